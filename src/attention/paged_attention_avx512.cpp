// AVX-512 softmax: vector max, polynomial exp (core/simd_math_avx512.h), and a
// vector sum with a fixed reduction order for a given n.
#include <immintrin.h>

#include <cmath>

#include "core/simd_math_avx512.h"

namespace pagoda {
using simd512::exp_ps;

float softmax_unnormalized_avx512(float* s, int n) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int i = 0;
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + i));
  if (i < n) {
    __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + i));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), mx));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (i < n) {
    __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), mx));
    _mm512_mask_storeu_ps(s + i, m, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
  }
  return _mm512_reduce_add_ps(vsum);
}

}  // namespace pagoda
