// AVX-512 weight matmul (F, BW, VL, DQ, VNNI, F16C).
//
// Float weights (f32, f16, bf16): register tiles of k_fr rows x k_fc columns; a
// weight vector is converted to f32 once per k step (exact) and FMA'd into every
// row of the tile. Per pair: 16 lanes, lane l accumulates k = l, l+16, ... with
// fma(x, w, acc), the tail chunk zero-padded by masked loads, then hsum16.
//
// Block-32 formats (q8_0, q4_0, q5_0, iq4_nl, mxfp4 with q8_0 activations;
// q4_1, q5_1 with q8_1): activations are quantized in the grouped layout
// (matmul_internal.h), each column tile of weights is packed into the same
// layout (16 blocks per group, one int32 lane per block), and a group costs each
// pair eight vpdpbusd (unsigned weight bytes x signed activation bytes, the
// accumulator starting at the activation's offset correction), one conversion,
// one multiply by the weight scales and one FMA with the activation scales:
//   s   = init_x; s = dpbusd(s, w'_j, x'_j) for j = 0..7     (exact integers)
//   acc = fma((float(s) * dw), dx, acc)                       (per lane)
//   acc = fma(mw, sx, acc)                                    (q4_1, q5_1: the min)
// then hsum16. Unsigned weight bytes are w + C: w ^ 0x80 for q8_0, the raw
// nibble (w + 8) for q4_0, the raw 5-bit value (w + 16) for q5_0, table value +
// 128 for iq4_nl and mxfp4, the value itself (C = 0) for q4_1/q5_1; init_x =
// -C * sum(x) over the block cancels the offset exactly. The weight scale of
// lane p is block p's fp16 d, or for mxfp4 its E8M0 byte as 2^(e - 128)
// (block_scales). K-quant formats live in
// matmul_kquants_avx512.cpp. Calls of one or two rows (decode) skip the
// packing: they read each weight block in place and move the block sums into
// the packed kernel's lanes instead (inplace_tile), with the same arithmetic
// per pair. vpdpbusd and FMA share two ports on Zen 5,
// so a group is 10 port slots (5 cycles) for 512 multiply-adds per pair; the
// 3x4 tile measures about 5.7 cycles from L1 (a layout with 8 blocks per group
// needs 12 slots for 512 and measured 6.4).
#include <immintrin.h>

#include <cstring>

#include "model/matmul_internal.h"
#include "model/matmul_simd_avx512.h"

namespace pagoda::matmul_detail {
namespace {

// Tile shapes, measured on Zen 5 (25 or 24 accumulators plus operands fill the
// 32 vector registers without spilling).
constexpr int k_fr = 5;  // float tile: rows
constexpr int k_fc = 5;  // float tile: columns
constexpr int k_qr = 3;  // q tile: rows
constexpr int k_qc = 4;  // q tile: columns
// Block-32 calls with fewer rows than this (decode) read the weights in place
// (inplace_tile) instead of packing them: packing costs about as much as the
// arithmetic and pays off only when several rows share the packed tile.
constexpr int k_inplace_max_rows = 3;
constexpr int k_inplace_rows = 2;  // in-place tile: rows (all of them)
constexpr int k_inplace_cols = 1;  // and one column: one weight stream (k_decode_prefetch_bytes)

// Packed weight group: w'[8][64] u8 + dw[16] f32 (+ mw[16] f32 for q4_1 / q5_1).
constexpr std::size_t group_pack_bytes(bool has_min) { return has_min ? 640 : 576; }
constexpr bool has_min(tensor_type t) { return t == tensor_type::q4_1 || t == tensor_type::q5_1; }

// ---------------------------------------------------------------------------
// Float weights
// ---------------------------------------------------------------------------

template <tensor_type T>
inline __m512 load_w(const std::byte* p, __mmask16 mask) {
  if constexpr (T == tensor_type::f32) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (T == tensor_type::f16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
  }
}

template <tensor_type T>
constexpr std::size_t elem_bytes() {
  return T == tensor_type::f32 ? 4 : 2;
}

// y[r][c] for r < R, c < C: rows of x at x + r * ldx, weight rows at w + c * w_stride.
// Stream (decode, one row, one column): prefetch k_decode_prefetch_bytes down
// the weight stream as it goes (matmul_internal.h) instead of the next tile
// into L2 before it; f16 1.39x the 1 x 5 tile's speed from memory
// (bench/RESULTS.md).
template <tensor_type T, bool Stream>
struct f_tile {
  template <int R, int C>
  struct shape {
    static void run(const float* x, std::int64_t ldx, const std::byte* w, std::size_t w_stride, std::int64_t n,
                    float* y, std::int64_t ldy);
  };
};

template <tensor_type T, bool Stream>
template <int R, int C>
void f_tile<T, Stream>::shape<R, C>::run(const float* x, std::int64_t ldx, const std::byte* w, std::size_t w_stride,
                                         std::int64_t n, float* y, std::int64_t ldy) {
  __m512 acc[R][C];
  zero_tile(acc, _mm512_setzero_ps());
  // One k step: the same operations for full chunks and for the masked tail.
  auto step = [&](std::int64_t k, __mmask16 mask) __attribute__((always_inline)) {
    __m512 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * ldx + k);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 wv = load_w<T>(w + c * w_stride + k * elem_bytes<T>(), mask);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  };
  std::int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    if constexpr (Stream)
      if (k * elem_bytes<T>() % 64 == 0)  // each cache line once
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
          _mm_prefetch(reinterpret_cast<const char*>(w + c * w_stride + k * elem_bytes<T>() + k_decode_prefetch_bytes),
                       _MM_HINT_T0);
    step(k, __mmask16(0xffff));
  }
  if (k < n) step(k, static_cast<__mmask16>((1u << (n - k)) - 1));
  store_tile_hsum16(acc, y, ldy);
}

