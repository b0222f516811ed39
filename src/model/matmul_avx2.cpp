// AVX2 weight matmul (AVX2, FMA, F16C).
//
// Float weights: register tiles of k_fr rows x k_tc columns, 8 lanes per pair;
// lane l accumulates k = l, l+8, ... with fma(x, w, acc), the tail chunk padded
// with zeros, then hsum8.
//
// The block-32 formats (q8_0, q4_0, q5_0 and the table formats iq4_nl, mxfp4
// against q8_0 activations; q4_1, q5_1 against q8_1) in the plain layout
// (matmul_internal.h). The super-block formats (q2_K to q6_K, iq4_xs, iq3_s):
// matmul_kquants_avx2.cpp. Per pair and block (32 elements), eight exact int32
// lane sums, then acc = fma(float(s) * dw, dx, acc), for q4_1 / q5_1
// acc = acc + fma(m, sx, float(s) * dw * dx) with m in lane 0 only (the block's
// min times the activation block's stored s: once per block, not once per
// lane; one add per block on acc's dependency chain, where a second fma made
// the one-column decode tile wait on two fma latencies per block), blocks in
// order, then hsum8:
//   q8_0: s = madd(maddubs(|w|, sign(x, w)), 1): |w| <= 128 and |x| <= 127, so
//         each int16 pair sum is at most 2 * 128 * 127 = 32512, never saturating.
//   q4_0, q5_0: s = madd(maddubs(u, x), 1) - C * sum(x): u = w + C is the
//         nibble (C = 8, 0..15) or the nibble with qh's bit as bit 4 (C = 16,
//         0..31; pair sums <= 2 * 31 * 127), the correction cancels the offset.
//   q4_1, q5_1: s = madd(maddubs(u, x), 1), u as q4_0 / q5_0 (no offset: the
//         min is the separate term above).
//   iq4_nl, mxfp4: w = table[nibble] by one byte shuffle of the 16-entry table,
//         then q8_0's step (|w| <= 127). dw is the fp16 d, or for mxfp4 the
//         E8M0 byte's 2^(e - 128) (from a table built at compile time).
#include <immintrin.h>

#include <cstddef>
#include <cstring>

#include "model/matmul_internal.h"
#include "model/matmul_simd_avx2.h"

