// Internal to the Quest bound kernels (quest.cpp, quest_avx2.cpp,
// quest_avx512.cpp): the level entry points and the one formula every level
// shares after its exact integer sums, so that all levels give the same bits.
// finish8_x4 uses SSE4.1 (blendv): include it only from the SIMD files.
#pragma once

#include <immintrin.h>

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

// f32 bounds; split: [n_rows][2][stride], q+ = max(q, 0) then q- = min(q, 0),
// zero past head_dim.
void bounds_avx2(const float* split, std::size_t stride, int n_rows, int head_dim, std::span<const key_summary> blocks,
                 float* out);
void bounds_avx512(const float* split, std::size_t stride, int n_rows, int head_dim,
                   std::span<const key_summary> blocks, float* out);
// int8 bounds (quest_bounds8).
void bounds8_avx2(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out);
void bounds8_avx512(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out);

}  // namespace pagoda::quest_detail
