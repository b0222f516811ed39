// AVX2 (+FMA, F16C) qk/av for the integer codecs, on the packed codes
// directly: keys and values with per-token or group scales (int8's default,
// int4/int2 with per-token scales, KIVI's int4/int2 values) and values with
// per-channel or static scales in integer arithmetic; keys with per-channel or
// static scales (KIVI's int4/int2 keys) in f32, their channel scales folded
// into the query per tile (below).
//
// AVX2 has no VNNI. The f32 operand (a query row per scale group for qk; a row
// of weights times token scales, w_t * S_t, per span of tiles for av) is
// rounded once to int16 in units of sc = max|x| / levels, levels = 32767 unless
// an int32 sum could overflow (avx2_levels in kv_codec_int.h), and the codes,
// zero-extended to 16 bits (the even and the odd bytes of each packed word
// apart: a shift and a mask per 16 codes), are multiplied by it with vpmaddwd:
// 16 products per instruction against an FMA's 8, and no code is converted to
// float. The int32 sums are exact; scales and offsets are applied after them
// in f32:
//   q.k_t  = sum_g S_gt * sc_g * (sum_{d in g} x_d u_td) + M_gt * (sum_{d in g} q_d)
//   a.v_d += sc * (sum_t x_t u_td) + (sum_t w_t M_t)                 per span
// with x the int16 operand. Each of its elements is off by at most
// max|x| / (2 * levels), plus the f32 rounding of x * levels / max|x|
// (avx2_operand_error); the offsets terms are f32 sums of the unrounded
// operand (a.v's over 8 lanes in a fixed order).
// Keys with 4- and 2-bit codes round the query to int8 instead (127 levels, as
// the AVX-512 q.k does for them: their codes' own step, 1/15 or 1/3 of a
// token's range, is far coarser) and multiply the codes as unsigned bytes
// with vpmaddubsw: 32 products per instruction, summed in int16 over a few
// words (qk_group_bytes) before one vpmaddwd by ones widens them: q.k in
// cache 12.6 -> 9.3 us (int4).
// Keys with per-channel or static scales fold them into an f32 operand per tile
// and widen their codes to f32 (shift, mask, convert) for FMAs:
//   q.k_t  = sum_d (q_d S_d) u_td + (sum_d q_d M_d)
// Values with per-channel or static scales apply them to each tile's code sums
// (the weights quantized over the tile):
//   a.v_d += S_d * sc * (sum_t x_t u_td) + M_d * (sum_t w_t)
//
// Batch invariance: a row's operand is quantized from that row alone (its max
// over the scale group or the span), integer sums are exact in any order, and
// every f32 lane (one token for qk, one channel for av) is one chain over scale
// groups (qk) or spans of tiles counted from the run's start (av), never split
// by n_q or n_tokens. A token of weight 0 has operand 0 (nor does it change the
// span's max) and adds 0 * M = 0 to its span's offset sum: nothing changes.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "quant/kv_codec_int.h"
#include "quant/kv_simd_avx2.h"

namespace pagoda::int_kv {
namespace {

using kv_simd::partial_bytes;
using kv_simd::prefetch_line;

// Code k (of 4 * 8 / BITS) of each 32-bit lane as f32: value index 4k' + j
// sits in byte j at bit BITS * k' (kv_codec_int.h), so shift = 8j + BITS * k'.
template <int BITS>
inline __m256 code_f32(__m256i v, int shift) {
  __m256i c = shift ? _mm256_srli_epi32(v, shift) : v;
  if (shift + BITS < 32) c = _mm256_and_si256(c, _mm256_set1_epi32((1 << BITS) - 1));
  return _mm256_cvtepi32_ps(c);
}

// 8 packed words from p, or the first n of them (zeros past) when n < 8.
inline __m256i load_words(const std::uint8_t* p, int n) {
  if (n >= 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (n <= 0) return _mm256_setzero_si256();
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(partial_bytes(p, 4 * n).b));
}

// ---------------------------------------------------------------------------
// The int16 operand
//
// Operand rows are stored in "pair order": of each 4 consecutive positions
// 4m + j (the 4 bytes j of one plane of a packed word), the row holds x0, x2,
// x1, x3, so the 32-bit word at 4m pairs the values of the even bytes and the
// one at 4m + 2 those of the odd bytes (codes_even, codes_odd).

// The largest of the 8 lanes.
inline float hmax8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// max|x[0, n)|.
float abs_max(const float* x, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, kv_simd::load8(x + i, n - i)));
  return hmax8(m);
}

