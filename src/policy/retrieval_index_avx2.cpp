// AVX2 + F16C twin of l2sq_f16_ref (retrieval_index.cpp).
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

}  // namespace pagoda
