// AVX-512 softmax: vector max, polynomial exp (core/simd_math_avx512.h), and a
// vector sum with a fixed reduction order for a given n; and soft-capping of
// scores, cap * tanh(x / cap), through the same exp.
#include <immintrin.h>

#include <cmath>

#include "core/simd_math_avx512.h"

namespace pagoda {
using simd512::exp_ps;

namespace {
// cap * tanh(x / cap) = cap - 2 cap / (exp(2 x / cap) + 1); exp_ps saturates,
// so large |x| give exactly +-cap.
inline __m512 softcap_ps(__m512 x, __m512 two_over_cap, __m512 cap, __m512 two_cap) {
  const __m512 e = exp_ps(_mm512_mul_ps(x, two_over_cap));
  return _mm512_sub_ps(cap, _mm512_div_ps(two_cap, _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
}
}  // namespace

void softcap_inplace_avx512(float* s, int n, float cap) {
  const __m512 two_over_cap = _mm512_set1_ps(2.0f / cap), vcap = _mm512_set1_ps(cap), two_cap = _mm512_set1_ps(2.0f * cap);
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, softcap_ps(_mm512_loadu_ps(s + i), two_over_cap, vcap, two_cap));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(s + i, m, softcap_ps(_mm512_maskz_loadu_ps(m, s + i), two_over_cap, vcap, two_cap));
  }
}

float softmax_unnormalized_avx512(float* s, int n, float sink) {
  __m512 vmax = _mm512_set1_ps(sink);
  int i = 0;
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + i));
  if (i < n) {
    __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + i));
  }
  const float mx_s = _mm512_reduce_max_ps(vmax);
  const __m512 mx = _mm512_set1_ps(mx_s);
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
  return sink == -INFINITY ? _mm512_reduce_add_ps(vsum) : _mm512_reduce_add_ps(vsum) + std::exp(sink - mx_s);
}

}  // namespace pagoda
