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

// Lanes [0, 4) of the result: the sums of a[0..3]; lanes [4, 8): of b[0..3].
inline __m256i sum8(const __m256i a[4], const __m256i b[4]) {
  auto pairs = [](__m256i x, __m256i y) { return _mm256_add_epi32(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y)); };
  auto quads = [](__m256i x, __m256i y) { return _mm256_add_epi32(_mm256_unpacklo_epi64(x, y), _mm256_unpackhi_epi64(x, y)); };
  const __m256i xa = quads(pairs(a[0], a[1]), pairs(a[2], a[3]));  // 128-bit half k: a[0..3]'s sums over half k
  const __m256i xb = quads(pairs(b[0], b[1]), pairs(b[2], b[3]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(xa, xb, 0x20), _mm256_permute2x128_si256(xa, xb, 0x31));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Four rows [r0, r0 + nr) against every block: eight blocks at a time
// finished together (their sums transposed so that a lane is a block and
// the max over rows is a vertical max, the same float operations per lane
// as finish8), the rest through quest_kernels.h's bound_pairs.
template <class Block, class Pair>
void rows4(const quest_block8* blocks, int n, const float* half, __m128i bias4, int nr, float* out, bool first,
           Block block, Pair pair) {
  const __m256i bias8 = _mm256_inserti128_si256(_mm256_castsi128_si256(bias4), bias4, 1);
  // The transposed lanes hold blocks 0 2 4 6 1 3 5 7; the scales and l1
  // shuffled out of the blocks' pairs hold 0 1 4 5 2 3 6 7.
  const __m256i to_lanes = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7), to_blocks = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 inf = _mm256_set1_ps(INFINITY);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i v[4];  // v[p]: rows 0-3 of block i + 2 p, then of block i + 2 p + 1
    for (int p = 0; p < 4; ++p) {
      __m256i a[4], b[4];
      pair(i + 2 * p, a, b);
      v[p] = _mm256_sub_epi32(sum8(a, b), bias8);
    }
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    const __m256i rows[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3),
                             _mm256_unpackhi_epi64(t1, t3)};
    const __m256 x0 = _mm256_loadu_ps(reinterpret_cast<const float*>(blocks + i));
    const __m256 x1 = _mm256_loadu_ps(reinterpret_cast<const float*>(blocks + i + 4));
    const __m256 scale = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)), to_lanes);
    const __m256i l1 =
        _mm256_permutevar8x32_epi32(_mm256_castps_si256(_mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 1, 3, 1))), to_lanes);
    __m256 best = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < nr; ++j) {
      __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(rows[j], rows[j]), l1));
      f = _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(half[j])), scale);
      f = _mm256_blendv_ps(f, inf, _mm256_cmp_ps(f, f, _CMP_UNORD_Q));  // a NaN: read the block
      best = _mm256_max_ps(f, best);
    }
    best = _mm256_blendv_ps(inf, best, _mm256_cmp_ps(scale, inf, _CMP_LT_OQ));  // a non-finite summary: read it
    best = _mm256_permutevar8x32_ps(best, to_blocks);
    _mm256_storeu_ps(out + i, first ? best : _mm256_max_ps(best, _mm256_loadu_ps(out + i)));
  }
  bound_pairs<__m256i>(
      blocks + i, n - i, half, bias4, nr, out + i, first, [&](int b, __m256i* acc) { block(i + b, acc); },
      [&](int b, __m256i* a, __m256i* c) { pair(i + b, a, c); },
      [](const __m256i* a) { return sum4(a[0], a[1], a[2], a[3]); },
      [](const __m256i* a, const __m256i* b) { return sum8(a, b); }, [](int) {});
}

// The query rows [r0, r0 + 4) of one side (pos or neg), rows past nr
// repeating the last one.
struct rows_of {
  const std::uint8_t* r[4];
  rows_of(const std::vector<std::uint8_t>& c, int pd, int r0, int nr) {
    for (int j = 0; j < 4; ++j) r[j] = c.data() + static_cast<std::size_t>(r0 + std::min(j, nr - 1)) * pd;
  }
};
}  // namespace

void bounds8_avx2(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out) {
  thread_local std::vector<float> half;  // [groups of 4 rows][4]: scale / 2, zero past n_rows
  half.assign((q.n_rows + 3) / 4 * 4, 0.0f);
  for (int r = 0; r < q.n_rows; ++r) half[r] = 0.5f * q.scale[r];
  const int pd = q.padded_dim, n_vec = pd / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  // Row groups outside the blocks, as the AVX-512 kernel: the usual decode
  // group (GQA up to 4) is one pass over the codes.
  for (int r0 = 0; r0 < q.n_rows; r0 += 4) {
    const int nr = std::min(4, q.n_rows - r0);
    const rows_of pos(q.pos, pd, r0, nr), neg(q.neg, pd, r0, nr);
    auto block = [&](int i, __m256i acc[4]) {
      const std::int8_t* lo = codes + static_cast<std::size_t>(i) * 2 * pd;
      const std::int8_t* hi = lo + pd;
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_si256();
      for (int v = 0; v < n_vec; ++v) {
        const __m256i l = load32(lo + v * 32), h = load32(hi + v * 32);
        for (int j = 0; j < 4; ++j) {
          // A 16-bit lane is two channels' pos x hi - neg x lo, of which one
          // term per channel is 0 (pos and neg are disjoint, quest.h): at
          // most 2 x 127 x 127 in magnitude, exact in int16.
          const __m256i d = _mm256_sub_epi16(_mm256_maddubs_epi16(load32(pos.r[j] + v * 32), h),
                                             _mm256_maddubs_epi16(load32(neg.r[j] + v * 32), l));
          acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(d, ones));
        }
      }
    };
    rows4(blocks, n, half.data() + r0, _mm_setzero_si128(), nr, out, r0 == 0, block, [&](int i, __m256i* a, __m256i* b) {
      block(i, a);
      block(i + 1, b);
    });
  }
  if (q.n_rows == 0)
    for (int i = 0; i < n; ++i) out[i] = blocks[i].scale < INFINITY ? -INFINITY : INFINITY;
}

