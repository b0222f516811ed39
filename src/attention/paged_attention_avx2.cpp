// AVX2 softmax: vector max, polynomial exp (core/simd_math_avx2.h), and a
// vector sum with a fixed reduction order for a given n (so a row's sum depends
// only on the row); and soft-capping of scores, cap * tanh(x / cap), through
// the same exp.
#include <immintrin.h>

#include <cmath>

#include "core/simd_math_avx2.h"
#include "quant/kv_simd_avx2.h"

namespace pagoda {
namespace {

using kv_simd::hsum8;
using kv_simd::lane_mask8;
using simd256::exp_ps;

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// cap * tanh(x / cap) = cap - 2 cap / (exp(2 x / cap) + 1); exp_ps saturates,
// so large |x| give exactly +-cap.
inline __m256 softcap_ps(__m256 x, __m256 two_over_cap, __m256 cap, __m256 two_cap) {
  const __m256 e = exp_ps(_mm256_mul_ps(x, two_over_cap));
  return _mm256_sub_ps(cap, _mm256_div_ps(two_cap, _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
}

}  // namespace

void softcap_inplace_avx2(float* s, int n, float cap) {
  const __m256 two_over_cap = _mm256_set1_ps(2.0f / cap), vcap = _mm256_set1_ps(cap), two_cap = _mm256_set1_ps(2.0f * cap);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, softcap_ps(_mm256_loadu_ps(s + i), two_over_cap, vcap, two_cap));
  if (i < n) {
    const __m256i m = lane_mask8(n - i);
    _mm256_maskstore_ps(s + i, m, softcap_ps(_mm256_maskload_ps(s + i, m), two_over_cap, vcap, two_cap));
  }
}

float softmax_unnormalized_avx2(float* s, int n, float sink) {
  __m256 vmax = _mm256_set1_ps(sink);
  int i = 0;
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
  if (i < n) {
    const __m256i m = lane_mask8(n - i);
    const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(s + i, m), _mm256_castsi256_ps(m));
    vmax = _mm256_max_ps(vmax, v);
  }
  const float mx_s = hmax8(vmax);
  const __m256 mx = _mm256_set1_ps(mx_s);
  __m256 vsum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), mx));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (i < n) {
    const __m256i m = lane_mask8(n - i);
    const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_maskload_ps(s + i, m), mx)), _mm256_castsi256_ps(m));
    _mm256_maskstore_ps(s + i, m, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return sink == -INFINITY ? hsum8(vsum) : hsum8(vsum) + std::exp(sink - mx_s);
}

}  // namespace pagoda
