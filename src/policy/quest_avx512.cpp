// AVX-512 Quest bounds (quest.h).
// f32: with q split into its positive and negative parts, max(q_d lo_d, q_d
// hi_d) = q+_d hi_d + q-_d lo_d, two FMAs per channel and row; four rows share
// each load of a block's min and max.
// int8: VNNI (vpdpbusd: 7-bit query codes x signed block codes, 64 channels
// per instruction), exact int32 sums, then quest_detail::finish8_x4.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/simd_math_avx512.h"
#include "policy/quest_kernels.h"

namespace pagoda::quest_detail {

void bounds_avx512(const float* split, std::size_t stride, int n_rows, int head_dim,
                   std::span<const key_summary> blocks, float* out) {
  using simd512::tail_mask;
  const int n_vec = (head_dim + 15) / 16;
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
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int v = 0; v < n_vec; ++v) {
        const __mmask16 m = tail_mask(head_dim - v * 16);
        const __m512 l = _mm512_maskz_loadu_ps(m, lo + v * 16), h = _mm512_maskz_loadu_ps(m, hi + v * 16);
        if (r0 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(next.min + v * 16), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next.max + v * 16), _MM_HINT_T0);
        }
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

namespace {
// The sums of four int32 vectors, lane j of the result for vector j.
inline __m128i sum4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
}  // namespace

namespace {
constexpr int k_ahead = 64;  // blocks the code prefetch runs ahead: 16 KiB at head_dim 128

// Four rows [r0, r0 + nr) against every block. NV > 0: NV vectors of 64
// channels, the rows' codes held in registers (4 x 2 x NV of them) across the
// blocks; NV = 0: any number of vectors, the codes loaded per block.
// first: out[i] = the rows' bound, else out[i] = max(out[i], it).
template <int NV>
void rows4(const quest_query8& q, const float* half, int r0, int nr, const std::int8_t* codes,
           const quest_block8* blocks, int n, float* out, bool first) {
  const int pd = q.padded_dim, n_vec = NV > 0 ? NV : pd / 64;
  auto query = [&](const std::vector<std::uint8_t>& c, int j, int v) {
    return j < nr ? _mm512_loadu_si512(c.data() + static_cast<std::size_t>(r0 + j) * pd + v * 64)
                  : _mm512_setzero_si512();
  };
  __m512i qp[4][NV > 0 ? NV : 1], qn[4][NV > 0 ? NV : 1];
  if constexpr (NV > 0)
    for (int j = 0; j < 4; ++j)
      for (int v = 0; v < NV; ++v) {
        qp[j][v] = query(q.pos, j, v);
        qn[j][v] = query(q.neg, j, v);
      }
  for (int i = 0; i < n; ++i) {
    if (!(blocks[i].scale < INFINITY)) {
      out[i] = INFINITY;
      continue;
    }
    const std::int8_t* lo = codes + static_cast<std::size_t>(i) * 2 * pd;
    const std::int8_t* hi = lo + pd;
    if (first && i + k_ahead < n)  // the codes are read once per step, from memory
      for (int v = 0; v < 2 * n_vec; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(lo + k_ahead * 2 * pd + v * 64), _MM_HINT_T0);
    // P and N of four rows; each at most 128 x 127 x 127 per 128 channels.
    __m512i ap[4], an[4];
    for (int j = 0; j < 4; ++j) ap[j] = an[j] = _mm512_setzero_si512();
    for (int v = 0; v < n_vec; ++v) {
      const __m512i l = _mm512_loadu_si512(lo + v * 64), h = _mm512_loadu_si512(hi + v * 64);
      for (int j = 0; j < 4; ++j) {
        if constexpr (NV > 0) {
          ap[j] = _mm512_dpbusd_epi32(ap[j], qp[j][v], h);
          an[j] = _mm512_dpbusd_epi32(an[j], qn[j][v], l);
        } else if (j < nr) {
          ap[j] = _mm512_dpbusd_epi32(ap[j], query(q.pos, j, v), h);
          an[j] = _mm512_dpbusd_epi32(an[j], query(q.neg, j, v), l);
        }
      }
    }
    const __m128i pm = sum4(_mm512_sub_epi32(ap[0], an[0]), _mm512_sub_epi32(ap[1], an[1]),
                            _mm512_sub_epi32(ap[2], an[2]), _mm512_sub_epi32(ap[3], an[3]));
    const float b = finish8_x4(pm, blocks[i], half + r0, nr);
    out[i] = first ? b : std::max(out[i], b);
  }
}
}  // namespace

void bounds8_avx512(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out) {
  thread_local std::vector<float> half;  // [groups of 4 rows][4]: scale / 2, zero past n_rows
  half.assign((q.n_rows + 3) / 4 * 4, 0.0f);
  for (int r = 0; r < q.n_rows; ++r) half[r] = 0.5f * q.scale[r];
  // Row groups outside the blocks (a group's codes stay in registers); the
  // usual decode group (GQA up to 4, head_dim up to 256) is one pass.
  for (int r0 = 0; r0 < q.n_rows; r0 += 4) {
    const int nr = std::min(4, q.n_rows - r0);
    const bool first = r0 == 0;
    switch (q.padded_dim / 64) {
      case 1: rows4<1>(q, half.data(), r0, nr, codes, blocks, n, out, first); break;
      case 2: rows4<2>(q, half.data(), r0, nr, codes, blocks, n, out, first); break;
      case 4: rows4<4>(q, half.data(), r0, nr, codes, blocks, n, out, first); break;
      default: rows4<0>(q, half.data(), r0, nr, codes, blocks, n, out, first);
    }
  }
  if (q.n_rows == 0)
    for (int i = 0; i < n; ++i) out[i] = blocks[i].scale < INFINITY ? -INFINITY : INFINITY;
}

