// Small helpers shared by the AVX2 KV kernels. Include only from *_avx2.cpp files.
//
// AVX2 has no masked loads of bytes or 16-bit words, so a vector that would
// read past the end of a tile (the last token vector of a tile whose
// block_size is not a multiple of 8, the last channels when head_dim is not)
// is copied through a zeroed stack buffer first; full vectors load directly.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant/kv_prefetch.h"

namespace pagoda::kv_simd {

// The first n of 8 lanes (n may be <= 0 or >= 8), for maskload / maskstore.
inline __m256i lane_mask8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Stores the first n lanes of v (all 8 when n >= 8).
inline void store8(float* p, __m256 v, int n) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, lane_mask8(n), v);
}

// Loads the first n lanes (all 8 when n >= 8), zeros past them.
inline __m256 load8(const float* p, int n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask8(n));
}

// 32 bytes of which the first n_bytes come from p, the rest zero: a partial
// vector's elements, read without touching memory past them.
struct partial_bytes {
  alignas(32) std::uint8_t b[32];
  partial_bytes(const std::uint8_t* p, int n_bytes) {
    std::memset(b, 0, sizeof b);
    std::memcpy(b, p, static_cast<std::size_t>(n_bytes));
  }
};

// 8 fp16 values as f32.
inline __m256 load_h8(const std::uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// The first n of 8 fp16 values as f32, zeros past them (0 < n).
inline __m256 load_h8(const std::uint8_t* p, int n) {
  if (n >= 8) return load_h8(p);
  return load_h8(partial_bytes(p, 2 * n).b);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace pagoda::kv_simd
