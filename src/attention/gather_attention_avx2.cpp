// AVX2 + F16C twins of score_key_rows_ref and add_weighted_row_ref
// (gather_attention.cpp): the scores of scattered keys from their token-major
// f16 rows, and one value row into the query rows' accumulators.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "attention/kv_selector.h"

namespace pagoda {
namespace {

float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// NR query rows (from q, [NR][head_dim]) against one key row.
template <int NR>
void score_one(const float* q, int head_dim, const std::uint16_t* key, float* out, std::size_t ld) {
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int d = 0; d < head_dim; d += 8) {
    const __m256 k = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(key + d)));
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + static_cast<std::size_t>(r) * head_dim + d), k, acc[r]);
  }
  for (int r = 0; r < NR; ++r) out[r * ld] = hsum(acc[r]);
}

}  // namespace

// REQUIRES: head_dim % 8 == 0.
void score_key_rows_avx2(const float* q, int n_q, int head_dim, const key_rows& rows, const std::int32_t* slots,
                         std::size_t n, float* scores, std::size_t ld) {
  // The rows are scattered across a copy far larger than the caches: fetch
  // the row a few keys ahead while this one is scored.
  constexpr std::size_t k_ahead = 4;
  const std::size_t row_bytes = static_cast<std::size_t>(head_dim) * sizeof(std::uint16_t);
  for (std::size_t e = 0; e < n; ++e) {
    if (e + k_ahead < n) {
      const char* next = reinterpret_cast<const char*>(rows.row(slots[e + k_ahead], head_dim));
      for (std::size_t b = 0; b < row_bytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    }
    const std::uint16_t* key = rows.row(slots[e], head_dim);
    int r = 0;
    for (; r + 4 <= n_q; r += 4) score_one<4>(q + static_cast<std::size_t>(r) * head_dim, head_dim, key, scores + r * ld + e, ld);
    for (; r < n_q; ++r) score_one<1>(q + static_cast<std::size_t>(r) * head_dim, head_dim, key, scores + r * ld + e, ld);
  }
}

// REQUIRES: head_dim % 8 == 0.
void add_weighted_row_avx2(const float* row, int head_dim, const float* w, std::size_t w_stride, int n_q,
                           float* acc) {
  for (int r = 0; r < n_q; ++r) {
    const float wr = w[r * w_stride];
    if (wr == 0.0f) continue;
    const __m256 wv = _mm256_set1_ps(wr);
    float* a = acc + static_cast<std::size_t>(r) * head_dim;
    for (int d = 0; d < head_dim; d += 8)
      _mm256_storeu_ps(a + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(row + d), _mm256_loadu_ps(a + d)));
  }
}

}  // namespace pagoda