// x[0, n) -> y[0, n_pad) in pair order (n_pad a multiple of 4, zeros past n),
// rounded to integers in units of sc = amax / levels (amax = max|x|, so
// |y| <= levels). Returns sc, 0 when amax is 0 (y all zero then).
float quantize_pairs(const float* x, int n, int n_pad, float amax, int levels, std::int16_t* y) {
  if (!(amax > 0)) {
    std::fill_n(y, n_pad, std::int16_t{0});
    return 0.0f;
  }
  const __m256 inv = _mm256_set1_ps(static_cast<float>(levels) / amax);
  for (int i = 0; i < n_pad; i += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(kv_simd::load8(x + i, n - i), inv));
    // [x0 x2 x1 x3 | x4 x6 x5 x7] as int32 -> int16 in 64-bit words 0 and 2 -> the low 128 bits.
    const __m256i p = _mm256_packs_epi32(_mm256_shuffle_epi32(v, _MM_SHUFFLE(3, 1, 2, 0)), _mm256_setzero_si256());
    const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, _MM_SHUFFLE(3, 1, 2, 0)));
    if (n_pad - i >= 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), h);
    else _mm_storel_epi64(reinterpret_cast<__m128i*>(y + i), h);
  }
  return amax / static_cast<float>(levels);
}

// x[0, n) -> y[0, n_pad) as int8 in their order (zeros past n), in units of
// sc = amax / 127. Returns sc, 0 when amax is 0.
float quantize_bytes(const float* x, int n, int n_pad, float amax, std::int8_t* y) {
  const float inv = amax > 0 ? 127.0f / amax : 0.0f;
  for (int i = 0; i < n_pad; ++i)
    y[i] = static_cast<std::int8_t>(i < n ? _mm_cvtss_si32(_mm_set_ss(x[i] * inv)) : 0);
  return amax > 0 ? amax / 127.0f : 0.0f;
}

// Codes of plane k (value 4k + j sits in byte j at bit BITS * k) of each packed
// word, zero-extended to 16 bits: bytes 0 and 2 (codes_even), 1 and 3 (codes_odd).
template <int BITS>
inline __m256i codes_even(__m256i v, int k) {
  return _mm256_and_si256(k ? _mm256_srli_epi16(v, BITS * k) : v, _mm256_set1_epi16((1 << BITS) - 1));
}
template <int BITS>
inline __m256i codes_odd(__m256i v, int k) {
  const __m256i c = _mm256_srli_epi16(v, 8 + BITS * k);
  return BITS * (k + 1) < 8 ? _mm256_and_si256(c, _mm256_set1_epi16((1 << BITS) - 1)) : c;
}

// The operand pair at p (two int16 in pair order) in every 32-bit lane.
inline __m256i pair_at(const std::int16_t* p) {
  std::int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc[r][v] += the products of the codes of NV vectors of packed words (one
// word per 32-bit lane) with row r's operand for the words' 4 * 8 / BITS
// values, at y + r * y_stride in pair order, summed per lane. (Forced inline:
// without it GCC left a.v at 13.2 us in cache instead of 11.4 for int8.)
template <int NR, int NV, int BITS>
__attribute__((always_inline)) inline void madd_words(const __m256i* vec, const std::int16_t* y, int y_stride,
                                                      __m256i (&acc)[NR][NV]) {
#pragma GCC unroll 4
  for (int k = 0; k < 8 / BITS; ++k) {
    __m256i even[NV], odd[NV];
    for (int v = 0; v < NV; ++v) {
      even[v] = codes_even<BITS>(vec[v], k);
      odd[v] = codes_odd<BITS>(vec[v], k);
    }
    for (int r = 0; r < NR; ++r) {
      const std::int16_t* p = y + static_cast<std::size_t>(r) * y_stride + 4 * k;
      const __m256i x02 = pair_at(p), x13 = pair_at(p + 2);
      for (int v = 0; v < NV; ++v)
        acc[r][v] = _mm256_add_epi32(
            acc[r][v], _mm256_add_epi32(_mm256_madd_epi16(even[v], x02), _mm256_madd_epi16(odd[v], x13)));
    }
  }
}

// ---------------------------------------------------------------------------
// qk

// 8 token lanes of one tile.
struct token_vector {
  const std::uint8_t* tile;
  const std::uint8_t* ahead;  // the tile whose same lines are prefetched meanwhile
  int tc;                     // first token
  int n;                      // valid lanes (tokens written)
  int n_read;                 // lanes that lie in the tile (block_size - tc, at most 8 used)
  float* scores;              // scores of row 0, token tc
};

// The quantized query rows of one call (per-token or group scales): row r's
// operand at y + r * stride (pair order, channels past head_dim zero), and per
// row and scale group (r * G + g) its unit sc and the f32 sum of its channels.
struct query_operand {
  const std::int16_t* y;
  const std::int8_t* y8;  // 4- and 2-bit codes: the int8 operand (natural order) instead
  int stride;
  const float* sc;
  const float* sum;
  int G;
};

// Group g's terms of the scores of NR rows (from r0) for NV token vectors
// from their int32 code sums, added to what the scores hold from the groups
// before (g > 0).
template <int NR, int NV>
void finish_scores(const tile_layout& L, kv_tile_shape s, const token_vector* tv, int g, const query_operand& op,
                   int r0, int ld, const __m256i (&dot)[NR][NV]) {
  const int B = s.block_size;
  for (int v = 0; v < NV; ++v) {
    const std::size_t at = L.scale_off + (static_cast<std::size_t>(g) * B + tv[v].tc) * 2;
    const int nr = std::min(tv[v].n_read, 8);
    const __m256 S = kv_simd::load_h8(tv[v].tile + at, nr);
    const __m256 M = kv_simd::load_h8(tv[v].tile + at + (L.offset_off - L.scale_off), nr);
    for (int r = 0; r < NR; ++r) {
      const std::size_t og = static_cast<std::size_t>(r0 + r) * op.G + g;
      float* out = tv[v].scores + static_cast<std::size_t>(r) * ld;
      const __m256 dot_f = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r][v]), _mm256_set1_ps(op.sc[og]));
      __m256 total = g == 0 ? _mm256_setzero_ps() : kv_simd::load8(out, tv[v].n);
      total = _mm256_fmadd_ps(S, dot_f, total);
      total = _mm256_fmadd_ps(M, _mm256_set1_ps(op.sum[og]), total);
      kv_simd::store8(out, total, tv[v].n);
    }
  }
}