void bounds4_avx2(const quest_query4& q4, const std::uint8_t* codes, const quest_block8* blocks, int n, float* out) {
  // 32 bytes of nibbles: channels [32 h, 32 h + 32) of a 128-channel group
  // in the low nibbles, 64 further on in the high ones (quest.h); h = hi + 8
  // and m = 8 - lo per channel. Since pos and neg are disjoint, channel d
  // adds |q_d| x c_d with c_d = hi_d where q_d > 0, -lo_d where q_d < 0:
  // 2 c_d = sign(q_d) (hi_d + lo_d) + (hi_d - lo_d) = sign(q_d) (h - m) + (h + m - 16),
  // in [-14, 14]. So one vpmaddubsw per 32 channels and row (|q| x 2 c, a
  // 16-bit lane at most 2 x 127 x 14; four summed per 128 channels stay
  // below 2^15), one vpmaddwd per 128: 2 (P - N) exactly.
  const quest_query8& q = q4.q;
  const int pd = q.padded_dim, n_grp = pd / 128;
  thread_local std::vector<std::uint8_t> mag;   // [n_rows][pd]: |q| codes
  thread_local std::vector<std::int8_t> sign;   // [n_rows][pd]: pos - neg (its sign)
  mag.resize(q.pos.size());
  sign.resize(q.pos.size());
  for (std::size_t x = 0; x < q.pos.size(); ++x) {
    mag[x] = static_cast<std::uint8_t>(q.pos[x] + q.neg[x]);
    sign[x] = static_cast<std::int8_t>(q.pos[x] - q.neg[x]);
  }
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
  for (int r0 = 0; r0 < q.n_rows; r0 += 4) {
    const int nr = std::min(4, q.n_rows - r0);
    const std::uint8_t* mr[4];
    const std::int8_t* sr[4];
    for (int j = 0; j < 4; ++j) {
      const std::size_t at = static_cast<std::size_t>(r0 + std::min(j, nr - 1)) * pd;
      mr[j] = mag.data() + at;
      sr[j] = sign.data() + at;
    }
    // NB (1 or 2) blocks from i: acc[b][j] for block i + b and row j; the
    // two blocks of a pair share each load of the query's codes.
    auto blocks_from = [&]<int NB>(int i, __m256i* const* acc) {
      for (int b = 0; b < NB; ++b)
        for (int j = 0; j < 4; ++j) acc[b][j] = _mm256_setzero_si256();
      for (int g = 0; g < n_grp; ++g) {
        __m256i s[NB][4];
        for (int b = 0; b < NB; ++b)
          for (int j = 0; j < 4; ++j) s[b][j] = _mm256_setzero_si256();
        for (int part = 0; part < 2; ++part)
          for (int half = 0; half < 2; ++half) {
            const int at = g * 64 + part * 32;  // byte offset; channels 2 g 64 + part 32 (+ 64 in the high nibbles)
            __m256i w[NB], c[NB];
            for (int b = 0; b < NB; ++b) {
              const std::uint8_t* lo = codes + static_cast<std::size_t>(i + b) * pd + at;
              const __m256i l = load32(lo), h = load32(lo + pd / 2);
              const __m256i hh = _mm256_and_si256(half ? _mm256_srli_epi16(h, 4) : h, low4);
              const __m256i mm = _mm256_and_si256(half ? _mm256_srli_epi16(l, 4) : l, low4);
              w[b] = _mm256_sub_epi8(hh, mm);
              c[b] = _mm256_sub_epi8(_mm256_add_epi8(hh, mm), sixteen);
            }
            const std::size_t ch = static_cast<std::size_t>(g) * 128 + part * 32 + half * 64;
            for (int j = 0; j < 4; ++j) {
              const __m256i sg = load32(sr[j] + ch), mg = load32(mr[j] + ch);
              for (int b = 0; b < NB; ++b)
                s[b][j] = _mm256_add_epi16(s[b][j], _mm256_maddubs_epi16(mg, _mm256_add_epi8(_mm256_sign_epi8(w[b], sg), c[b])));
            }
          }
        for (int b = 0; b < NB; ++b)
          for (int j = 0; j < 4; ++j)
            acc[b][j] = _mm256_add_epi32(acc[b][j], _mm256_srai_epi32(_mm256_madd_epi16(s[b][j], ones), 1));
      }
    };
    rows4(
        blocks, n, q4.half_scale.data() + r0, _mm_setzero_si128(), nr, out, r0 == 0,
        [&](int i, __m256i* a) {
          __m256i* const acc[1] = {a};
          blocks_from.template operator()<1>(i, acc);
        },
        [&](int i, __m256i* a, __m256i* b) {
          __m256i* const acc[2] = {a, b};
          blocks_from.template operator()<2>(i, acc);
        });
  }
  if (q.n_rows == 0)
    for (int i = 0; i < n; ++i) out[i] = blocks[i].scale < INFINITY ? -INFINITY : INFINITY;
}

}  // namespace pagoda::quest_detail
