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

}  // namespace
}  // namespace pagoda::matmul_detail