// ---------------------------------------------------------------------------
// Grouped q8 layout: transposition and activation quantization
// ---------------------------------------------------------------------------

// Eight 32-byte blocks b[p] -> four vectors out[k] with qword p = qword k of b[p].
inline void transpose8(const __m256i b[8], __m512i out[4]) {
  const __m512i z0 = _mm512_inserti64x4(_mm512_castsi256_si512(b[0]), b[2], 1);
  const __m512i z1 = _mm512_inserti64x4(_mm512_castsi256_si512(b[1]), b[3], 1);
  const __m512i z2 = _mm512_inserti64x4(_mm512_castsi256_si512(b[4]), b[6], 1);
  const __m512i z3 = _mm512_inserti64x4(_mm512_castsi256_si512(b[5]), b[7], 1);
  const __m512i u0 = _mm512_unpacklo_epi64(z0, z1);  // [b0.q0 b1.q0][b0.q2 b1.q2][b2.q0 b3.q0][b2.q2 b3.q2]
  const __m512i u1 = _mm512_unpackhi_epi64(z0, z1);
  const __m512i u2 = _mm512_unpacklo_epi64(z2, z3);
  const __m512i u3 = _mm512_unpackhi_epi64(z2, z3);
  out[0] = _mm512_shuffle_i64x2(u0, u2, _MM_SHUFFLE(2, 0, 2, 0));
  out[1] = _mm512_shuffle_i64x2(u1, u3, _MM_SHUFFLE(2, 0, 2, 0));
  out[2] = _mm512_shuffle_i64x2(u0, u2, _MM_SHUFFLE(3, 1, 3, 1));
  out[3] = _mm512_shuffle_i64x2(u1, u3, _MM_SHUFFLE(3, 1, 3, 1));
}

// Sixteen 32-byte blocks b[p] -> eight vectors out[j] with dword p = dword j of
// b[p]: two 8-block qword transposes, then each qword k splits into its even
// dwords (out[2k]) and odd dwords (out[2k + 1]).
inline void transpose_group(const __m256i b[16], __m512i out[8]) {
  __m512i lo[4], hi[4];
  transpose8(b, lo);
  transpose8(b + 8, hi);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = _mm512_permutex2var_epi32(lo[k], even, hi[k]);
    out[2 * k + 1] = _mm512_permutex2var_epi32(lo[k], odd, hi[k]);
  }
}

// One block of 32 floats -> 32 int8 (as a ymm), the fp16 scale and the f32
// scale before rounding, bit-exact with quantize_block_q8 (ggml's x86 q8_0).
inline __m256i quantize_block(const float* x, fp16_t& d16, float& d_f32) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  d_f32 = amax / 127.0f;
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  d16 = _cvtss_sh(d_f32, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  auto q = [&](__m512 v) {
    v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v, vid), lo), hi);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(v));
  };
  return _mm256_inserti128_si256(_mm256_castsi128_si256(q(v0)), q(v1), 1);
}

