// q8_0 / q4_0 tiles hold ggml's block structs, byte for byte, quantized with
// ggml's reference rounding; head_dim not a multiple of 32 is zero-padded.
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "core/aligned_buffer.h"
#include "core/ggml_blocks.h"
#include "quant/kv_codec.h"

namespace pagoda {
namespace {

TEST(kv_codec_ggml, q8_0_block_matches_ggml_reference) {
  const kv_codec* c = get_kv_codec(kv_type::q8_0);
  kv_format f = default_kv_format(kv_type::q8_0, kv_role::key);
  kv_tile_shape shape{2, 32};
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[i] = std::sin(0.37f * i) * (i < 32 ? 2.0f : 0.01f);
  aligned_buffer tile(c->tile_bytes(f, shape));
  ASSERT_EQ(c->tile_bytes(f, shape), 2 * sizeof(block_q8_0));
  c->encode(f, shape, nullptr, x.data(), 0, 2, tile.data());
  for (int t = 0; t < 2; ++t) {
    // ggml's quantize_row_q8_0_ref, written out.
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[t * 32 + i]));
    float d = amax / 127, id = d ? 1 / d : 0;
    block_q8_0 want;
    want.d = f32_to_fp16(d);
    for (int i = 0; i < 32; ++i) want.qs[i] = static_cast<std::int8_t>(std::roundf(x[t * 32 + i] * id));
    EXPECT_EQ(std::memcmp(tile.data() + t * sizeof(block_q8_0), &want, sizeof want), 0) << "token " << t;
  }
}

TEST(kv_codec_ggml, q4_0_block_matches_ggml_reference) {
  const kv_codec* c = get_kv_codec(kv_type::q4_0);
  kv_format f = default_kv_format(kv_type::q4_0, kv_role::value);
  kv_tile_shape shape{1, 32};
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = std::cos(0.91f * i) - 0.3f;
  aligned_buffer tile(c->tile_bytes(f, shape));
  c->encode(f, shape, nullptr, x.data(), 0, 1, tile.data());
  float amax = 0, mx = 0;
  for (float v : x)
    if (std::fabs(v) > amax) {
      amax = std::fabs(v);
      mx = v;
    }
  float d = mx / -8, id = d ? 1 / d : 0;
  block_q4_0 want;
  want.d = f32_to_fp16(d);
  for (int j = 0; j < 16; ++j) {
    auto a = static_cast<std::uint8_t>(std::min<std::int8_t>(15, static_cast<std::int8_t>(x[j] * id + 8.5f)));
    auto b = static_cast<std::uint8_t>(std::min<std::int8_t>(15, static_cast<std::int8_t>(x[16 + j] * id + 8.5f)));
    want.qs[j] = static_cast<std::uint8_t>(a | (b << 4));
  }
  EXPECT_EQ(std::memcmp(tile.data(), &want, sizeof want), 0);
}

// stories260K's head_dim 8: one block per token, the 24 padding values zero.
TEST(kv_codec_ggml, head_dim_not_a_multiple_of_32_is_zero_padded) {
  const kv_codec* c = get_kv_codec(kv_type::q8_0);
  kv_format f = default_kv_format(kv_type::q8_0, kv_role::key);
  kv_tile_shape shape{16, 8};
  EXPECT_EQ(c->tile_bytes(f, shape), 16 * sizeof(block_q8_0));
  std::vector<float> x(16 * 8);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 11) - 5.0f;
  aligned_buffer tile(c->tile_bytes(f, shape));
  std::memset(tile.data(), 0x77, c->tile_bytes(f, shape));
  c->encode(f, shape, nullptr, x.data(), 0, 16, tile.data());
  for (int t = 0; t < 16; ++t) {
    block_q8_0 b;
    std::memcpy(&b, tile.data() + t * sizeof b, sizeof b);
    for (int i = 8; i < 32; ++i) ASSERT_EQ(b.qs[i], 0) << "token " << t << " padding " << i;
  }
  std::vector<float> y(x.size());
  c->decode(f, shape, nullptr, tile.data(), 0, 16, y.data());
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 5.0 / 127);
}

}  // namespace
}  // namespace pagoda
