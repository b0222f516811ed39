// AVX-512 VNNI qk/av for the integer codecs, on the packed codes directly.
//
// The f32 operand (a query row, or a row of attention weights times the token
// scales) is split into two int8 vectors, x ~ sc * (hi + lo / 254), so one
// vpdpbusd pass per half gives the dot product of the codes with x to about
// 1.6e-5 * max|x| per element: far below the codes' own rounding. Offsets
// (sum of x times the group minimum) are added in f32.
//
// Keys with per-channel or static scales (FOLDED) take x = q * S rounded once
// to 16-bit words instead, multiplied (vpdpwssd) with the codes split into
// their even and odd bytes: the same number of dot-product instructions as the
// two int8 halves, but the operand, which per-channel keys rebuild for every
// tile, costs a third of the instructions to make (fold_quantize_rows).
//
// Batch invariance: a row's operand is quantized from that row alone (its own
// max), each 32-bit lane sums one token (qk) or one channel (av) in a fixed
// order, and zero weights quantize to zero codes that add exactly nothing.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "quant/kv_codec_int.h"
#include "quant/kv_simd_avx512.h"

namespace pagoda::int_kv {
namespace {

constexpr float k_inv254 = 1.0f / 254.0f;

// Whether q.k keeps a second accumulator per row (operand_error in
// kv_codec_int.h). 8-bit codes need the query's lo half. 4- and 2-bit codes
// with per-token scales carry errors ten times larger than a query rounded to
// 8 bits, so one pass is enough there. With per-channel or static scales the
// operand is q * S, whose small channels a single 8-bit pass would round away:
// it is one int16 word per channel, and the second accumulator sums the odd
// channels (FOLDED below).
template <int BITS, bool FOLDED>
constexpr bool k_qk_lo = BITS == 8 || FOLDED;

using kv_simd::lane_mask;
using kv_simd::load_h16;
using kv_simd::prefetch_line;

inline int round16(int n) { return (n + 15) & ~15; }

// 16 operand positions v (already times 127 / max|x|) -> their hi and lo
// words at dst[0, 8) (layout of quantize_hilo below).
// Each half is rounded to the nearest integer (ties to even) once, by the
// conversion to int32; the hi half comes back to f32 exactly (|hi| <= 127) for
// the residual. (A round to f32 then a conversion gives the same integers at
// two instructions more on each half's path.)
inline void store_hilo16(__m512 v, std::int32_t* dst, bool with_lo) {
  constexpr int k_nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i hi = _mm512_cvt_roundps_epi32(v, k_nearest);
  const __m128i hb = _mm512_cvtsepi32_epi8(hi);
  __m128i lb = _mm_setzero_si128();
  if (with_lo) {
    const __m512 h = _mm512_cvtepi32_ps(hi);
    const __m512i lo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, h), _mm512_set1_ps(254.0f)), k_nearest);
    lb = _mm512_cvtsepi32_epi8(lo);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi32(hb, lb));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 4), _mm_unpackhi_epi32(hb, lb));
}

// x[0, n) -> one operand row (n_pad a multiple of 16, zeros past n) with
// x ~ sc * (hi + lo / 254), or x ~ sc * hi when !with_lo (lo words are then 0),
// given amax = max|x|. The row is stored as the kernels read it: for each
// 32-bit word w (operand bytes 4w .. 4w + 3), row[2w] holds the hi bytes and
// row[2w + 1] the lo bytes. Returns sc (0 when x is all zero).
float quantize_hilo_max(const float* x, int n, int n_pad, float amax, std::int32_t* row, bool with_lo) {
  if (!(amax > 0)) {
    std::memset(row, 0, static_cast<std::size_t>(n_pad) * 2);
    return 0.0f;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  for (int i = 0; i < n_pad; i += 16)
    store_hilo16(_mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask(n - i), x + i), inv), row + i / 2, with_lo);
  return amax / 127.0f;
}

// quantize_hilo_max, taking the max itself.
float quantize_hilo(const float* x, int n, int n_pad, std::int32_t* row, bool with_lo) {
  __m512 vmax = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(lane_mask(n - i), x + i)));
  return quantize_hilo_max(x, n, n_pad, _mm512_reduce_max_ps(vmax), row, with_lo);
}

// Where the 8 vectors of a dense 128-position a.v operand row come from
// (av_run): weights at w_row + at[c] (lanes m[c]), per-token scales and
// offsets at tile[c] + scale / offset offset + 2 * (token in tile).
struct av_dense8 {
  std::size_t at[8];
  __mmask16 m[8];
  const std::uint8_t* s[8];
  const std::uint8_t* o[8];
};

