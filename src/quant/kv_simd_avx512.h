// Small helpers shared by the AVX-512 KV kernels. Include only from *_avx512.cpp files.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace pagoda::kv_simd {

// The first n of 16 lanes (n may be <= 0 or >= 16).
inline __mmask16 lane_mask(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << std::max(n, 0)) - 1);
}

// 16 fp16 values as f32.
inline __m512 load_h16(const std::uint8_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

// Asks for the next tile while this one is computed: tiles of a run sit at
// scattered addresses (a block table), where the hardware prefetchers cannot
// guess the next one.
inline void prefetch_tile(const void* tile, std::size_t bytes) {
  const char* p = static_cast<const char*>(tile);
  for (std::size_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

}  // namespace pagoda::kv_simd
