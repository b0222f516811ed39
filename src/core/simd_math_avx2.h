// Vector math shared by AVX2 kernels (AVX2, FMA). Include only from
// *_avx2.cpp files.
#pragma once

#include <immintrin.h>

namespace pagoda::simd256 {

// exp(x) for 8 floats, as core/simd_math_avx512.h's exp_ps: range reduction by
// ln 2, a degree-6 Taylor polynomial on |r| <= ln2/2 (truncation error below
// 2e-7 relative), then 2^n. AVX2 has no scalef: 2^n is applied as two exact
// powers of two, 2^(n/2) and 2^(n - n/2) (each within the normal range for n
// in [-150, 128]), so results that are subnormal round once, as with scalef.
// Saturates to 0 below -103 and to exp(88.7) above 88.7.
inline __m256 exp_ps(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693145751953125f);
  const __m256 ln2_lo = _mm256_set1_ps(1.428606765330187e-06f);
  x = _mm256_max_ps(x, _mm256_set1_ps(-103.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  auto pow2 = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(n2));
}

}  // namespace pagoda::simd256