std::size_t grouped_act_row_bytes(tensor_type t, std::int64_t n_in) {
  return static_cast<std::size_t>(n_groups(n_in)) * group_act_bytes(act_format_of(t));
}

// Quantizes 16 blocks (512 floats) into one group of the grouped layout for
// weight offset C (init = -C * sum), with sx when with_s (q8_1). `natural`
// stores the values in block order instead (block p at bytes 32p..32p+31), the
// layout the in-place decode kernel reads; init, dx and sx are the same.
inline void prepare_group(const float* x, int offset, bool with_s, bool natural, std::byte* out) {
  __m256i blk[16];
  fp16_t d16[16];
  alignas(64) float dfl[16];
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p) blk[p] = quantize_block(x + p * k_block, d16[p], dfl[p]);
  __m512i xq[8];
  transpose_group(blk, xq);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i s = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j) {
    if (!natural) _mm512_store_si512(out + 64 * j, xq[j]);
    s = _mm512_dpbusd_epi32(s, ones, xq[j]);  // lane p: the sum of block p
  }
  if (natural)
    for (int p = 0; p < 16; ++p) _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * p), blk[p]);
  _mm512_store_si512(out + k_group_init_off, _mm512_mullo_epi32(s, _mm512_set1_epi32(-offset)));
  const __m256i d = _mm256_setr_epi16(
      static_cast<short>(d16[0]), static_cast<short>(d16[1]), static_cast<short>(d16[2]), static_cast<short>(d16[3]),
      static_cast<short>(d16[4]), static_cast<short>(d16[5]), static_cast<short>(d16[6]), static_cast<short>(d16[7]),
      static_cast<short>(d16[8]), static_cast<short>(d16[9]), static_cast<short>(d16[10]), static_cast<short>(d16[11]),
      static_cast<short>(d16[12]), static_cast<short>(d16[13]), static_cast<short>(d16[14]),
      static_cast<short>(d16[15]));
  _mm512_store_ps(out + k_group_d_off, _mm512_cvtph_ps(d));
  if (with_s) {  // s = fp16(d * sum), as f32
    const __m512 ds = _mm512_mul_ps(_mm512_load_ps(dfl), _mm512_cvtepi32_ps(s));
    _mm512_store_ps(out + k_group_s_off,
                    _mm512_cvtph_ps(_mm512_cvtps_ph(ds, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  }
}

void grouped_prepare(tensor_type t, const float* x, std::int64_t m, std::int64_t n_in, std::byte* act,
                     std::size_t row_bytes) {
  const std::int64_t nb = n_in / k_block, full = nb / k_group_blocks;
  const int offset = group_weight_offset(t);
  const act_format af = act_format_of(t);
  const bool with_s = af == act_format::q8_1, natural = m < k_inplace_max_rows;
  const std::size_t gb = group_act_bytes(af);
  for (std::int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * n_in;
    std::byte* row = act + static_cast<std::size_t>(i) * row_bytes;
    for (std::int64_t g = 0; g < full; ++g)
      prepare_group(xr + g * k_group_blocks * k_block, offset, with_s, natural, row + g * gb);
    if (full * k_group_blocks < nb) {  // last group: zero blocks quantize to q = 0, d = 0
      float tail[k_group_blocks * k_block] = {};
      std::memcpy(tail, xr + full * k_group_blocks * k_block,
                  static_cast<std::size_t>(n_in - full * k_group_blocks * k_block) * sizeof(float));
      prepare_group(tail, offset, with_s, natural, row + full * gb);
    }
  }
}

// ---------------------------------------------------------------------------
// Weight packing: one column (weight row) into ng groups of group_pack_bytes.
// ---------------------------------------------------------------------------

template <tensor_type T>
constexpr std::size_t weight_block_bytes() {
  switch (T) {
    case tensor_type::q8_0: return sizeof(block_q8_0);
    case tensor_type::q4_0: return sizeof(block_q4_0);
    case tensor_type::q4_1: return sizeof(block_q4_1);
    case tensor_type::q5_0: return sizeof(block_q5_0);
    case tensor_type::q5_1: return sizeof(block_q5_1);
    case tensor_type::mxfp4: return sizeof(block_mxfp4);
    default: return sizeof(block_iq4_nl);
  }
}

// Table formats (iq4_nl, mxfp4): the table's values + 128, as the unsigned
// weight bytes vpdpbusd takes (C = 128).
struct offset_table {
  alignas(16) std::uint8_t v[16];
};
constexpr offset_table offset_by_128(const std::int8_t (&table)[16]) {
  offset_table t{};
  for (int i = 0; i < 16; ++i) t.v[i] = static_cast<std::uint8_t>(table[i] + 128);
  return t;
}
constexpr offset_table k_iq4nl_u8 = offset_by_128(k_iq4nl_values), k_mxfp4_u8 = offset_by_128(k_mxfp4_values);

// 16 E8M0 exponents (one per dword lane, 0..255) -> 2^(e - 128) as f32, bit
// for bit e8m0_half_to_f32.
inline __m512 e8m0_half_x16(__m512i e) {
  const __mmask16 subnormal = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(subnormal, normal, tiny));
}

// Lane p's weight scale from dm, whose lane p starts with block p's head: the
// fp16 d in its low half, or mxfp4's E8M0 byte in its low byte.
template <tensor_type T>
inline __m512 block_scales(__m512i dm) {
  if constexpr (T == tensor_type::mxfp4) return e8m0_half_x16(_mm512_and_si512(dm, _mm512_set1_epi32(0xff)));
  else return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
}

// The 16 nibbles at p as 32 bytes in element order: low nibbles, then high.
inline __m256i unpack_nibbles(const std::byte* p) {
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(qs, m4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// Block b's 32 weights as unsigned bytes w + C (group_weight_offset), except
// q8_0, whose signed bytes are flipped by pack_group.
template <tensor_type T>
inline __m256i load_weight_block(const std::byte* row, std::int64_t b) {
  const std::byte* blk = row + b * weight_block_bytes<T>();
  if constexpr (T == tensor_type::q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else if constexpr (T == tensor_type::q4_0) {
    return unpack_nibbles(blk + 2);  // w + 8
  } else if constexpr (T == tensor_type::q4_1) {
    return unpack_nibbles(blk + 4);  // w
  } else if constexpr (T == tensor_type::q5_0 || T == tensor_type::q5_1) {
    constexpr int qh_off = T == tensor_type::q5_0 ? 2 : 4;
    std::uint32_t qh;
    std::memcpy(&qh, blk + qh_off, 4);  // bit e: the fifth bit of element e
    const __m256i lo4 = unpack_nibbles(blk + qh_off + 4);
    return _mm256_mask_add_epi8(lo4, static_cast<__mmask32>(qh), lo4, _mm256_set1_epi8(16));  // w (+ 16 for q5_0)
  } else {  // iq4_nl, mxfp4: table value + 128, the nibbles after the 2- or 1-byte scale
    constexpr bool mx = T == tensor_type::mxfp4;
    const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(mx ? k_mxfp4_u8.v : k_iq4nl_u8.v));
    const __m256i nib = unpack_nibbles(blk + (mx ? 1 : 2));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nib);
  }
}

// Packs the 16 blocks of weights at `blocks` (ggml layout) into one group:
// w'[8][64], dw[16] and, for q4_1 / q5_1, mw[16].
template <tensor_type T>
inline void pack_group(const std::byte* blocks, std::byte* out) {
  constexpr int stride = static_cast<int>(weight_block_bytes<T>());
  __m256i blk[16];
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p) blk[p] = load_weight_block<T>(blocks, p);
  __m512i wq[8];
  transpose_group(blk, wq);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(T == tensor_type::q8_0 ? 0x80 : 0));
  for (int j = 0; j < 8; ++j) _mm512_store_si512(out + 64 * j, _mm512_xor_si512(wq[j], flip));
  // The scale (and min) sit at the start of each block: gather the dwords
  // there and keep their low (high) halves.
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(stride));
  const __m512i dm = _mm512_i32gather_epi32(offsets, blocks, 1);
  _mm512_store_ps(out + 512, block_scales<T>(dm));
  if constexpr (has_min(T)) _mm512_store_ps(out + 576, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
}

