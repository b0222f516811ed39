// AVX2 Quest bounds (quest.h), as quest_avx512.cpp with 8-wide vectors: with q
// split into its positive and negative parts, max(q_d lo_d, q_d hi_d) =
// q+_d hi_d + q-_d lo_d, two FMAs per channel and row; four rows share each
// load of a block's min and max.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>

#include "kv/kv_backend.h"
#include "quant/kv_simd_avx2.h"

namespace pagoda {

// split: [n_rows][2][stride] q+ then q-, zero past head_dim (stride >= head_dim
// rounded up to 8).
void quest_bounds_avx2(const float* split, std::size_t stride, int n_rows, int head_dim,
                       std::span<const key_summary> blocks, float* out) {
  using kv_simd::hsum8;
  using kv_simd::load8;
  const int n_vec = (head_dim + 7) / 8;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const float* lo = blocks[i].min;
    const float* hi = blocks[i].max;
    float best = -INFINITY;
    for (int r0 = 0; r0 < n_rows; r0 += 4) {
      const int nr = std::min(4, n_rows - r0);
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int v = 0; v < n_vec; ++v) {
        const int n = head_dim - v * 8;
        const __m256 l = load8(lo + v * 8, n), h = load8(hi + v * 8, n);
        for (int j = 0; j < nr; ++j) {
          const float* qp = split + 2 * static_cast<std::size_t>(r0 + j) * stride + v * 8;
          acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qp), h, acc[j]);
          acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + stride), l, acc[j]);
        }
      }
      for (int j = 0; j < nr; ++j) {
        // A NaN sum (an infinite key channel times 0) means "unknown": read it.
        const float s = hsum8(acc[j]);
        best = std::isnan(s) ? INFINITY : std::max(best, s);
      }
    }
    out[i] = best;
  }
}

}  // namespace pagoda
