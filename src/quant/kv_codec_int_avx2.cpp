// AVX2 (+FMA, F16C) qk/av for the integer codecs with per-token or group
// scales (int8's default, int4/int2 values), on the packed codes directly,
// and qk for keys with per-channel or static scales (KIVI's int4/int2 keys):
// each tile's channel scales are folded into the query (below). Values with
// per-channel or static scales apply them to each tile's code sums.
//
// AVX2 has no VNNI, so codes are widened to f32 (shift, mask, convert: once
// per code for all the rows that use it) and multiplied by the f32 operand
// with FMAs; scales and offsets are applied after the integer-code sums:
//   q.k_t  = sum_g S_gt * (sum_{d in g} q_d u_td) + M_gt * (sum_{d in g} q_d)
//   a.v_d += sum_t (w_t S_t) u_td + (sum_t w_t M_t)
// Keys with per-channel or static scales fold them into the operand, per tile:
//   q.k_t  = sum_d (q_d S_d) u_td + (sum_d q_d M_d)
// Rounding is float rounding of these sums (no operand is quantized).
//
// Batch invariance: every lane (one token for qk, one channel for av) is one
// FMA chain over channels (qk) or tokens (av) in increasing order, split at
// boundaries fixed by the run (scale groups; spans of tiles counted from the
// run's start), never by n_q or n_tokens. A token of weight 0 has operand
// 0 * S = 0 and adds 0 * M = 0 to its span's offset sum: nothing changes.
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