// Packs one weight row. `prefetch_row` (may be null) is the row the next column
// tile will pack: it is fetched into L2 now, so its memory traffic overlaps this
// tile's arithmetic instead of stalling the next pack.
template <tensor_type T>
void pack_column(const std::byte* row, std::int64_t nb, std::int64_t ng, std::byte* out,
                 const std::byte* prefetch_row) {
  constexpr std::size_t group_bytes = k_group_blocks * weight_block_bytes<T>();
  constexpr std::size_t pack_bytes = group_pack_bytes(has_min(T));
  const std::int64_t full = nb / k_group_blocks;
  for (std::int64_t g = 0; g < full; ++g) {
    if (prefetch_row)
      for (std::size_t o = 0; o < group_bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch_row + g * group_bytes + o), _MM_HINT_T1);
    pack_group<T>(row + g * group_bytes, out + g * pack_bytes);
  }
  if (full < ng) {  // last group: the missing blocks are zero (d = 0, and zero activations face them)
    alignas(64) std::byte tail[group_bytes + 64] = {};
    std::memcpy(tail, row + full * group_bytes, static_cast<std::size_t>(nb - full * k_group_blocks) * weight_block_bytes<T>());
    pack_group<T>(tail, out + full * pack_bytes);
  }
}

// y[r][c] for r < R, c < C from prepared activation rows (act + r * act_stride)
// and packed columns (wpack + c * ng * group_pack_bytes(MIN)).
template <bool MIN>
struct q_tile {
  template <int R, int C>
  struct shape {
    static void run(const std::byte* act, std::size_t act_stride, const std::byte* wpack, std::int64_t ng, float* y,
                    std::int64_t ldy);
  };
};

