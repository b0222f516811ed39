// ggml's packed block layouts, shared by weight formats (GGUF tensors) and the
// ggml-compatible KV codecs (q8_0, q4_0). Byte-exact with ggml (ggml-common.h):
// every struct's size is asserted, and field order is the file's byte order.
//
// Two families:
//   blocks of 32 ("legacy"): q4_0, q4_1, q5_0, q5_1, q8_0, q8_1, iq4_nl, mxfp4;
//   super-blocks of 256 (k_qk_k): q2_K .. q6_K, q8_K, iq4_xs, iq3_s, with
//   integer sub-block scales under one or two fp16 super-block scales.
// q8_1 and q8_K are activation formats: ggml quantizes the activations of a
// matrix product to them and never stores them in files.
#pragma once

#include <bit>
#include <cstdint>

#include "core/half.h"

namespace pagoda {

inline constexpr int k_qk8_0 = 32;
inline constexpr int k_qk4_0 = 32;
inline constexpr int k_qk_legacy = 32;  // elements of every block-32 format
inline constexpr int k_qk_k = 256;      // elements of every super-block format

// 32 int8 values with one fp16 scale: x[i] = d * qs[i].
struct block_q8_0 {
  fp16_t d;
  std::int8_t qs[k_qk8_0];
};
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must match ggml's layout");

// 32 4-bit values with one fp16 scale: x[j] = d * ((qs[j] & 15) - 8) and
// x[j + 16] = d * ((qs[j] >> 4) - 8) for j < 16.
struct block_q4_0 {
  fp16_t d;
  std::uint8_t qs[k_qk4_0 / 2];
};
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must match ggml's layout");

// As q4_0 with an offset instead of the -8: x[j] = d * (qs[j] & 15) + m,
// x[j + 16] = d * (qs[j] >> 4) + m.
struct block_q4_1 {
  fp16_t d;
  fp16_t m;
  std::uint8_t qs[k_qk_legacy / 2];
};
static_assert(sizeof(block_q4_1) == 20, "block_q4_1 must match ggml's layout");

// 5-bit values: the low 4 bits as in q4_0, bit 4 of element e (0..31) is bit e
// of the little-endian word qh. x[e] = d * (q[e] - 16).
struct block_q5_0 {
  fp16_t d;
  std::uint8_t qh[4];
  std::uint8_t qs[k_qk_legacy / 2];
};
static_assert(sizeof(block_q5_0) == 22, "block_q5_0 must match ggml's layout");

// q5_0's values with q4_1's offset: x[e] = d * q[e] + m.
struct block_q5_1 {
  fp16_t d;
  fp16_t m;
  std::uint8_t qh[4];
  std::uint8_t qs[k_qk_legacy / 2];
};
static_assert(sizeof(block_q5_1) == 24, "block_q5_1 must match ggml's layout");

// Activation format of q4_1 / q5_1 products: q8_0 plus s = fp16(d * sum(qs)),
// with d the f32 scale before it is rounded to fp16.
struct block_q8_1 {
  fp16_t d;
  fp16_t s;
  std::int8_t qs[k_qk_legacy];
};
static_assert(sizeof(block_q8_1) == 36, "block_q8_1 must match ggml's layout");

// 32 4-bit indices into ggml's non-linear table k_iq4nl_values (model/quants.h):
// x[j] = d * values[qs[j] & 15], x[j + 16] = d * values[qs[j] >> 4].
struct block_iq4_nl {
  fp16_t d;
  std::uint8_t qs[k_qk_legacy / 2];
};
static_assert(sizeof(block_iq4_nl) == 18, "block_iq4_nl must match ggml's layout");

// OCP microscaling FP4 (gpt-oss's expert weights): iq4_nl's nibble layout with
// 4-bit E2M1 codes, whose doubled values are k_mxfp4_values (model/quants.h),
// and a shared power-of-two scale e in E8M0 (2^(e - 127); no NaN code, as in
// ggml): x[j] = e8m0_half_to_f32(e) * values[qs[j] & 15], x[j + 16] likewise
// with qs[j] >> 4.
struct block_mxfp4 {
  std::uint8_t e;
  std::uint8_t qs[k_qk_legacy / 2];
};
static_assert(sizeof(block_mxfp4) == 17, "block_mxfp4 must match ggml's layout");

// Half the E8M0 scale, 2^(e - 128), exactly (ggml_e8m0_to_fp32_half): the f32
// exponent field e - 1 for e >= 2, the subnormals 2^-128 and 2^-127 for e = 0, 1.
// e = 255 is 2^127 (ggml reads no NaN). constexpr so SIMD files can build
// tables from it at compile time without emitting a copy (matmul_internal.h).
constexpr float e8m0_half_to_f32(std::uint8_t e) {
  const std::uint32_t bits = e < 2 ? std::uint32_t{0x00200000} << e : static_cast<std::uint32_t>(e - 1) << 23;
  return std::bit_cast<float>(bits);
}

// 2 bits per value, 16 groups of 16. scales[g]: low nibble the scale, high
// nibble the min of group g. Element 128n + 32j + l (n < 2, j < 4, l < 32) is
// (qs[32n + l] >> 2j) & 3 and belongs to group 8n + 2j + l / 16:
// x = d * scale * q - dmin * min.
struct block_q2_k {
  std::uint8_t scales[k_qk_k / 16];
  std::uint8_t qs[k_qk_k / 4];
  fp16_t d;
  fp16_t dmin;
};
static_assert(sizeof(block_q2_k) == 84, "block_q2_K must match ggml's layout");

// 3 bits per value: q2_K's low bits and element order, the third bit of
// element 128n + 32j + l is bit 4n + j of hmask[l] (set means +4). Value
// q - 4 in -4..3. 16 signed 6-bit group scales (stored + 32) in 12 bytes: the
// low 4 bits of scale i are scales[i] & 15 (i < 8) or scales[i - 8] >> 4, the
// high 2 bits are bits 2(i / 4) of scales[8 + i % 4]. x = d * (scale - 32) * q.
struct block_q3_k {
  std::uint8_t hmask[k_qk_k / 8];
  std::uint8_t qs[k_qk_k / 4];
  std::uint8_t scales[12];
  fp16_t d;
};
static_assert(sizeof(block_q3_k) == 110, "block_q3_K must match ggml's layout");

// 4 bits per value, 8 sub-blocks of 32, each with a 6-bit scale and a 6-bit
// min packed in 12 bytes (ggml's get_scale_min_k4). Chunk c (c < 4) of 32
// bytes holds elements 64c + l (low nibbles, sub-block 2c) and 64c + 32 + l
// (high nibbles, sub-block 2c + 1). x = d * scale * q - dmin * min.
struct block_q4_k {
  fp16_t d;
  fp16_t dmin;
  std::uint8_t scales[12];
  std::uint8_t qs[k_qk_k / 2];
};
static_assert(sizeof(block_q4_k) == 144, "block_q4_K must match ggml's layout");

// q4_K plus a fifth bit: for element 64c + 32h + l (h = 0 low nibble, 1 high)
// it is bit 2c + h of qh[l].
struct block_q5_k {
  fp16_t d;
  fp16_t dmin;
  std::uint8_t scales[12];
  std::uint8_t qh[k_qk_k / 8];
  std::uint8_t qs[k_qk_k / 2];
};
static_assert(sizeof(block_q5_k) == 176, "block_q5_K must match ggml's layout");

// 6 bits per value in two halves of 128: for half n, element 128n + 32i + l
// (i < 4, l < 32) has its low 4 bits in ql[64n + 32(i % 2) + l] (low nibble
// for i < 2, high for i >= 2) and its high 2 bits at bits 2i of qh[32n + l].
// 16 int8 group scales: x = d * scales[e / 16] * (q - 32).
struct block_q6_k {
  std::uint8_t ql[k_qk_k / 2];
  std::uint8_t qh[k_qk_k / 4];
  std::int8_t scales[k_qk_k / 16];
  fp16_t d;
};
static_assert(sizeof(block_q6_k) == 210, "block_q6_K must match ggml's layout");

// Activation format of the super-block products: f32 scale, 256 int8 values,
// and the sum of each 16 values (the min and offset terms use them).
struct block_q8_k {
  float d;
  std::int8_t qs[k_qk_k];
  std::int16_t bsums[k_qk_k / 16];
};
static_assert(sizeof(block_q8_k) == 292, "block_q8_K must match ggml's layout");

// iq4_nl's table values in sub-blocks of 32 with 6-bit scales: sub-block b has
// ls = ((scales_l[b / 2] >> 4(b % 2)) & 15) | ((scales_h >> 2b) & 3) << 4 and
// qs[16b .. 16b + 16) as in iq4_nl. x = d * (ls - 32) * value.
struct block_iq4_xs {
  fp16_t d;
  std::uint16_t scales_h;
  std::uint8_t scales_l[k_qk_k / 64];
  std::uint8_t qs[k_qk_k / 2];
};
static_assert(sizeof(block_iq4_xs) == 136, "block_iq4_XS must match ggml's layout");

// Groups of 4 values from a 512-entry grid (k_iq3s_grid, model/quants.h):
// group g (g < 64, elements 4g .. 4g + 3) uses entry qs[g] | ((qh[g / 8] >> (g % 8)) & 1) << 8;
// element e is negated when bit e % 8 of signs[e / 8] is set. Sub-block b of 32
// has scale 1 + 2 * ((scales[b / 2] >> 4(b % 2)) & 15). x = d * scale * (+-grid).
struct block_iq3_s {
  fp16_t d;
  std::uint8_t qs[k_qk_k / 4];
  std::uint8_t qh[k_qk_k / 32];
  std::uint8_t signs[k_qk_k / 8];
  std::uint8_t scales[k_qk_k / 64];
};
static_assert(sizeof(block_iq3_s) == 110, "block_iq3_S must match ggml's layout");

}  // namespace pagoda