// Scores of NR rows (q: row 0 of them, qsum: their sums over group g's
// channels) for NV token vectors, adding group g's terms to what scores hold
// from the groups before (g > 0). Words [w0, w1) hold group g's channels; only
// channels below head_dim are read from q.
// FOLDED (per-channel or static scales): q is the folded operand q * S, there
// is one group, and qsum holds each row's offsets term sum_d q_d M_d.
template <int NR, int NV, int BITS, bool FOLDED = false>
void qk_group(const tile_layout& L, kv_tile_shape s, const token_vector* tv, int g, int w0, int w1, const float* q,
              const float* qsum, int ld) {
  constexpr int CPB = 8 / BITS;
  const int B = s.block_size, D = s.head_dim;
  const std::size_t step = static_cast<std::size_t>(B) * 4;
  __m256 dot[NV][NR];
  for (int v = 0; v < NV; ++v)
    for (int r = 0; r < NR; ++r) dot[v][r] = _mm256_setzero_ps();
  for (int w = w0; w < w1; ++w) {
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
  if constexpr (FOLDED) {
    for (int v = 0; v < NV; ++v)
      for (int r = 0; r < NR; ++r)
        kv_simd::store8(tv[v].scores + static_cast<std::size_t>(r) * ld, _mm256_add_ps(dot[v][r], _mm256_set1_ps(qsum[r])),
                        tv[v].n);
    return;
  }
  for (int v = 0; v < NV; ++v) {
    const std::size_t at = L.scale_off + (static_cast<std::size_t>(g) * B + tv[v].tc) * 2;
    const int nr = std::min(tv[v].n_read, 8);
    const __m256 S = kv_simd::load_h8(tv[v].tile + at, nr);
    const __m256 M = kv_simd::load_h8(tv[v].tile + at + (L.offset_off - L.scale_off), nr);
    for (int r = 0; r < NR; ++r) {
      float* out = tv[v].scores + static_cast<std::size_t>(r) * ld;
      __m256 total = g == 0 ? _mm256_setzero_ps() : kv_simd::load8(out, tv[v].n);
      total = _mm256_fmadd_ps(S, dot[v][r], total);
      total = _mm256_fmadd_ps(M, _mm256_set1_ps(qsum[r]), total);
      kv_simd::store8(out, total, tv[v].n);
    }
  }
}

// All of a chunk's token vectors for NR rows from r0: group by group, the
// vectors two at a time (eight accumulators for four rows).
template <int NR, int BITS>
void qk_chunk_rows(const tile_layout& L, kv_tile_shape s, const token_vector* chunk, int n_vec, const float* q, int r0,
                   int ld) {
  const int D = s.head_dim;
  const int G = L.n_groups;
  const int words_per_group = L.mode == kv_scale_mode::group ? L.group_size / L.lanes : L.n_outer;
  const float* qr = q + static_cast<std::size_t>(r0) * D;
  token_vector tv[2];
  for (int g = 0; g < G; ++g) {
    const int d0 = g * L.group_size, d1 = std::min(D, d0 + L.group_size);
    float qsum[NR];
    for (int r = 0; r < NR; ++r) {
      float sum = 0;
      for (int d = d0; d < d1; ++d) sum += qr[static_cast<std::size_t>(r) * D + d];
      qsum[r] = sum;
    }
    const int w0 = g * words_per_group, w1 = w0 + words_per_group;
    int i = 0;
    for (; i + 2 <= n_vec; i += 2) {
      for (int v = 0; v < 2; ++v) {
        tv[v] = chunk[i + v];
        tv[v].scores += static_cast<std::size_t>(r0) * ld;
      }
      qk_group<NR, 2, BITS>(L, s, tv, g, w0, w1, qr, qsum, ld);
    }
    if (i < n_vec) {
      tv[0] = chunk[i];
      tv[0].scores += static_cast<std::size_t>(r0) * ld;
      qk_group<NR, 1, BITS>(L, s, tv, g, w0, w1, qr, qsum, ld);
    }
  }
}

template <int BITS>
void qk_run(const tile_layout& L, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* q, int n_q,
            float* scores, int ld) {
  const int B = s.block_size;
  // Token vectors in chunks of up to 16 (eight 16-token tiles): a chunk's
  // codes stay in L1 while every block of four rows runs over them.
  constexpr int k_chunk = 16;
  token_vector chunk[k_chunk];
  int n_vec = 0;
  auto run_chunk = [&] {
    int r = 0;
    for (; r + 4 <= n_q; r += 4) qk_chunk_rows<4, BITS>(L, s, chunk, n_vec, q, r, ld);
    switch (n_q - r) {
      case 3: qk_chunk_rows<3, BITS>(L, s, chunk, n_vec, q, r, ld); break;
      case 2: qk_chunk_rows<2, BITS>(L, s, chunk, n_vec, q, r, ld); break;
      case 1: qk_chunk_rows<1, BITS>(L, s, chunk, n_vec, q, r, ld); break;
      default: break;
    }
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
  thread_local std::vector<float> folded, consts, scale, offset;
  folded.resize(static_cast<std::size_t>(n_q) * D);
  consts.resize(static_cast<std::size_t>(n_q));
  scale.resize(static_cast<std::size_t>(D));
  offset.resize(static_cast<std::size_t>(D));
  if (!per_tile) {
    std::copy_n(sp->scale, D, scale.data());
    std::copy_n(sp->offset, D, offset.data());
  }
  constexpr int k_chunk = 16;
  token_vector chunk[k_chunk];
  const int n_tiles = (n_tokens + B - 1) / B, ahead = kv_simd::prefetch_ahead(L.bytes);
  for (int i = 0; i < n_tiles; ++i) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[i]);
    const std::uint8_t* later = kv_simd::tile_ahead(tiles, i, n_tiles, ahead);
    kv_simd::prefetch_slice(later, L.codes_bytes, L.bytes);
    if (per_tile || i == 0) {
      if (per_tile)
        for (int d = 0; d < D; ++d) {
          fp16_t h[2];
          std::memcpy(&h[0], tile + L.scale_off + 2 * static_cast<std::size_t>(d), 2);
          std::memcpy(&h[1], tile + L.offset_off + 2 * static_cast<std::size_t>(d), 2);
          scale[static_cast<std::size_t>(d)] = fp16_to_f32(h[0]);
          offset[static_cast<std::size_t>(d)] = fp16_to_f32(h[1]);
        }
      for (int r = 0; r < n_q; ++r) {
        const float* qr = q + static_cast<std::size_t>(r) * D;
        float* fr = folded.data() + static_cast<std::size_t>(r) * D;
        float c = 0;
        for (int d = 0; d < D; ++d) {
          fr[d] = qr[d] * scale[static_cast<std::size_t>(d)];
          c += qr[d] * offset[static_cast<std::size_t>(d)];
        }
        consts[static_cast<std::size_t>(r)] = c;
      }
    }
    const int nt = std::min(B, n_tokens - i * B);
    for (int tc0 = 0; tc0 < nt; tc0 += 8 * k_chunk) {
      int n_vec = 0;
      for (int tc = tc0; tc < nt && n_vec < k_chunk; tc += 8)
        chunk[n_vec++] = {tile, later, tc, nt - tc, B - tc, scores + static_cast<std::size_t>(i) * B + tc};
      auto rows = [&]<int NR>(int r0) {
        const float* fr = folded.data() + static_cast<std::size_t>(r0) * D;
        const float* cr = consts.data() + r0;
        token_vector tv[2];
        int v = 0;
        for (; v + 2 <= n_vec; v += 2) {
          for (int k = 0; k < 2; ++k) {
            tv[k] = chunk[v + k];
            tv[k].scores += static_cast<std::size_t>(r0) * ld;
          }
          qk_group<NR, 2, BITS, true>(L, s, tv, 0, 0, L.n_outer, fr, cr, ld);
        }
        if (v < n_vec) {
          tv[0] = chunk[v];
          tv[0].scores += static_cast<std::size_t>(r0) * ld;
          qk_group<NR, 1, BITS, true>(L, s, tv, 0, 0, L.n_outer, fr, cr, ld);
        }
      };
      for_row_blocks(n_q, rows);
    }
  }
}