// Scores of NR rows (from r0) for NV token vectors, adding group g's terms to
// what scores hold from the groups before (g > 0). Words [w0, w1) hold group
// g's channels.
template <int NR, int NV, int BITS>
void qk_group(const tile_layout& L, kv_tile_shape s, const token_vector* tv, int g, int w0, int w1,
              const query_operand& op, int r0, int ld) {
  constexpr int LANES = 32 / BITS;
  const int B = s.block_size;
  const std::size_t step = static_cast<std::size_t>(B) * 4;
  __m256i dot[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) dot[r][v] = _mm256_setzero_si256();
  const std::int16_t* y0 = op.y + static_cast<std::size_t>(r0) * op.stride;
  for (int w = w0; w < w1; ++w) {
    __m256i vec[NV];
    for (int v = 0; v < NV; ++v) {
      const std::size_t at = w * step + static_cast<std::size_t>(tv[v].tc) * 4;
      vec[v] = load_words(tv[v].tile + at, tv[v].n_read);
      if (at % 64 == 0) prefetch_line(tv[v].ahead + at);
    }
    madd_words<NR, NV, BITS>(vec, y0 + w * LANES, op.stride, dot);
  }
  finish_scores<NR, NV>(L, s, tv, g, op, r0, ld, dot);
}