template <bool MIN>
template <int R, int C>
void q_tile<MIN>::shape<R, C>::run(const std::byte* act, std::size_t act_stride, const std::byte* wpack,
                                   std::int64_t ng, float* y, std::int64_t ldy) {
  constexpr std::size_t act_bytes = MIN ? 704 : 640, pack_bytes = group_pack_bytes(MIN);
  __m512 acc[R][C];
  zero_tile(acc, _mm512_setzero_ps());
  for (std::int64_t g = 0; g < ng; ++g) {
    const std::byte* xg = act + g * act_bytes;
    const std::byte* wg = wpack + g * pack_bytes;
    const std::size_t w_stride = static_cast<std::size_t>(ng) * pack_bytes;
    __m512i s[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i init = _mm512_load_si512(xg + r * act_stride + k_group_init_off);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) s[r][c] = init;
    }
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      __m512i wk[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) wk[c] = _mm512_load_si512(wg + c * w_stride + 64 * k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i xk = _mm512_load_si512(xg + r * act_stride + 64 * k);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) s[r][c] = _mm512_dpbusd_epi32(s[r][c], wk[c], xk);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_load_ps(xg + r * act_stride + k_group_d_off);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s[r][c]), _mm512_load_ps(wg + c * w_stride + 512));
        acc[r][c] = _mm512_fmadd_ps(f, dx, acc[r][c]);
        if constexpr (MIN)
          acc[r][c] = _mm512_fmadd_ps(_mm512_load_ps(wg + c * w_stride + 576),
                                      _mm512_load_ps(xg + r * act_stride + k_group_s_off), acc[r][c]);
      }
    }
  }
  store_tile_hsum16(acc, y, ldy);
}

// ---------------------------------------------------------------------------
// In-place decode tiles: q_tile's per-pair arithmetic with the weights read
// from the file's blocks, for calls of fewer than k_inplace_max_rows rows
// (activations in the natural grouped layout, prepare_group). Per group and
// column, pairs of blocks (2q, 2q + 1) fill one vector of unsigned weight bytes
// (load_weight_block, q8_0 flipped as in pack_group), one vpdpbusd per row
// against the activation's 64 natural bytes leaves each block's sum in eight
// dword lanes, and reduce_blocks gathers the sixteen exact block sums into
// lane p = block p, the lane q_tile's packed layout gives them. From there the
// float steps are q_tile's own (init, scale, fma), so a row's outputs are
// bitwise those of the packed kernel (matmul.h's batch invariance). The tiles
// are one column wide and prefetch down the weight stream
// (k_decode_prefetch_bytes).
// ---------------------------------------------------------------------------

