// Helpers shared by the AVX2 matmul files (matmul_avx2.cpp,
// matmul_kquants_avx2.cpp). Include only from files built with the AVX2 flags;
// internal linkage, as matmul_internal.h explains.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "core/half.h"

namespace pagoda::matmul_detail {
namespace {

// The per-pair horizontal reduction, fixed: halves, then pairs of the rest.
inline float hsum8(__m256 v) {
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));
  return _mm_cvtss_f32(d);
}

// The fp16 at p (any alignment) as f32.
inline float load_half(const std::byte* p) {
  fp16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 16 nibbles at p as 32 bytes in element order (low nibbles, then high;
// the block-32 formats' and iq4_xs's sub-blocks): the 16 bytes in both lanes,
// the high lane's 64-bit words shifted down by 4 (bits crossing into a byte
// from its neighbour are masked off), so no cross-lane shuffle is needed.
inline __m256i nibbles32(const std::byte* p) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
}

// The 32 bits of the little-endian word at p as 32 bytes: byte j is 0xff when
// bit j is set, else 0 (q5_0 / q5_1's fifth bits, iq3_s's signs). Byte j / 8
// of the word goes to byte j, which keeps only bit j % 8.
inline __m256i bits32_to_bytes(const std::byte* p) {
  std::uint32_t w;
  std::memcpy(&w, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(w)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

}  // namespace
}  // namespace pagoda::matmul_detail