// qk_group for 4- and 2-bit codes: the codes as unsigned bytes times the int8
// operand with vpmaddubsw (32 products per instruction, pairs summed to int16:
// at most 2 * 15 * 127 per pass, no saturation), K_RUN words summed in int16
// lanes before vpmaddwd by ones widens them to int32.
template <int NR, int NV, int BITS>
void qk_group_bytes(const tile_layout& L, kv_tile_shape s, const token_vector* tv, int g, int w0, int w1,
                    const query_operand& op, int r0, int ld) {
  constexpr int LANES = 32 / BITS, PLANES = 8 / BITS;
  constexpr int K_RUN = 32767 / (2 * ((1 << BITS) - 1) * 127) / PLANES;  // int4 4 words, int2 10
  const int B = s.block_size;
  const std::size_t step = static_cast<std::size_t>(B) * 4;
  const __m256i mask = _mm256_set1_epi8(static_cast<char>((1 << BITS) - 1)), ones = _mm256_set1_epi16(1);
  __m256i dot[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) dot[r][v] = _mm256_setzero_si256();
  const std::int8_t* y0 = op.y8 + static_cast<std::size_t>(r0) * op.stride;
  for (int w_run = w0; w_run < w1; w_run += K_RUN) {
    __m256i part[NR][NV];
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < NV; ++v) part[r][v] = _mm256_setzero_si256();
    for (int w = w_run; w < std::min(w1, w_run + K_RUN); ++w) {
      __m256i vec[NV];
      for (int v = 0; v < NV; ++v) {
        const std::size_t at = w * step + static_cast<std::size_t>(tv[v].tc) * 4;
        vec[v] = load_words(tv[v].tile + at, tv[v].n_read);
        if (at % 64 == 0) prefetch_line(tv[v].ahead + at);
      }
#pragma GCC unroll 4
      for (int k = 0; k < PLANES; ++k) {
        __m256i c[NV];
        for (int v = 0; v < NV; ++v) c[v] = _mm256_and_si256(k ? _mm256_srli_epi16(vec[v], BITS * k) : vec[v], mask);
        for (int r = 0; r < NR; ++r) {
          std::int32_t x4;
          std::memcpy(&x4, y0 + static_cast<std::size_t>(r) * op.stride + w * LANES + 4 * k, 4);
          const __m256i x = _mm256_set1_epi32(x4);
          for (int v = 0; v < NV; ++v) part[r][v] = _mm256_add_epi16(part[r][v], _mm256_maddubs_epi16(c[v], x));
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < NV; ++v) dot[r][v] = _mm256_add_epi32(dot[r][v], _mm256_madd_epi16(part[r][v], ones));
  }
  finish_scores<NR, NV>(L, s, tv, g, op, r0, ld, dot);
}

// Keys with per-channel or static scales: scores of NR rows (q: row 0's
// folded operand q * S, consts: each row's offsets term sum_d q_d M_d) for NV
// token vectors, over all channel words.
template <int NR, int NV, int BITS>
void qk_folded(const tile_layout& L, kv_tile_shape s, const token_vector* tv, const float* q, const float* consts,
               int ld) {
  constexpr int CPB = 8 / BITS;
  const int B = s.block_size, D = s.head_dim;
  const std::size_t step = static_cast<std::size_t>(B) * 4;
  __m256 dot[NV][NR];
  for (int v = 0; v < NV; ++v)
    for (int r = 0; r < NR; ++r) dot[v][r] = _mm256_setzero_ps();
  for (int w = 0; w < L.n_outer; ++w) {
    __m256i vec[NV];
    for (int v = 0; v < NV; ++v) {
      const std::size_t at = w * step + static_cast<std::size_t>(tv[v].tc) * 4;
      vec[v] = load_words(tv[v].tile + at, tv[v].n_read);
      if (at % 64 == 0) prefetch_line(tv[v].ahead + at);
    }
    const int ch0 = w * L.lanes;
#pragma GCC unroll 16
    for (int k = 0; k < CPB; ++k)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int ch = ch0 + 4 * k + j;
        if (ch >= D) break;  // padding channels of the last word
        __m256 u[NV];
        for (int v = 0; v < NV; ++v) u[v] = code_f32<BITS>(vec[v], 8 * j + BITS * k);
        for (int r = 0; r < NR; ++r) {
          const __m256 qb = _mm256_broadcast_ss(q + static_cast<std::size_t>(r) * D + ch);
          for (int v = 0; v < NV; ++v) dot[v][r] = _mm256_fmadd_ps(qb, u[v], dot[v][r]);
        }
      }
  }
  for (int v = 0; v < NV; ++v)
    for (int r = 0; r < NR; ++r)
      kv_simd::store8(tv[v].scores + static_cast<std::size_t>(r) * ld,
                      _mm256_add_ps(dot[v][r], _mm256_set1_ps(consts[r])), tv[v].n);
}

// Runs kernel.template operator()<NV>(tv) over a chunk's token vectors two at
// a time (eight accumulators for four rows), then the one left, each with its
// scores moved to row r0.
template <typename F>
void token_vector_pairs(const token_vector* chunk, int n_vec, int r0, int ld, F&& kernel) {
  token_vector tv[2];
  int i = 0;
  for (; i + 2 <= n_vec; i += 2) {
    for (int v = 0; v < 2; ++v) {
      tv[v] = chunk[i + v];
      tv[v].scores += static_cast<std::size_t>(r0) * ld;
    }
    kernel.template operator()<2>(tv);
  }
  if (i < n_vec) {
    tv[0] = chunk[i];
    tv[0].scores += static_cast<std::size_t>(r0) * ld;
    kernel.template operator()<1>(tv);
  }
}