// v[q] holds the partial sums of block 2q in lanes 0-7 and of block 2q + 1 in
// lanes 8-15; returns lane p = block p's total. First level, off the shuffle
// port: for each qword, [a.lo + a.hi, b.lo + b.hi] (shifts, adds and a
// blend), so r_k = fold(v[2k], v[2k + 1]) holds blocks 4k..4k+3 with four
// partials each, block 4k + 2 (l % 2) + l / 8 in lane l. Then two levels of
// two-source permutes, each adding two partials of one block.
struct reduce_maps {
  alignas(64) std::int32_t a[16], b[16];
};
constexpr reduce_maps make_level2() {
  reduce_maps m{};
  for (int lane = 0; lane < 16; ++lane) {  // lane 2b + t: block b, partials 2t and 2t + 1
    const int b = lane / 2, t = lane % 2, bl = b % 4, base = 16 * (b / 4) + 8 * (bl % 2) + bl / 2;
    m.a[lane] = base + 2 * (2 * t);
    m.b[lane] = base + 2 * (2 * t + 1);
  }
  return m;
}
constexpr reduce_maps k_level2 = make_level2();

inline __m512i reduce_blocks(const __m512i (&v)[8]) {
  auto fold = [](__m512i a, __m512i b) {
    return _mm512_mask_blend_epi32(0xAAAA, _mm512_add_epi32(a, _mm512_srli_epi64(a, 32)),
                                   _mm512_add_epi32(b, _mm512_slli_epi64(b, 32)));
  };
  auto pair = [](__m512i a, __m512i b, __m512i ia, __m512i ib) {
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, ia, b), _mm512_permutex2var_epi32(a, ib, b));
  };
  const __m512i l2a = _mm512_load_si512(k_level2.a), l2b = _mm512_load_si512(k_level2.b);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i z0 = pair(fold(v[0], v[1]), fold(v[2], v[3]), l2a, l2b);
  const __m512i z1 = pair(fold(v[4], v[5]), fold(v[6], v[7]), l2a, l2b);
  return pair(z0, z1, even, odd);
}

// The head of each of a full group's 16 blocks in lane p = block p: its fp16
// scale in the low half (what the kernel uses of a 16-lane gather at offsets
// 0, B, 2B, ...), and for q4_1 / q5_1 the fp16 min in the high half; from the
// group's bytes loaded as 64-byte vectors and moved into place by one masked
// word permute per vector (a head at an even offset never straddles two of
// them). mxfp4's one-byte heads sit at odd offsets in odd blocks (17-byte
// blocks): the word holding one is moved, then shifted down a byte, so lane p's
// low byte is e as after the gather. The gather cost about 30% of the q8_0
// decode kernel's time in L2.
template <tensor_type T>
struct group_heads {
  static constexpr int k_block_bytes = static_cast<int>(weight_block_bytes<T>());
  static constexpr int k_head_bytes = has_min(T) ? 4 : T == tensor_type::mxfp4 ? 1 : 2;  // the min's half only with MIN
  static constexpr int k_vectors = (15 * k_block_bytes + k_head_bytes + 63) / 64;  // vectors holding the heads
  // The last vector stops at the group's end (the next bytes may be past the tensor).
  static constexpr int k_last_bytes = 16 * k_block_bytes - 64 * (k_vectors - 1);
  static constexpr __mmask64 k_last_mask = k_last_bytes >= 64 ? ~__mmask64{0} : (__mmask64{1} << (k_last_bytes % 64)) - 1;
  struct maps {
    alignas(64) std::int16_t idx[32];
    alignas(64) std::uint32_t shift[16];  // bits to shift lane p down: 8 for a byte head at an odd offset
    std::uint32_t mask[k_vectors];
  };
  static constexpr maps make() {
    maps m{};
    for (int p = 0; p < 16; ++p) {
      const int o = p * k_block_bytes, k = o / 64;
      m.idx[2 * p] = static_cast<std::int16_t>(o % 64 / 2);
      if (has_min(T)) m.idx[2 * p + 1] = static_cast<std::int16_t>(o % 64 / 2 + 1);  // <= 31: offsets are multiples of 4
      m.shift[p] = static_cast<std::uint32_t>(8 * (o % 2));
      m.mask[k] |= (has_min(T) ? 3u : 1u) << (2 * p);
    }
    return m;
  }
  static constexpr maps k_maps = make();
  static __m512i load(const std::byte* wg) {
    const __m512i idx = _mm512_load_si512(k_maps.idx);
    __m512i dm = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = 0; k < k_vectors; ++k) {
      const __m512i v = k + 1 < k_vectors ? _mm512_loadu_si512(wg + 64 * k) : _mm512_maskz_loadu_epi8(k_last_mask, wg + 64 * k);
      dm = _mm512_mask_permutexvar_epi16(dm, k_maps.mask[k], idx, v);
    }
    if constexpr (k_head_bytes == 1) dm = _mm512_srlv_epi32(dm, _mm512_load_si512(k_maps.shift));
    return dm;
  }
};

