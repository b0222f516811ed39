#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "core/simd_math_avx512.h"

namespace pagoda {

void rms_norm_avx512(const float* x, const float* w, int n, float eps, float* out) {
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  if (i < n) {
    __m512 v = _mm512_maskz_loadu_ps(simd512::tail_mask(n - i), x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float ss = _mm512_reduce_add_ps(acc);
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(n) + eps));
  for (i = 0; i < n; i += 16) {
    __mmask16 m = simd512::tail_mask(n - i);
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), scale);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
  }
}

void silu_mul_avx512(const float* g, const float* u, std::int64_t n, float* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (std::int64_t i = 0; i < n; i += 16) {
    __mmask16 m = simd512::tail_mask(static_cast<int>(n - i < 16 ? n - i : 16));
    __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
    __m512 uv = _mm512_maskz_loadu_ps(m, u + i);
    __m512 e = simd512::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, uv));
  }
}

}  // namespace pagoda