// Keys with per-token or group scales: every row's operand once per call,
// then token vectors in chunks of up to 16 (eight 16-token tiles): a chunk's
// codes stay in L1 while every block of four rows runs over them, group by group.
template <int BITS>
void qk_run(const tile_layout& L, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* q, int n_q,
            float* scores, int ld) {
  const int B = s.block_size, D = s.head_dim, G = L.n_groups;
  const int stride = L.n_outer * L.lanes, levels = avx2_levels(L, s);
  const int words_per_group = L.mode == kv_scale_mode::group ? L.group_size / L.lanes : L.n_outer;
  // Grow-only per thread: a second call of the same shape allocates nothing.
  // 4- and 2-bit codes take an int8 operand (qk_group_bytes), 8-bit ones int16.
  constexpr bool k_bytes = BITS < 8;
  thread_local std::vector<std::int16_t> y;
  thread_local std::vector<std::int8_t> y8;
  thread_local std::vector<float> sc, sum;
  (k_bytes ? y8.resize(static_cast<std::size_t>(n_q) * stride) : y.resize(static_cast<std::size_t>(n_q) * stride));
  sc.resize(static_cast<std::size_t>(n_q) * G);
  sum.resize(static_cast<std::size_t>(n_q) * G);
  for (int r = 0; r < n_q; ++r)
    for (int g = 0; g < G; ++g) {
      // Groups (whole key words, avx2_supported) are quantized apart, each with its own sc.
      const int d0 = g * L.group_size, n = std::min(D, d0 + L.group_size) - d0;
      const float* qr = q + static_cast<std::size_t>(r) * D + d0;
      float total = 0;
      for (int d = 0; d < n; ++d) total += qr[d];
      const std::size_t og = static_cast<std::size_t>(r) * G + g;
      sum[og] = total;
      const std::size_t at = static_cast<std::size_t>(r) * stride + d0;
      const int n_pad = G == 1 ? stride : n;
      sc[og] = k_bytes ? quantize_bytes(qr, n, n_pad, abs_max(qr, n), y8.data() + at)
                       : quantize_pairs(qr, n, n_pad, abs_max(qr, n), levels, y.data() + at);
    }
  const query_operand op{y.data(), y8.data(), stride, sc.data(), sum.data(), G};
  constexpr int k_chunk = 16;
  token_vector chunk[k_chunk];
  int n_vec = 0;
  auto run_chunk = [&] {
    for_row_blocks(n_q, [&]<int NR>(int r0) {
      for (int g = 0; g < G; ++g) {
        const int w0 = g * words_per_group, w1 = w0 + words_per_group;
        token_vector_pairs(chunk, n_vec, r0, ld,
                           [&]<int NV>(const token_vector* tv) {
                             if constexpr (k_bytes) qk_group_bytes<NR, NV, BITS>(L, s, tv, g, w0, w1, op, r0, ld);
                             else qk_group<NR, NV, BITS>(L, s, tv, g, w0, w1, op, r0, ld);
                           });
      }
    });
    n_vec = 0;
  };
  const int n_tiles = (n_tokens + B - 1) / B, ahead = kv_simd::prefetch_ahead(L.bytes);
  for (int i = 0; i < n_tiles; ++i) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[i]);
    const std::uint8_t* later = kv_simd::tile_ahead(tiles, i, n_tiles, ahead);
    // Scales and offsets follow the codes, where the loop does not reach.
    kv_simd::prefetch_slice(later, L.codes_bytes, L.bytes);
    const int nt = std::min(B, n_tokens - i * B);
    for (int tc = 0; tc < nt; tc += 8) {
      chunk[n_vec++] = {tile, later, tc, nt - tc, B - tc, scores + static_cast<std::size_t>(i) * B + tc};
      if (n_vec == k_chunk) run_chunk();
    }
  }
  if (n_vec > 0) run_chunk();
}