namespace {
// Lanes [0, 4) of the result: the sums of a[0..3]; lanes [4, 8): of b[0..3].
inline __m256i sum8(const __m512i a[4], const __m512i b[4]) {
  auto pairs = [](__m512i x, __m512i y) { return _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y)); };
  auto quads = [](__m512i x, __m512i y) { return _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y)); };
  const __m512i xa = quads(pairs(a[0], a[1]), pairs(a[2], a[3]));  // 128-bit lane k: a[0..3]'s part k
  const __m512i xb = quads(pairs(b[0], b[1]), pairs(b[2], b[3]));
  const __m512i e = _mm512_add_epi32(_mm512_shuffle_i32x4(xa, xb, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_i32x4(xa, xb, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i f = _mm512_add_epi32(e, _mm512_shuffle_i32x4(e, e, _MM_SHUFFLE(2, 3, 0, 1)));  // [sa sa sb sb]
  return _mm512_castsi512_si256(_mm512_shuffle_i32x4(f, f, _MM_SHUFFLE(2, 0, 2, 0)));
}

// int4 (quest_bounds4): four rows [r0, r0 + nr) against every block. With
// the min's codes negated (quest.h), one accumulator per row and block sums
// pos x hi + neg x (-lo) = P - N + bias; two blocks share the horizontal
// sums and the finish. NG > 0: NG groups of 128 channels, the rows' codes
// held in registers.
template <int NG>
void rows4_int4(const quest_query4& q4, int r0, int nr, const std::uint8_t* codes, const quest_block8* blocks, int n,
                float* out, bool first) {
  const quest_query8& q = q4.q;
  const int pd = q.padded_dim, n_grp = NG > 0 ? NG : pd / 128;
  auto query = [&](const std::vector<std::uint8_t>& c, int j, int v) {
    return j < nr ? _mm512_loadu_si512(c.data() + static_cast<std::size_t>(r0 + j) * pd + v * 64)
                  : _mm512_setzero_si512();
  };
  __m512i qp[4][NG > 0 ? 2 * NG : 1], qn[4][NG > 0 ? 2 * NG : 1];
  if constexpr (NG > 0)
    for (int j = 0; j < 4; ++j)
      for (int v = 0; v < 2 * NG; ++v) {
        qp[j][v] = query(q.pos, j, v);
        qn[j][v] = query(q.neg, j, v);
      }
  const __m128i bias4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q4.bias.data() + r0));
  const float* half = q4.half_scale.data() + r0;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  auto block = [&](int i, __m512i acc[4]) {
    const std::uint8_t* lo = codes + static_cast<std::size_t>(i) * pd;
    const std::uint8_t* hi = lo + pd / 2;
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_setzero_si512();
    for (int g = 0; g < n_grp; ++g) {
      const __m512i l = _mm512_loadu_si512(lo + g * 64), h = _mm512_loadu_si512(hi + g * 64);
      const __m512i l0 = _mm512_and_si512(l, low4), l1 = _mm512_and_si512(_mm512_srli_epi16(l, 4), low4);
      const __m512i h0 = _mm512_and_si512(h, low4), h1 = _mm512_and_si512(_mm512_srli_epi16(h, 4), low4);
      for (int j = 0; j < 4; ++j) {
        if constexpr (NG > 0) {
          acc[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[j], qp[j][2 * g], h0), qp[j][2 * g + 1], h1);
          acc[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[j], qn[j][2 * g], l0), qn[j][2 * g + 1], l1);
        } else if (j < nr) {
          acc[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[j], query(q.pos, j, 2 * g), h0), query(q.pos, j, 2 * g + 1), h1);
          acc[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[j], query(q.neg, j, 2 * g), l0), query(q.neg, j, 2 * g + 1), l1);
        }
      }
    }
  };
  const int ahead = 2 * k_ahead;  // 2 x the blocks of rows4 (the same bytes ahead): both blocks' codes
  bound_pairs<__m512i>(
      blocks, n, half, bias4, nr, out, first, block,
      [&](int i, __m512i* a, __m512i* b) {
        block(i, a);
        block(i + 1, b);
      },
      [](const __m512i* a) { return sum4(a[0], a[1], a[2], a[3]); },
      [](const __m512i* a, const __m512i* b) { return sum8(a, b); },
      [&](int i) {
        if (!first || i + ahead + 1 >= n) return;
        for (int v = 0; v < 4 * n_grp; ++v)
          _mm_prefetch(reinterpret_cast<const char*>(codes + static_cast<std::size_t>(i + ahead) * pd + v * 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(blocks + i + ahead), _MM_HINT_T0);
      });
}
}  // namespace

void bounds4_avx512(const quest_query4& q, const std::uint8_t* codes, const quest_block8* blocks, int n, float* out) {
  const int n_rows = q.q.n_rows;
  for (int r0 = 0; r0 < n_rows; r0 += 4) {
    const int nr = std::min(4, n_rows - r0);
    const bool first = r0 == 0;
    if (q.q.padded_dim == 128) rows4_int4<1>(q, r0, nr, codes, blocks, n, out, first);
    else rows4_int4<0>(q, r0, nr, codes, blocks, n, out, first);
  }
  if (n_rows == 0)
    for (int i = 0; i < n; ++i) out[i] = blocks[i].scale < INFINITY ? -INFINITY : INFINITY;
}

}  // namespace pagoda::quest_detail