// The operands of R rows (from r0) for one group g of per-token (or group)
// scales in the dense 128-position case: per row x = w * S, bias += w * M,
// then quantize_hilo_max's rounding of x; the same operations in the same
// order as the general loop in av_run, without its index arithmetic. The
// tile's scales and offsets are widened once for all R rows; x waits in xs.
template <int R>
inline void av_operands_dense8(const float* w, std::size_t ld, const av_dense8& d, std::size_t group_at, int r0,
                               int G, int g, int stride, float* sc, float* bias, std::int32_t* packed) {
  alignas(64) float xs[R][128];
  __m512 b[R], vmax[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    b[r] = _mm512_loadu_ps(bias + static_cast<std::size_t>((r0 + r) * G + g) * 16);
    vmax[r] = _mm512_setzero_ps();
  }
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m512 S = load_h16(d.s[c] + group_at, d.m[c]), M = load_h16(d.o[c] + group_at, d.m[c]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(d.m[c], w + static_cast<std::size_t>(r0 + r) * ld + d.at[c]);
      const __m512 x = _mm512_mul_ps(wv, S);
      b[r] = _mm512_fmadd_ps(wv, M, b[r]);
      vmax[r] = _mm512_max_ps(vmax[r], _mm512_abs_ps(x));
      _mm512_store_ps(xs[r] + 16 * c, x);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int og = (r0 + r) * G + g;
    _mm512_storeu_ps(bias + static_cast<std::size_t>(og) * 16, b[r]);
    std::int32_t* row = packed + static_cast<std::size_t>(og) * (stride / 2);
    const float amax = _mm512_reduce_max_ps(vmax[r]);
    if (!(amax > 0)) {
      std::memset(row, 0, 128 * 2);
      sc[og] = 0.0f;
      continue;
    }
    const __m512 inv = _mm512_set1_ps(127.0f / amax);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) store_hilo16(_mm512_mul_ps(_mm512_load_ps(xs[r] + 16 * c), inv), row + c * 8, true);
    sc[og] = amax / 127.0f;
  }
}

// Per-call buffers for the prepared operands; grown, never shrunk.
struct operand_rows {
  std::vector<float> sc;                     // [rows * groups]
  std::vector<float> extra;                  // [rows * groups]: sum of q (qk), bias (av)
  std::vector<float> wsum;                   // [rows]: sum of the tile's weights (av, per-channel or static)
  std::vector<float> bias;                   // [rows * groups][16]: sum_t w_t M_t lane by lane (av, per token)
  std::vector<float> x;                      // [stride]
  std::vector<float> s, m;                   // [stride]: a tile's per-channel scales and offsets as f32
  std::vector<float> qs, qp, qmax;           // folded q.k: [rows][stride] q' and q, [rows] (scale_query_rows)
  // The quantized operand rows (quantize_hilo): [rows * groups][stride / 2].
  std::vector<std::int32_t> packed;
  void size(int rows, int groups, int stride) {
    std::size_t n = static_cast<std::size_t>(rows) * groups;
    if (packed.size() < n * stride / 2) packed.resize(n * stride / 2);
    if (sc.size() < n) {
      sc.resize(n);
      extra.resize(n);
    }
    if (wsum.size() < static_cast<std::size_t>(rows)) wsum.resize(rows);
    if (bias.size() < n * 16) bias.resize(n * 16);
    if (x.size() < static_cast<std::size_t>(stride)) {
      x.resize(stride);
      s.resize(stride);
      m.resize(stride);
    }
    if (qs.size() < static_cast<std::size_t>(rows) * stride) {
      qs.resize(static_cast<std::size_t>(rows) * stride);
      qp.resize(qs.size());
    }
    if (qmax.size() < static_cast<std::size_t>(rows)) qmax.resize(rows);
  }
};
thread_local operand_rows t_ops;

// Operand row og (= row * G + group).
inline std::int32_t* operand_row(operand_rows& ops, int og, int stride) {
  return ops.packed.data() + static_cast<std::size_t>(og) * (stride / 2);
}
inline const std::int32_t* operand_row(const operand_rows& ops, int og, int stride) {
  return ops.packed.data() + static_cast<std::size_t>(og) * (stride / 2);
}

// Folded q.k (per-channel or static scales S, offsets M): the operand of row r
// is x = q_r * S rounded to int16 words. Its unit is fixed by bounds instead of
// by max|x|, so that no row needs a pass for its max at every tile:
//   x_d ~ sc_r * round(q'_rd * S'_d),  q'_r = q_r * levels / max|q_r|  (once per call),
//                                      S'  = S / max S                 (once per tile, for all rows),
//   sc_r = max|q_r| * max S / levels,  |q'_rd * S'_d| <= levels.
// Each element is then off by at most max|q_r| * max S / (2 * levels)
// (int_kv::operand_error). Operand word w holds channels 4w + 0 and 4w + 2
// (row[2w], low and high half), 4w + 1 and 4w + 3 (row[2w + 1]), as the even
// and odd bytes of a code word pair with them (codes_wide).

// q' of every row into ops.qs and q into ops.qp ([n_q][stride] each, zeros past
// hd), max|q_r| / levels into ops.qmax.
void scale_query_rows(const float* q, int n_q, int hd, int stride, float levels, operand_rows& ops) {
  for (int r = 0; r < n_q; ++r) {
    const float* qr = q + static_cast<std::size_t>(r) * hd;
    float* qs = ops.qs.data() + static_cast<std::size_t>(r) * stride;
    float* qp = ops.qp.data() + static_cast<std::size_t>(r) * stride;
    __m512 vmax = _mm512_setzero_ps();
    for (int d = 0; d < stride; d += 16) {
      const __m512 qv = _mm512_maskz_loadu_ps(lane_mask(hd - d), qr + d);
      _mm512_storeu_ps(qp + d, qv);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(qv));
    }
    const float qmax = _mm512_reduce_max_ps(vmax);
    const __m512 inv = _mm512_set1_ps(qmax > 0 ? levels / qmax : 0.0f);
    for (int d = 0; d < stride; d += 16) _mm512_storeu_ps(qs + d, _mm512_mul_ps(_mm512_loadu_ps(qp + d), inv));
    ops.qmax[r] = qmax / levels;
  }
}

