// Internal to the Quest bound kernels (quest.cpp, quest_int4.cpp,
// quest_avx2.cpp, quest_avx512.cpp): the level entry points and the one formula every level
// shares after its exact integer sums, so that all levels give the same bits.
// finish8_x4 uses SSE4.1 (blendv): include it only from the SIMD files.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "policy/quest.h"

namespace pagoda::quest_detail {

// The int8 bound of one row from its exact integer part P - N (quest.h):
// float(2 (P - N) + l1) * (scale_r / 2) * block.scale, in this order in
// float (the SIMD levels do the same per lane, so all levels agree bitwise;
// 2 (P - N) + l1 is exact in float for head_dim <= 512). A NaN (a NaN query
// scale) gives +inf: the block is read. Blocks with a non-finite summary
// (scale +inf) are +inf before any of this (the kernels check first).
inline float finish8(std::int32_t p_minus_n, const quest_block8& b, float half_q_scale) {
  const float v = static_cast<float>(2 * p_minus_n + b.l1) * half_q_scale * b.scale;
  return std::isnan(v) ? INFINITY : v;
}

// The reference twins' loop (quest_bounds8_ref, quest_bounds4_ref): exact
// integer sums P - N per row and block from code(i, side, d), the code of
// channel d of block i's min (side 0) or max (side 1), then finish8.
template <typename Code>
void bounds_ref(const quest_query8& q, const quest_block8* blocks, int n, float* out, Code code) {
  const int pd = q.padded_dim;
  for (int i = 0; i < n; ++i) {
    float best = -INFINITY;
    for (int r = 0; r < q.n_rows && blocks[i].scale < INFINITY; ++r) {
      std::int32_t p = 0, m = 0;
      for (int d = 0; d < pd; ++d) {
        p += q.pos[static_cast<std::size_t>(r) * pd + d] * code(i, 1, d);
        m += q.neg[static_cast<std::size_t>(r) * pd + d] * code(i, 0, d);
      }
      best = std::max(best, finish8(p - m, blocks[i], 0.5f * q.scale[r]));
    }
    out[i] = blocks[i].scale < INFINITY ? best : INFINITY;
  }
}

// The finish of four rows at once, lane r as finish8 of row r: the integer
// sums pm (P - N per row), half_scale[r] = scale_r / 2, rows >= nr ignored.
// Returns the max over the rows (+inf for a NaN).
inline float finish8_x4(__m128i pm, const quest_block8& b, const float* half_scale, int nr) {
  const __m128i two_pm_l1 = _mm_add_epi32(_mm_add_epi32(pm, pm), _mm_set1_epi32(b.l1));
  __m128 v = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(two_pm_l1), _mm_loadu_ps(half_scale)), _mm_set1_ps(b.scale));
  v = _mm_blendv_ps(v, _mm_set1_ps(INFINITY), _mm_cmpunord_ps(v, v));
  const __m128 live = _mm_castsi128_ps(_mm_cmpgt_epi32(_mm_set1_epi32(nr), _mm_setr_epi32(0, 1, 2, 3)));
  v = _mm_blendv_ps(_mm_set1_ps(-INFINITY), v, live);
  v = _mm_max_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_max_ss(v, _mm_shuffle_ps(v, v, 1)));
}

// quest_encode_query with codes padded to padded_dim (>= head_dim, a multiple of 64).
void encode_query(const float* q, int n_rows, int head_dim, int padded_dim, quest_query8& out);

// f32 bounds; split: [n_rows][2][stride], q+ = max(q, 0) then q- = min(q, 0),
// zero past head_dim.
void bounds_avx2(const float* split, std::size_t stride, int n_rows, int head_dim, std::span<const key_summary> blocks,
                 float* out);
void bounds_avx512(const float* split, std::size_t stride, int n_rows, int head_dim,
                   std::span<const key_summary> blocks, float* out);
// int8 bounds (quest_bounds8).
void bounds8_avx2(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out);
void bounds8_avx512(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out);
// int4 bounds (quest_bounds4).
void bounds4_avx2(const quest_query4& q, const std::uint8_t* codes, const quest_block8* blocks, int n, float* out);
void bounds4_avx512(const quest_query4& q, const std::uint8_t* codes, const quest_block8* blocks, int n, float* out);

}  // namespace pagoda::quest_detail
