// AVX-512 Quest bounds (quest.h): with q split into its positive and negative
// parts, max(q_d lo_d, q_d hi_d) = q+_d hi_d + q-_d lo_d, two FMAs per channel
// and row; four rows share each load of a block's min and max.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>

#include "core/simd_math_avx512.h"
#include "kv/kv_backend.h"

namespace pagoda {

// split: [n_rows][2][stride] q+ then q-, zero past head_dim (stride >= head_dim
// rounded up to 16).
void quest_bounds_avx512(const float* split, std::size_t stride, int n_rows, int head_dim,
                       std::span<const key_summary> blocks, float* out) {
  using simd512::tail_mask;
  const int n_vec = (head_dim + 15) / 16;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const float* lo = blocks[i].min;
    const float* hi = blocks[i].max;
    float best = -INFINITY;
    for (int r0 = 0; r0 < n_rows; r0 += 4) {
      const int nr = std::min(4, n_rows - r0);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int v = 0; v < n_vec; ++v) {
        const __mmask16 m = tail_mask(head_dim - v * 16);
        const __m512 l = _mm512_maskz_loadu_ps(m, lo + v * 16), h = _mm512_maskz_loadu_ps(m, hi + v * 16);
        for (int j = 0; j < nr; ++j) {
          const float* qp = split + 2 * static_cast<std::size_t>(r0 + j) * stride + v * 16;
          acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qp), h, acc[j]);
          acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + stride), l, acc[j]);
        }
      }
      for (int j = 0; j < nr; ++j) {
        // A NaN sum (an infinite key channel times 0) means "unknown": read it.
        const float s = _mm512_reduce_add_ps(acc[j]);
        best = std::isnan(s) ? INFINITY : std::max(best, s);
      }
    }
    out[i] = best;
  }
}

}  // namespace pagoda
