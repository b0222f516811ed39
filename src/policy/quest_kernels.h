// Internal to the Quest bound kernels (quest.cpp, quest_int4.cpp,
// quest_avx2.cpp, quest_avx512.cpp): the level entry points and the one formula every level
// shares after its exact integer sums, so that all levels give the same bits.
// finish8_x4 uses SSE4.1 (blendv), finish8_x8 AVX2: call them only from the SIMD files.
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

// finish8_x4 of two blocks at once (AVX2): lanes [0, 4) rows of block a, [4, 8) of
// block b (the same float operations per lane, so the same bits).
inline void finish8_x8(__m256i pm, const quest_block8& a, const quest_block8& b, const float* half_scale, int nr,
                       float* out_a, float* out_b) {
  const __m256i l1 = _mm256_setr_epi32(a.l1, a.l1, a.l1, a.l1, b.l1, b.l1, b.l1, b.l1);
  const __m256 sc = _mm256_setr_ps(a.scale, a.scale, a.scale, a.scale, b.scale, b.scale, b.scale, b.scale);
  const __m128 h4 = _mm_loadu_ps(half_scale);
  const __m256 half = _mm256_insertf128_ps(_mm256_castps128_ps256(h4), h4, 1);
  __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(pm, pm), l1)), half), sc);
  v = _mm256_blendv_ps(v, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i row = _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3);
  v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nr), row)));
  v = _mm256_max_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm256_max_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
  *out_a = _mm256_cvtss_f32(v);
  *out_b = _mm_cvtss_f32(_mm256_extractf128_ps(v, 1));
}

// The blocks of one group of four rows [r0, r0 + nr), two at a time (they
// share the horizontal sums and the finish): block(i, acc) leaves row j's
// P - N + bias of block i in the lanes of acc[j] (V: the level's integer
// vector), pair(i, a, b) does block(i, a) and block(i + 1, b); sum4(acc) gives the four sums, sum8(a, b) those of two blocks
// (lanes [0, 4) and [4, 8)); ahead(i) runs before blocks i and i + 1 (a
// prefetch, or nothing). first: out[i] = the rows' bound, else out[i] =
// max(out[i], it). Blocks with a non-finite summary are +inf.
// pair(i, a, b): block(i, a) and block(i + 1, b) at once.
template <class V, class Block, class Pair, class Sum4, class Sum8, class Ahead>
void bound_pairs(const quest_block8* blocks, int n, const float* half, __m128i bias4, int nr, float* out, bool first,
                 Block block, Pair pair, Sum4 sum4, Sum8 sum8, Ahead ahead) {
  const __m256i bias8 = _mm256_inserti128_si256(_mm256_castsi128_si256(bias4), bias4, 1);
  auto put = [&](int i, float b) {
    b = blocks[i].scale < INFINITY ? b : INFINITY;  // a non-finite summary: read the block
    out[i] = first ? b : std::max(out[i], b);
  };
  int i = 0;
  for (; i + 2 <= n; i += 2) {
    ahead(i);
    V a[4], b[4];
    pair(i, a, b);
    float va = 0, vb = 0;
    finish8_x8(_mm256_sub_epi32(sum8(a, b), bias8), blocks[i], blocks[i + 1], half, nr, &va, &vb);
    put(i, va);
    put(i + 1, vb);
  }
  if (i < n) {
    V a[4];
    block(i, a);
    put(i, finish8_x4(_mm_sub_epi32(sum4(a), bias4), blocks[i], half, nr));
  }
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