namespace pagoda::matmul_detail {
namespace {

constexpr int k_fr = 3;  // float tile rows
constexpr int k_qr = 2;  // q tile rows
constexpr int k_tc = 4;  // columns per tile; also the threads' split grain

// ---------------------------------------------------------------------------
// Float weights
// ---------------------------------------------------------------------------

template <tensor_type T>
constexpr std::size_t elem_bytes() {
  return T == tensor_type::f32 ? 4 : 2;
}

template <tensor_type T>
inline __m256 load_w8(const std::byte* p) {
  if constexpr (T == tensor_type::f32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (T == tensor_type::f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
}

// y[r][c] for r < R, c < C: rows of x at x + r * ldx, weight rows at w + c * w_stride.
// Decode uses these tiles too: a one-column tile streaming its weights
// (the AVX-512 decode tiles) ran f16 at 0.85x and f32 at 0.96-1.03x of the
// 3 x 4 tile at one thread here (eight lanes: one accumulator's FMA latency
// bounds it), and 1 x 2 / 1 x 4 stream tiles at 0.76-0.98x (bench/RESULTS.md).
template <tensor_type T>
struct f_tile {
  template <int R, int C>
  struct shape {
    static void run(const float* x, std::int64_t ldx, const std::byte* w, std::size_t w_stride, std::int64_t n,
                    float* y, std::int64_t ldy);
  };
};

template <tensor_type T>
template <int R, int C>
void f_tile<T>::shape<R, C>::run(const float* x, std::int64_t ldx, const std::byte* w, std::size_t w_stride,
                                 std::int64_t n, float* y, std::int64_t ldy) {
  __m256 acc[R][C];
  zero_tile(acc, _mm256_setzero_ps());
  std::int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m256 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 wv = load_w8<T>(w + c * w_stride + k * elem_bytes<T>());
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  if (k < n) {  // tail: zero-padded copies, then the same step
    const int rem = static_cast<int>(n - k);
    __m256 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      alignas(32) float t[8] = {};
      std::memcpy(t, x + r * ldx + k, static_cast<std::size_t>(rem) * sizeof(float));
      xv[r] = _mm256_load_ps(t);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      alignas(32) std::byte t[32] = {};
      std::memcpy(t, w + c * w_stride + k * elem_bytes<T>(), static_cast<std::size_t>(rem) * elem_bytes<T>());
      const __m256 wv = load_w8<T>(t);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  store_tile(acc, y, ldy, hsum8);
}

// ---------------------------------------------------------------------------
// Activation quantization (plain layout), bit-exact with quantize_block_q8_0
// ---------------------------------------------------------------------------

// One block of 32 floats, bit-exact with quantize_block_q8 (ggml's x86 q8_0:
// id = 127 / amax, round half to even).
inline fp16_t quantize_block(const float* x, std::int8_t* q, float* d_f32) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float max = _mm_cvtss_f32(m4);
  const float d = max / 127.0f;
  const float id = max != 0.0f ? 127.0f / max : 0.0f;
  const __m256 vid = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i qi[4];
  for (int j = 0; j < 4; ++j) {
    __m256 s = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[j], vid), lo), hi);
    qi[j] = _mm256_cvtps_epi32(_mm256_round_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // packs interleave 128-bit lanes; the dword permute restores element order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *d_f32 = d;
  return _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

std::size_t avx2_act_row_bytes(tensor_type t, std::int64_t n_in) {
  return is_quantized(t) ? plain_act_row_bytes(act_format_of(t), n_in) : 0;
}

void avx2_prepare(tensor_type t, const float* x, std::int64_t m, std::int64_t n_in, std::byte* act,
                  std::size_t row_bytes) {
  prepare_plain(act_format_of(t), x, m, n_in, act, row_bytes, quantize_block, quantize_q8_k_avx2);
}

// ---------------------------------------------------------------------------
// Block-32 tiles (plain layout)
// ---------------------------------------------------------------------------

constexpr bool is_table_format(tensor_type t) { return t == tensor_type::iq4_nl || t == tensor_type::mxfp4; }
// Formats with a min (q8_1 activations) and with a fifth bit per value.
constexpr bool has_min(tensor_type t) { return t == tensor_type::q4_1 || t == tensor_type::q5_1; }
constexpr bool has_qh(tensor_type t) { return t == tensor_type::q5_0 || t == tensor_type::q5_1; }
// Formats whose unsigned values carry the offset group_weight_offset (q4_0: 8, q5_0: 16).
constexpr bool has_offset(tensor_type t) { return t == tensor_type::q4_0 || t == tensor_type::q5_0; }

template <tensor_type T>
constexpr std::size_t q_block_bytes() {
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

// Where a block's values (nibbles, or q8_0's bytes) and q5's high bits start.
template <tensor_type T>
constexpr std::size_t q_values_offset() {
  switch (T) {
    case tensor_type::q4_1: return offsetof(block_q4_1, qs);
    case tensor_type::q5_0: return offsetof(block_q5_0, qs);
    case tensor_type::q5_1: return offsetof(block_q5_1, qs);
    case tensor_type::mxfp4: return offsetof(block_mxfp4, qs);
    default: return 2;  // q8_0, q4_0, iq4_nl: after the fp16 d
  }
}
template <tensor_type T>
constexpr std::size_t q_high_offset() {
  return T == tensor_type::q5_1 ? offsetof(block_q5_1, qh) : offsetof(block_q5_0, qh);
}

// e8m0_half_to_f32 of every byte, evaluated at compile time: one load per
// block instead of the bit assembly, and no copy of the header's inline
// function in this file.
struct e8m0_half_table {
  float v[256];
};
constexpr e8m0_half_table make_e8m0_half_table() {
  e8m0_half_table t{};
  for (int e = 0; e < 256; ++e) t.v[e] = e8m0_half_to_f32(static_cast<std::uint8_t>(e));
  return t;
}
constexpr e8m0_half_table k_e8m0_half = make_e8m0_half_table();

// Stream (decode, one row, a 1 x 1 tile): prefetch k_decode_prefetch_bytes
// down the weight stream as it goes (matmul_internal.h) instead of the next
// tile into L2 before it (block_cols' Prefetch); about 2x the 2 x 4 tile's
// speed from memory for q8_0 (bench/RESULTS.md).
template <tensor_type T, bool Stream>
struct q_tile {
  template <int R, int C>
  struct shape {
    static void run(const std::byte* act, std::size_t act_stride, std::int64_t n_in, const std::byte* w,
                    std::size_t w_stride, float* y, std::int64_t ldy);
  };
};

template <tensor_type T, bool Stream>
template <int R, int C>
void q_tile<T, Stream>::shape<R, C>::run(const std::byte* act, std::size_t act_stride, std::int64_t n_in,
                                         const std::byte* w, std::size_t w_stride, float* y, std::int64_t ldy) {
  constexpr std::size_t block_bytes = q_block_bytes<T>();
  const std::int64_t nb = n_in / k_block;
  const plain_layout l = plain_layout_of(act_format_of(T), n_in);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(group_weight_offset(T)));
  __m256i table = _mm256_setzero_si256();  // the table formats' signed values, in both lanes
  if constexpr (is_table_format(T))
    table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(T == tensor_type::mxfp4 ? k_mxfp4_values : k_iq4nl_values)));
  __m256 acc[R][C];
  zero_tile(acc, _mm256_setzero_ps());
  for (std::int64_t b = 0; b < nb; ++b) {
    if constexpr (Stream)
      _mm_prefetch(reinterpret_cast<const char*>(w + b * block_bytes + k_decode_prefetch_bytes), _MM_HINT_T0);
    __m256i xv[R], corr[R];
    __m256 dx[R], sx[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const std::byte* row = act + r * act_stride;
      xv[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(row + b * k_block));
      dx[r] = _mm256_broadcast_ss(reinterpret_cast<const float*>(row + l.d_off) + b);
      if constexpr (has_offset(T)) corr[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(offset, xv[r]), ones16);
      if constexpr (has_min(T)) sx[r] = _mm256_broadcast_ss(reinterpret_cast<const float*>(row + l.s_off) + b);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const std::byte* blk = w + c * w_stride + b * block_bytes;
      const __m256 dw = T == tensor_type::mxfp4 ? _mm256_broadcast_ss(&k_e8m0_half.v[static_cast<std::uint8_t>(blk[0])])
                                                : _mm256_set1_ps(load_half(blk));
      constexpr bool is_signed = T == tensor_type::q8_0 || is_table_format(T);
      __m256i wu, ws;  // unsigned weight operand; for q8_0 and the tables also the signed bytes
      if constexpr (T == tensor_type::q8_0) {
        ws = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        wu = _mm256_sign_epi8(ws, ws);
      } else if constexpr (is_table_format(T)) {
        ws = _mm256_shuffle_epi8(table, nibbles32(blk + q_values_offset<T>()));
        wu = _mm256_sign_epi8(ws, ws);
      } else {
        wu = nibbles32(blk + q_values_offset<T>());
        if constexpr (has_qh(T))
          wu = _mm256_or_si256(wu, _mm256_and_si256(bits32_to_bytes(blk + q_high_offset<T>()), _mm256_set1_epi8(16)));
      }
      // The min (at byte 2 of q4_1 and q5_1 blocks) in lane 0, zeros above:
      // added once per block.
      [[maybe_unused]] __m256 mw = _mm256_setzero_ps();
      if constexpr (has_min(T)) mw = _mm256_zextps128_ps256(_mm_set_ss(load_half(blk + offsetof(block_q4_1, m))));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256i s;
        if constexpr (is_signed) {
          s = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, _mm256_sign_epi8(xv[r], ws)), ones16);
        } else {
          s = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv[r]), ones16);
          if constexpr (has_offset(T)) s = _mm256_sub_epi32(s, corr[r]);
        }
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s), dw);
        if constexpr (has_min(T))  // the block's whole term first: one add per block on acc's chain
          acc[r][c] = _mm256_add_ps(acc[r][c], _mm256_fmadd_ps(mw, sx[r], _mm256_mul_ps(f, dx[r])));
        else
          acc[r][c] = _mm256_fmadd_ps(f, dx[r], acc[r][c]);
      }
    }
  }
  store_tile(acc, y, ldy, hsum8);
}

