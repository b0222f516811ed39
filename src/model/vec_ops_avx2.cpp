// AVX2 twins of vec_ops.h's rms_norm and silu_mul (AVX2, FMA): 8 lanes, the
// last partial vector through masked loads and stores.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "core/simd_math_avx2.h"
#include "quant/kv_simd_avx2.h"

namespace pagoda {

using kv_simd::hsum8;
using kv_simd::load8;
using kv_simd::store8;

// The sum of squares in 8 f32 lanes (lane l takes x[l], x[l + 8], ...) and
// hsum8, so a row's scale depends on n alone, then out = x * scale * w.
void rms_norm_avx2(const float* x, const float* w, int n, float eps, float* out) {
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    const __m256 v = load8(x + i, n - i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(hsum8(acc) / static_cast<float>(n) + eps));
  for (int i = 0; i < n; i += 8)
    store8(out + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i, n - i), scale), load8(w + i, n - i)), n - i);
}

// g / (1 + exp(-g)) * u with core/simd_math_avx2.h's exp.
void silu_mul_avx2(const float* g, const float* u, std::int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (std::int64_t i = 0; i < n; i += 8) {
    const int left = static_cast<int>(n - i < 8 ? n - i : 8);
    const __m256 gv = load8(g + i, left);
    const __m256 e = simd256::exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    store8(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), load8(u + i, left)), left);
  }
}

}  // namespace pagoda