// The largest of a tile's (or the static) scales: on the fp16 bits, which
// order as unsigned integers for the scales' non-negative values.
float scale_max(int hd, const std::uint8_t* s16, const float* s32) {
  if (s16) {
    __m256i vmax = _mm256_setzero_si256();
    for (int d = 0; d < hd; d += 16) vmax = _mm256_max_epu16(vmax, _mm256_maskz_loadu_epi16(lane_mask(hd - d), s16 + 2 * d));
    __m128i m = _mm_max_epu16(_mm256_castsi256_si128(vmax), _mm256_extracti128_si256(vmax, 1));
    m = _mm_max_epu16(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epu16(m, _mm_shuffle_epi32(m, 0xb1));
    m = _mm_max_epu16(m, _mm_srli_epi32(m, 16));
    return _mm_cvtss_f32(_mm_cvtph_ps(m));
  }
  __m512 vmax = _mm512_setzero_ps();
  for (int d = 0; d < hd; d += 16) vmax = _mm512_max_ps(vmax, _mm512_maskz_loadu_ps(lane_mask(hd - d), s32 + d));
  return _mm512_reduce_max_ps(vmax);
}

// Rows r0 .. r0 + R of fold_quantize_rows, channel vector by channel vector:
// S' and M are widened once and serve all R rows from registers.
template <int R>
void fold_rows(int r0, int hd, int stride, const std::uint8_t* s16, const std::uint8_t* m16, const float* s32,
               const float* m32, float smax, operand_rows& ops) {
  // Within each 8-byte group of int16 channels c0..c3: c0 c2 c1 c3.
  const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,  //
                                         0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  const __m512 sinv = _mm512_set1_ps(smax > 0 ? 1.0f / smax : 0.0f);
  const float* qs[R];
  const float* qp[R];
  std::int32_t* row[R];
  __m512 bias[R];
  for (int r = 0; r < R; ++r) {
    qs[r] = ops.qs.data() + static_cast<std::size_t>(r0 + r) * stride;
    qp[r] = ops.qp.data() + static_cast<std::size_t>(r0 + r) * stride;
    row[r] = operand_row(ops, r0 + r, stride);
    bias[r] = _mm512_setzero_ps();
  }
  for (int d = 0; d < stride; d += 16) {
    const __mmask16 m = lane_mask(hd - d);
    const __m512 S = _mm512_mul_ps(s16 ? load_h16(s16 + 2 * d, m) : _mm512_maskz_loadu_ps(m, s32 + d), sinv);
    const __m512 M = m16 ? load_h16(m16 + 2 * d, m) : _mm512_maskz_loadu_ps(m, m32 + d);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(qs[r] + d), S);
      const __m256i w = _mm512_cvtepi32_epi16(_mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row[r] + d / 2), _mm256_shuffle_epi8(w, order));
      bias[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qp[r] + d), M, bias[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    ops.extra[r0 + r] = _mm512_reduce_add_ps(bias[r]);
    ops.sc[r0 + r] = ops.qmax[r0 + r] * smax;
  }
}

// The operand rows of one tile's scales (s16/m16: fp16 in the tile) or the
// static ones (s32/m32): per row the int16 words, sc[r] and extra[r] = q_r . M.
// Scales that are all zero, or not finite (an fp16 overflow of a huge range),
// give a zero operand.
void fold_quantize_rows(int n_q, int hd, int stride, const std::uint8_t* s16, const std::uint8_t* m16,
                        const float* s32, const float* m32, operand_rows& ops) {
  float smax = scale_max(hd, s16, s32);
  if (!(smax > 0) || !(smax < INFINITY)) smax = 0.0f;
  int r = 0;
  for (; r + 4 <= n_q; r += 4) fold_rows<4>(r, hd, stride, s16, m16, s32, m32, smax, ops);
  switch (n_q - r) {
    case 3: fold_rows<3>(r, hd, stride, s16, m16, s32, m32, smax, ops); break;
    case 2: fold_rows<2>(r, hd, stride, s16, m16, s32, m32, smax, ops); break;
    case 1: fold_rows<1>(r, hd, stride, s16, m16, s32, m32, smax, ops); break;
    default: break;
  }
}

// Extracts code k of every byte: 16 lanes x 4 bytes of values.
template <int BITS>
inline __m512i codes_k(__m512i v, int k) {
  if constexpr (BITS == 8) return v;
  const __m512i low = _mm512_set1_epi8(static_cast<char>((1 << BITS) - 1));
  return _mm512_and_si512(_mm512_srli_epi32(v, BITS * k), low);
}

// Code k of every byte as 16-bit words: even (bytes 0 and 2 of each 32-bit
// lane, the channels or tokens 4w + 0 and 4w + 2 of operand word w) and odd
// (bytes 1 and 3).
template <int BITS>
inline void codes_wide(__m512i v, int k, __m512i& even, __m512i& odd) {
  if constexpr (BITS == 8) {
    even = _mm512_and_si512(v, _mm512_set1_epi32(0x00ff00ff));
    odd = _mm512_srli_epi16(v, 8);
  } else {
    const __m512i low = _mm512_set1_epi32(((1 << BITS) - 1) * 0x00010001);
    even = _mm512_and_si512(k == 0 ? v : _mm512_srli_epi32(v, BITS * k), low);
    odd = _mm512_and_si512(_mm512_srli_epi32(v, BITS * k + 8), low);
  }
}

