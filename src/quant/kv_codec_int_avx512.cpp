// AVX-512 VNNI qk/av for the integer codecs, on the packed codes directly.
//
// The f32 operand (a query row, or a row of attention weights times the token
// scales) is split into two int8 vectors, x ~ sc * (hi + lo / 254), so one
// vpdpbusd pass per half gives the dot product of the codes with x to about
// 1.6e-5 * max|x| per element: far below the codes' own rounding. Zero offsets
// of int8 (u = c + 128) cancel exactly in integers (128 * sum(hi)).
//
// Batch invariance: a row's operand is quantized from that row alone (its own
// max), each 32-bit lane sums one token (qk) or one channel (av) in a fixed
// order, and zero weights quantize to zero codes that add exactly nothing.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "quant/kv_codec_int.h"

namespace pagoda::int_kv {
namespace {

constexpr float k_inv254 = 1.0f / 254.0f;

inline __mmask16 lane_mask(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << std::max(n, 0)) - 1);
}

inline int round16(int n) { return (n + 15) & ~15; }

inline std::int32_t load_i32(const std::int8_t* p) {
  std::int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __m512 load_h16(const std::uint8_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

// x[0, n) -> hi, lo [n_pad] (zeros past n; n_pad a multiple of 16) with
// x ~ sc * (hi + lo / 254). Returns sc (0 when x is all zero).
float quantize_hilo(const float* x, int n, int n_pad, std::int8_t* hi, std::int8_t* lo, std::int32_t* hi_sum,
                    std::int32_t* lo_sum) {
  __m512 vmax = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(lane_mask(n - i), x + i)));
  const float amax = _mm512_reduce_max_ps(vmax);
  if (!(amax > 0)) {
    std::memset(hi, 0, n_pad);
    std::memset(lo, 0, n_pad);
    *hi_sum = *lo_sum = 0;
    return 0.0f;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
  for (int i = 0; i < n_pad; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask(n - i), x + i), inv);
    __m512 h = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, h), _mm512_set1_ps(254.0f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i hi32 = _mm512_cvtps_epi32(h), lo32 = _mm512_cvtps_epi32(l);
    sh = _mm512_add_epi32(sh, hi32);
    sl = _mm512_add_epi32(sl, lo32);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), _mm512_cvtsepi32_epi8(hi32));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), _mm512_cvtsepi32_epi8(lo32));
  }
  *hi_sum = _mm512_reduce_add_epi32(sh);
  *lo_sum = _mm512_reduce_add_epi32(sl);
  return amax / 127.0f;
}

// Per-call buffers for the prepared operands; grown, never shrunk.
struct operand_rows {
  std::vector<std::int8_t> hi, lo;           // [rows * groups][stride]
  std::vector<float> sc;                     // [rows * groups]
  std::vector<std::int32_t> hi_sum, lo_sum;  // [rows * groups]
  std::vector<float> extra;                  // [rows * groups]: sum of q (qk), bias (av)
  std::vector<float> wsum;                   // [rows]: sum of the tile's weights (av, per-channel asymmetric)
  std::vector<float> x;                      // [stride]
  void size(int rows, int groups, int stride) {
    std::size_t n = static_cast<std::size_t>(rows) * groups;
    if (hi.size() < n * stride) {
      hi.resize(n * stride);
      lo.resize(n * stride);
    }
    if (sc.size() < n) {
      sc.resize(n);
      hi_sum.resize(n);
      lo_sum.resize(n);
      extra.resize(n);
    }
    if (wsum.size() < static_cast<std::size_t>(rows)) wsum.resize(rows);
    if (x.size() < static_cast<std::size_t>(stride)) x.resize(stride);
  }
};
thread_local operand_rows t_ops;

// Extracts code k of every byte: 16 lanes x 4 bytes of values.
template <int BITS>
inline __m512i codes_k(__m512i v, int k) {
  if constexpr (BITS == 8) return v;
  const __m512i low = _mm512_set1_epi8(static_cast<char>((1 << BITS) - 1));
  return _mm512_and_si512(_mm512_srli_epi32(v, BITS * k), low);
}

