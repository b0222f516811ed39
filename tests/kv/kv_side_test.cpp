// Side blocks (kv_manager.h, "Side blocks"): memory a sequence holds beyond
// its KV (a retrieval index, policy statistics) is paid for with blocks of the
// same pool and counted in its tenant's quota.
#include <algorithm>
#include <vector>

#include <gtest/gtest.h>

#include "kv/kv_manager.h"

namespace pagoda {
namespace {

constexpr std::int32_t k_block = 4;           // tokens a block
constexpr std::int64_t k_block_bytes = 1000;  // bytes a side block stands for

std::vector<token_id> tokens(int n) {
  std::vector<token_id> t(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<std::size_t>(i)] = 10 + i;
  return t;
}

// Adds seq with `charge`, allocates and commits its whole prompt.
bool start(kv_manager& kv, seq_id seq, int n_prompt, side_charge charge, std::string_view tenant = {}) {
  sequence_options o;
  o.tenant = tenant;
  o.side = charge;
  const std::vector<token_id> p = tokens(n_prompt);
  EXPECT_TRUE(kv.add_sequence(seq, p, o).ok());
  if (!kv.allocate(seq, n_prompt)) return false;
  EXPECT_TRUE(kv.commit(seq, p).ok());
  return true;
}

TEST(kv_side, index_is_charged_in_pool_blocks_and_released_with_the_sequence) {
  kv_manager kv(k_block, 100);
  kv.set_side_block_bytes(k_block_bytes);
  // 2,500 fixed + 100 per token: at 16 tokens, 4,100 bytes = 5 side blocks beside 4 KV blocks.
  ASSERT_TRUE(start(kv, seq_id(1), 16, side_charge{2500, 100}));
  EXPECT_EQ(kv.n_side_blocks(seq_id(1)), 5);
  kv_metrics m = kv.metrics();
  EXPECT_EQ(m.n_blocks_used, 9);
  EXPECT_EQ(m.n_side_blocks, 5);
  EXPECT_EQ(m.side_block_bytes, k_block_bytes);
  EXPECT_EQ(m.side_bound_bytes, 4100);
  EXPECT_TRUE(kv.check_invariants().ok()) << kv.check_invariants().message();

  // Growing by 10 tokens needs 1,000 bytes more: one more side block.
  ASSERT_TRUE(kv.allocate(seq_id(1), 10));
  EXPECT_EQ(kv.n_side_blocks(seq_id(1)), 6);
  // A measured size above the bound is paid for at the next allocate.
  ASSERT_TRUE(kv.set_side_measured(seq_id(1), 9500).ok());
  ASSERT_TRUE(kv.allocate(seq_id(1), 10));
  EXPECT_EQ(kv.n_side_blocks(seq_id(1)), 10);
  EXPECT_TRUE(kv.check_invariants().ok()) << kv.check_invariants().message();

  ASSERT_TRUE(kv.free_sequence(seq_id(1)).ok());
  m = kv.metrics();
  EXPECT_EQ(m.n_side_blocks, 0);
  EXPECT_EQ(m.n_blocks_used, 0);
  EXPECT_EQ(m.n_blocks_free + m.n_blocks_cached, 100);
  EXPECT_TRUE(kv.check_invariants().ok()) << kv.check_invariants().message();
}

TEST(kv_side, a_pool_too_small_for_kv_and_index_refuses_instead_of_exceeding) {
  kv_manager kv(k_block, 12);
  kv.set_side_block_bytes(k_block_bytes);
  const side_charge charge{4000, 0};  // 4 side blocks whatever the length
  // 16 tokens: 4 KV + 4 side blocks. A request of 40 tokens would need 10 + 4 > 12.
  EXPECT_TRUE(kv.check_request_fits(16, 0, {}, 1, {}, charge).ok());
  const status st = kv.check_request_fits(40, 0, {}, 1, {}, charge);
  EXPECT_EQ(st.code(), errc::resource_exhausted);
  EXPECT_NE(st.message().find("side memory"), std::string::npos) << st.message();
  // Without the charge the same request fits: the side memory is what refuses it.
  EXPECT_TRUE(kv.check_request_fits(40, 0).ok());

  ASSERT_TRUE(start(kv, seq_id(1), 16, charge));
  EXPECT_EQ(kv.metrics().n_blocks_used, 8);
  // A second sequence would need 4 KV + 4 side blocks with 4 left: all or
  // nothing, so it takes none (the scheduler waits or preempts).
  const std::vector<token_id> p = tokens(16);
  sequence_options o;
  o.side = charge;
  ASSERT_TRUE(kv.add_sequence(seq_id(2), p, o).ok());
  EXPECT_FALSE(kv.allocate(seq_id(2), 16));
  EXPECT_EQ(kv.allocation_blocker(seq_id(2), 16), alloc_blocker::pool);
  EXPECT_EQ(kv.n_side_blocks(seq_id(2)), 0);
  EXPECT_EQ(kv.metrics().n_blocks_used, 8);
  EXPECT_TRUE(kv.check_invariants().ok()) << kv.check_invariants().message();
}

TEST(kv_side, the_tenants_quota_counts_side_blocks) {
  kv_manager kv(k_block, 100);
  kv.set_side_block_bytes(k_block_bytes);
  ASSERT_TRUE(kv.set_tenant_quota("alice", 10).ok());
  const side_charge charge{5000, 0};  // 5 side blocks
  // 8 tokens: 2 KV + 5 side = 7 <= 10; 24 tokens: 6 + 5 = 11 > 10.
  EXPECT_TRUE(kv.check_request_fits(8, 0, "alice", 1, {}, charge).ok());
  const status st = kv.check_request_fits(24, 0, "alice", 1, {}, charge);
  EXPECT_EQ(st.code(), errc::resource_exhausted);
  EXPECT_NE(st.message().find("tenant 'alice'"), std::string::npos) << st.message();

  ASSERT_TRUE(start(kv, seq_id(1), 8, charge, "alice"));
  const kv_metrics m = kv.metrics();
  const auto alice = std::find_if(m.tenants.begin(), m.tenants.end(), [](const tenant_kv_usage& t) { return t.name == "alice"; });
  ASSERT_NE(alice, m.tenants.end());
  EXPECT_EQ(alice->n_used_blocks, 7);
  EXPECT_EQ(alice->n_side_blocks, 5);
  // Her second sequence (2 KV + 5 side) is over her quota though the pool has room.
  const std::vector<token_id> p = tokens(8);
  sequence_options o;
  o.tenant = "alice";
  o.side = charge;
  ASSERT_TRUE(kv.add_sequence(seq_id(2), p, o).ok());
  EXPECT_FALSE(kv.allocate(seq_id(2), 8));
  EXPECT_EQ(kv.allocation_blocker(seq_id(2), 8), alloc_blocker::quota);
  EXPECT_TRUE(kv.check_invariants().ok()) << kv.check_invariants().message();
}

TEST(kv_side, a_fork_takes_its_own_side_blocks_and_nothing_is_charged_without_a_block_size) {
  kv_manager kv(k_block, 100);
  kv.set_side_block_bytes(k_block_bytes);
  ASSERT_TRUE(start(kv, seq_id(1), 8, side_charge{3000, 0}));
  ASSERT_TRUE(kv.fork(seq_id(1), seq_id(2)).ok());
  EXPECT_EQ(kv.n_side_blocks(seq_id(2)), 0);
  ASSERT_TRUE(kv.allocate(seq_id(2), 1));
  EXPECT_EQ(kv.n_side_blocks(seq_id(2)), 3);
  EXPECT_EQ(kv.metrics().n_side_blocks, 6);
  EXPECT_TRUE(kv.check_invariants().ok()) << kv.check_invariants().message();

  kv_manager off(k_block, 100);  // side_block_bytes 0: side memory is not charged
  ASSERT_TRUE(start(off, seq_id(1), 8, side_charge{3000, 100}));
  EXPECT_EQ(off.n_side_blocks(seq_id(1)), 0);
  EXPECT_EQ(off.metrics().n_blocks_used, 2);
}

}  // namespace
}  // namespace pagoda