// ah/al[v][r] += the codes of the 64-byte vectors vec[v] (all packed word w)
// times row r's hi/lo operand words: wp points at row 0's pair for operand
// word w * (8 / BITS), row r's is rowstep further on, the next codes' words
// follow at +2. Each broadcast serves all NV vectors. WIDE: the pair is the
// int16 operand of fold_quantize_rows, ah sums the even codes, al the odd.
template <int R, int BITS, bool LO, int NV = 1, bool WIDE = false>
inline void accumulate(const __m512i* vec, const std::int32_t* wp, std::size_t rowstep, __m512i (*ah)[R],
                       __m512i (*al)[R]) {
  static_assert(!WIDE || LO, "the int16 operand uses both accumulators");
  constexpr int CPB = 8 / BITS;
#pragma GCC unroll 16
  for (int k = 0; k < CPB; ++k) {
    __m512i u[NV], o[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      if constexpr (WIDE) codes_wide<BITS>(vec[v], k, u[v], o[v]);
      else u[v] = codes_k<BITS>(vec[v], k);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const std::int32_t* p = wp + r * rowstep + 2 * k;
      const __m512i h = _mm512_set1_epi32(p[0]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        if constexpr (WIDE) kv_simd::dpwssd(ah[v][r], u[v], h);
        else kv_simd::dpbusd(ah[v][r], u[v], h);
      }
      if constexpr (LO) {
        const __m512i l = _mm512_set1_epi32(p[1]);
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) {
          if constexpr (WIDE) kv_simd::dpwssd(al[v][r], o[v], l);
          else kv_simd::dpbusd(al[v][r], u[v], l);
        }
      }
    }
  }
}

// The dot product with an operand of scale sc, from its integer halves (WIDE:
// the even and odd sums, whose total wide_levels keeps within int32).
template <bool LO, bool WIDE = false>
inline __m512 finish_dot(__m512i ah, __m512i al, float sc) {
  if constexpr (WIDE) return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ah, al)), _mm512_set1_ps(sc));
  if constexpr (!LO) return _mm512_mul_ps(_mm512_cvtepi32_ps(ah), _mm512_set1_ps(sc));
  __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(al), _mm512_set1_ps(k_inv254), _mm512_cvtepi32_ps(ah));
  return _mm512_mul_ps(dot, _mm512_set1_ps(sc));
}

// ---------------------------------------------------------------------------
// qk. FOLDED: per-channel or static scales folded into the query (one scale
// group spanning all words); otherwise per-token scales from the tile, G groups.

// 16 token lanes of one tile.
struct token_vector {
  const std::uint8_t* tile;
  const std::uint8_t* ahead;  // the tile whose same lines are prefetched meanwhile
  int tc;        // first token
  __mmask16 m;   // valid lanes
  float* scores; // scores of row 0, token tc
};

// h/l[v][r] += the integer sums over n_words packed words of NV token vectors
// (cp[v], then step bytes further per word; lanes m[v]) with operand words
// from op on, prefetching the same lines from pp[v] on.
template <int R, int NV, int BITS, bool LO, bool WIDE>
__attribute__((always_inline)) inline void dot_words(const std::uint8_t** cp, const std::uint8_t** pp,
                                                     const __mmask16* m, std::size_t step, int n_words,
                                                     const std::int32_t* op, std::size_t rowstep, __m512i (*h)[R],
                                                     __m512i (*l)[R]) {
  for (int w = 0; w < n_words; ++w) {
    __m512i vec[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      vec[v] = _mm512_maskz_loadu_epi32(m[v], cp[v]);
      prefetch_line(pp[v]);
      cp[v] += step;
      pp[v] += step;
    }
    accumulate<R, BITS, LO, NV, WIDE>(vec, op, rowstep, h, l);
    op += (8 / BITS) * 2;
  }
}

// Scores of R rows (from r0) for a list of token vectors, NV at a time: for each
// of the G scale groups the integer sums over its words, then the scales. The
// accumulators go from the sums to the scores without leaving registers, and
// the per-call work is paid once per list: called per pair of vectors, the
// call, the hand-over of the sums through memory and the bookkeeping around
// them took a quarter of int8 q.k.
template <int R, int NV, int BITS, bool FOLDED>
__attribute__((noinline)) void qk_list(const tile_layout& L, int block_size, const token_vector* tv, int n_vec,
                                       const operand_rows& ops, int r0, int stride, int G, int words_per_group,
                                       int ld) {
  constexpr bool LO = k_qk_lo<BITS, FOLDED>;
  const std::size_t step = static_cast<std::size_t>(block_size) * 4;
  const std::size_t rowstep = static_cast<std::size_t>(G) * (stride / 2);
  for (int i = 0; i + NV <= n_vec; i += NV) {
    const token_vector* t = tv + i;
    const std::uint8_t* cp[NV];
    const std::uint8_t* pp[NV];
    __mmask16 m[NV];
    __m512 total[NV][R];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      m[v] = t[v].m;
      cp[v] = t[v].tile + static_cast<std::size_t>(t[v].tc) * 4;
      pp[v] = t[v].ahead + static_cast<std::size_t>(t[v].tc) * 4;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) total[v][r] = _mm512_setzero_ps();
    }
    for (int g = 0; g < G; ++g) {
      __m512i h[NV][R], l[NV][R];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) h[v][r] = l[v][r] = _mm512_setzero_si512();
      // cp and pp walk on through the groups' words.
      const std::int32_t* op = operand_row(ops, r0 * G + g, stride) +
                               static_cast<std::size_t>(g) * words_per_group * (8 / BITS) * 2;
      dot_words<R, NV, BITS, LO, FOLDED>(cp, pp, m, step, words_per_group, op, rowstep, h, l);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        __m512 S, M;
        if constexpr (!FOLDED) {
          const std::size_t at = (static_cast<std::size_t>(g) * block_size + t[v].tc) * 2;
          S = load_h16(t[v].tile + L.scale_off + at, m[v]);
          M = load_h16(t[v].tile + L.offset_off + at, m[v]);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const int og = (r0 + r) * G + g;
          __m512 dot = finish_dot<LO, FOLDED>(h[v][r], l[v][r], ops.sc[og]);
          if constexpr (FOLDED) {
            dot = _mm512_add_ps(dot, _mm512_set1_ps(ops.extra[og]));
            total[v][r] = _mm512_add_ps(total[v][r], dot);
          } else {
            total[v][r] = _mm512_fmadd_ps(S, dot, total[v][r]);
            total[v][r] = _mm512_fmadd_ps(M, _mm512_set1_ps(ops.extra[og]), total[v][r]);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(t[v].scores + static_cast<std::size_t>(r0 + r) * ld, m[v], total[v][r]);
  }
}

