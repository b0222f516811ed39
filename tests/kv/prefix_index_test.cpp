#include "kv/prefix_index.h"

#include <vector>

#include <gtest/gtest.h>

namespace pagoda {
namespace {

const std::vector<token_id> k_a = {1, 2, 3, 4};
const std::vector<token_id> k_b = {1, 2, 3, 5};

TEST(hash_block, depends_on_parent_tokens_and_extras) {
  const block_key base = hash_block(k_root_parent_key, k_a, "");
  EXPECT_EQ(base, hash_block(k_root_parent_key, k_a, ""));
  EXPECT_NE(base, hash_block(k_root_parent_key + 1, k_a, ""));
  EXPECT_NE(base, hash_block(k_root_parent_key, k_b, ""));
  EXPECT_NE(base, hash_block(k_root_parent_key, k_a, "x"));
  // The chain: the same tokens under different parents differ.
  EXPECT_NE(hash_block(base, k_a, ""), hash_block(hash_block(k_root_parent_key, k_b, ""), k_a, ""));
}

TEST(extra_keys, fields_are_unambiguous) {
  const std::string ab_c =
      std::string(extra_keys().add(extra_key_kind::tenant, "ab").add(extra_key_kind::cache_salt, "c").bytes());
  const std::string a_bc =
      std::string(extra_keys().add(extra_key_kind::tenant, "a").add(extra_key_kind::cache_salt, "bc").bytes());
  const std::string salt_only = std::string(extra_keys().add(extra_key_kind::cache_salt, "abc").bytes());
  const std::string tenant_only = std::string(extra_keys().add(extra_key_kind::tenant, "abc").bytes());
  EXPECT_NE(ab_c, a_bc);
  EXPECT_NE(salt_only, tenant_only);
  EXPECT_TRUE(extra_keys().empty());
  EXPECT_FALSE(extra_keys().add(extra_key_kind::cache_salt, "").empty());
}

TEST(prefix_index, insert_find_erase) {
  prefix_index idx(4, 8);
  const block_key k0 = hash_block(k_root_parent_key, k_a, "");
  EXPECT_FALSE(idx.find(k0, k_root_parent_key, k_a, "").has_value());
  EXPECT_TRUE(idx.insert(block_id(3), k0, k_root_parent_key, k_a, ""));
  EXPECT_EQ(idx.size(), 1u);
  EXPECT_TRUE(idx.contains(block_id(3)));
  EXPECT_EQ(idx.key_of(block_id(3)), k0);
  EXPECT_EQ(std::vector<token_id>(idx.tokens_of(block_id(3)).begin(), idx.tokens_of(block_id(3)).end()), k_a);
  EXPECT_EQ(idx.find(k0, k_root_parent_key, k_a, ""), block_id(3));
  EXPECT_TRUE(idx.check_invariants().ok());

  idx.erase(block_id(3));
  EXPECT_FALSE(idx.contains(block_id(3)));
  EXPECT_FALSE(idx.find(k0, k_root_parent_key, k_a, "").has_value());
  EXPECT_EQ(idx.size(), 0u);
  EXPECT_TRUE(idx.check_invariants().ok());
}

TEST(prefix_index, a_second_block_with_the_same_key_is_not_registered) {
  prefix_index idx(4, 8);
  const block_key k0 = hash_block(k_root_parent_key, k_a, "");
  EXPECT_TRUE(idx.insert(block_id(1), k0, k_root_parent_key, k_a, ""));
  EXPECT_FALSE(idx.insert(block_id(2), k0, k_root_parent_key, k_a, ""));
  EXPECT_FALSE(idx.contains(block_id(2)));
  EXPECT_EQ(idx.find(k0, k_root_parent_key, k_a, ""), block_id(1));
  EXPECT_TRUE(idx.check_invariants().ok());
}

TEST(prefix_index, a_key_collision_is_a_miss_never_wrong_kv) {
  // Pretend k_b's block collides with k_a's key: the stored content disagrees.
  prefix_index idx(4, 8);
  const block_key k0 = hash_block(k_root_parent_key, k_a, "s");
  ASSERT_TRUE(idx.insert(block_id(0), k0, k_root_parent_key, k_a, "s"));
  EXPECT_FALSE(idx.find(k0, k_root_parent_key, k_b, "s").has_value());      // other tokens
  EXPECT_FALSE(idx.find(k0, k_root_parent_key + 1, k_a, "s").has_value());  // other parent
  EXPECT_FALSE(idx.find(k0, k_root_parent_key, k_a, "t").has_value());      // other extras
  EXPECT_FALSE(idx.find(k0, k_root_parent_key, k_a, "").has_value());
  EXPECT_FALSE(idx.find(k0, k_root_parent_key, std::vector<token_id>{1, 2, 3}, "s").has_value());
  EXPECT_EQ(idx.find(k0, k_root_parent_key, k_a, "s"), block_id(0));
}

TEST(prefix_index, invariant_check_catches_a_key_that_is_not_the_contents_hash) {
  prefix_index idx(4, 8);
  ASSERT_TRUE(idx.insert(block_id(0), 12345, k_root_parent_key, k_a, ""));
  EXPECT_FALSE(idx.check_invariants().ok());
}

TEST(prefix_index_death, only_full_blocks_are_keyed) {
  prefix_index idx(4, 8);
  EXPECT_DEATH((void)idx.insert(block_id(0), 1, k_root_parent_key, std::vector<token_id>{1, 2}, ""), "full blocks");
}

}  // namespace
}  // namespace pagoda