// ah/al[r] += the codes of one 64-byte vector v (packed word w) times row
// (r0 + r)'s hi/lo operand bytes of scale group g.
template <int R, int BITS>
inline void accumulate(__m512i v, int w, const operand_rows& ops, int r0, int G, int g, int stride, __m512i* ah,
                       __m512i* al) {
  constexpr int CPB = 8 / BITS;
  for (int k = 0; k < CPB; ++k) {
    const __m512i u = codes_k<BITS>(v, k);
    const int off = (w * CPB + k) * 4;
    for (int r = 0; r < R; ++r) {
      const std::size_t row = static_cast<std::size_t>((r0 + r) * G + g) * stride;
      ah[r] = _mm512_dpbusd_epi32(ah[r], u, _mm512_set1_epi32(load_i32(ops.hi.data() + row + off)));
      al[r] = _mm512_dpbusd_epi32(al[r], u, _mm512_set1_epi32(load_i32(ops.lo.data() + row + off)));
    }
  }
}

// The dot product of operand og with the codes from its integer halves; for
// int8 the +128 of every code is taken out exactly first.
template <int BITS>
inline __m512 finish_dot(__m512i ah, __m512i al, const operand_rows& ops, int og) {
  if constexpr (BITS == 8) {
    ah = _mm512_sub_epi32(ah, _mm512_set1_epi32(128 * ops.hi_sum[og]));
    al = _mm512_sub_epi32(al, _mm512_set1_epi32(128 * ops.lo_sum[og]));
  }
  __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(al), _mm512_set1_ps(k_inv254), _mm512_cvtepi32_ps(ah));
  return _mm512_mul_ps(dot, _mm512_set1_ps(ops.sc[og]));
}