template <int BITS, bool FOLDED>
void qk_run(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
            const float* q, int n_q, float* scores, int ld) {
  const int B = s.block_size, hd = s.head_dim;
  const int stride = round16(L.n_outer * L.lanes);
  const int G = FOLDED ? 1 : L.n_groups;
  const int words_per_group = L.mode == kv_scale_mode::group ? L.group_size / L.lanes : L.n_outer;
  const bool per_tile = L.mode == kv_scale_mode::per_channel;
  operand_rows& ops = t_ops;
  ops.size(n_q, G, stride);
  if constexpr (FOLDED) scale_query_rows(q, n_q, hd, stride, static_cast<float>(wide_levels(L)), ops);

  // Quantizes every row's operand: q (per-token scales) or q * S (folded).
  auto prepare = [&](const std::uint8_t* tile) {
    if constexpr (FOLDED) {
      if (per_tile)
        fold_quantize_rows(n_q, hd, stride, tile + L.scale_off, tile + L.offset_off, nullptr, nullptr, ops);
      else
        fold_quantize_rows(n_q, hd, stride, nullptr, nullptr, sp->scale, sp->offset, ops);
    } else {
      for (int r = 0; r < n_q; ++r) {
        const float* qr = q + static_cast<std::size_t>(r) * hd;
        float* x = ops.x.data();
        for (int g = 0; g < G; ++g) {
          const int og = r * G + g;
          // Groups are quantized separately: each has its own sc (the group's
          // channels of hi/lo sit at their own offsets in a full-width row).
          std::fill(x, x + stride, 0.0f);
          float qsum = 0;
          for (int d = g * L.group_size; d < (g + 1) * L.group_size; ++d) {
            x[d] = qr[d];
            qsum += qr[d];
          }
          ops.extra[og] = qsum;
          ops.sc[og] = quantize_hilo(x, hd, stride, operand_row(ops, og, stride), k_qk_lo<BITS, FOLDED>);
        }
      }
    }
  };

  // Token vectors in chunks of up to 16 (eight 16-token tiles), two at a time
  // within a chunk (sharing each operand broadcast): a chunk's codes stay in
  // L1 while every block of four rows runs over them. Per-channel scales
  // change the operand at every tile, which then ends the chunk.
  constexpr int k_chunk = 16;
  token_vector chunk[k_chunk];
  int n_vec = 0;
  auto run_chunk = [&] {
    auto rows = [&]<int R>(int r0) {
      const int even = n_vec & ~1;
      qk_list<R, 2, BITS, FOLDED>(L, B, chunk, even, ops, r0, stride, G, words_per_group, ld);
      if (even < n_vec) qk_list<R, 1, BITS, FOLDED>(L, B, chunk + even, 1, ops, r0, stride, G, words_per_group, ld);
    };
    for_row_blocks(n_q, rows);
    n_vec = 0;
  };
  if (!per_tile) prepare(nullptr);
  const int n_tiles = (n_tokens + B - 1) / B, ahead = kv_simd::prefetch_ahead(L.bytes);
  for (int i = 0; i < n_tiles; ++i) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[i]);
    const std::uint8_t* later = kv_simd::tile_ahead(tiles, i, n_tiles, ahead);
    // Scales and offsets follow the codes, where the loop does not reach.
    kv_simd::prefetch_slice(later, L.codes_bytes, L.bytes);
    if (per_tile) {
      if (n_vec > 0) run_chunk();
      prepare(tile);
    }
    const int nt = std::min(B, n_tokens - i * B);
    for (int tc = 0; tc < nt; tc += 16) {
      chunk[n_vec++] = {tile, later, tc, lane_mask(nt - tc), scores + static_cast<std::size_t>(i) * B + tc};
      if (n_vec == k_chunk) run_chunk();
    }
  }
  if (n_vec > 0) run_chunk();
}

// ---------------------------------------------------------------------------
// av.

// One packed word (four tokens, or 4 * 8 / BITS codes per channel) of a group:
// where its channels start and its operand word index.
struct group_word {
  const std::uint8_t* codes;
  int operand;
};

// Per-channel scales and offsets of folded a.v (a tile's fp16 ones, or static
// f32 ones) and each row's sum of weights.
struct av_fold {
  const std::uint8_t* s16 = nullptr;
  const std::uint8_t* m16 = nullptr;
  const float* s32 = nullptr;
  const float* m32 = nullptr;
  const float* wsum = nullptr;
};

