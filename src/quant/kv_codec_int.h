// Internal: integer KV codecs (int8, int4, int2), their tile layout and SIMD kernels.
//
// Every element is an unsigned code u of `bits` bits with a scale S and offset M:
//   x = S * u + M,  S = (max - min) / (2^bits - 1),  M = min
// over the element's scale group (asymmetric, KIVI-style, for every width: on
// keys, whose channels sit at different offsets, a min/max range halves int8's
// step against a symmetric one and takes stories260K from +0.15% to +0.08%
// perplexity). S and M come from the scale mode:
//   per_token      S, M per token (fp16 each)             scales [B]
//   group          S, M per token and group of channels   scales [n_groups][B]
//   per_channel    S, M per channel over the block        scales [D]        (sealed)
//   static_scales  S, M per channel from calibration      nothing in the tile
//
// Codes are packed for VNNI dot products (vpdpbusd: 4 unsigned bytes x 4 signed
// bytes into one 32-bit lane), `lanes` = 4 * codes-per-byte values per 32-bit word:
//   keys   [ceil(D / lanes)][B][4 bytes]: a word holds `lanes` channels of one
//          token, so a 64-byte vector is 16 tokens (one per 32-bit lane);
//   values [ceil(B / lanes)][D][4 bytes]: a word holds `lanes` tokens of one
//          channel, so a 64-byte vector is 16 channels.
// Inside a word, value index 4k + j (j < 4) is byte j, bits [bits*k, bits*k + bits):
// shifting the word right by bits*k and masking each byte yields 4 consecutive values.
// Padding values (channels past D, tokens past B) hold code 0.
// After the codes: fp16 scales [n_scales], then fp16 offsets [n_scales].
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "quant/kv_codec.h"
#include "quant/kv_prefetch.h"

namespace pagoda::int_kv {

// The largest block_size the kernels take (check() enforces it): the AVX-512
// a.v keeps up to one tile's packed words in a stack array of this many
// entries (word_lists in kv_codec_int_avx512.cpp), the AVX2 a.v the operand
// of one span (at most max(128, block_size) tokens, k_span_positions).
inline constexpr int k_max_block_size = 1024;

// Calls rows.template operator()<R>(r0) over rows [0, n) in blocks of R = 4
// rows, then one block of the 3, 2 or 1 left: the kernels' row tiling.
template <typename F>
inline void for_row_blocks(int n, F&& rows) {
  int r = 0;
  for (; r + 4 <= n; r += 4) rows.template operator()<4>(r);
  switch (n - r) {
    case 3: rows.template operator()<3>(r); break;
    case 2: rows.template operator()<2>(r); break;
    case 1: rows.template operator()<1>(r); break;
    default: break;
  }
}

struct tile_layout {
  int bits = 8;
  int cpb = 1;            // codes per byte
  int lanes = 4;          // values per 32-bit word
  bool key = true;
  kv_scale_mode mode = kv_scale_mode::per_token;
  int n_groups = 1;       // scale groups per token (per_token 1, group D / group_size)
  int group_size = 0;     // channels per scale group (per_token: D)
  int n_outer = 0;        // keys: channel words; values: token words
  std::size_t codes_bytes = 0;
  std::size_t n_scales = 0;
  std::size_t scale_off = 0;
  std::size_t offset_off = 0;
  std::size_t bytes = 0;