// ---------------------------------------------------------------------------
// qk. FOLDED: per-channel or static scales folded into the query (one scale
// group spanning all words); otherwise per-token scales from the tile, G groups.
template <int R, int BITS, bool FOLDED>
void qk_block(const tile_layout& L, kv_tile_shape s, const std::uint8_t* tile, int tc, __mmask16 m,
              const operand_rows& ops, int r0, int stride, int G, int words_per_group, float* scores, int ld) {
  constexpr bool SYM = BITS == 8;
  const int B = s.block_size;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m512i ah[R], al[R];
    for (int r = 0; r < R; ++r) ah[r] = al[r] = _mm512_setzero_si512();
    for (int w = g * words_per_group; w < (g + 1) * words_per_group; ++w)
      accumulate<R, BITS>(_mm512_maskz_loadu_epi32(m, tile + (static_cast<std::size_t>(w) * B + tc) * 4), w, ops, r0, G,
                          g, stride, ah, al);
    __m512 S, M;
    if constexpr (!FOLDED) {
      S = load_h16(tile + L.scale_off + (static_cast<std::size_t>(g) * B + tc) * 2, m);
      if constexpr (!SYM) M = load_h16(tile + L.offset_off + (static_cast<std::size_t>(g) * B + tc) * 2, m);
    }
    for (int r = 0; r < R; ++r) {
      const int og = (r0 + r) * G + g;
      __m512 dot = finish_dot<BITS>(ah[r], al[r], ops, og);
      if constexpr (FOLDED) {
        if constexpr (!SYM) dot = _mm512_add_ps(dot, _mm512_set1_ps(ops.extra[og]));
        total[r] = _mm512_add_ps(total[r], dot);
      } else {
        total[r] = _mm512_fmadd_ps(S, dot, total[r]);
        if constexpr (!SYM) total[r] = _mm512_fmadd_ps(M, _mm512_set1_ps(ops.extra[og]), total[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(scores + static_cast<std::size_t>(r) * ld + tc, m, total[r]);
}

template <int BITS, bool FOLDED>
void qk_run(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
            const float* q, int n_q, float* scores, int ld) {
  constexpr bool SYM = BITS == 8;
  const int B = s.block_size, hd = s.head_dim;
  const int stride = round16(L.n_outer * L.lanes);
  const int G = FOLDED ? 1 : L.n_groups;
  const int words_per_group = L.mode == kv_scale_mode::group ? L.group_size / L.lanes : L.n_outer;
  const bool per_tile = L.mode == kv_scale_mode::per_channel;
  operand_rows& ops = t_ops;
  ops.size(n_q, G, stride);

  // Quantizes every row's operand: q (per-token scales) or q * S (folded).
  auto prepare = [&](const std::uint8_t* tile) {
    for (int r = 0; r < n_q; ++r) {
      const float* qr = q + static_cast<std::size_t>(r) * hd;
      float* x = ops.x.data();
      if constexpr (FOLDED) {
        float bias = 0;
        for (int d = 0; d < hd; ++d) {
          float S, M;
          if (per_tile) {
            S = fp16_to_f32(reinterpret_cast<const fp16_t*>(tile + L.scale_off)[d]);
            M = SYM ? 0.0f : fp16_to_f32(reinterpret_cast<const fp16_t*>(tile + L.offset_off)[d]);
          } else {
            S = sp->scale[d];
            M = SYM ? 0.0f : sp->offset[d];
          }
          x[d] = qr[d] * S;
          bias += qr[d] * M;
        }
        ops.extra[r] = bias;
        ops.sc[r] = quantize_hilo(x, hd, stride, ops.hi.data() + static_cast<std::size_t>(r) * stride,
                                  ops.lo.data() + static_cast<std::size_t>(r) * stride, &ops.hi_sum[r], &ops.lo_sum[r]);
      } else {
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
          ops.sc[og] = quantize_hilo(x, hd, stride, ops.hi.data() + static_cast<std::size_t>(og) * stride,
                                     ops.lo.data() + static_cast<std::size_t>(og) * stride, &ops.hi_sum[og],
                                     &ops.lo_sum[og]);
        }
      }
    }
  };

  if (!per_tile) prepare(nullptr);
  for (int i = 0; i * B < n_tokens; ++i) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[i]);
    if (per_tile) prepare(tile);
    const int nt = std::min(B, n_tokens - i * B);
    float* sc = scores + static_cast<std::size_t>(i) * B;
    for (int tc = 0; tc < nt; tc += 16) {
      const __mmask16 m = lane_mask(nt - tc);
      int r = 0;
      for (; r + 4 <= n_q; r += 4)
        qk_block<4, BITS, FOLDED>(L, s, tile, tc, m, ops, r, stride, G, words_per_group,
                                  sc + static_cast<std::size_t>(r) * ld, ld);
      float* sr = sc + static_cast<std::size_t>(r) * ld;
      switch (n_q - r) {
        case 3: qk_block<3, BITS, FOLDED>(L, s, tile, tc, m, ops, r, stride, G, words_per_group, sr, ld); break;
        case 2: qk_block<2, BITS, FOLDED>(L, s, tile, tc, m, ops, r, stride, G, words_per_group, sr, ld); break;
        case 1: qk_block<1, BITS, FOLDED>(L, s, tile, tc, m, ops, r, stride, G, words_per_group, sr, ld); break;
        default: break;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// av. FOLDED: per-channel or static scales applied per channel after the dot;
// otherwise the tile's per-token (per group) scales are folded into the weights.
template <int R, int BITS, bool FOLDED>
void av_block(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const std::uint8_t* tile, int dc,
              __mmask16 mc, int n_words, int g, const operand_rows& ops, int r0, int stride, int G, float* acc) {
  constexpr bool SYM = BITS == 8;
  const int hd = s.head_dim;
  __m512i ah[R], al[R];
  for (int r = 0; r < R; ++r) ah[r] = al[r] = _mm512_setzero_si512();
  for (int w = 0; w < n_words; ++w)
    accumulate<R, BITS>(_mm512_maskz_loadu_epi32(mc, tile + (static_cast<std::size_t>(w) * hd + dc) * 4), w, ops, r0,
                        G, g, stride, ah, al);
  __m512 S, M;
  if constexpr (FOLDED) {
    if (L.mode == kv_scale_mode::per_channel) {
      S = load_h16(tile + L.scale_off + static_cast<std::size_t>(dc) * 2, mc);
      if constexpr (!SYM) M = load_h16(tile + L.offset_off + static_cast<std::size_t>(dc) * 2, mc);
    } else {
      S = _mm512_maskz_loadu_ps(mc, sp->scale + dc);
      if constexpr (!SYM) M = _mm512_maskz_loadu_ps(mc, sp->offset + dc);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int og = (r0 + r) * G + g;
    __m512 dot = finish_dot<BITS>(ah[r], al[r], ops, og);
    if constexpr (FOLDED) {
      dot = _mm512_mul_ps(dot, S);
      if constexpr (!SYM) dot = _mm512_fmadd_ps(M, _mm512_set1_ps(ops.wsum[r0 + r]), dot);
    }
    float* a = acc + static_cast<std::size_t>(r0 + r) * hd + dc;
    _mm512_mask_storeu_ps(a, mc, _mm512_add_ps(_mm512_maskz_loadu_ps(mc, a), dot));
  }
}

template <int BITS, bool FOLDED>
void av_run(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
            const float* w, int ld, int n_q, float* acc) {
  constexpr bool SYM = BITS == 8;
  const int B = s.block_size, hd = s.head_dim;
  const int stride = round16(L.n_outer * L.lanes);
  const int G = FOLDED ? 1 : L.n_groups;
  operand_rows& ops = t_ops;
  ops.size(n_q, G, stride);
  // Asymmetric per-token offsets: sum_t w_t M_t per row and group, added once at the end.
  if constexpr (!FOLDED && !SYM) std::fill(ops.extra.begin(), ops.extra.begin() + static_cast<std::size_t>(n_q) * G, 0.0f);

  for (int i = 0; i * B < n_tokens; ++i) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[i]);
    const int nt = std::min(B, n_tokens - i * B);
    const float* wi = w + static_cast<std::size_t>(i) * B;
    const fp16_t* S16 = reinterpret_cast<const fp16_t*>(tile + L.scale_off);
    const fp16_t* M16 = reinterpret_cast<const fp16_t*>(tile + L.offset_off);
    for (int r = 0; r < n_q; ++r) {
      const float* wr = wi + static_cast<std::size_t>(r) * ld;
      for (int g = 0; g < G; ++g) {
        const int og = r * G + g;
        const float* x = wr;
        if constexpr (!FOLDED) {
          float* xs = ops.x.data();
          float bias = 0;
          for (int t = 0; t < nt; ++t) {
            xs[t] = wr[t] * fp16_to_f32(S16[static_cast<std::size_t>(g) * B + t]);
            if constexpr (!SYM) bias += wr[t] * fp16_to_f32(M16[static_cast<std::size_t>(g) * B + t]);
          }
          if constexpr (!SYM) ops.extra[og] += bias;
          x = xs;
        } else if constexpr (!SYM) {
          float sum = 0;
          for (int t = 0; t < nt; ++t) sum += wr[t];
          ops.wsum[r] = sum;
        }
        ops.sc[og] = quantize_hilo(x, nt, stride, ops.hi.data() + static_cast<std::size_t>(og) * stride,
                                   ops.lo.data() + static_cast<std::size_t>(og) * stride, &ops.hi_sum[og],
                                   &ops.lo_sum[og]);
      }
    }
    const int n_words = (nt + L.lanes - 1) / L.lanes;
    for (int dc = 0; dc < hd; dc += 16) {
      const __mmask16 mc = lane_mask(hd - dc);
      const int g = FOLDED ? 0 : dc / L.group_size;
      int r = 0;
      for (; r + 4 <= n_q; r += 4) av_block<4, BITS, FOLDED>(L, s, sp, tile, dc, mc, n_words, g, ops, r, stride, G, acc);
      switch (n_q - r) {
        case 3: av_block<3, BITS, FOLDED>(L, s, sp, tile, dc, mc, n_words, g, ops, r, stride, G, acc); break;
        case 2: av_block<2, BITS, FOLDED>(L, s, sp, tile, dc, mc, n_words, g, ops, r, stride, G, acc); break;
        case 1: av_block<1, BITS, FOLDED>(L, s, sp, tile, dc, mc, n_words, g, ops, r, stride, G, acc); break;
        default: break;
      }
    }
  }
  if constexpr (!FOLDED && !SYM)
    for (int r = 0; r < n_q; ++r)
      for (int d = 0; d < hd; ++d)
        acc[static_cast<std::size_t>(r) * hd + d] += ops.extra[r * G + d / L.group_size];
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