// acc rows [R][hd] (channels dc .. dc + 16 * NV) += the dot products of a group's
// words with the R operand rows: the integer sums, then the scales (sc[r *
// sc_stride], and for FOLDED the per-channel ones in f), on registers. A
// function of its own: with the sums inlined into a larger one, GCC kept the
// accumulators on the stack. The same channels of the next group's words
// (n_next of them) are prefetched meanwhile.
template <int R, int NV, int BITS, bool FOLDED>
__attribute__((noinline)) void av_dot(const group_word* words, int n_words, const group_word* next, int n_next,
                                      int dc, const __mmask16* mc, const std::int32_t* base, std::size_t rowstep,
                                      const float* sc, int sc_stride, const av_fold& f, float* __restrict acc,
                                      int hd) {
  __m512i h[NV][R], l[NV][R];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) h[v][r] = l[v][r] = _mm512_setzero_si512();
  __mmask16 m[NV];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) m[v] = mc[v];
  for (int i = 0; i < n_words; ++i) {
    const std::uint8_t* wp = words[i].codes + static_cast<std::size_t>(dc) * 4;
    __m512i vec[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) vec[v] = _mm512_maskz_loadu_epi32(m[v], wp + 64 * v);
    if (i < n_next) {
      const std::uint8_t* np = next[i].codes + static_cast<std::size_t>(dc) * 4;
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) prefetch_line(np + 64 * v);
    }
    accumulate<R, BITS, true, NV>(vec, base + static_cast<std::size_t>(words[i].operand) * 2, rowstep, h, l);
  }
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    const int d0 = dc + 16 * v;
    __m512 S, M;
    if constexpr (FOLDED) {
      if (f.s16) {
        S = load_h16(f.s16 + static_cast<std::size_t>(d0) * 2, m[v]);
        M = load_h16(f.m16 + static_cast<std::size_t>(d0) * 2, m[v]);
      } else {
        S = _mm512_maskz_loadu_ps(m[v], f.s32 + d0);
        M = _mm512_maskz_loadu_ps(m[v], f.m32 + d0);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512 dot = finish_dot<true>(h[v][r], l[v][r], sc[r * sc_stride]);
      if constexpr (FOLDED) {
        dot = _mm512_mul_ps(dot, S);
        dot = _mm512_fmadd_ps(M, _mm512_set1_ps(f.wsum[r]), dot);
      }
      float* a = acc + static_cast<std::size_t>(r) * hd + d0;
      _mm512_mask_storeu_ps(a, m[v], _mm512_add_ps(_mm512_maskz_loadu_ps(m[v], a), dot));
    }
  }
}

// FOLDED: per-channel or static scales applied per channel after the dot;
// otherwise the tile's per-token (per group) scales are folded into the weights.
//
// Weights are quantized per OPERAND GROUP of consecutive tiles (up to 128 tokens;
// one tile for per-channel scales, which change from tile to tile): integer sums
// run over the whole group and are converted once. Groups are aligned to the
// start of the run, so a row's groups hold the same weights (zeros past its
// position) however many rows or tokens share the call.
// NV vectors of 16 channels from dc on (each operand broadcast serves all of
// them); the group's packed words come as one flat list.
template <int R, int NV, int BITS, bool FOLDED>
void av_block(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const std::uint8_t* const* tiles,
              const group_word* words, int n_group_words, const group_word* next, int n_next, int dc, int g,
              const operand_rows& ops, int r0, int stride, int G, float* acc) {
  const int hd = s.head_dim;
  __mmask16 mc[NV];
  for (int v = 0; v < NV; ++v) mc[v] = lane_mask(hd - dc - 16 * v);
  av_fold f;
  if constexpr (FOLDED) {
    if (L.mode == kv_scale_mode::per_channel) {
      f.s16 = tiles[0] + L.scale_off;
      f.m16 = tiles[0] + L.offset_off;
    } else {
      f.s32 = sp->scale;
      f.m32 = sp->offset;
    }
    f.wsum = ops.wsum.data() + r0;
  }
  av_dot<R, NV, BITS, FOLDED>(words, n_group_words, next, n_next, dc, mc, operand_row(ops, r0 * G + g, stride),
                              static_cast<std::size_t>(G) * (stride / 2), ops.sc.data() + r0 * G + g, G, f,
                              acc + static_cast<std::size_t>(r0) * hd, hd);
}

template <int NV, int BITS, bool FOLDED>
void av_vectors(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const std::uint8_t* const* tiles,
                const group_word* words, int n_group_words, const group_word* next, int n_next, int dc, int g,
                const operand_rows& ops, int n_q, int stride, int G, float* acc) {
  int r = 0;
  for (; r + 4 <= n_q; r += 4)
    av_block<4, NV, BITS, FOLDED>(L, s, sp, tiles, words, n_group_words, next, n_next, dc, g, ops, r, stride, G, acc);
  switch (n_q - r) {
    case 3: av_block<3, NV, BITS, FOLDED>(L, s, sp, tiles, words, n_group_words, next, n_next, dc, g, ops, r, stride, G, acc); break;
    case 2: av_block<2, NV, BITS, FOLDED>(L, s, sp, tiles, words, n_group_words, next, n_next, dc, g, ops, r, stride, G, acc); break;
    case 1: av_block<1, NV, BITS, FOLDED>(L, s, sp, tiles, words, n_group_words, next, n_next, dc, g, ops, r, stride, G, acc); break;
    default: break;
  }
}