  int u_max() const { return (1 << bits) - 1; }
};

tile_layout layout_of(const kv_format& fmt, kv_tile_shape shape);

// Byte offset of value (token t, channel d) and its bit shift in that byte.
inline std::size_t code_byte(const tile_layout& L, kv_tile_shape s, int t, int d, int& shift) {
  int outer, inner, pos;
  if (L.key) {
    outer = d / L.lanes;
    inner = d % L.lanes;
    pos = outer * s.block_size + t;
  } else {
    outer = t / L.lanes;
    inner = t % L.lanes;
    pos = outer * s.head_dim + d;
  }
  shift = L.bits * (inner / 4);
  return static_cast<std::size_t>(pos) * 4 + (inner % 4);
}

// Index into the scale (and offset) arrays of value (t, d), for modes that store them.
inline std::size_t scale_index(const tile_layout& L, kv_tile_shape s, int t, int d) {
  switch (L.mode) {
    case kv_scale_mode::per_token: return static_cast<std::size_t>(t);
    case kv_scale_mode::group: return static_cast<std::size_t>(d / L.group_size) * s.block_size + t;
    default: return static_cast<std::size_t>(d);
  }
}

// The levels of the int16 operand of keys with per-channel or static scales
// in the AVX-512 q.k (x = q * S rounded to integers in [-levels, levels]):
// 32767, or less where a score's integer sum over the padded channels of a
// token (at most positions * u_max * levels) would not fit an int32.
// The int16 operand's levels for sums over `positions` codes of at most
// u_max each: 32767, or the most that keeps positions * u_max * levels an int32.
inline int int16_levels(long positions, int u_max) {
  return static_cast<int>(std::clamp<long>(2147483647L / (positions * u_max), 127, 32767));
}

inline int wide_levels(const tile_layout& L) {
  return int16_levels((static_cast<long>(L.n_outer) * L.lanes + 15) / 16 * 16, L.u_max());
}

// Precision of the f32 operand in the AVX-512 kernels. The operand (a query row
// for qk; a row of weights times token scales, per group of up to 128 tokens,
// for av) is scaled by 127 / max|x| and rounded to int8 "hi"; for av and for
// keys with int8 codes the residual is rounded again to int8 "lo" in units of
// 1/254, so each element is off by at most max|x| / (127 * 508); hi only
// (int4/int2 keys with per-token or group scales): max|x| / 254.
// A score then differs from the exact one on the codes by at most
// eps * max_d(|x_d| * S_d) * sum_d u_d (offsets are applied exactly in f32).
// Keys with per-channel or static scales (x = q * S) are rounded once to
// int16 in units of max|q| * max S / wide_levels (kv_codec_int_avx512.cpp,
// fold_quantize_rows): there the bound is eps * max_d |q_d| * max_d S_d *
// sum_d u_d with eps = 1 / (2 * wide_levels), 1 / 65534 for head_dim up to 256.
inline double operand_error(const tile_layout& L) {
  const bool folded = L.mode == kv_scale_mode::per_channel || L.mode == kv_scale_mode::static_scales;
  if (L.key && folded) return 1.0 / (2.0 * wide_levels(L));
  return L.key && L.bits < 8 ? 1.0 / 254.0 : 1.0 / (127.0 * 508.0);
}

// The levels of the int16 operand of the AVX2 integer kernels
// (kv_codec_int_avx2.cpp: x rounded to integers in [-levels, levels] in units
// of max|x| / levels): 32767, or less where an int32 sum could overflow. A sum
// runs over `positions` codes: q.k over one scale group's channels (padded to
// whole words: head_dim rounded up to lanes for per-token scales), a.v over one
// span's tokens (kv_simd::span_tiles tiles, each padded to whole words: 128 for
// 16-token tiles), and is at most positions * u_max * levels in magnitude.
// int8 gets 32767 up to 256 positions (256 * 255 * 32767 < 2^31 - 1): keys up
// to head_dim 256, values up to block_size 256 (8224 at 1024).
inline int avx2_levels(const tile_layout& L, kv_tile_shape s) {
  const long words = L.key ? (L.mode == kv_scale_mode::group ? (L.group_size + L.lanes - 1) / L.lanes : L.n_outer)
                           : static_cast<long>(kv_simd::span_tiles(s.block_size)) * L.n_outer;
  return int16_levels(words * L.lanes, L.u_max());
}

// Precision of the AVX2 kernels' operand against the reference, as eps in
// operand_error's bound (a score or value sum off by at most
// eps * max(|x| * S) * sum u over its terms, offsets exact): 1 / (2 * levels)
// for the rounding to integers, plus 2^-23 for the f32 product x * levels /
// max|x| that is rounded (up to levels * 2^-23 units of max|x| / levels).
// Keys with per-channel or static scales stay in f32 at this level: 0.
// Keys with 4- or 2-bit codes and per-token or group scales round the query to
// int8 instead (vpmaddubsw), as the AVX-512 q.k does: 1 / 254 + 2^-23.
inline double avx2_operand_error(const tile_layout& L, kv_tile_shape s) {
  if (L.key && (L.mode == kv_scale_mode::per_channel || L.mode == kv_scale_mode::static_scales)) return 0.0;
  if (L.key && L.bits < 8) return 1.0 / 254.0 + 0x1p-23;
  return 1.0 / (2.0 * avx2_levels(L, s)) + 0x1p-23;
}

// Whether the AVX-512 kernels handle this format (others use the reference):
// scale groups must align with the packed words (keys) or 16-channel vectors (values).
bool simd_supported(const tile_layout& L, kv_tile_shape shape);

// Whether the AVX2 kernels handle this format (others use the reference at
// that level): per-token scales, groups whose key words lie in one group, and
// keys with per-channel or static scales (folded into the query per tile).
bool avx2_supported(const tile_layout& L, kv_tile_shape shape);

void qk_avx2(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
             int n_tokens, const float* q, int n_q, float* scores, int ld);
void av_avx2(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
             int n_tokens, const float* w, int ld, int n_q, float* acc);

void qk_avx512(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
               int n_tokens, const float* q, int n_q, float* scores, int ld);
void av_avx512(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
               int n_tokens, const float* w, int ld, int n_q, float* acc);

}  // namespace pagoda::int_kv