// Keys with per-channel scales (the tile's fp16 S and M per channel) or
// static ones (sp): tile by tile, every row's operand q * S and offsets term
// sum_d q_d M_d (in channel order, so a row's scores never depend on the
// other rows), then the token vectors of the tile, four rows at a time.
template <int BITS>
void qk_run_folded(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
                   int n_tokens, const float* q, int n_q, float* scores, int ld) {
  const int B = s.block_size, D = s.head_dim;
  const bool per_tile = L.mode == kv_scale_mode::per_channel;
  thread_local std::vector<float> folded, consts;
  folded.resize(static_cast<std::size_t>(n_q) * D);
  consts.resize(static_cast<std::size_t>(n_q));
  constexpr int k_chunk = 16;
  token_vector chunk[k_chunk];
  const int n_tiles = (n_tokens + B - 1) / B, ahead = kv_simd::prefetch_ahead(L.bytes);
  for (int i = 0; i < n_tiles; ++i) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[i]);
    const std::uint8_t* later = kv_simd::tile_ahead(tiles, i, n_tiles, ahead);
    kv_simd::prefetch_slice(later, L.codes_bytes, L.bytes);
    if (per_tile || i == 0) {
      // 8 channels at a time (F16C for the tile's scales; one scalar fp16
      // conversion per channel and row took 3/4 of the time here); lane l of
      // the offsets term sums channels l, l + 8, ... in order.
      for (int r = 0; r < n_q; ++r) {
        const float* qr = q + static_cast<std::size_t>(r) * D;
        float* fr = folded.data() + static_cast<std::size_t>(r) * D;
        __m256 c = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
          const int n = D - d;
          const __m256 S = per_tile ? kv_simd::load_h8(tile + L.scale_off + 2 * static_cast<std::size_t>(d), n)
                                    : kv_simd::load8(sp->scale + d, n);
          const __m256 M = per_tile ? kv_simd::load_h8(tile + L.offset_off + 2 * static_cast<std::size_t>(d), n)
                                    : kv_simd::load8(sp->offset + d, n);
          const __m256 qv = kv_simd::load8(qr + d, n);
          kv_simd::store8(fr + d, _mm256_mul_ps(qv, S), n);
          c = _mm256_fmadd_ps(qv, M, c);
        }
        consts[static_cast<std::size_t>(r)] = kv_simd::hsum8(c);
      }
    }
    const int nt = std::min(B, n_tokens - i * B);
    for (int tc0 = 0; tc0 < nt; tc0 += 8 * k_chunk) {
      int n_vec = 0;
      for (int tc = tc0; tc < nt && n_vec < k_chunk; tc += 8)
        chunk[n_vec++] = {tile, later, tc, nt - tc, B - tc, scores + static_cast<std::size_t>(i) * B + tc};
      for_row_blocks(n_q, [&]<int NR>(int r0) {
        const float* fr = folded.data() + static_cast<std::size_t>(r0) * D;
        const float* cr = consts.data() + r0;
        token_vector_pairs(chunk, n_vec, r0, ld,
                           [&]<int NV>(const token_vector* tv) { qk_folded<NR, NV, BITS>(L, s, tv, fr, cr, ld); });
      });
    }
  }
}

// ---------------------------------------------------------------------------
// av

using kv_simd::tile_span;

// Operand positions of one span: tokens padded to whole words per tile, at
// most span * (block_size + lanes - 1) <= max(128, block_size) + 8 * 15.
constexpr int k_span_positions = k_max_block_size + 128;

// Channels [d0, d0 + n_ch) (n_ch <= 8 * NC) of NR rows, rows acc_ld apart:
//   acc[r][d] = (acc[r][d] + sc[r] * sum_t y[r][t] u_td) + bias[r]
// over the span's tokens: y holds each row's int16 operand (pair order) at
// position k * P + t (tile k of the span, P positions per tile), zero past
// the valid tokens.
template <int NR, int NC, int BITS>
void av_rows(const tile_span& sp, kv_tile_shape s, int P, int d0, int n_ch, const std::int16_t* y, int y_stride,
             const float* sc, const float* bias, float* acc, int acc_ld) {
  constexpr int LANES = 32 / BITS;
  const int D = s.head_dim;
  int nc[NC];
  for (int c = 0; c < NC; ++c) nc[c] = n_ch - 8 * c;
  __m256i a[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = _mm256_setzero_si256();
  for (int k = 0; k < sp.n; ++k) {
    const int n_words = (sp.nt[k] + LANES - 1) / LANES;  // packed token words holding valid tokens
    for (int tw = 0; tw < n_words; ++tw) {
      const std::size_t at = (static_cast<std::size_t>(tw) * D + d0) * 4;
      __m256i vec[NC];
      for (int c = 0; c < NC; ++c) {
        vec[c] = load_words(sp.tile[k] + at + 32 * c, nc[c]);
        if ((at + 32 * c) % 64 == 0) prefetch_line(sp.later[k] + at + 32 * c);
      }
      madd_words<NR, NC, BITS>(vec, y + k * P + tw * LANES, y_stride, a);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m256 scr = _mm256_set1_ps(sc[r]), br = _mm256_set1_ps(bias[r]);
    for (int c = 0; c < NC; ++c) {
      float* out = acc + static_cast<std::size_t>(r) * acc_ld + 8 * c;
      const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][c]), scr, kv_simd::load8(out, nc[c]));
      kv_simd::store8(out, _mm256_add_ps(v, br), nc[c]);
    }
  }
}

