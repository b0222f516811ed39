#include "kv/kv_storage.h"

#include <gtest/gtest.h>

namespace pagoda {
namespace {

TEST(kv_storage, bytes_per_block_follow_the_formula) {
  // stories260K: 5 layers, 4 KV heads, head_dim 8: 2*5*4*8*4 = 1280 bytes per token in f32.
  auto f32 = kv_layout::uniform(5, 4, 8, 16, kv_type::f32, kv_type::f32);
  EXPECT_EQ(f32.bytes_per_block(), 1280u * 16);
  EXPECT_DOUBLE_EQ(f32.bytes_per_token(), 1280.0);
  auto f16 = kv_layout::uniform(5, 4, 8, 16, kv_type::f16, kv_type::f16);
  EXPECT_DOUBLE_EQ(f16.bytes_per_token(), 640.0);
  auto mixed = kv_layout::uniform(5, 4, 8, 16, kv_type::f32, kv_type::f16);
  EXPECT_DOUBLE_EQ(mixed.bytes_per_token(), 960.0);
  auto s = kv_storage::create(f16, 10);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->total_bytes(), 10 * f16.bytes_per_block());
}

TEST(kv_storage, rejects_bad_layouts) {
  auto l = kv_layout::uniform(2, 2, 8, 16, kv_type::f32, kv_type::f32);
  EXPECT_EQ(kv_storage::create(l, 0).error().code(), errc::invalid_argument);
  l.block_size = 0;
  EXPECT_FALSE(kv_storage::create(l, 4).ok());
}

TEST(kv_storage, write_view_and_copy_block) {
  auto layout = kv_layout::uniform(2, 2, 4, 4, kv_type::f32, kv_type::f32);
  auto s = *kv_storage::create(layout, 8);
  std::vector<block_id> table{block_id(5), block_id(2)};
  // 6 tokens x 2 heads x 4 dims; value = token*100 + head*10 + dim.
  std::vector<float> k(6 * 8), v(6 * 8);
  for (int t = 0; t < 6; ++t)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 4; ++d) {
        k[t * 8 + h * 4 + d] = t * 100 + h * 10 + d;
        v[t * 8 + h * 4 + d] = -(t * 100 + h * 10 + d);
      }
  s->write(1, table, 0, 6, k.data(), v.data());
  auto kv = s->k_view(1, table, 6);
  auto vv = s->v_view(1, table, 6);
  float out[4];
  kv.codec->decode(kv.format, kv.shape, kv.tile(1, 1), 1, 1, out);  // token 5, head 1
  EXPECT_EQ(out[3], 513.0f);
  vv.codec->decode(vv.format, vv.shape, vv.tile(0, 0), 2, 1, out);  // token 2, head 0
  EXPECT_EQ(out[1], -201.0f);
  s->copy_block(block_id(2), block_id(7));
  std::vector<block_id> copy{block_id(5), block_id(7)};
  auto kc = s->k_view(1, copy, 6);
  kc.codec->decode(kc.format, kc.shape, kc.tile(1, 1), 1, 1, out);
  EXPECT_EQ(out[3], 513.0f);
}

}  // namespace
}  // namespace pagoda
