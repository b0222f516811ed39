// Eviction of cached prefix blocks through the KV manager: lru against lfu
// on a hot prefix and a scan, chains never losing a root before its
// descendants, and evictions counted by reason.
#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "kv/kv_manager.h"

namespace pagoda {
namespace {

constexpr std::int32_t k_block = 4;

kv_manager make(cache_eviction e, std::int32_t n_blocks) {
  kv_group_config g;
  g.class_blocks = {n_blocks};
  g.eviction = e;
  return kv_manager(k_block, std::vector<kv_group_config>{g});
}

std::vector<token_id> toks(int n, int first) {
  std::vector<token_id> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

// Adds seq with prompt and stores the rest of it; returns the cached tokens.
std::int32_t prefill(kv_manager& m, std::int64_t id, const std::vector<token_id>& prompt,
                     const sequence_options& opts = {}) {
  const seq_id s(id);
  const auto cached = m.add_sequence(s, prompt, opts);
  EXPECT_TRUE(cached.ok());
  if (!cached.ok()) return -1;
  EXPECT_TRUE(m.allocate(s, static_cast<std::int32_t>(prompt.size()) - *cached).has_value());
  EXPECT_TRUE(m.commit(s, std::span<const token_id>(prompt).subspan(static_cast<std::size_t>(*cached))).ok());
  return *cached;
}

void run_once(kv_manager& m, std::int64_t id, const std::vector<token_id>& prompt) {
  prefill(m, id, prompt);
  EXPECT_TRUE(m.free_sequence(seq_id(id)).ok());
  const status st = m.check_invariants();
  EXPECT_TRUE(st.ok()) << st.message();
}

// A hot system prompt (3 full blocks) served 4 times, then 10 one-off
// documents of 2 full blocks each through a pool of 16 blocks: the hot
// prefix's blocks cached after the scan.
std::int32_t hot_blocks_after_scan(cache_eviction e) {
  kv_manager m = make(e, 16);
  const auto hot = toks(13, 1000);
  std::int64_t id = 1;
  for (int i = 0; i < 4; ++i) run_once(m, id++, hot);
  EXPECT_EQ(m.n_cached_prompt_blocks(hot), 3);
  for (int d = 0; d < 10; ++d) run_once(m, id++, toks(9, 5000 + 100 * d));
  return m.n_cached_prompt_blocks(hot);
}

TEST(kv_eviction, a_hot_prefix_survives_a_scan_that_lru_loses) {
  EXPECT_EQ(hot_blocks_after_scan(cache_eviction::lru), 0);
  EXPECT_EQ(hot_blocks_after_scan(cache_eviction::lfu), 3);
}

// Every cached block's parent is still indexed (or it is a root): nothing
// cached is unreachable. Sequences run one after another (a prompt's blocks
// are computed only when not cached), some kept running a while.
void expect_no_orphans(cache_eviction e, std::uint32_t seed) {
  kv_manager m = make(e, 24);
  std::mt19937 rng(seed);
  // Prompts: one of 3 roots (2 blocks), one of 3 branches (2 blocks), a unique tail.
  std::vector<std::int64_t> live;
  std::int64_t n_evictions_seen = 0;
  for (std::int64_t id = 1; id <= 300; ++id) {
    std::vector<token_id> prompt = toks(8, 100 * static_cast<int>(rng() % 3));
    const auto branch = toks(8, 10000 + 100 * static_cast<int>(rng() % 3));
    prompt.insert(prompt.end(), branch.begin(), branch.end());
    const auto tail = toks(static_cast<int>(1 + rng() % 9), 100000 + 20 * static_cast<int>(id));
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    while (m.n_takeable_blocks() < 8) {  // make room: end the oldest running sequences
      ASSERT_FALSE(live.empty());
      ASSERT_TRUE(m.free_sequence(seq_id(live.front())).ok());
      live.erase(live.begin());
    }
    prefill(m, id, prompt);
    live.push_back(id);
    if (rng() % 2 == 0) {
      ASSERT_TRUE(m.free_sequence(seq_id(live.back())).ok());
      live.pop_back();
    }
    const status st = m.check_invariants();
    ASSERT_TRUE(st.ok()) << st.message();
    const prefix_index& index = m.index();
    std::set<block_key> keys;
    for (std::int32_t b = 0; b < m.n_blocks(); ++b)
      if (index.contains(block_id(b))) keys.insert(index.key_of(block_id(b)));
    for (std::int32_t b = 0; b < m.n_blocks(); ++b) {
      const block_id l(b);
      if (!index.contains(l) || m.pool().ref_count(l) > 0) continue;
      const block_key parent = index.parent_of(l);
      ASSERT_TRUE(parent == k_root_parent_key || keys.contains(parent))
          << "step " << id << ": cached block " << b << " lost its parent";
    }
    n_evictions_seen = m.metrics().n_evictions;
  }
  EXPECT_GT(n_evictions_seen, 100);  // the pool was under pressure throughout
}

TEST(kv_eviction, a_chain_never_loses_its_root_before_its_descendants) {
  for (const cache_eviction e : {cache_eviction::lru, cache_eviction::lfu}) {
    for (std::uint32_t seed = 1; seed <= 5; ++seed) {
      SCOPED_TRACE(::testing::Message() << cache_eviction_name(e) << " seed " << seed);
      expect_no_orphans(e, seed);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(kv_eviction, evictions_are_counted_by_reason) {
  for (const cache_eviction e : {cache_eviction::lru, cache_eviction::lfu}) {
    SCOPED_TRACE(cache_eviction_name(e));
    kv_manager m = make(e, 8);
    const auto by = [&](eviction_reason r) { return m.metrics().n_evictions_by_reason[static_cast<std::size_t>(r)]; };
    sequence_options t;
    t.tenant = "t";
    // capacity: 2 prompts of 3 full blocks + 1 partial leave 6 cached blocks and 2 free;
    // a third needs 4 blocks, so 2 cached ones go.
    run_once(m, 1, toks(13, 100));
    run_once(m, 2, toks(13, 200));
    EXPECT_EQ(by(eviction_reason::capacity), 0);
    run_once(m, 3, toks(13, 300));
    EXPECT_EQ(by(eviction_reason::capacity), 2);
    // quota: tenant t at a quota of 4 caches 3 blocks, then a new prompt of 4
    // blocks pays with its own cache.
    ASSERT_TRUE(m.set_tenant_quota("t", 4).ok());
    prefill(m, 4, toks(13, 400), t);
    ASSERT_TRUE(m.free_sequence(seq_id(4)).ok());
    const std::int64_t capacity_before = by(eviction_reason::capacity);
    prefill(m, 5, toks(13, 500), t);
    ASSERT_TRUE(m.free_sequence(seq_id(5)).ok());
    EXPECT_EQ(by(eviction_reason::quota), 3);
    EXPECT_EQ(by(eviction_reason::capacity), capacity_before);  // nobody else's cache was touched for t
    ASSERT_TRUE(m.set_tenant_quota("t", 1).ok());  // lowering the quota drops t's cache beyond it
    EXPECT_EQ(by(eviction_reason::quota), 5);
    // admin: erasing t's KV, then resetting the whole cache.
    EXPECT_EQ(m.evict_cached_blocks("t"), 1);
    EXPECT_EQ(by(eviction_reason::admin), 1);
    const std::int32_t rest = m.pool().n_cached();
    EXPECT_GT(rest, 0);
    EXPECT_EQ(m.evict_cached_blocks(), rest);
    EXPECT_EQ(by(eviction_reason::admin), 1 + rest);
    const kv_metrics km = m.metrics();
    EXPECT_EQ(km.n_evictions, km.n_evictions_by_reason[0] + km.n_evictions_by_reason[1] + km.n_evictions_by_reason[2]);
    const status st = m.check_invariants();
    EXPECT_TRUE(st.ok()) << st.message();
  }
}

}  // namespace
}  // namespace pagoda