// ---------------------------------------------------------------------------
// av

using kv_simd::tile_span;

// Operand positions of one span: tokens padded to whole words per tile, at
// most span * (block_size + lanes - 1) <= max(128, block_size) + 8 * 15.
constexpr int k_span_positions = k_max_block_size + 128;

// Channels [d0, d0 + n_ch) (n_ch <= 8 * NC) of NR rows: acc[r][0 .. n_ch)
// (rows acc_ld apart) += sum over the span's tokens of x[r][position] * u_t: x
// holds each row's operand (w_t * S_t, or w_t with per-channel scales) at
// position k * P + t (tile k of the span, P positions per tile), zero past
// the valid tokens.
template <int NR, int NC, int BITS>
void av_rows(const tile_span& sp, kv_tile_shape s, int P, int d0, int n_ch, const float* x, int x_stride, float* acc,
             int acc_ld) {
  constexpr int CPB = 8 / BITS, LANES = 4 * CPB;
  const int D = s.head_dim;
  int nc[NC];
  for (int c = 0; c < NC; ++c) nc[c] = n_ch - 8 * c;
  __m256 a[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = kv_simd::load8(acc + static_cast<std::size_t>(r) * acc_ld + 8 * c, nc[c]);
  for (int k = 0; k < sp.n; ++k) {
    const int n_words = (sp.nt[k] + LANES - 1) / LANES;  // packed token words holding valid tokens
    for (int tw = 0; tw < n_words; ++tw) {
      const std::size_t at = (static_cast<std::size_t>(tw) * D + d0) * 4;
      __m256i vec[NC];
      for (int c = 0; c < NC; ++c) {
        vec[c] = load_words(sp.tile[k] + at + 32 * c, nc[c]);
        if ((at + 32 * c) % 64 == 0) prefetch_line(sp.later[k] + at + 32 * c);
      }
      const float* xk = x + k * P + tw * LANES;
#pragma GCC unroll 16
      for (int kk = 0; kk < CPB; ++kk)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          __m256 u[NC];
          for (int c = 0; c < NC; ++c) u[c] = code_f32<BITS>(vec[c], 8 * j + BITS * kk);
          for (int r = 0; r < NR; ++r) {
            const __m256 xb = _mm256_broadcast_ss(xk + static_cast<std::size_t>(r) * x_stride + 4 * kk + j);
            for (int c = 0; c < NC; ++c) a[r][c] = _mm256_fmadd_ps(xb, u[c], a[r][c]);
          }
        }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) kv_simd::store8(acc + static_cast<std::size_t>(r) * acc_ld + 8 * c, a[r][c], nc[c]);
}

// Scale group g of NR rows (from r0) over one span: their operands and offset
// sums, the code sums channel chunk by chunk, then the offset sums.
template <int NR, int BITS>
void av_group_rows(const tile_layout& L, kv_tile_shape s, const tile_span& sp, int i0, const float* w, int ld, int r0,
                   int g, float* acc) {
  const int B = s.block_size, D = s.head_dim;
  const int P = L.n_outer * L.lanes;
  alignas(32) float x[NR][k_span_positions];
  float bias[NR];
  for (int r = 0; r < NR; ++r) {
    const float* wr = w + static_cast<std::size_t>(r0 + r) * ld;
    float sum = 0;
    for (int k = 0; k < sp.n; ++k) {
      const int tok0 = (i0 + k) * B, nt = sp.nt[k];
      const std::uint8_t* S16 = sp.tile[k] + L.scale_off + static_cast<std::size_t>(g) * B * 2;
      const std::uint8_t* M16 = sp.tile[k] + L.offset_off + static_cast<std::size_t>(g) * B * 2;
      float* xr = x[r] + k * P;
      for (int t = 0; t < nt; ++t) {
        fp16_t sh, mh;
        __builtin_memcpy(&sh, S16 + 2 * t, 2);
        __builtin_memcpy(&mh, M16 + 2 * t, 2);
        xr[t] = wr[tok0 + t] * _cvtsh_ss(sh);
        sum += wr[tok0 + t] * _cvtsh_ss(mh);
      }
      std::fill(xr + nt, xr + P, 0.0f);  // unwritten slots and padding tokens add 0 * u = 0
    }
    bias[r] = sum;
  }
  const int c0 = g * L.group_size, c1 = std::min(D, c0 + L.group_size);
  for (int d0 = c0; d0 < c1; d0 += 16)
    av_rows<NR, 2, BITS>(sp, s, P, d0, std::min(16, c1 - d0), &x[0][0], k_span_positions,
                         acc + static_cast<std::size_t>(r0) * D + d0, D);
  for (int r = 0; r < NR; ++r) {
    float* a = acc + static_cast<std::size_t>(r0 + r) * D;
    const __m256 b = _mm256_set1_ps(bias[r]);
    for (int d = c0; d < c1; d += 8) kv_simd::store8(a + d, _mm256_add_ps(kv_simd::load8(a + d, c1 - d), b), c1 - d);
  }
}

// Values with per-channel scales (each tile's fp16 S and M per channel) or
// static ones (sp, the same for every tile), tile by tile:
//   a.v_d += S_d * (sum_t w_t u_td) + M_d * (sum_t w_t)   over the tile's tokens t
// The code sums run as av_rows runs them, from zero, 16 channels at a time;
// each lane is then one FMA chain over the tiles in order, whatever n_q.
template <int NR, int BITS>
void av_folded_rows(const tile_layout& L, kv_tile_shape s, const kv_static_params* stat, const tile_span& one,
                    int tile, const float* w, int ld, int r0, float* acc) {
  const int B = s.block_size, D = s.head_dim, P = L.n_outer * L.lanes, nt = one.nt[0];
  alignas(32) float x[NR][k_span_positions];
  float wsum[NR];
  for (int r = 0; r < NR; ++r) {
    const float* wr = w + static_cast<std::size_t>(r0 + r) * ld + static_cast<std::size_t>(tile) * B;
    float sum = 0;
    for (int t = 0; t < nt; ++t) {
      x[r][t] = wr[t];
      sum += wr[t];
    }
    std::fill(x[r] + nt, x[r] + P, 0.0f);
    wsum[r] = sum;
  }
  const std::uint8_t* S16 = one.tile[0] + L.scale_off;
  const std::uint8_t* M16 = one.tile[0] + L.offset_off;
  for (int d0 = 0; d0 < D; d0 += 16) {
    const int n_ch = std::min(16, D - d0);
    alignas(32) float sums[NR][16] = {};
    av_rows<NR, 2, BITS>(one, s, P, d0, n_ch, &x[0][0], k_span_positions, &sums[0][0], 16);
    for (int c = 0; c < 2 && 8 * c < n_ch; ++c) {
      const int nc = n_ch - 8 * c, d = d0 + 8 * c;
      const __m256 sc = stat ? kv_simd::load8(stat->scale + d, nc) : kv_simd::load_h8(S16 + 2 * d, nc);
      const __m256 of = stat ? kv_simd::load8(stat->offset + d, nc) : kv_simd::load_h8(M16 + 2 * d, nc);
      for (int r = 0; r < NR; ++r) {
        float* a = acc + static_cast<std::size_t>(r0 + r) * D + d;
        __m256 v = _mm256_fmadd_ps(sc, _mm256_load_ps(&sums[r][8 * c]), kv_simd::load8(a, nc));
        kv_simd::store8(a, _mm256_fmadd_ps(of, _mm256_set1_ps(wsum[r]), v), nc);
      }
    }
  }
}

template <int BITS>
void av_run_folded(const tile_layout& L, kv_tile_shape s, const kv_static_params* stat, const void* const* tiles,
                   int n_tokens, const float* w, int ld, int n_q, float* acc) {
  const int B = s.block_size;
  const int n_tiles = (n_tokens + B - 1) / B, ahead = kv_simd::prefetch_ahead(L.bytes);
  if (L.mode == kv_scale_mode::per_channel) stat = nullptr;  // the tile's own scales
  for (int i = 0; i < n_tiles; ++i) {
    const tile_span one(tiles, i, 1, n_tiles, n_tokens, B, ahead);
    kv_simd::prefetch_slice(one.later[0], L.codes_bytes, L.bytes);
    for_row_blocks(n_q, [&]<int NR>(int r0) { av_folded_rows<NR, BITS>(L, s, stat, one, i, w, ld, r0, acc); });
  }
}

template <int BITS>
void av_run(const tile_layout& L, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* w, int ld,
            int n_q, float* acc) {
  const int B = s.block_size;
  const int span = kv_simd::span_tiles(B);
  const int n_tiles = (n_tokens + B - 1) / B, ahead = kv_simd::prefetch_ahead(L.bytes);
  for (int i0 = 0; i0 < n_tiles; i0 += span) {
    const tile_span sp(tiles, i0, span, n_tiles, n_tokens, B, ahead);
    for (int k = 0; k < sp.n; ++k) kv_simd::prefetch_slice(sp.later[k], L.codes_bytes, L.bytes);
    for (int g = 0; g < L.n_groups; ++g) {
      for_row_blocks(n_q, [&]<int NR>(int r0) { av_group_rows<NR, BITS>(L, s, sp, i0, w, ld, r0, g, acc); });
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