// Formats with an AVX2 kernel; the others run generic_quant_cols.
bool has_avx2_kernel(tensor_type t) {
  return !is_quantized(t) || t == tensor_type::q8_0 || t == tensor_type::q4_0 || t == tensor_type::q4_1 ||
         t == tensor_type::q5_0 || t == tensor_type::q5_1 || is_table_format(t) || has_kq_kernel_avx2(t);
}

template <tensor_type T>
void q_cols(const job& jb, std::int64_t c0, std::int64_t c1) {
  if (jb.m == 1) return block_cols<q_tile<T, true>::template shape, 1, 1, false>(jb, c0, c1);
  block_cols<q_tile<T, false>::template shape, k_qr, k_tc, true>(jb, c0, c1);
}

std::size_t avx2_pack_bytes(tensor_type t, std::int64_t n_in) {
  return has_avx2_kernel(t) ? 0 : generic_pack_bytes(t, n_in);
}

void avx2_cols(const job& jb, std::int64_t c0, std::int64_t c1, std::byte* pack) {
  switch (jb.w->type) {
    case tensor_type::f32: return float_cols<f_tile<tensor_type::f32>::shape, k_fr, k_tc>(jb, c0, c1);
    case tensor_type::f16: return float_cols<f_tile<tensor_type::f16>::shape, k_fr, k_tc>(jb, c0, c1);
    case tensor_type::bf16: return float_cols<f_tile<tensor_type::bf16>::shape, k_fr, k_tc>(jb, c0, c1);
    case tensor_type::q8_0: return q_cols<tensor_type::q8_0>(jb, c0, c1);
    case tensor_type::q4_0: return q_cols<tensor_type::q4_0>(jb, c0, c1);
    case tensor_type::q4_1: return q_cols<tensor_type::q4_1>(jb, c0, c1);
    case tensor_type::q5_0: return q_cols<tensor_type::q5_0>(jb, c0, c1);
    case tensor_type::q5_1: return q_cols<tensor_type::q5_1>(jb, c0, c1);
    case tensor_type::iq4_nl: return q_cols<tensor_type::iq4_nl>(jb, c0, c1);
    case tensor_type::mxfp4: return q_cols<tensor_type::mxfp4>(jb, c0, c1);
    case tensor_type::q2_k:
    case tensor_type::q3_k:
    case tensor_type::q4_k:
    case tensor_type::q5_k:
    case tensor_type::q6_k:
    case tensor_type::iq4_xs:
    case tensor_type::iq3_s: return kq_cols_avx2(jb, c0, c1);
    default: return generic_quant_cols(jb, c0, c1, pack);
  }
}

std::int64_t avx2_col_tile(tensor_type) { return k_tc; }

const kernel_set k_avx2_kernels{avx2_col_tile, avx2_act_row_bytes, avx2_prepare, avx2_pack_bytes, avx2_cols};

}  // namespace

const kernel_set& kernels_avx2() { return k_avx2_kernels; }

}  // namespace pagoda::matmul_detail
