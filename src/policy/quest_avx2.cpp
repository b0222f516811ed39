// AVX2 Quest bounds (quest.h), as quest_avx512.cpp with 8-wide vectors.
// f32: q+_d hi_d + q-_d lo_d, two FMAs per channel and row.
// int8: vpmaddubsw (7-bit query codes x signed block codes: a pair of products
// is at most 2 x 127 x 127 < 2^15, so it never saturates) then vpmaddwd into
// exact int32 sums, then quest_detail::finish8.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "policy/quest_kernels.h"
#include "quant/kv_simd_avx2.h"

namespace pagoda::quest_detail {

void bounds_avx2(const float* split, std::size_t stride, int n_rows, int head_dim, std::span<const key_summary> blocks,
                 float* out) {
  using kv_simd::hsum8;
  using kv_simd::load8;
  const int n_vec = (head_dim + 7) / 8;
  // Summaries of consecutive blocks lie far apart (kv_storage: [block][layer][head]),
  // where the hardware prefetchers cannot follow: each step asks for the lines
  // of the block `ahead` further on that match the lines it reads (about 32 KiB
  // ahead, as the KV kernels do, kv_prefetch.h).
  const std::size_t ahead = std::max<std::size_t>(1, (std::size_t{32} << 10) / (2 * sizeof(float) * head_dim));
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const float* lo = blocks[i].min;
    const float* hi = blocks[i].max;
    const key_summary& next = blocks[std::min(i + ahead, blocks.size() - 1)];
    float best = -INFINITY;
    for (int r0 = 0; r0 < n_rows; r0 += 4) {
      const int nr = std::min(4, n_rows - r0);
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int v = 0; v < n_vec; ++v) {
        const int n = head_dim - v * 8;
        const __m256 l = load8(lo + v * 8, n), h = load8(hi + v * 8, n);
        if (r0 == 0 && v % 2 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(next.min + v * 8), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next.max + v * 8), _MM_HINT_T0);
        }
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

namespace {
// The sums of four int32 vectors, lane j of the result for vector j.
inline __m128i sum4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
  const __m256i abcd = _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}
}  // namespace

void bounds8_avx2(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out) {
  const int pd = q.padded_dim, n_vec = pd / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  auto dot = [&](const std::uint8_t* u, __m256i c) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)), c), ones);
  };
  thread_local std::vector<float> half;  // [groups of 4 rows][4]: scale / 2, zero past n_rows
  half.assign((q.n_rows + 3) / 4 * 4, 0.0f);
  for (int r = 0; r < q.n_rows; ++r) half[r] = 0.5f * q.scale[r];
  for (int i = 0; i < n; ++i) {
    if (!(blocks[i].scale < INFINITY)) {
      out[i] = INFINITY;
      continue;
    }
    const std::int8_t* lo = codes + static_cast<std::size_t>(i) * 2 * pd;
    const std::int8_t* hi = lo + pd;
    float best = -INFINITY;
    for (int r0 = 0; r0 < q.n_rows; r0 += 4) {
      const int nr = std::min(4, q.n_rows - r0);
      __m256i ap[4], an[4];
      for (int j = 0; j < 4; ++j) ap[j] = an[j] = _mm256_setzero_si256();
      for (int v = 0; v < n_vec; ++v) {
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + v * 32));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + v * 32));
        for (int j = 0; j < nr; ++j) {
          const std::size_t at = static_cast<std::size_t>(r0 + j) * pd + v * 32;
          ap[j] = _mm256_add_epi32(ap[j], dot(q.pos.data() + at, h));
          an[j] = _mm256_add_epi32(an[j], dot(q.neg.data() + at, l));
        }
      }
      const __m128i pm = sum4(_mm256_sub_epi32(ap[0], an[0]), _mm256_sub_epi32(ap[1], an[1]),
                              _mm256_sub_epi32(ap[2], an[2]), _mm256_sub_epi32(ap[3], an[3]));
      best = std::max(best, finish8_x4(pm, blocks[i], half.data() + r0, nr));
    }
    out[i] = best;
  }
}

void bounds4_avx2(const quest_query4& q4, const std::uint8_t* codes, const quest_block8* blocks, int n, float* out) {
  // 32 bytes of nibbles: channels [32 h, 32 h + 32) of a 128-channel group
  // in the low nibbles, 64 further on in the high ones (quest.h). Pairs of
  // products are at most 2 x 127 x 15: vpmaddubsw cannot saturate.
  const quest_query8& q = q4.q;
  const int pd = q.padded_dim, n_grp = pd / 128;
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  auto dot = [&](const std::uint8_t* u, __m256i c) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)), c), ones);
  };
  for (int i = 0; i < n; ++i) {
    if (!(blocks[i].scale < INFINITY)) {
      out[i] = INFINITY;
      continue;
    }
    const std::uint8_t* lo = codes + static_cast<std::size_t>(i) * pd;
    const std::uint8_t* hi = lo + pd / 2;
    float best = -INFINITY;
    for (int r0 = 0; r0 < q.n_rows; r0 += 4) {
      const int nr = std::min(4, q.n_rows - r0);
      __m256i acc[4];  // pos x hi + neg x (-lo): P - N + bias (the min's codes are negated)
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_si256();
      for (int g = 0; g < n_grp; ++g)
        for (int part = 0; part < 2; ++part) {
          const int at = g * 64 + part * 32;  // byte offset; channels 2 g 64 + part 32 and 64 more
          const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + at));
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + at));
          const __m256i l0 = _mm256_and_si256(l, low4), l1 = _mm256_and_si256(_mm256_srli_epi16(l, 4), low4);
          const __m256i h0 = _mm256_and_si256(h, low4), h1 = _mm256_and_si256(_mm256_srli_epi16(h, 4), low4);
          const std::size_t c0 = static_cast<std::size_t>(g) * 128 + part * 32, c1 = c0 + 64;
          for (int j = 0; j < nr; ++j) {
            const std::size_t row = static_cast<std::size_t>(r0 + j) * pd;
            acc[j] = _mm256_add_epi32(acc[j], _mm256_add_epi32(dot(q.pos.data() + row + c0, h0), dot(q.pos.data() + row + c1, h1)));
            acc[j] = _mm256_add_epi32(acc[j], _mm256_add_epi32(dot(q.neg.data() + row + c0, l0), dot(q.neg.data() + row + c1, l1)));
          }
        }
      const __m128i pm = sum4(acc[0], acc[1], acc[2], acc[3]);
      const __m128i b4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q4.bias.data() + r0));
      best = std::max(best, finish8_x4(_mm_sub_epi32(pm, b4), blocks[i], q4.half_scale.data() + r0, nr));
    }
    out[i] = best;
  }
}

}  // namespace pagoda::quest_detail