// Scale group g of NR rows (from r0) over one span: each row's operand
// x_t = w_t * S_t (quantized over the span) and offset sum, then the channels
// 16 at a time.
template <int NR, int BITS>
void av_group_rows(const tile_layout& L, kv_tile_shape s, const tile_span& sp, int i0, const float* w, int ld, int r0,
                   int g, int levels, float* acc) {
  const int B = s.block_size, D = s.head_dim;
  const int P = L.n_outer * L.lanes, n_pos = sp.n * P;
  alignas(32) float x[k_span_positions + 8];
  alignas(32) std::int16_t y[NR][k_span_positions];
  float sc[NR], bias[NR];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int r = 0; r < NR; ++r) {
    const float* wr = w + static_cast<std::size_t>(r0 + r) * ld;
    // Lane l of sum and vmax takes the tile's tokens l, l + 8, ...: a fixed
    // order, to which a token of weight 0 adds exactly nothing.
    __m256 sum = _mm256_setzero_ps(), vmax = _mm256_setzero_ps();
    for (int k = 0; k < sp.n; ++k) {
      const int tok0 = (i0 + k) * B, nt = sp.nt[k];
      const std::uint8_t* S16 = sp.tile[k] + L.scale_off + static_cast<std::size_t>(g) * B * 2;
      const std::uint8_t* M16 = sp.tile[k] + L.offset_off + static_cast<std::size_t>(g) * B * 2;
      float* xr = x + k * P;
      // Whole vectors up to P (x has room past the span): zeros past nt, where
      // unwritten slots and padding tokens add 0 * u = 0.
      for (int t = 0; t < P; t += 8) {
        const int n = nt - t;
        const __m256 wv = kv_simd::load8(wr + tok0 + t, n);
        const __m256 xv = n > 0 ? _mm256_mul_ps(wv, kv_simd::load_h8(S16 + 2 * t, n)) : _mm256_setzero_ps();
        if (n > 0) sum = _mm256_fmadd_ps(wv, kv_simd::load_h8(M16 + 2 * t, n), sum);
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, xv));
        _mm256_storeu_ps(xr + t, xv);
      }
    }
    bias[r] = kv_simd::hsum8(sum);
    sc[r] = quantize_pairs(x, n_pos, n_pos, hmax8(vmax), levels, y[r]);
  }
  const int c0 = g * L.group_size, c1 = std::min(D, c0 + L.group_size);
  for (int d0 = c0; d0 < c1; d0 += 16)
    av_rows<NR, 2, BITS>(sp, s, P, d0, std::min(16, c1 - d0), &y[0][0], k_span_positions, sc, bias,
                         acc + static_cast<std::size_t>(r0) * D + d0, D);
}

// Values with per-channel scales (each tile's fp16 S and M per channel) or
// static ones (sp, the same for every tile), tile by tile:
//   a.v_d += S_d * (sum_t w_t u_td) + M_d * (sum_t w_t)   over the tile's tokens t
// with w quantized over the tile; the code sums come from av_rows from zero,
// 16 channels at a time; each lane is then one FMA chain over the tiles in
// order, whatever n_q.
template <int NR, int BITS>
void av_folded_rows(const tile_layout& L, kv_tile_shape s, const kv_static_params* stat, const tile_span& one,
                    int tile, const float* w, int ld, int r0, int levels, float* acc) {
  const int B = s.block_size, D = s.head_dim, P = L.n_outer * L.lanes, nt = one.nt[0];
  alignas(32) std::int16_t y[NR][k_span_positions];
  float sc[NR], wsum[NR];
  const float zero[NR] = {};
  for (int r = 0; r < NR; ++r) {
    const float* wr = w + static_cast<std::size_t>(r0 + r) * ld + static_cast<std::size_t>(tile) * B;
    float sum = 0;
    for (int t = 0; t < nt; ++t) sum += wr[t];
    wsum[r] = sum;
    sc[r] = quantize_pairs(wr, nt, P, abs_max(wr, nt), levels, y[r]);
  }
  const std::uint8_t* S16 = one.tile[0] + L.scale_off;
  const std::uint8_t* M16 = one.tile[0] + L.offset_off;
  for (int d0 = 0; d0 < D; d0 += 16) {
    const int n_ch = std::min(16, D - d0);
    alignas(32) float sums[NR][16] = {};
    av_rows<NR, 2, BITS>(one, s, P, d0, n_ch, &y[0][0], k_span_positions, sc, zero, &sums[0][0], 16);
    for (int c = 0; c < 2 && 8 * c < n_ch; ++c) {
      const int nc = n_ch - 8 * c, d = d0 + 8 * c;
      const __m256 sc_d = stat ? kv_simd::load8(stat->scale + d, nc) : kv_simd::load_h8(S16 + 2 * d, nc);
      const __m256 of = stat ? kv_simd::load8(stat->offset + d, nc) : kv_simd::load_h8(M16 + 2 * d, nc);
      for (int r = 0; r < NR; ++r) {
        float* a = acc + static_cast<std::size_t>(r0 + r) * D + d;
        __m256 v = _mm256_fmadd_ps(sc_d, _mm256_load_ps(&sums[r][8 * c]), kv_simd::load8(a, nc));
        kv_simd::store8(a, _mm256_fmadd_ps(of, _mm256_set1_ps(wsum[r]), v), nc);
      }
    }
  }
}

