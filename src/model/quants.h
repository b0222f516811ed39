// Quantized weight formats: which ones Pagoda computes with, how their blocks
// decode (reference twins for the kernels in matmul_*), and the activation
// quantizers ggml pairs them with.
//
// Every quantized format decodes to one exact integer form (int_block):
//   w[e] = da * sc[e / 16] * q[e] - db * mn[e / 16]
// with small integers q, sc, mn and two f32 factors. A matrix product quantizes
// its activations to the format's activation type (ggml's vec_dot_type) and
// then sums integers, exactly as ggml-cpu does on x86:
//
//   weights                                  activations
//   q8_0, q4_0, q5_0, iq4_nl, mxfp4          q8_0  (blocks of 32)
//   q4_1, q5_1                               q8_1  (q8_0 + fp16 s = d * sum)
//   q2_K, q3_K, q4_K, q5_K, q6_K,            q8_K  (blocks of 256, f32 scale,
//   iq4_xs, iq3_s                                   sums of 16)
//
// So for one block, with integer activations a[e] and activation scale dx:
//   sum_e w[e] x[e] = dx * (da * S - db * M),  S = sum_g sc[g] sum_{e in g} q[e] a[e],
//                                              M = sum_g mn[g] sum_{e in g} a[e],
// where S and M are exact integers. q8_1 (q4_1, q5_1: mn = 1, db = -m) is the
// exception ggml makes: M * dx is replaced by the stored fp16 s.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/ggml_blocks.h"
#include "model/gguf.h"

namespace pagoda {

// The activation type of a matrix product with weights of a given type.
enum class act_format : std::uint8_t { f32, q8_0, q8_1, q8_k };

act_format act_format_of(gguf::tensor_type t);
// True for the types whose products run on quantized activations.
inline bool is_quantized_weight(gguf::tensor_type t) { return act_format_of(t) != act_format::f32; }
// Elements per block of a quantized weight type (32 or 256); 1 for float types.
int weight_block_elems(gguf::tensor_type t);
// Elements per activation block (32 for q8_0/q8_1, 256 for q8_K).
inline int act_block_elems(act_format a) { return a == act_format::q8_k ? k_qk_k : k_qk_legacy; }

// ggml's non-linear 4-bit table (iq4_nl, iq4_xs).
inline constexpr std::int8_t k_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                   1,    13,   25,  38,  53,  69,  89,  113};
// Doubled E2M1 values (ggml's kvalues_mxfp4): codes 0..7 are 0, 0.5, 1, 1.5,
// 2, 3, 4, 6 times two, codes 8..15 their negatives (code 8, -0, is 0 here).
inline constexpr std::int8_t k_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// ggml's iq3_s grid: entry i packs 4 values (little-endian bytes), each odd in 1..15.
extern const std::uint32_t k_iq3s_grid[512];

// One block of weights in exact integer form (see the top of this file).
// Legacy formats fill n = 32 and two groups of 16 with the same sc and mn.
struct int_block {
  int n = 0;               // elements: 32 or 256
  std::int8_t q[k_qk_k];   // [n]
  std::int16_t sc[16];     // [n / 16] group scales
  std::int16_t mn[16];     // [n / 16] group mins (0 for formats without a min)
  float da = 0;
  float db = 0;
};

// Decodes the block at `block` of quantized type t. REQUIRES: is_quantized_weight(t).
void decode_int_block(gguf::tensor_type t, const std::byte* block, int_block& out);

// Dequantizes n values (a whole number of blocks) of quantized type t, bit for
// bit as ggml's dequantize_row_* (each value as (da * sc) * q - db * mn in f32).
void dequantize_quantized_row(gguf::tensor_type t, const std::byte* src, std::int64_t n, float* out);

// ---------------------------------------------------------------------------
// Activation quantizers: the bytes ggml-cpu's x86 (AVX2/AVX-512) build makes.
// ---------------------------------------------------------------------------

// q8_0 (x86): amax = max |x|, d = amax / 127 stored as fp16, q = round-half-even
// (x * (127 / amax)) (0 when amax = 0). NaN or inf give garbage but defined
// behaviour (the scaled value is clamped to +-127 before rounding). n % 32 == 0.
void quantize_row_q8_0(const float* x, std::int64_t n, void* out);
// q8_1 (x86): q8_0's d and qs, and s = fp16(d * sum(qs)) with d before rounding.
void quantize_row_q8_1(const float* x, std::int64_t n, void* out);
// q8_K (ggml's quantize_row_q8_K_ref, which the x86 build uses): m = the element
// of largest |x| (the first on ties), iscale = -127 / m, q = min(127,
// round-half-even(iscale * x)), d = 1 / iscale, bsums = sums of 16. An all-zero
// block gets d = 0, q = 0, bsums = 0. n % 256 == 0.
void quantize_row_q8_k(const float* x, std::int64_t n, void* out);

// One block of q8_0 / q8_1 as the kernels need it: writes 32 int8, returns the
// fp16 scale, and stores the f32 scale before rounding in *d_f32.
fp16_t quantize_block_q8(const float* x, std::int8_t* q, float* d_f32);

// ---------------------------------------------------------------------------
// Weight quantizers (synthetic models and tests). q4_0 is ggml's reference
// quantizer byte for byte; q4_K, q5_K and q6_K are simple min/max quantizers
// that produce valid blocks but not llama-quantize's (which searches for scales).
// ---------------------------------------------------------------------------
void quantize_row_q4_0(const float* x, std::int64_t n, void* out);
void quantize_row_q4_k(const float* x, std::int64_t n, void* out);
void quantize_row_q5_k(const float* x, std::int64_t n, void* out);
void quantize_row_q6_k(const float* x, std::int64_t n, void* out);
// mxfp4, not ggml's quantizer: each block takes the smallest E8M0 exponent e
// whose largest code, 6 * 2^(e - 127), covers max |x| (so nothing is clipped;
// ggml's choice, floor(log2(amax)) - 2, clips up to a quarter of the range),
// and each value the nearest code (ties to the code with mantissa bit 0, the
// even index, as OCP's round-to-nearest-even). Error per value at most half
// the gap between neighbouring codes, so at most 2^(e - 127), which is below
// max |x| / 3. All-zero blocks get e = 0. Non-finite inputs give a valid block
// (NaN becomes code 0, inf the largest code).
void quantize_row_mxfp4(const float* x, std::int64_t n, void* out);

}  // namespace pagoda
