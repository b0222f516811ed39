// ggml's packed block layouts, shared by weight formats (GGUF tensors) and the
// ggml-compatible KV codecs (q8_0, q4_0). Byte-exact with ggml.
#pragma once

#include <cstdint>

#include "core/half.h"

namespace pagoda {

inline constexpr int k_qk8_0 = 32;
inline constexpr int k_qk4_0 = 32;

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

}  // namespace pagoda