template <int BITS>
void av_run_folded(const tile_layout& L, kv_tile_shape s, const kv_static_params* stat, const void* const* tiles,
                   int n_tokens, const float* w, int ld, int n_q, float* acc) {
  const int B = s.block_size, levels = avx2_levels(L, s);
  const int n_tiles = (n_tokens + B - 1) / B, ahead = kv_simd::prefetch_ahead(L.bytes);
  if (L.mode == kv_scale_mode::per_channel) stat = nullptr;  // the tile's own scales
  for (int i = 0; i < n_tiles; ++i) {
    const tile_span one(tiles, i, 1, n_tiles, n_tokens, B, ahead);
    kv_simd::prefetch_slice(one.later[0], L.codes_bytes, L.bytes);
    for_row_blocks(n_q, [&]<int NR>(int r0) { av_folded_rows<NR, BITS>(L, s, stat, one, i, w, ld, r0, levels, acc); });
  }
}

template <int BITS>
void av_run(const tile_layout& L, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* w, int ld,
            int n_q, float* acc) {
  const int B = s.block_size, levels = avx2_levels(L, s);
  const int span = kv_simd::span_tiles(B);
  const int n_tiles = (n_tokens + B - 1) / B, ahead = kv_simd::prefetch_ahead(L.bytes);
  for (int i0 = 0; i0 < n_tiles; i0 += span) {
    const tile_span sp(tiles, i0, span, n_tiles, n_tokens, B, ahead);
    for (int k = 0; k < sp.n; ++k) kv_simd::prefetch_slice(sp.later[k], L.codes_bytes, L.bytes);
    for (int g = 0; g < L.n_groups; ++g) {
      for_row_blocks(n_q, [&]<int NR>(int r0) { av_group_rows<NR, BITS>(L, s, sp, i0, w, ld, r0, g, levels, acc); });
    }
  }
}

}  // namespace

bool avx2_supported(const tile_layout& L, kv_tile_shape s) {
  if (L.mode == kv_scale_mode::per_token) return true;
  // Keys fold per-channel or static scales into the query (qk_run_folded),
  // values apply them to each tile's code sums (av_run_folded).
  if (L.mode == kv_scale_mode::per_channel || L.mode == kv_scale_mode::static_scales) return true;
  // A key word must not straddle two scale groups.
  return L.mode == kv_scale_mode::group && (!L.key || L.group_size % L.lanes == 0);
}

void qk_avx2(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
             const float* q, int n_q, float* scores, int ld) {
  if (n_tokens <= 0 || n_q <= 0) return;
  const tile_layout L = layout_of(fmt, s);
  if (L.mode == kv_scale_mode::per_channel || L.mode == kv_scale_mode::static_scales) {
    switch (L.bits) {
      case 8: return qk_run_folded<8>(L, s, sp, tiles, n_tokens, q, n_q, scores, ld);
      case 4: return qk_run_folded<4>(L, s, sp, tiles, n_tokens, q, n_q, scores, ld);
      default: return qk_run_folded<2>(L, s, sp, tiles, n_tokens, q, n_q, scores, ld);
    }
  }
  switch (L.bits) {
    case 8: return qk_run<8>(L, s, tiles, n_tokens, q, n_q, scores, ld);
    case 4: return qk_run<4>(L, s, tiles, n_tokens, q, n_q, scores, ld);
    default: return qk_run<2>(L, s, tiles, n_tokens, q, n_q, scores, ld);
  }
}

void av_avx2(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
             int n_tokens, const float* w, int ld, int n_q, float* acc) {
  if (n_tokens <= 0 || n_q <= 0) return;
  const tile_layout L = layout_of(fmt, s);
  if (L.mode == kv_scale_mode::per_channel || L.mode == kv_scale_mode::static_scales) {
    switch (L.bits) {
      case 8: return av_run_folded<8>(L, s, sp, tiles, n_tokens, w, ld, n_q, acc);
      case 4: return av_run_folded<4>(L, s, sp, tiles, n_tokens, w, ld, n_q, acc);
      default: return av_run_folded<2>(L, s, sp, tiles, n_tokens, w, ld, n_q, acc);
    }
  }
  switch (L.bits) {
    case 8: return av_run<8>(L, s, tiles, n_tokens, w, ld, n_q, acc);
    case 4: return av_run<4>(L, s, tiles, n_tokens, w, ld, n_q, acc);
    default: return av_run<2>(L, s, tiles, n_tokens, w, ld, n_q, acc);
  }
}

}  // namespace pagoda::int_kv