// y[r][c] for r < R, c < C from natural-layout activation rows (act + r *
// act_stride) and weight rows (w + c * w_stride) of n_in values.
template <tensor_type T>
struct inplace_tile {
  template <int R, int C>
  struct shape {
    static void run(const std::byte* act, std::size_t act_stride, std::int64_t n_in, const std::byte* w,
                    std::size_t w_stride, float* y, std::int64_t ldy);
  };
};

template <tensor_type T>
template <int R, int C>
void inplace_tile<T>::shape<R, C>::run(const std::byte* act, std::size_t act_stride, std::int64_t n_in,
                                       const std::byte* w, std::size_t w_stride, float* y, std::int64_t ldy) {
  const std::int64_t nb = n_in / k_block;
  constexpr bool MIN = has_min(T);
  constexpr std::size_t block_bytes = weight_block_bytes<T>(), group_bytes = k_group_blocks * block_bytes;
  constexpr std::size_t act_bytes = MIN ? 704 : 640;
  const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(block_bytes)));
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(T == tensor_type::q8_0 ? 0x80 : 0));
  __m512 acc[R][C];
  zero_tile(acc, _mm512_setzero_ps());
  // One group of n blocks (16 but in the last group); blocks past n are never
  // read: their weight lanes stay zero, as the zero activations facing them.
  auto group = [&](std::int64_t g, int n) __attribute__((always_inline)) {
    const std::byte* xg = act + g * act_bytes;
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const std::byte* wg = w + c * w_stride + g * group_bytes;
      // Further down the column range's stream of rows, into L1.
      for (std::size_t o = 0; o < group_bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wg + k_decode_prefetch_bytes + o), _MM_HINT_T0);
      __m512i v[R][8];
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        __m512i wq = _mm512_setzero_si512();
        if (2 * q + 1 < n)
          wq = _mm512_mask_broadcast_i64x4(_mm512_castsi256_si512(load_weight_block<T>(wg, 2 * q)), 0xf0,
                                           load_weight_block<T>(wg, 2 * q + 1));
        else if (2 * q < n)
          wq = _mm512_zextsi256_si512(load_weight_block<T>(wg, 2 * q));
        wq = _mm512_xor_si512(wq, flip);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          v[r][q] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, _mm512_load_si512(xg + r * act_stride + 64 * q));
      }
      const __m512i dm = n == k_group_blocks ? group_heads<T>::load(wg)
                                             : _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, offsets, wg, 1);
      const __m512 dw = block_scales<T>(dm);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const std::byte* xr = xg + r * act_stride;
        const __m512i s = _mm512_add_epi32(_mm512_load_si512(xr + k_group_init_off), reduce_blocks(v[r]));
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s), dw);
        acc[r][c] = _mm512_fmadd_ps(f, _mm512_load_ps(xr + k_group_d_off), acc[r][c]);
        if constexpr (MIN)
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))),
                                      _mm512_load_ps(xr + k_group_s_off), acc[r][c]);
      }
    }
  };
  const std::int64_t full = nb / k_group_blocks;
  for (std::int64_t g = 0; g < full; ++g) group(g, static_cast<int>(k_group_blocks));
  if (full * k_group_blocks < nb) group(full, static_cast<int>(nb - full * k_group_blocks));
  store_tile_hsum16(acc, y, ldy);
}