template <int BITS, bool FOLDED>
void av_run(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
            const float* w, int ld, int n_q, float* acc) {
  constexpr int k_group_tokens = 128;
  const int B = s.block_size, hd = s.head_dim;
  const int P = L.n_outer * L.lanes;  // operand positions per tile (tokens padded to whole words)
  const int tpg = L.mode == kv_scale_mode::per_channel ? 1 : std::max(1, k_group_tokens / B);
  const int stride = round16(P * tpg);
  const int G = FOLDED ? 1 : L.n_groups;
  const int n_tiles = (n_tokens + B - 1) / B;
  operand_rows& ops = t_ops;
  ops.size(n_q, G, stride);
  // Per-token offsets: sum_t w_t M_t per row and group, accumulated lane by
  // lane over the tiles and added once at the end.
  if constexpr (!FOLDED) std::fill_n(ops.bias.begin(), static_cast<std::size_t>(n_q) * G * 16, 0.0f);
  const std::uint8_t* group[k_group_tokens];  // tpg <= k_group_tokens
  int nt[k_group_tokens];
  // A group's words: at most k_group_tokens / 4 + tpg (tiles of whole words,
  // at least 4 tokens per word), or one tile of up to k_max_block_size tokens
  // (check()), ceil(block_size / 4) words.
  group_word word_lists[2][k_max_block_size];
  group_word* words = word_lists[0];
  group_word* next_words = word_lists[1];
  // The words of the group of tiles from i0 on; returns their number.
  auto list_words = [&](int i0, group_word* out) {
    int n = 0;
    for (int j = 0; j < std::min(tpg, n_tiles - i0); ++j) {
      const auto* tile = static_cast<const std::uint8_t*>(tiles[i0 + j]);
      const int ntj = std::min(B, n_tokens - (i0 + j) * B);
      for (int w = 0; w < (ntj + L.lanes - 1) / L.lanes; ++w)
        out[n++] = {tile + static_cast<std::size_t>(w) * hd * 4, (j * L.n_outer + w) * (8 / BITS)};
    }
    return n;
  };
  int n_next_words = list_words(0, next_words);

  for (int i0 = 0; i0 < n_tiles; i0 += tpg) {
    const int n_group_tiles = std::min(tpg, n_tiles - i0);
    for (int j = 0; j < n_group_tiles; ++j) {
      group[j] = static_cast<const std::uint8_t*>(tiles[i0 + j]);
      nt[j] = std::min(B, n_tokens - (i0 + j) * B);
    }
    std::swap(words, next_words);  // the next group's list becomes this one's
    const int n_group_words = n_next_words;
    // The next group's codes are prefetched line by line inside av_dot, as its
    // words mirror this group's; its scales and offsets here.
    const int n_next = std::clamp(n_tiles - (i0 + tpg), 0, tpg);
    n_next_words = n_next > 0 ? list_words(i0 + tpg, next_words) : 0;
    for (int j = 0; j < n_next; ++j) kv_simd::prefetch_slice(tiles[i0 + tpg + j], L.codes_bytes, L.bytes);
    const bool dense = P % 16 == 0;
    if constexpr (!FOLDED) {
      if (dense && stride == 128) {
        av_dense8 d;
        for (int c = 0, j = 0, t = 0; c < 8; ++c, t += 16) {
          if (t == P) {
            ++j;
            t = 0;
          }
          const bool in = j < n_group_tiles;
          d.m[c] = in ? lane_mask(nt[j] - t) : 0;
          d.at[c] = static_cast<std::size_t>(i0 + (in ? j : 0)) * B + t;
          d.s[c] = group[in ? j : 0] + L.scale_off + 2 * t;
          d.o[c] = group[in ? j : 0] + L.offset_off + 2 * t;
        }
        for (int g = 0; g < G; ++g) {
          const std::size_t at = static_cast<std::size_t>(g) * B * 2;
          auto rows = [&]<int R>(int r0) {
            av_operands_dense8<R>(w, static_cast<std::size_t>(ld), d, at, r0, G, g, stride, ops.sc.data(),
                                  ops.bias.data(), ops.packed.data());
          };
          for_row_blocks(n_q, rows);
        }
      }
    }
    for (int r = 0; r < n_q && !(!FOLDED && dense && stride == 128); ++r) {
      for (int g = 0; g < G; ++g) {
        const int og = r * G + g;
        float* x = ops.x.data();
        __m512 bias = _mm512_setzero_ps(), sum = _mm512_setzero_ps(), vmax = _mm512_setzero_ps();
        if constexpr (!FOLDED) bias = _mm512_loadu_ps(&ops.bias[static_cast<std::size_t>(og) * 16]);
        if (dense) {
          // Every 16 operand positions lie in one tile: x is written whole,
          // zeros included, and its max taken on the way.
          for (int c = 0, j = 0, t = 0; c < stride; c += 16, t += 16) {
            if (t == P) {  // (a division per vector here cost more than the rest of the loop)
              ++j;
              t = 0;
            }
            const __mmask16 m = j < n_group_tiles ? lane_mask(nt[j] - t) : 0;
            const float* wr = w + static_cast<std::size_t>(r) * ld + static_cast<std::size_t>(i0 + j) * B;
            const __m512 wv = _mm512_maskz_loadu_ps(m, wr + t);
            __m512 xv = wv;
            if constexpr (!FOLDED) {
              const std::uint8_t* tile = group[j < n_group_tiles ? j : 0];
              const std::size_t at = static_cast<std::size_t>(g) * B * 2 + 2 * t;
              xv = _mm512_mul_ps(wv, load_h16(tile + L.scale_off + at, m));
              bias = _mm512_fmadd_ps(wv, load_h16(tile + L.offset_off + at, m), bias);
            } else {
              sum = _mm512_add_ps(sum, wv);
            }
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(xv));
            _mm512_storeu_ps(x + c, xv);
          }
          if constexpr (!FOLDED) _mm512_storeu_ps(&ops.bias[static_cast<std::size_t>(og) * 16], bias);
          if constexpr (FOLDED) ops.wsum[r] = _mm512_reduce_add_ps(sum);
          ops.sc[og] = quantize_hilo_max(x, stride, stride, _mm512_reduce_max_ps(vmax), operand_row(ops, og, stride), true);
          continue;
        }
        std::fill_n(x, stride, 0.0f);
        for (int j = 0; j < n_group_tiles; ++j) {
          const float* wr = w + static_cast<std::size_t>(r) * ld + static_cast<std::size_t>(i0 + j) * B;
          const std::uint8_t* S16 = group[j] + L.scale_off + static_cast<std::size_t>(g) * B * 2;
          const std::uint8_t* M16 = group[j] + L.offset_off + static_cast<std::size_t>(g) * B * 2;
          for (int t = 0; t < nt[j]; t += 16) {
            const __mmask16 m = lane_mask(nt[j] - t);
            const __m512 wv = _mm512_maskz_loadu_ps(m, wr + t);
            if constexpr (!FOLDED) {
              // x_t = w_t * S_t; bias += w_t * M_t.
              _mm512_mask_storeu_ps(x + j * P + t, m, _mm512_mul_ps(wv, load_h16(S16 + 2 * t, m)));
              bias = _mm512_fmadd_ps(wv, load_h16(M16 + 2 * t, m), bias);
            } else {
              _mm512_mask_storeu_ps(x + j * P + t, m, wv);
              sum = _mm512_add_ps(sum, wv);
            }
          }
        }
        if constexpr (!FOLDED) _mm512_storeu_ps(&ops.bias[static_cast<std::size_t>(og) * 16], bias);
        if constexpr (FOLDED) ops.wsum[r] = _mm512_reduce_add_ps(sum);
        ops.sc[og] = quantize_hilo(x, stride, stride, operand_row(ops, og, stride), true);
      }
    }
    // Pairs of 16-channel vectors where both lie in one scale group.
    for (int dc = 0; dc < hd;) {
      const int g = FOLDED ? 0 : dc / L.group_size;
      const bool pair = dc + 16 < hd && (FOLDED || (dc + 16) / L.group_size == g);
      if (pair) av_vectors<2, BITS, FOLDED>(L, s, sp, group, words, n_group_words, next_words, n_next_words, dc, g, ops, n_q, stride, G, acc);
      else av_vectors<1, BITS, FOLDED>(L, s, sp, group, words, n_group_words, next_words, n_next_words, dc, g, ops, n_q, stride, G, acc);
      dc += pair ? 32 : 16;
    }
  }
  if constexpr (!FOLDED)
    for (int r = 0; r < n_q; ++r)
      for (int g = 0; g < G; ++g) {
        const __m512 bias = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_loadu_ps(&ops.bias[static_cast<std::size_t>(r * G + g) * 16])));
        float* a = acc + static_cast<std::size_t>(r) * hd;
        for (int d = g * L.group_size; d < (g + 1) * L.group_size; d += 16) {
          const __mmask16 m = lane_mask((g + 1) * L.group_size - d);
          _mm512_mask_storeu_ps(a + d, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + d), bias));
        }
      }
}

