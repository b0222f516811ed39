// A KV group of another model (a draft model's) in a storage: its own shape,
// reached only through kv_group_backend; block ops route by id.
#include <gtest/gtest.h>

#include "kv/kv_storage.h"

namespace pagoda {
namespace {

TEST(kv_group_backend, a_foreign_group_has_its_own_shape_and_blocks) {
  // Target: 3 layers, 2 KV heads of 8; draft: 2 layers, 1 KV head of 4.
  const kv_layout target = kv_layout::uniform(3, 2, 8, 4, kv_type::f32, kv_type::f32);
  const kv_layout draft = kv_layout::uniform(2, 1, 4, 4, kv_type::f32, kv_type::f32);
  const kv_group_blocks groups[] = {{{0, 1, 2}, {6}, {}}, {{0, 1}, {6}, {draft}}};
  auto made = kv_storage::create(std::span<const kv_layout>(&target, 1), groups);
  ASSERT_TRUE(made.ok()) << made.error().message();
  kv_storage& s = **made;
  EXPECT_EQ(s.n_groups(), 2);
  EXPECT_EQ(s.n_blocks(), 12);
  EXPECT_FALSE(s.foreign_group(0));
  EXPECT_TRUE(s.foreign_group(1));
  EXPECT_EQ(s.layout().n_layers, 3);  // the target's layers route to group 0 only
  for (int l = 0; l < 3; ++l) EXPECT_EQ(s.layer_group(l), 0);

  kv_group_backend d(s, 1);
  EXPECT_EQ(d.layout().n_layers, 2);
  EXPECT_EQ(d.layout().n_kv_heads, 1);
  EXPECT_EQ(d.layout().head_dim, 4);
  EXPECT_EQ(d.group_of(block_id(7)), 0);
  EXPECT_EQ(d.group_of(block_id(2)), -1) << "a target block is not the draft's";
  EXPECT_EQ(s.block_layout(block_id(7)).head_dim, 4);
  EXPECT_NE(s.block_bytes(block_id(7)), s.block_bytes(block_id(2)));

  // Writes through the facade land in the draft's blocks, in its shape.
  const std::vector<block_id> table{block_id(9), block_id(6)};
  std::vector<float> k(6 * 4), v(6 * 4);
  for (int i = 0; i < 24; ++i) {
    k[static_cast<std::size_t>(i)] = static_cast<float>(i);
    v[static_cast<std::size_t>(i)] = -static_cast<float>(i);
  }
  d.write(1, table, 0, 6, k.data(), v.data());
  const paged_kv_view kv = d.k_view(1, table, 6);
  float out[4];
  kv.codec->decode(kv.format, kv.shape, nullptr, kv.tile(1, 0), 1, 1, out);  // token 5
  EXPECT_EQ(out[2], 22.0f);
  // Block ops by id: a copy within the draft group, bytes of its layout.
  d.copy_block(block_id(6), block_id(10), 2);
  const std::vector<block_id> copy{block_id(9), block_id(10)};
  const paged_kv_view kc = d.k_view(1, copy, 6);
  kc.codec->decode(kc.format, kc.shape, nullptr, kc.tile(1, 0), 1, 1, out);
  EXPECT_EQ(out[2], 22.0f);
  std::vector<std::byte> bytes(s.block_bytes(block_id(9)));
  s.read_block(block_id(9), bytes);
  EXPECT_TRUE(s.write_block(block_id(11), bytes).ok());
}

TEST(kv_group_backend, rejects_malformed_foreign_groups) {
  const kv_layout target = kv_layout::uniform(2, 2, 8, 4, kv_type::f32, kv_type::f32);
  const kv_layout draft = kv_layout::uniform(2, 1, 4, 4, kv_type::f32, kv_type::f32);
  const kv_group_blocks bad_layers[] = {{{0, 1}, {4}, {}}, {{1, 2}, {4}, {draft}}};
  EXPECT_FALSE(kv_storage::create(std::span<const kv_layout>(&target, 1), bad_layers).ok());
  const kv_group_blocks wrong_count[] = {{{0, 1}, {4}, {}}, {{0, 1, 2}, {4}, {draft}}};
  EXPECT_FALSE(kv_storage::create(std::span<const kv_layout>(&target, 1), wrong_count).ok());
  const kv_group_blocks two_classes[] = {{{0, 1}, {4}, {}}, {{0, 1}, {4}, {draft, draft}}};
  EXPECT_FALSE(kv_storage::create(std::span<const kv_layout>(&target, 1), two_classes).ok());
}

}  // namespace
}  // namespace pagoda
