// AVX2 + F16C twins of l2sq_f16_ref and dots_f32_ref (retrieval_index.cpp).
#include <immintrin.h>

#include <cstdint>

#include "core/half.h"

namespace pagoda {

float l2sq_f16_avx2(const std::uint16_t* a, const std::uint16_t* b, int n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 d0 = _mm256_sub_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i))),
                                    _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i))));
    const __m256 d1 = _mm256_sub_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i + 8))),
                                    _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i + 8))));
    s0 = _mm256_fmadd_ps(d0, d0, s0);
    s1 = _mm256_fmadd_ps(d1, d1, s1);
  }
  const __m256 s = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float r = _mm_cvtss_f32(h);
  for (; i < n; ++i) {
    const float d = fp16_to_f32(a[i]) - fp16_to_f32(b[i]);
    r += d * d;
  }
  return r;
}

// Four rows at a time share each load of q; 8 lanes per row, summed at the end.
void dots_f32_avx2(const float* q, const float* rows, int n_rows, int dim, float* out) {
  auto hsum = [](__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  };
  const int full = dim - dim % 8;
  int i = 0;
  for (; i + 4 <= n_rows; i += 4) {
    const float* r = rows + static_cast<std::size_t>(i) * dim;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int d = 0; d < full; d += 8) {
      const __m256 x = _mm256_loadu_ps(q + d);
      s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r + d), s0);
      s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r + dim + d), s1);
      s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r + 2 * dim + d), s2);
      s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r + 3 * dim + d), s3);
    }
    float t[4] = {hsum(s0), hsum(s1), hsum(s2), hsum(s3)};
    for (int d = full; d < dim; ++d)
      for (int j = 0; j < 4; ++j) t[j] += q[d] * r[j * dim + d];
    for (int j = 0; j < 4; ++j) out[i + j] = t[j];
  }
  for (; i < n_rows; ++i) {
    const float* r = rows + static_cast<std::size_t>(i) * dim;
    __m256 s0 = _mm256_setzero_ps();
    for (int d = 0; d < full; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(r + d), s0);
    float t = hsum(s0);
    for (int d = full; d < dim; ++d) t += q[d] * r[d];
    out[i] = t;
  }
}

}  // namespace pagoda
