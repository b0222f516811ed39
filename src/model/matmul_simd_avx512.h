// Helpers shared by the AVX-512 matmul files (matmul_avx512.cpp,
// matmul_kquants_avx512.cpp). Include only from files built with the AVX-512
// flags; internal linkage, as matmul_internal.h explains.
#pragma once

#include <immintrin.h>

#include "model/matmul_simd_avx2.h"

namespace pagoda::matmul_detail {
namespace {

// The per-pair horizontal reduction, fixed: halves, then quarters, then pairs.
inline float hsum16(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));
  return _mm_cvtss_f32(d);
}

// hsum16 of sixteen vectors at once: lane j of the result is hsum16(v[j]),
// bit for bit (each stage adds the same lane pairs as hsum16's, only for
// several vectors per instruction: 46 shuffles and adds instead of about 128).
inline __m512 hsum16x16(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
  // Halves: lanes l and l + 8 of v[2i] (lanes 0-7) and v[2i + 1] (8-15).
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Quarters: 128-bit chunk q of b[i] holds v[4i + q]'s four sums.
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Pairs: chunk q of c[i] holds two sums of v[8i + q], then two of v[8i + 4 + q].
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Last pair: lane 4q + m holds v[q + 4m]'s sum; permute to lane order.
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, d);
}

// store_tile with hsum16 (y[r * ldy + c] = hsum16(acc[r][c])), the same bits,
// reducing sixteen pairs at a time when the tile has enough of them (a
// multi-row tile: prompt chunks, speculative verification); smaller tiles
// reduce one pair at a time.
template <int R, int C>
inline void store_tile_hsum16(const __m512 (&acc)[R][C], float* y, std::int64_t ldy) {
  constexpr int n = R * C;
  if constexpr (n < 8) {
    store_tile(acc, y, ldy, hsum16);
  } else {
    alignas(64) float sums[(n + 15) / 16 * 16];
#pragma GCC unroll 2
    for (int base = 0; base < n; base += 16) {
      __m512 v[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) v[j] = base + j < n ? acc[(base + j) / C][(base + j) % C] : _mm512_setzero_ps();
      _mm512_store_ps(sums + base, hsum16x16(v));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) y[r * ldy + c] = sums[r * C + c];
  }
}

}  // namespace
}  // namespace pagoda::matmul_detail