template <tensor_type T>
void quant_cols(const job& jb, std::int64_t col_begin, std::int64_t col_end, std::byte* pack) {
  if (jb.m < k_inplace_max_rows)
    return block_cols<inplace_tile<T>::template shape, k_inplace_rows, k_inplace_cols, false>(jb, col_begin, col_end);
  constexpr std::size_t pack_bytes = group_pack_bytes(has_min(T));
  const weight_view& w = *jb.w;
  const std::int64_t nb = w.n_in / k_block, ng = n_groups(w.n_in);
  const auto* wbase = static_cast<const std::byte*>(w.data);
  for_each_tile<k_qr, k_qc>(jb.m, col_begin, col_end, [&](std::int64_t r0, int nr, std::int64_t c0, int nc) {
    if (r0 == 0)  // a new column tile: pack its weights once for all row tiles
      for (int c = 0; c < nc; ++c) {
        const std::int64_t next = c0 + k_qc + c;
        pack_column<T>(wbase + static_cast<std::size_t>(c0 + c) * w.row_bytes, nb, ng, pack + c * ng * pack_bytes,
                       next < col_end ? wbase + static_cast<std::size_t>(next) * w.row_bytes : nullptr);
      }
    tiles<q_tile<has_min(T)>::template shape, k_qr, k_qc>.at(nr, nc)(
        jb.act + static_cast<std::size_t>(r0) * jb.act_row_bytes, jb.act_row_bytes, pack, ng,
        jb.y + r0 * w.n_out + c0, w.n_out);
  });
}

// Float weights: one-column stream tiles for decode, register tiles otherwise.
template <tensor_type T>
void f_cols(const job& jb, std::int64_t c0, std::int64_t c1) {
  if (jb.m == 1) return float_cols<f_tile<T, true>::template shape, 1, 1, false>(jb, c0, c1);
  float_cols<f_tile<T, false>::template shape, k_fr, k_fc>(jb, c0, c1);
}

std::size_t avx512_act_row_bytes(tensor_type t, std::int64_t n_in) {
  if (uses_groups(t)) return grouped_act_row_bytes(t, n_in);
  return is_quantized(t) ? kq_act_row_bytes_avx512(t, n_in) : 0;
}

void avx512_prepare(tensor_type t, const float* x, std::int64_t m, std::int64_t n_in, std::byte* act,
                    std::size_t row_bytes) {
  if (uses_groups(t)) return grouped_prepare(t, x, m, n_in, act, row_bytes);
  kq_prepare_avx512(t, x, m, n_in, act, row_bytes);
}

std::size_t avx512_pack_bytes(tensor_type t, std::int64_t n_in) {
  if (uses_groups(t)) return static_cast<std::size_t>(k_qc * n_groups(n_in)) * group_pack_bytes(has_min(t));
  return 0;
}

void avx512_cols(const job& jb, std::int64_t c0, std::int64_t c1, std::byte* pack) {
  switch (jb.w->type) {
    case tensor_type::f32: return f_cols<tensor_type::f32>(jb, c0, c1);
    case tensor_type::f16: return f_cols<tensor_type::f16>(jb, c0, c1);
    case tensor_type::bf16: return f_cols<tensor_type::bf16>(jb, c0, c1);
    case tensor_type::q8_0: return quant_cols<tensor_type::q8_0>(jb, c0, c1, pack);
    case tensor_type::q4_0: return quant_cols<tensor_type::q4_0>(jb, c0, c1, pack);
    case tensor_type::q4_1: return quant_cols<tensor_type::q4_1>(jb, c0, c1, pack);
    case tensor_type::q5_0: return quant_cols<tensor_type::q5_0>(jb, c0, c1, pack);
    case tensor_type::q5_1: return quant_cols<tensor_type::q5_1>(jb, c0, c1, pack);
    case tensor_type::iq4_nl: return quant_cols<tensor_type::iq4_nl>(jb, c0, c1, pack);
    case tensor_type::mxfp4: return quant_cols<tensor_type::mxfp4>(jb, c0, c1, pack);
    default: return kq_cols_avx512(jb, c0, c1);
  }
}

std::int64_t avx512_col_tile(tensor_type t) {
  if (!is_quantized(t)) return k_fc;
  return uses_groups(t) ? k_qc : kq_col_tile_avx512(t);
}

const kernel_set k_avx512_kernels{avx512_col_tile, avx512_act_row_bytes, avx512_prepare, avx512_pack_bytes, avx512_cols};

}  // namespace

const kernel_set& kernels_avx512() { return k_avx512_kernels; }

}  // namespace pagoda::matmul_detail