template <bool FOLDED>
void qk_bits(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n,
             const float* q, int n_q, float* scores, int ld) {
  switch (L.bits) {
    case 8: return qk_run<8, FOLDED>(L, s, sp, tiles, n, q, n_q, scores, ld);
    case 4: return qk_run<4, FOLDED>(L, s, sp, tiles, n, q, n_q, scores, ld);
    default: return qk_run<2, FOLDED>(L, s, sp, tiles, n, q, n_q, scores, ld);
  }
}

template <bool FOLDED>
void av_bits(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n,
             const float* w, int ld, int n_q, float* acc) {
  switch (L.bits) {
    case 8: return av_run<8, FOLDED>(L, s, sp, tiles, n, w, ld, n_q, acc);
    case 4: return av_run<4, FOLDED>(L, s, sp, tiles, n, w, ld, n_q, acc);
    default: return av_run<2, FOLDED>(L, s, sp, tiles, n, w, ld, n_q, acc);
  }
}

bool folded(const tile_layout& L) {
  return L.mode == kv_scale_mode::per_channel || L.mode == kv_scale_mode::static_scales;
}

}  // namespace

void qk_avx512(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
               int n_tokens, const float* q, int n_q, float* scores, int ld) {
  if (n_tokens <= 0 || n_q <= 0) return;
  const tile_layout L = layout_of(fmt, s);
  if (folded(L)) qk_bits<true>(L, s, sp, tiles, n_tokens, q, n_q, scores, ld);
  else qk_bits<false>(L, s, sp, tiles, n_tokens, q, n_q, scores, ld);
}

void av_avx512(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
               int n_tokens, const float* w, int ld, int n_q, float* acc) {
  if (n_tokens <= 0 || n_q <= 0) return;
  const tile_layout L = layout_of(fmt, s);
  if (folded(L)) av_bits<true>(L, s, sp, tiles, n_tokens, w, ld, n_q, acc);
  else av_bits<false>(L, s, sp, tiles, n_tokens, w, ld, n_q, acc);
}

}  // namespace pagoda::int_kv
