#include "kv/kv_manager.h"

#include <algorithm>
#include <memory>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

namespace pagoda {
namespace {

std::vector<token_id> toks(int n, int first = 100) {
  std::vector<token_id> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::vector<std::int32_t> ids(std::span<const block_id> v) {
  std::vector<std::int32_t> out;
  for (const block_id b : v) out.push_back(b.value);
  return out;
}

sequence_options of_tenant(std::string_view name) {
  sequence_options o;
  o.tenant = name;
  return o;
}

void expect_ok(const kv_manager& m) {
  const status st = m.check_invariants();
  EXPECT_TRUE(st.ok()) << st.message();
}

// Adds seq and stores its whole prompt in one chunk; returns the cached tokens.
std::int32_t add_and_prefill(kv_manager& m, std::int64_t id, const std::vector<token_id>& prompt,
                             const sequence_options& opts = {}) {
  const seq_id s(id);
  const auto cached = m.add_sequence(s, prompt, opts);
  EXPECT_TRUE(cached.ok()) << cached.error().message();
  if (!cached.ok()) return -1;
  const std::int32_t n_new = static_cast<std::int32_t>(prompt.size()) - *cached;
  const auto a = m.allocate(s, n_new);
  EXPECT_TRUE(a.has_value());
  if (!a) return -1;
  EXPECT_TRUE(a->copies.empty());
  const status st = m.commit(s, std::span<const token_id>(prompt).subspan(static_cast<std::size_t>(*cached)));
  EXPECT_TRUE(st.ok()) << st.message();
  expect_ok(m);
  return *cached;
}

// Decodes one token: allocate one slot, perform nothing, commit.
std::optional<allocation> decode_one(kv_manager& m, std::int64_t id, token_id t) {
  auto a = m.allocate(seq_id(id), 1);
  if (a) {
    const token_id one[] = {t};
    const status st = m.commit(seq_id(id), one);
    EXPECT_TRUE(st.ok()) << st.message();
  }
  expect_ok(m);
  return a;
}

TEST(kv_manager, identical_prompts_share_full_blocks) {
  kv_manager m(4, 16);
  const auto prompt = toks(10);
  EXPECT_EQ(add_and_prefill(m, 1, prompt), 0);
  const std::vector<std::int32_t> a_table = ids(m.block_table(seq_id(1)));
  ASSERT_EQ(a_table.size(), 3u);

  EXPECT_EQ(add_and_prefill(m, 2, prompt), 8);
  const std::vector<std::int32_t> b_table = ids(m.block_table(seq_id(2)));
  ASSERT_EQ(b_table.size(), 3u);
  EXPECT_EQ(b_table[0], a_table[0]);
  EXPECT_EQ(b_table[1], a_table[1]);
  EXPECT_NE(b_table[2], a_table[2]);
  EXPECT_EQ(m.pool().ref_count(block_id(a_table[0])), 2);
  EXPECT_EQ(m.pool().ref_count(block_id(a_table[2])), 1);
  EXPECT_EQ(m.n_stored_tokens(seq_id(2)), 10);

  const kv_metrics km = m.metrics();
  EXPECT_EQ(km.n_prefix_query_tokens, 20);
  EXPECT_EQ(km.n_prefix_hit_tokens, 8);
  EXPECT_DOUBLE_EQ(km.prefix_hit_ratio(), 0.4);
  EXPECT_EQ(km.n_blocks_used, 4);
  EXPECT_EQ(km.n_stored_tokens, 4 + 4 + 2 + 2);  // shared blocks once
}

TEST(kv_manager, the_last_prompt_token_is_always_computed) {
  kv_manager m(4, 16);
  add_and_prefill(m, 1, toks(8));  // two full blocks, both cached
  EXPECT_EQ(m.index().size(), 2u);
  EXPECT_EQ(add_and_prefill(m, 2, toks(8)), 4);  // not 8: token 7 must be computed
  EXPECT_EQ(add_and_prefill(m, 3, toks(9)), 8);
  EXPECT_EQ(add_and_prefill(m, 4, toks(1)), 0);
  EXPECT_EQ(add_and_prefill(m, 5, toks(5)), 4);
  EXPECT_EQ(add_and_prefill(m, 6, toks(4)), 0);
}

TEST(kv_manager, a_cache_hit_stops_at_the_first_missing_block) {
  kv_manager m(4, 16);
  add_and_prefill(m, 1, toks(12));
  std::vector<token_id> p = toks(12);
  p[5] = 9999;  // block 1 differs, block 2 equal but its parent differs
  EXPECT_EQ(add_and_prefill(m, 2, p), 4);
}

TEST(kv_manager, salts_and_tenants_isolate_the_cache) {
  kv_manager m(4, 64);
  const auto p = toks(9);
  EXPECT_EQ(add_and_prefill(m, 1, p), 0);
  EXPECT_EQ(add_and_prefill(m, 2, p, {.tenant = "", .cache_salt = "x"}), 0);
  EXPECT_EQ(add_and_prefill(m, 3, p, {.tenant = "", .cache_salt = "x"}), 8);
  EXPECT_EQ(add_and_prefill(m, 4, p, {.tenant = "acme", .cache_salt = ""}), 0);
  EXPECT_EQ(add_and_prefill(m, 5, p, {.tenant = "acme", .cache_salt = ""}), 8);
  EXPECT_EQ(add_and_prefill(m, 6, p, {.tenant = "acme", .cache_salt = "x"}), 0);
  EXPECT_EQ(add_and_prefill(m, 7, p, {.tenant = "x", .cache_salt = ""}), 0);  // tenant "x" is not salt "x"
  EXPECT_EQ(add_and_prefill(m, 8, p), 8);                                     // the global cache
  EXPECT_EQ(m.block_table(seq_id(8))[0], m.block_table(seq_id(1))[0]);
  EXPECT_EQ(m.tenant_of(seq_id(5)), *m.find_tenant("acme"));
  EXPECT_EQ(m.tenant_of(seq_id(3)), tenant_id(0));
}

TEST(kv_manager, fork_copies_a_shared_partial_block_once_on_first_write) {
  kv_manager m(4, 16);
  add_and_prefill(m, 1, toks(6));
  const std::vector<std::int32_t> parent = ids(m.block_table(seq_id(1)));
  ASSERT_EQ(parent.size(), 2u);
  ASSERT_TRUE(m.fork(seq_id(1), seq_id(2)).ok());
  expect_ok(m);
  EXPECT_EQ(ids(m.block_table(seq_id(2))), parent);
  EXPECT_EQ(m.pool().ref_count(block_id(parent[1])), 2);
  EXPECT_EQ(m.n_stored_tokens(seq_id(2)), 6);
  EXPECT_EQ(m.n_blocks_needed(seq_id(2), 1), 1);  // the copy
  EXPECT_EQ(m.n_blocks_needed(seq_id(2), 0), 0);

  const auto a = decode_one(m, 2, 7);
  ASSERT_TRUE(a.has_value());
  ASSERT_EQ(a->copies.size(), 1u);
  EXPECT_EQ(a->copies[0].src.value, parent[1]);
  EXPECT_EQ(a->copies[0].n_tokens, 2);
  EXPECT_EQ(a->n_new_blocks, 0);
  const std::vector<std::int32_t> child = ids(m.block_table(seq_id(2)));
  EXPECT_EQ(child[0], parent[0]);
  EXPECT_EQ(child[1], a->copies[0].dst.value);
  EXPECT_NE(child[1], parent[1]);
  EXPECT_EQ(ids(m.block_table(seq_id(1))), parent);  // the parent's table is untouched
  EXPECT_EQ(m.pool().ref_count(block_id(parent[1])), 1);
  EXPECT_EQ(m.pool().ref_count(block_id(parent[0])), 2);

  // Neither further writes of the child nor the parent's own copy again.
  for (token_id t = 8; t < 12; ++t) {
    const auto c = decode_one(m, 2, t);
    ASSERT_TRUE(c.has_value());
    EXPECT_TRUE(c->copies.empty());
  }
  const auto p = decode_one(m, 1, 50);
  ASSERT_TRUE(p.has_value());
  EXPECT_TRUE(p->copies.empty());
  EXPECT_EQ(ids(m.block_table(seq_id(1))), parent);
  EXPECT_EQ(m.metrics().n_cow_copies, 1);
  EXPECT_EQ(m.tokens(seq_id(1)).back(), 50);
  EXPECT_EQ(m.tokens(seq_id(2)).back(), 11);

  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  ASSERT_TRUE(m.free_sequence(seq_id(2)).ok());
  expect_ok(m);
  EXPECT_EQ(m.metrics().n_blocks_used, 0);
}

TEST(kv_manager, fork_at_a_block_boundary_copies_nothing) {
  kv_manager m(4, 16);
  add_and_prefill(m, 1, toks(8));
  ASSERT_TRUE(m.fork(seq_id(1), seq_id(2)).ok());
  const auto a = decode_one(m, 2, 1);
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->copies.empty());
  EXPECT_EQ(a->n_new_blocks, 1);
  EXPECT_EQ(m.metrics().n_cow_copies, 0);
}

TEST(kv_manager, fork_between_allocate_and_commit_is_refused) {
  kv_manager m(4, 16);
  add_and_prefill(m, 1, toks(8));
  ASSERT_TRUE(m.allocate(seq_id(1), 1).has_value());
  const status st = m.fork(seq_id(1), seq_id(2));
  EXPECT_EQ(st.code(), errc::invalid_argument);
  EXPECT_FALSE(m.contains(seq_id(2)));
  EXPECT_EQ(m.fork(seq_id(9), seq_id(3)).code(), errc::not_found);
  EXPECT_EQ(m.fork(seq_id(1), seq_id(1)).code(), errc::invalid_argument);
  expect_ok(m);
}

TEST(kv_manager, commit_rejects_misuse_and_changes_nothing) {
  kv_manager m(4, 16);
  add_and_prefill(m, 1, toks(6));
  ASSERT_TRUE(m.fork(seq_id(1), seq_id(2)).ok());
  const token_id one[] = {7};
  // A write into the shared block without allocate() first.
  EXPECT_EQ(m.commit(seq_id(2), one).code(), errc::internal);
  EXPECT_EQ(m.n_stored_tokens(seq_id(2)), 6);
  // More tokens than allocated slots.
  const auto five = toks(5);
  ASSERT_TRUE(m.allocate(seq_id(1), 1).has_value());
  EXPECT_EQ(m.commit(seq_id(1), five).code(), errc::out_of_range);
  // A token that is not the prompt's.
  ASSERT_TRUE(m.add_sequence(seq_id(3), toks(6, 500)).ok());
  ASSERT_TRUE(m.allocate(seq_id(3), 6).has_value());
  const auto wrong = toks(6, 501);
  EXPECT_EQ(m.commit(seq_id(3), wrong).code(), errc::invalid_argument);
  EXPECT_EQ(m.n_stored_tokens(seq_id(3)), 0);
  EXPECT_EQ(m.commit(seq_id(42), one).code(), errc::not_found);
  EXPECT_TRUE(m.commit(seq_id(3), {}).ok());
  expect_ok(m);
}

TEST(kv_manager, add_and_free_reject_bad_ids) {
  kv_manager m(4, 16);
  ASSERT_TRUE(m.add_sequence(seq_id(1), toks(3)).ok());
  EXPECT_EQ(m.add_sequence(seq_id(1), toks(3)).error().code(), errc::invalid_argument);
  EXPECT_EQ(m.add_sequence(seq_id(2), std::vector<token_id>{}).error().code(), errc::invalid_argument);
  EXPECT_EQ(m.free_sequence(seq_id(2)).code(), errc::not_found);
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  EXPECT_EQ(m.free_sequence(seq_id(1)).code(), errc::not_found);
  expect_ok(m);
}

struct snapshot {
  std::vector<std::int32_t> queue;
  std::vector<std::vector<std::int32_t>> tables;
  std::vector<std::int32_t> stored;
  std::size_t index_size;
  std::int64_t evictions, cow;
  std::int32_t used, cached, free;
  bool operator==(const snapshot&) const = default;
};

snapshot take_snapshot(const kv_manager& m, std::initializer_list<std::int64_t> seqs) {
  snapshot s;
  s.queue = ids(m.pool().free_queue());
  for (const auto id : seqs) {
    s.tables.push_back(ids(m.block_table(seq_id(id))));
    s.stored.push_back(m.n_stored_tokens(seq_id(id)));
  }
  s.index_size = m.index().size();
  const kv_metrics km = m.metrics();
  s.evictions = km.n_evictions;
  s.cow = km.n_cow_copies;
  s.used = km.n_blocks_used;
  s.cached = km.n_blocks_cached;
  s.free = km.n_blocks_free;
  return s;
}

TEST(kv_manager, a_failed_allocate_changes_nothing) {
  kv_manager m(4, 6);
  add_and_prefill(m, 1, toks(8, 0));  // 2 blocks, cached after free
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  add_and_prefill(m, 2, toks(6, 50));  // 2 blocks, one partial
  ASSERT_TRUE(m.fork(seq_id(2), seq_id(3)).ok());
  ASSERT_TRUE(m.add_sequence(seq_id(4), toks(30, 200)).ok());
  // 2 free + 2 cached takeable; seq 4 needs 8.
  EXPECT_EQ(m.n_takeable_blocks(), 4);
  EXPECT_EQ(m.n_blocks_needed(seq_id(4), 30), 8);
  EXPECT_FALSE(m.can_allocate(seq_id(4), 30));
  const snapshot before = take_snapshot(m, {2, 3, 4});
  EXPECT_FALSE(m.allocate(seq_id(4), 30).has_value());
  EXPECT_EQ(take_snapshot(m, {2, 3, 4}), before);
  expect_ok(m);

  // A copy-on-write that cannot get its block changes nothing either.
  ASSERT_TRUE(m.allocate(seq_id(4), 16).has_value());  // takes all 4
  EXPECT_EQ(m.n_takeable_blocks(), 0);
  const snapshot before_cow = take_snapshot(m, {2, 3, 4});
  EXPECT_FALSE(m.can_allocate(seq_id(3), 1));
  EXPECT_FALSE(m.allocate(seq_id(3), 1).has_value());
  EXPECT_EQ(take_snapshot(m, {2, 3, 4}), before_cow);
  expect_ok(m);
}

TEST(kv_manager, the_eviction_order_is_lru_across_sequences_and_deepest_first) {
  // 8 blocks of 4 tokens. Each sequence stores 9 tokens: 2 full blocks + 1 partial.
  kv_manager m(4, 8);
  const auto pa = toks(9, 0), pb = toks(9, 100), pc = toks(9, 200);
  add_and_prefill(m, 1, pa);
  EXPECT_EQ(ids(m.block_table(seq_id(1))), (std::vector<std::int32_t>{0, 1, 2}));
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  // The partial block 2 is reused first; the chain leaves deepest first: 1, then 0.
  EXPECT_EQ(ids(m.pool().free_queue()), (std::vector<std::int32_t>{2, 3, 4, 5, 6, 7, 1, 0}));

  add_and_prefill(m, 2, pb);
  EXPECT_EQ(ids(m.block_table(seq_id(2))), (std::vector<std::int32_t>{2, 3, 4}));
  ASSERT_TRUE(m.free_sequence(seq_id(2)).ok());
  EXPECT_EQ(ids(m.pool().free_queue()), (std::vector<std::int32_t>{4, 5, 6, 7, 1, 0, 3, 2}));

  // A reuses its prefix: blocks 0 and 1 become the most recently used.
  EXPECT_EQ(add_and_prefill(m, 3, pa), 8);
  EXPECT_EQ(ids(m.block_table(seq_id(3))), (std::vector<std::int32_t>{0, 1, 4}));
  ASSERT_TRUE(m.free_sequence(seq_id(3)).ok());
  EXPECT_EQ(ids(m.pool().free_queue()), (std::vector<std::int32_t>{4, 5, 6, 7, 3, 2, 1, 0}));
  EXPECT_EQ(m.metrics().n_evictions, 0);

  // 7 blocks: 4 free ones, then B's chain (3 before 2), then A's deepest block.
  ASSERT_TRUE(m.add_sequence(seq_id(4), toks(28, 300)).ok());
  ASSERT_TRUE(m.allocate(seq_id(4), 28).has_value());
  EXPECT_EQ(ids(m.block_table(seq_id(4))), (std::vector<std::int32_t>{4, 5, 6, 7, 3, 2, 1}));
  EXPECT_EQ(m.metrics().n_evictions, 3);
  EXPECT_EQ(m.index().size(), 1u);
  EXPECT_TRUE(m.index().contains(block_id(0)));
  expect_ok(m);

  // B is gone from the cache; A keeps its first block.
  ASSERT_TRUE(m.free_sequence(seq_id(4)).ok());
  EXPECT_EQ(add_and_prefill(m, 5, pb), 0);
  EXPECT_EQ(add_and_prefill(m, 6, pa), 4);
  (void)pc;
}

TEST(kv_manager, a_block_already_cached_elsewhere_is_not_registered_twice) {
  kv_manager m(4, 16);
  const auto p = toks(9);
  // Both start before either has stored anything: no hit for the second.
  ASSERT_EQ(*m.add_sequence(seq_id(1), p), 0);
  ASSERT_EQ(*m.add_sequence(seq_id(2), p), 0);
  for (const std::int64_t s : {1, 2}) {
    ASSERT_TRUE(m.allocate(seq_id(s), 9).has_value());
    ASSERT_TRUE(m.commit(seq_id(s), p).ok());
  }
  expect_ok(m);
  EXPECT_EQ(m.index().size(), 2u);
  const auto t2 = ids(m.block_table(seq_id(2)));
  EXPECT_FALSE(m.pool().is_hashed(block_id(t2[0])));
  // Seq 2's duplicates hold nothing cacheable: released, they are free, reused first.
  ASSERT_TRUE(m.free_sequence(seq_id(2)).ok());
  const auto q = ids(m.pool().free_queue());
  EXPECT_EQ(std::vector<std::int32_t>(q.begin(), q.begin() + 3), (std::vector<std::int32_t>{t2[0], t2[1], t2[2]}));
  EXPECT_EQ(m.metrics().n_blocks_cached, 0);
  EXPECT_EQ(add_and_prefill(m, 3, p), 8);
}

TEST(kv_manager, without_prefix_caching_nothing_is_shared_or_counted) {
  kv_manager m(4, 16, false);
  EXPECT_EQ(add_and_prefill(m, 1, toks(9)), 0);
  EXPECT_EQ(add_and_prefill(m, 2, toks(9)), 0);
  EXPECT_EQ(m.index().size(), 0u);
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  const kv_metrics km = m.metrics();
  EXPECT_EQ(km.n_blocks_cached, 0);
  EXPECT_EQ(km.n_prefix_query_tokens, 0);
  EXPECT_EQ(km.n_blocks_used, 3);
}

TEST(kv_manager, quota_limits_a_tenants_used_blocks) {
  kv_manager m(4, 16);
  ASSERT_TRUE(m.set_tenant_quota("a", 3).ok());
  EXPECT_EQ(m.set_tenant_quota("a", -1).code(), errc::invalid_argument);
  const sequence_options a = of_tenant("a");
  add_and_prefill(m, 1, toks(12), a);
  ASSERT_TRUE(m.add_sequence(seq_id(2), toks(4, 900), a).ok());
  EXPECT_FALSE(m.can_allocate(seq_id(2), 1));
  EXPECT_FALSE(m.allocate(seq_id(2), 1).has_value());
  EXPECT_FALSE(decode_one(m, 1, 5).has_value());
  // Other tenants are unaffected.
  add_and_prefill(m, 3, toks(12, 500));
  // Lifting the quota lets the tenant grow.
  ASSERT_TRUE(m.set_tenant_quota("a", std::nullopt).ok());
  EXPECT_TRUE(m.allocate(seq_id(2), 1).has_value());
  const kv_metrics km = m.metrics();
  ASSERT_EQ(km.tenants.size(), 2u);
  EXPECT_EQ(km.tenants[1].name, "a");
  EXPECT_EQ(km.tenants[1].n_used_blocks, 4);
  EXPECT_EQ(km.tenants[0].n_used_blocks, 3);
  expect_ok(m);
}

TEST(kv_manager, a_tenant_at_its_quota_evicts_only_its_own_cache) {
  kv_manager m(4, 8);
  add_and_prefill(m, 1, toks(8, 0));  // default tenant: 2 blocks
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  ASSERT_TRUE(m.set_tenant_quota("a", 3).ok());
  const sequence_options a = of_tenant("a");
  add_and_prefill(m, 2, toks(12, 100), a);
  const auto a_table = ids(m.block_table(seq_id(2)));
  ASSERT_TRUE(m.free_sequence(seq_id(2)).ok());
  const tenant_id ta = *m.find_tenant("a");
  EXPECT_EQ(m.pool().n_cached(ta), 3);
  EXPECT_EQ(m.pool().n_cached(tenant_id(0)), 2);
  EXPECT_EQ(m.n_takeable_blocks(), 8);

  // Free blocks exist, but the tenant is at its quota: it pays with its own
  // deepest cached block, and the default tenant's cache is untouched.
  ASSERT_TRUE(m.add_sequence(seq_id(3), toks(4, 900), a).ok());
  ASSERT_TRUE(m.allocate(seq_id(3), 4).has_value());
  EXPECT_EQ(ids(m.block_table(seq_id(3))), (std::vector<std::int32_t>{a_table[2]}));
  EXPECT_EQ(m.pool().n_cached(tenant_id(0)), 2);
  EXPECT_EQ(m.pool().n_cached(ta), 2);
  EXPECT_EQ(m.metrics().n_evictions, 1);
  expect_ok(m);

  // Used + new beyond the quota fails even with cache to evict.
  EXPECT_EQ(m.n_blocks_needed(seq_id(3), 13), 3);
  EXPECT_FALSE(m.allocate(seq_id(3), 13).has_value());
  EXPECT_TRUE(m.allocate(seq_id(3), 12).has_value());
  EXPECT_EQ(m.pool().n_cached(tenant_id(0)), 2);
  EXPECT_EQ(m.pool().n_cached(ta), 0);
  expect_ok(m);
}

TEST(kv_manager, a_tenant_below_its_quota_evicts_the_global_lru) {
  kv_manager m(4, 4);
  add_and_prefill(m, 1, toks(16, 0));  // the whole pool, default tenant
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  EXPECT_EQ(m.metrics().n_blocks_cached, 4);
  ASSERT_TRUE(m.set_tenant_quota("b", 2).ok());
  ASSERT_TRUE(m.add_sequence(seq_id(2), toks(8, 100), of_tenant("b")).ok());
  ASSERT_TRUE(m.allocate(seq_id(2), 8).has_value());
  EXPECT_EQ(ids(m.block_table(seq_id(2))), (std::vector<std::int32_t>{3, 2}));
  EXPECT_EQ(m.metrics().n_evictions, 2);
  expect_ok(m);
}

TEST(kv_manager, lowering_a_quota_drops_cache_beyond_it) {
  kv_manager m(4, 16);
  const sequence_options a = of_tenant("a");
  add_and_prefill(m, 1, toks(16, 0), a);
  add_and_prefill(m, 2, toks(8, 100), a);
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  ASSERT_TRUE(m.set_tenant_quota("a", 3).ok());
  const tenant_id ta = *m.find_tenant("a");
  EXPECT_EQ(m.pool().n_used(ta), 2);
  EXPECT_EQ(m.pool().n_cached(ta), 1);
  EXPECT_EQ(m.metrics().n_evictions, 3);
  // What stays is the first block of seq 1's chain (the deepest leave first).
  EXPECT_EQ(*m.add_sequence(seq_id(3), toks(16, 0), a), 4);
  expect_ok(m);
}

TEST(kv_manager, metrics_count_shared_blocks_once) {
  kv_manager m(4, 16);
  add_and_prefill(m, 1, toks(10));
  kv_metrics km = m.metrics();
  EXPECT_EQ(km.n_blocks_used, 3);
  EXPECT_EQ(km.n_stored_tokens, 10);
  EXPECT_DOUBLE_EQ(km.fragmentation(), 1.0 - 10.0 / 12.0);
  EXPECT_DOUBLE_EQ(km.usage(), 3.0 / 16.0);
  ASSERT_TRUE(m.fork(seq_id(1), seq_id(2)).ok());
  km = m.metrics();
  EXPECT_EQ(km.n_stored_tokens, 10);
  EXPECT_DOUBLE_EQ(km.fragmentation(), 1.0 - 10.0 / 12.0);
  EXPECT_EQ(km.n_sequences, 2);
  ASSERT_TRUE(decode_one(m, 2, 1).has_value());  // copy (2 tokens) + 1 new
  km = m.metrics();
  EXPECT_EQ(km.n_blocks_used, 4);
  EXPECT_EQ(km.n_stored_tokens, 13);
  EXPECT_EQ(km.n_blocks_used_peak, 4);
  ASSERT_TRUE(m.preempt_sequence(seq_id(2)).ok());
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  km = m.metrics();
  EXPECT_EQ(km.n_preemptions, 1);
  EXPECT_EQ(km.n_blocks_used, 0);
  EXPECT_EQ(km.n_blocks_cached, 2);
  EXPECT_EQ(km.n_blocks_free, 14);
  EXPECT_EQ(km.n_stored_tokens, 0);
  EXPECT_DOUBLE_EQ(km.fragmentation(), 0.0);
  EXPECT_EQ(km.n_blocks_used_peak, 4);
  m.reset_peak();
  EXPECT_EQ(m.metrics().n_blocks_used_peak, 0);
  EXPECT_NE(format_kv_metrics(km).find("1 preemptions"), std::string::npos);
}

TEST(kv_manager, preempted_sequences_come_back_through_the_cache) {
  kv_manager m(4, 16);
  add_and_prefill(m, 1, toks(6));
  for (token_id t = 0; t < 5; ++t) ASSERT_TRUE(decode_one(m, 1, t).has_value());
  const std::vector<token_id> all(m.tokens(seq_id(1)).begin(), m.tokens(seq_id(1)).end());
  ASSERT_EQ(all.size(), 11u);
  ASSERT_TRUE(m.preempt_sequence(seq_id(1)).ok());
  EXPECT_EQ(add_and_prefill(m, 1, all), 8);
  EXPECT_EQ(m.metrics().n_preemptions, 1);
}

TEST(kv_manager, check_request_fits_against_pool_and_quota) {
  kv_manager m(4, 16);  // 64 token slots
  EXPECT_TRUE(m.check_request_fits(60, 4).ok());
  const status too_big = m.check_request_fits(61, 4);
  EXPECT_EQ(too_big.code(), errc::resource_exhausted);
  EXPECT_NE(too_big.message().find("17 KV blocks"), std::string::npos) << too_big.message();
  // Two completions of an 8-token prompt share its 2 full blocks: 4 + 2 blocks.
  EXPECT_TRUE(m.check_request_fits(8, 8, "", 2).ok());
  EXPECT_EQ(m.check_request_fits(8, 40, "", 2).code(), errc::resource_exhausted);  // 12 + 10 > 16
  ASSERT_TRUE(m.set_tenant_quota("t", 5).ok());
  EXPECT_EQ(m.check_request_fits(8, 16, "t").code(), errc::resource_exhausted);
  EXPECT_TRUE(m.check_request_fits(8, 12, "t").ok());
  EXPECT_EQ(m.check_request_fits(0, 4).code(), errc::invalid_argument);
}

TEST(kv_manager, evict_cached_blocks_empties_the_cache) {
  kv_manager m(4, 16);
  add_and_prefill(m, 1, toks(12));
  add_and_prefill(m, 2, toks(12, 50));
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  EXPECT_EQ(m.evict_cached_blocks(), 3);
  expect_ok(m);
  EXPECT_EQ(m.index().size(), 3u);  // seq 2's blocks are in use and stay
  EXPECT_EQ(m.metrics().n_blocks_cached, 0);
  EXPECT_EQ(add_and_prefill(m, 3, toks(12)), 0);
}

TEST(kv_manager, evict_cached_blocks_of_one_tenant_leaves_the_others) {
  kv_manager m(4, 32);
  const sequence_options a = of_tenant("a"), b = of_tenant("b");
  add_and_prefill(m, 1, toks(12), a);
  add_and_prefill(m, 2, toks(12), b);
  add_and_prefill(m, 3, toks(8, 40), a);  // still running: its blocks stay
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  ASSERT_TRUE(m.free_sequence(seq_id(2)).ok());
  EXPECT_EQ(m.evict_cached_blocks("nobody"), 0);
  EXPECT_EQ(m.evict_cached_blocks("a"), 3);
  expect_ok(m);
  EXPECT_EQ(add_and_prefill(m, 4, toks(12), a), 0) << "a's prompt is gone from the cache";
  EXPECT_EQ(add_and_prefill(m, 5, toks(12), b), 8) << "b's stays";
  EXPECT_EQ(m.metrics().n_prefix_hit_blocks, 2);
  expect_ok(m);
}

TEST(kv_manager, drop_frees_blocks_from_the_middle_and_keeps_positions) {
  kv_manager m(4, 16);
  std::vector<kv_op> ops;
  m.set_op_listener([&](const kv_op& op) { ops.push_back(op); });
  add_and_prefill(m, 1, toks(14));  // blocks 0..3, the last holding 2 slots
  const std::vector<block_id> before(m.block_table(seq_id(1)).begin(), m.block_table(seq_id(1)).end());
  const std::int32_t drop_these[] = {2, 1};
  ASSERT_TRUE(m.drop(seq_id(1), drop_these).ok());
  expect_ok(m);
  EXPECT_EQ(m.n_stored_tokens(seq_id(1)), 6);
  EXPECT_EQ(ids(m.block_table(seq_id(1))), (std::vector<std::int32_t>{before[0].value, before[3].value}));
  EXPECT_EQ(std::vector<std::int32_t>(m.positions(seq_id(1)).begin(), m.positions(seq_id(1)).end()),
            (std::vector<std::int32_t>{0, 1, 2, 3, 12, 13}));
  // The dropped blocks stay cached (they were full and keyed); nothing was copied.
  EXPECT_EQ(m.metrics().n_blocks_used, 2);
  EXPECT_EQ(m.metrics().n_blocks_cached, 2);
  // Blocks filled after a drop hold K/V computed without the dropped tokens:
  // they are never registered under the plain chain.
  ASSERT_TRUE(m.allocate(seq_id(1), 2).has_value());
  ASSERT_TRUE(m.commit(seq_id(1), toks(2, 500)).ok());
  expect_ok(m);
  EXPECT_FALSE(m.index().contains(m.block_table(seq_id(1))[1]));
  EXPECT_EQ(m.positions(seq_id(1)).back(), 15);
  // Errors change nothing: a partly filled block, a repeated index, out of range.
  ASSERT_TRUE(m.allocate(seq_id(1), 1).has_value());
  ASSERT_TRUE(m.commit(seq_id(1), toks(1, 600)).ok());
  const std::int32_t partial[] = {2};
  const std::int32_t twice[] = {0, 0};
  const std::int32_t outside[] = {-1};
  EXPECT_FALSE(m.drop(seq_id(1), partial).ok());
  EXPECT_FALSE(m.drop(seq_id(1), twice).ok());
  EXPECT_FALSE(m.drop(seq_id(1), outside).ok());
  EXPECT_FALSE(m.drop(seq_id(9), drop_these).ok());
  EXPECT_EQ(m.n_stored_tokens(seq_id(1)), 9);
  expect_ok(m);
}

TEST(kv_manager, positions_that_are_not_slot_numbers_are_never_shared) {
  kv_manager m(4, 16);
  ASSERT_TRUE(m.add_sequence(seq_id(1), toks(9)).ok());
  ASSERT_TRUE(m.allocate(seq_id(1), 8).has_value());
  const std::vector<std::int32_t> shifted = {0, 1, 2, 3, 10, 11, 12, 13};
  ASSERT_TRUE(m.commit(seq_id(1), toks(8), shifted).ok());
  expect_ok(m);
  EXPECT_TRUE(m.index().contains(m.block_table(seq_id(1))[0]));
  EXPECT_FALSE(m.index().contains(m.block_table(seq_id(1))[1]));
  // Positions must increase.
  ASSERT_TRUE(m.allocate(seq_id(1), 1).has_value());
  const token_id one[] = {108};
  const std::int32_t back[] = {13};
  EXPECT_FALSE(m.commit(seq_id(1), one, back).ok());
  EXPECT_EQ(m.n_stored_tokens(seq_id(1)), 8);
}

TEST(kv_manager, truncate_reopens_a_private_block_in_place) {
  kv_manager m(4, 16, /*enable_prefix_caching=*/false);
  std::vector<kv_op> ops;
  m.set_op_listener([&](const kv_op& op) { ops.push_back(op); });
  add_and_prefill(m, 1, toks(11));
  ASSERT_TRUE(m.allocate(seq_id(1), 6).has_value());  // slots past the stored ones, never written
  const block_id second = m.block_table(seq_id(1))[1];
  ops.clear();
  ASSERT_TRUE(m.truncate(seq_id(1), 6).ok());
  expect_ok(m);
  EXPECT_EQ(m.n_stored_tokens(seq_id(1)), 6);
  EXPECT_EQ(m.block_table(seq_id(1)).size(), 2u);
  EXPECT_EQ(m.metrics().n_stored_tokens, 6);
  // Blocks 2..4 (one partly written, two never written) went back to the
  // pool, released; block 1 reopens at slot 2.
  ASSERT_EQ(ops.size(), 4u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(ops[i].kind, kv_op_kind::release);
  EXPECT_EQ(ops[3].kind, kv_op_kind::truncate);
  EXPECT_EQ(ops[3].block, second);
  EXPECT_EQ(ops[3].n_tokens, 2);
  // Writing again goes into the same block, no copy.
  const auto a = m.allocate(seq_id(1), 1);
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->copies.empty());
  ASSERT_TRUE(m.commit(seq_id(1), toks(1, 700)).ok());
  EXPECT_EQ(m.block_table(seq_id(1))[1], second);
  EXPECT_FALSE(m.truncate(seq_id(1), 8).ok());
  EXPECT_FALSE(m.truncate(seq_id(1), -1).ok());
  expect_ok(m);
}

TEST(kv_manager, truncate_into_a_cached_block_copies_it_on_the_next_write) {
  kv_manager m(4, 16);
  std::vector<kv_op> ops;
  m.set_op_listener([&](const kv_op& op) { ops.push_back(op); });
  add_and_prefill(m, 1, toks(9));
  const block_id cached = m.block_table(seq_id(1))[1];
  ASSERT_TRUE(m.index().contains(cached));
  ops.clear();
  ASSERT_TRUE(m.truncate(seq_id(1), 6).ok());
  expect_ok(m);
  for (const kv_op& op : ops) EXPECT_NE(op.kind, kv_op_kind::truncate);  // the cached block is never reopened
  const auto a = m.allocate(seq_id(1), 1);
  ASSERT_TRUE(a.has_value());
  ASSERT_EQ(a->copies.size(), 1u);
  EXPECT_EQ(a->copies[0].src, cached);
  EXPECT_EQ(a->copies[0].n_tokens, 2);
  ASSERT_TRUE(m.commit(seq_id(1), toks(1, 800)).ok());
  expect_ok(m);
  // The original still serves the prefix to others.
  EXPECT_TRUE(m.index().contains(cached));
  EXPECT_EQ(add_and_prefill(m, 2, toks(9)), 8);
  EXPECT_EQ(m.block_table(seq_id(2))[1], cached);
}

TEST(kv_manager, evictions_are_reported_with_their_key_and_tokens) {
  kv_manager m(4, 4);
  std::vector<kv_op> evicted;
  m.set_op_listener([&](const kv_op& op) {
    if (op.kind == kv_op_kind::evict) evicted.push_back(op);
  });
  add_and_prefill(m, 1, toks(9));
  const block_id first = m.block_table(seq_id(1))[0];
  const block_key key = m.index().key_of(first);
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  EXPECT_EQ(m.evict_cached_blocks(), 2);
  ASSERT_EQ(evicted.size(), 2u);
  const auto it = std::find_if(evicted.begin(), evicted.end(), [&](const kv_op& op) { return op.block == first; });
  ASSERT_NE(it, evicted.end());
  EXPECT_EQ(it->key, key);
  EXPECT_EQ(it->parent, k_root_parent_key);
  EXPECT_EQ(it->tokens, toks(4));
  EXPECT_EQ(m.metrics().n_evictions, 2);
}

TEST(kv_manager, allocation_blocker_says_pool_or_quota) {
  kv_manager m(4, 8);
  ASSERT_TRUE(m.set_tenant_quota("t", 2).ok());
  ASSERT_TRUE(m.add_sequence(seq_id(1), toks(5), of_tenant("t")).ok());
  EXPECT_EQ(m.allocation_blocker(seq_id(1), 8), alloc_blocker::none);
  EXPECT_EQ(m.allocation_blocker(seq_id(1), 9), alloc_blocker::quota);
  ASSERT_TRUE(m.add_sequence(seq_id(2), toks(5)).ok());
  EXPECT_EQ(m.allocation_blocker(seq_id(2), 32), alloc_blocker::none);
  EXPECT_EQ(m.allocation_blocker(seq_id(2), 33), alloc_blocker::pool);
}

TEST(kv_manager, prompt_keys_and_cached_prompt_blocks) {
  kv_manager m(4, 16);
  const auto keys = m.prompt_keys(toks(9));
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9)), 0);
  add_and_prefill(m, 1, toks(9));
  EXPECT_EQ(m.index().key_of(m.block_table(seq_id(1))[0]), keys[0]);
  EXPECT_EQ(m.index().key_of(m.block_table(seq_id(1))[1]), keys[1]);
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9)), 2);
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(8)), 1);  // the last prompt token is always computed
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9), of_tenant("other")), 0);
  EXPECT_NE(m.prompt_keys(toks(9), of_tenant("other"))[0], keys[0]);
}

// --- KV classes ----------------------------------------------------------------

sequence_options with_runs(std::span<const kv_class_run> runs, std::string_view tenant = {}) {
  sequence_options o;
  o.tenant = tenant;
  o.classes = runs;
  return o;
}

std::vector<std::int32_t> classes_of(const kv_manager& m, std::int64_t id) {
  std::vector<std::int32_t> out;
  for (const block_id b : m.block_table(seq_id(id))) out.push_back(m.block_class(b));
  return out;
}

TEST(kv_manager_classes, blocks_inside_a_run_get_its_class_straddling_and_decode_blocks_get_0) {
  kv_manager m(4, std::vector<std::int32_t>{16, 8});
  EXPECT_EQ(m.n_classes(), 2);
  EXPECT_EQ(m.n_blocks(), 24);
  const kv_class_run runs[] = {{2, 13, 1}};
  add_and_prefill(m, 1, toks(16), with_runs(runs));
  // [0,4) starts outside the run, [4,8) and [8,12) lie inside, [12,16) leaves it.
  EXPECT_EQ(classes_of(m, 1), (std::vector<std::int32_t>{0, 1, 1, 0}));
  for (const block_id b : m.block_table(seq_id(1)))
    EXPECT_EQ(b.value >= 16, m.block_class(b) == 1) << b.value;  // class 1 owns ids [16, 24)
  ASSERT_TRUE(decode_one(m, 1, 7).has_value());
  EXPECT_EQ(classes_of(m, 1), (std::vector<std::int32_t>{0, 1, 1, 0, 0}));

  // Adjacent runs of one class count as one; of two classes, the block straddles.
  kv_manager m3(4, std::vector<std::int32_t>{8, 8, 8});
  const kv_class_run same[] = {{0, 6, 1}, {6, 8, 1}};
  const kv_class_run differ[] = {{0, 6, 1}, {6, 8, 2}};
  add_and_prefill(m3, 1, toks(8), with_runs(same));
  add_and_prefill(m3, 2, toks(8, 300), with_runs(differ));
  EXPECT_EQ(classes_of(m3, 1), (std::vector<std::int32_t>{1, 1}));
  EXPECT_EQ(classes_of(m3, 2), (std::vector<std::int32_t>{1, 0}));
  expect_ok(m3);
}

TEST(kv_manager_classes, chunked_prefill_classes_blocks_as_one_chunk_and_unstored_slots_take_the_next_tokens) {
  kv_manager m(4, std::vector<std::int32_t>{16, 8});
  const kv_class_run runs[] = {{0, 12, 1}};
  const auto prompt = toks(14);
  ASSERT_TRUE(m.add_sequence(seq_id(1), prompt, with_runs(runs)).ok());
  for (std::size_t done = 0; done < prompt.size(); done += 3) {
    const std::size_t n = std::min<std::size_t>(3, prompt.size() - done);
    ASSERT_TRUE(m.allocate(seq_id(1), static_cast<std::int32_t>(n)).has_value());
    ASSERT_TRUE(m.commit(seq_id(1), std::span<const token_id>(prompt).subspan(done, n)).ok());
  }
  EXPECT_EQ(classes_of(m, 1), (std::vector<std::int32_t>{1, 1, 1, 0}));

  // Stored at positions 0, 1, 2, 9 (a policy renumbered them, or skipped):
  // runs name tokens, not positions, so the next block holds tokens 4..7,
  // inside the run [0, 12), whatever their positions.
  const auto other = toks(14, 300);
  ASSERT_EQ(*m.add_sequence(seq_id(2), other, with_runs(runs)), 0);
  ASSERT_TRUE(m.allocate(seq_id(2), 4).has_value());
  const std::int32_t gap[] = {0, 1, 2, 9};
  ASSERT_TRUE(m.commit(seq_id(2), std::span<const token_id>(other).subspan(0, 4), gap).ok());
  ASSERT_TRUE(m.allocate(seq_id(2), 4).has_value());
  EXPECT_EQ(classes_of(m, 2), (std::vector<std::int32_t>{1, 1}));
  // Tokens 8..11 too; after a drop of the first block the table is shorter,
  // but the block after takes tokens 12..15, which leave the run.
  const std::int32_t more[] = {10, 11, 12, 13};
  ASSERT_TRUE(m.commit(seq_id(2), std::span<const token_id>(other).subspan(4, 4), more).ok());
  const std::int32_t first[] = {0};
  ASSERT_TRUE(m.drop(seq_id(2), first).ok());
  ASSERT_TRUE(m.allocate(seq_id(2), 4).has_value());
  EXPECT_EQ(classes_of(m, 2), (std::vector<std::int32_t>{1, 1}));  // [tokens 4..7], then 8..11
  const std::int32_t last[] = {14, 15, 16, 17};
  ASSERT_TRUE(m.commit(seq_id(2), std::span<const token_id>(other).subspan(8, 4), last).ok());
  ASSERT_TRUE(m.allocate(seq_id(2), 2).has_value());
  EXPECT_EQ(classes_of(m, 2), (std::vector<std::int32_t>{1, 1, 0}));  // tokens 12..15 leave the run
  expect_ok(m);
}

TEST(kv_manager_classes, a_full_class_blocks_allocation_even_when_another_has_room) {
  kv_manager m(4, std::vector<std::int32_t>{2, 2});
  const kv_class_run runs[] = {{0, 8, 1}};
  add_and_prefill(m, 1, toks(8), with_runs(runs));  // class 1 is full
  EXPECT_EQ(m.n_takeable_blocks(1), 0);
  EXPECT_EQ(m.n_takeable_blocks(0), 2);
  const kv_class_run first_block[] = {{0, 4, 1}};
  ASSERT_TRUE(m.add_sequence(seq_id(2), toks(5, 200), with_runs(first_block)).ok());
  EXPECT_EQ(m.n_blocks_needed(seq_id(2), 5), 2);
  EXPECT_EQ(m.allocation_blocker(seq_id(2), 5), alloc_blocker::pool);
  EXPECT_FALSE(m.can_allocate(seq_id(2), 5));
  EXPECT_FALSE(m.allocate(seq_id(2), 5).has_value());
  EXPECT_TRUE(m.block_table(seq_id(2)).empty());
  EXPECT_EQ(m.allocation_blocker(seq_id(2), 0), alloc_blocker::none);
  // Without runs the same prompt takes class-0 blocks only: it fits.
  add_and_prefill(m, 3, toks(5, 200));
  EXPECT_EQ(classes_of(m, 3), (std::vector<std::int32_t>{0, 0}));
  expect_ok(m);

  // The reverse: class 0 full, class 1 with room.
  kv_manager r(4, std::vector<std::int32_t>{2, 2});
  add_and_prefill(r, 1, toks(8));
  ASSERT_TRUE(r.add_sequence(seq_id(2), toks(1, 200)).ok());
  EXPECT_EQ(r.n_takeable_blocks(1), 2);
  EXPECT_EQ(r.allocation_blocker(seq_id(2), 1), alloc_blocker::pool);
  EXPECT_FALSE(r.allocate(seq_id(2), 1).has_value());
  add_and_prefill(r, 3, toks(4, 300), with_runs(first_block));
  EXPECT_EQ(classes_of(r, 3), (std::vector<std::int32_t>{1}));
  expect_ok(r);
}

TEST(kv_manager_classes, allocation_evicts_cached_blocks_of_its_class_only) {
  kv_manager m(4, std::vector<std::int32_t>{2, 2});
  const kv_class_run runs[] = {{0, 8, 1}};
  add_and_prefill(m, 1, toks(8));
  add_and_prefill(m, 2, toks(8, 200), with_runs(runs));
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  ASSERT_TRUE(m.free_sequence(seq_id(2)).ok());
  EXPECT_EQ(m.metrics().n_blocks_cached, 4);
  // The class-0 cache is older, but a class-1 prompt evicts class-1 blocks.
  add_and_prefill(m, 3, toks(8, 400), with_runs(runs));
  EXPECT_EQ(m.metrics().n_evictions, 2);
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9)), 2);
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9, 200), with_runs(runs)), 0);
  expect_ok(m);
}

TEST(kv_manager_classes, copy_on_write_copies_into_a_block_of_the_same_class) {
  kv_manager m(4, std::vector<std::int32_t>{4, 3});
  const kv_class_run runs[] = {{0, 8, 1}};
  add_and_prefill(m, 1, toks(8), with_runs(runs));
  ASSERT_TRUE(m.fork(seq_id(1), seq_id(2)).ok());
  ASSERT_TRUE(m.truncate(seq_id(2), 6).ok());  // block 1 is shared and partly kept
  const block_id shared = m.block_table(seq_id(2))[1];
  const auto a = decode_one(m, 2, 9);
  ASSERT_TRUE(a.has_value());
  ASSERT_EQ(a->copies.size(), 1u);
  EXPECT_EQ(a->copies[0].src, shared);
  EXPECT_EQ(m.block_class(a->copies[0].dst), 1);
  EXPECT_EQ(classes_of(m, 2), (std::vector<std::int32_t>{1, 1}));

  // With class 1 out of blocks, the copy waits, though class 0 has room.
  ASSERT_TRUE(m.fork(seq_id(1), seq_id(3)).ok());
  ASSERT_TRUE(m.truncate(seq_id(3), 5).ok());
  EXPECT_EQ(m.n_takeable_blocks(1), 0);
  EXPECT_EQ(m.allocation_blocker(seq_id(3), 1), alloc_blocker::pool);
  EXPECT_FALSE(m.allocate(seq_id(3), 1).has_value());
  expect_ok(m);
}

TEST(kv_manager_classes, compaction_replaces_shared_blocks_by_blocks_of_their_class) {
  kv_manager m(4, std::vector<std::int32_t>{4, 4});
  const kv_class_run runs[] = {{0, 8, 1}};
  const auto prompt = toks(8);
  add_and_prefill(m, 1, prompt, with_runs(runs));
  ASSERT_TRUE(m.fork(seq_id(1), seq_id(2)).ok());
  // Keep slots 0, 1, 3, 4, 5, 6: slots [2, 6) are rewritten, in both shared blocks.
  kv_compaction c;
  c.first = 2;
  c.n_slots = 6;
  c.gather = std::make_shared<kv_gather>();
  for (const std::int32_t slot : {3, 4, 5, 6}) {
    c.tokens.push_back(prompt[static_cast<std::size_t>(slot)]);
    c.positions.push_back(slot);
    c.gather->sources.push_back(slot);
  }
  ASSERT_TRUE(m.compact(seq_id(2), c).ok());
  ASSERT_EQ(m.block_table(seq_id(2)).size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) EXPECT_NE(m.block_table(seq_id(2))[i], m.block_table(seq_id(1))[i]);
  EXPECT_EQ(classes_of(m, 2), (std::vector<std::int32_t>{1, 1}));
  expect_ok(m);
}

TEST(kv_manager_classes, prefix_keys_carry_the_class) {
  kv_manager m(4, std::vector<std::int32_t>{16, 8});
  const kv_class_run all[] = {{0, 8, 1}};
  const kv_class_run second[] = {{4, 8, 1}};
  const kv_class_run first[] = {{0, 4, 1}};
  const auto plain = m.prompt_keys(toks(9));
  const auto keys_all = m.prompt_keys(toks(9), with_runs(all));
  const auto keys_second = m.prompt_keys(toks(9), with_runs(second));
  ASSERT_EQ(plain.size(), 2u);
  EXPECT_NE(keys_all[0], plain[0]);
  EXPECT_NE(keys_all[1], plain[1]);
  EXPECT_EQ(keys_second[0], plain[0]);  // block 0 is of class 0 in both
  EXPECT_NE(keys_second[1], plain[1]);

  add_and_prefill(m, 1, toks(9), with_runs(all));
  EXPECT_EQ(m.index().key_of(m.block_table(seq_id(1))[0]), keys_all[0]);
  EXPECT_EQ(m.index().key_of(m.block_table(seq_id(1))[1]), keys_all[1]);
  // The same tokens without the class do not share; with the same runs they do.
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9)), 0);
  EXPECT_EQ(add_and_prefill(m, 2, toks(9)), 0);
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9), with_runs(all)), 2);
  EXPECT_EQ(add_and_prefill(m, 3, toks(9), with_runs(all)), 8);
  EXPECT_EQ(ids(m.block_table(seq_id(3))).front(), ids(m.block_table(seq_id(1))).front());
  // Class 1 only over block 0: block 0 hits, block 1 (class 0 for it) does not.
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9), with_runs(first)), 1);
  EXPECT_EQ(add_and_prefill(m, 4, toks(9), with_runs(first)), 4);
  // And the reverse: a class-0 cache serves no class-1 prompt.
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9, 500), with_runs(all)), 0);
  add_and_prefill(m, 5, toks(9, 500));
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9, 500), with_runs(all)), 0);
  EXPECT_EQ(m.n_cached_prompt_blocks(toks(9, 500)), 2);
}

TEST(kv_manager_classes, bad_class_runs_are_refused) {
  kv_manager m(4, std::vector<std::int32_t>{8, 8});
  const kv_class_run no_such_class[] = {{0, 4, 2}};
  const kv_class_run overlap[] = {{0, 4, 1}, {3, 6, 1}};
  const kv_class_run unsorted[] = {{4, 6, 1}, {0, 2, 1}};
  const kv_class_run empty[] = {{3, 3, 1}};
  const kv_class_run past_the_prompt[] = {{0, 9, 1}};
  for (const auto runs : {std::span<const kv_class_run>(no_such_class), std::span<const kv_class_run>(overlap),
                          std::span<const kv_class_run>(unsorted), std::span<const kv_class_run>(empty),
                          std::span<const kv_class_run>(past_the_prompt)}) {
    const auto r = m.add_sequence(seq_id(1), toks(8), with_runs(runs));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code(), errc::invalid_argument) << r.error().message();
    EXPECT_EQ(m.check_request_fits(8, 4, "", 1, runs).code(), errc::invalid_argument);
    EXPECT_EQ(m.n_cached_prompt_blocks(toks(8), with_runs(runs)), 0);
  }
  EXPECT_FALSE(m.contains(seq_id(1)));
  // A single-class manager knows class 0 only.
  kv_manager one(4, 8);
  const kv_class_run class1[] = {{0, 4, 1}};
  EXPECT_EQ(one.add_sequence(seq_id(1), toks(8), with_runs(class1)).error().code(), errc::invalid_argument);
  expect_ok(m);
}

TEST(kv_manager_classes, check_request_fits_counts_each_class_against_its_blocks) {
  kv_manager m(4, std::vector<std::int32_t>{8, 2});
  const kv_class_run twelve[] = {{0, 12, 1}};
  const kv_class_run eight[] = {{0, 8, 1}};
  const status too_big = m.check_request_fits(12, 4, "", 1, twelve);
  EXPECT_EQ(too_big.code(), errc::resource_exhausted);
  EXPECT_NE(too_big.message().find("3 KV blocks of class 1"), std::string::npos) << too_big.message();
  EXPECT_NE(too_big.message().find("2 blocks of class 1"), std::string::npos) << too_big.message();
  EXPECT_TRUE(m.check_request_fits(12, 4, "", 1, eight).ok());
  // 40 slots in all, but only 32 of class 0.
  const status class0 = m.check_request_fits(36, 4);
  EXPECT_EQ(class0.code(), errc::resource_exhausted);
  EXPECT_NE(class0.message().find("of class 0"), std::string::npos) << class0.message();
  EXPECT_TRUE(m.check_request_fits(28, 4).ok());
  // Two completions share the two full class-1 blocks; each has its own class-0 block.
  EXPECT_TRUE(m.check_request_fits(8, 4, "", 2, eight).ok());
  EXPECT_TRUE(m.check_request_fits(8, 16, "", 2, eight).ok());   // 2 x 4 class-0 blocks
  EXPECT_FALSE(m.check_request_fits(8, 20, "", 2, eight).ok());  // 2 x 5 class-0 blocks > 8
}

TEST(kv_manager_classes, fork_copies_the_class_runs) {
  kv_manager m(4, std::vector<std::int32_t>{8, 8});
  const kv_class_run runs[] = {{0, 12, 1}};
  const auto prompt = toks(13);
  ASSERT_TRUE(m.add_sequence(seq_id(1), prompt, with_runs(runs)).ok());
  ASSERT_TRUE(m.allocate(seq_id(1), 4).has_value());
  ASSERT_TRUE(m.commit(seq_id(1), std::span<const token_id>(prompt).subspan(0, 4)).ok());
  ASSERT_TRUE(m.fork(seq_id(1), seq_id(2)).ok());
  ASSERT_TRUE(m.allocate(seq_id(2), 9).has_value());
  EXPECT_EQ(classes_of(m, 2), (std::vector<std::int32_t>{1, 1, 1, 0}));
  expect_ok(m);
}

TEST(kv_manager_classes, quotas_count_every_class_and_evict_own_cache_of_any_class) {
  kv_manager m(4, std::vector<std::int32_t>{4, 4});
  ASSERT_TRUE(m.set_tenant_quota("t", 3).ok());
  const kv_class_run runs[] = {{0, 8, 1}};
  add_and_prefill(m, 1, toks(9), with_runs(runs, "t"));  // 2 class-1 blocks + 1 class-0 block
  EXPECT_EQ(classes_of(m, 1), (std::vector<std::int32_t>{1, 1, 0}));
  ASSERT_TRUE(m.add_sequence(seq_id(2), toks(1, 300), of_tenant("t")).ok());
  EXPECT_EQ(m.allocation_blocker(seq_id(2), 1), alloc_blocker::quota);
  ASSERT_TRUE(m.free_sequence(seq_id(2)).ok());
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  EXPECT_EQ(m.pool().n_cached(m.tenant("t")), 2);  // its two class-1 blocks

  // Three class-0 blocks at a quota of 3: its class-1 cache has to go.
  add_and_prefill(m, 3, toks(12, 500), of_tenant("t"));
  EXPECT_EQ(m.pool().n_used(m.tenant("t")), 3);
  EXPECT_EQ(m.pool().n_cached(m.tenant("t")), 0);
  EXPECT_EQ(m.metrics().n_evictions, 2);
  expect_ok(m);
}

TEST(kv_manager_classes, metrics_report_each_class) {
  kv_manager m(4, std::vector<std::int32_t>{4, 2});
  const kv_class_run runs[] = {{0, 4, 1}};
  add_and_prefill(m, 1, toks(9), with_runs(runs));
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  const kv_class_run three[] = {{0, 3, 1}};
  add_and_prefill(m, 2, toks(3, 300), with_runs(three));  // a block the run does not fill: class 0
  const kv_metrics km = m.metrics();
  ASSERT_EQ(km.classes.size(), 2u);
  EXPECT_EQ(km.classes[0].n_blocks, 4);
  EXPECT_EQ(km.classes[0].n_used, 1);
  EXPECT_EQ(km.classes[0].n_cached, 1);
  EXPECT_EQ(km.classes[0].n_free, 2);
  EXPECT_EQ(km.classes[1].n_blocks, 2);
  EXPECT_EQ(km.classes[1].n_used, 0);
  EXPECT_EQ(km.classes[1].n_cached, 1);
  EXPECT_EQ(km.classes[1].n_free, 1);
  EXPECT_EQ(km.n_blocks_used, 1);
  EXPECT_EQ(km.n_blocks_cached, 2);
  EXPECT_NE(format_kv_metrics(km).find("class 1 0/2 used 1 cached"), std::string::npos) << format_kv_metrics(km);

  kv_manager one(4, 8);
  ASSERT_EQ(one.metrics().classes.size(), 1u);
  EXPECT_EQ(one.metrics().classes[0].n_blocks, 8);
  EXPECT_EQ(format_kv_metrics(one.metrics()).find("class"), std::string::npos);
}

}  // namespace
}  // namespace pagoda

namespace pagoda {
namespace {

// A full-attention group of full_blocks and a sliding window of window_tokens
// over window_blocks (Gemma's layers, kv_group.h), class_count classes each.
kv_manager window_manager(std::int32_t full_blocks, std::int32_t window_blocks, std::int32_t window_tokens,
                          std::int32_t class_count = 1) {
  kv_group_config full, window;
  full.class_blocks.assign(static_cast<std::size_t>(class_count), full_blocks);
  window.kind = kv_group_kind::sliding_window;
  window.window_tokens = window_tokens;
  window.class_blocks.assign(static_cast<std::size_t>(class_count), window_blocks);
  return kv_manager(4, std::vector<kv_group_config>{full, window});
}

std::int32_t n_null(std::span<const block_id> table) {
  return static_cast<std::int32_t>(std::count_if(table.begin(), table.end(), [](block_id b) { return !b.valid(); }));
}

// A sliding-window group: a sequence holds the blocks its next query reads,
// the ones the window moved past become NULL and stay cached in the group's
// pool for prefix hits, and a cached prefix needs only the blocks of its
// first query's window. The full group keeps every block.
TEST(kv_manager_window, blocks_follow_the_window_and_stay_cached) {
  kv_manager m = window_manager(32, 6, /*window_tokens=*/6);
  ASSERT_EQ(m.n_groups(), 2);
  EXPECT_TRUE(m.has_sliding_window());
  const seq_id a(1);
  add_and_prefill(m, 1, toks(10));  // 3 blocks in each group
  EXPECT_EQ(m.metrics().groups[1].n_used, 3);
  // The next query at position 10 sees positions 5..10: block 0 (0..3) is out.
  EXPECT_EQ(*m.release_window(a, 10), 1);
  expect_ok(m);
  EXPECT_EQ(n_null(m.block_table(a, 1)), 1);
  EXPECT_EQ(n_null(m.block_table(a, 0)), 0);
  EXPECT_EQ(m.metrics().groups[1].n_used, 2);
  EXPECT_EQ(m.metrics().groups[1].n_cached, 1);  // block 0's K/V stay for the prefix cache
  for (int i = 10; i < 20; ++i) {
    ASSERT_TRUE(m.allocate(a, 1).has_value());
    const token_id t[] = {static_cast<token_id>(100 + i)};
    ASSERT_TRUE(m.commit(a, t).ok());
    ASSERT_TRUE(m.release_window(a, i + 1).ok());
    expect_ok(m);
    EXPECT_LE(m.metrics().groups[1].n_used, 3);
  }
  EXPECT_EQ(m.metrics().groups[1].n_used, 2);    // blocks 3 and 4 (positions 12..19)
  EXPECT_EQ(m.metrics().groups[1].n_cached, 3);  // blocks 0..2, nothing taken from them
  EXPECT_EQ(m.metrics().groups[1].n_freed_out_of_window, 3);
  EXPECT_EQ(m.metrics().groups[0].n_used, 5);
  // Rolling back past the window given up is refused; within it, allowed.
  EXPECT_EQ(m.truncate(a, 8).code(), errc::out_of_range);
  ASSERT_TRUE(m.truncate(a, 18).ok());
  expect_ok(m);
  ASSERT_TRUE(m.free_sequence(a).ok());
  expect_ok(m);
  EXPECT_EQ(m.metrics().groups[1].n_used, 0);

  // The same 20 tokens again: the full group holds all 5 blocks and a query at
  // 20 needs positions 15..20, blocks 3 and 4 of the window, which are cached:
  // all are used, and the window table holds only those two.
  std::vector<token_id> again = toks(20);
  again.push_back(7);
  const auto hit = m.add_sequence(seq_id(2), again);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(*hit, 20);
  expect_ok(m);
  EXPECT_EQ(n_null(m.block_table(seq_id(2), 1)), 3);
  EXPECT_EQ(m.metrics().groups[1].n_used, 2);
  ASSERT_TRUE(m.free_sequence(seq_id(2)).ok());
  expect_ok(m);
}

TEST(kv_manager_window, a_prefix_whose_window_was_evicted_is_cut_and_allocation_waits_for_the_window) {
  kv_manager m = window_manager(32, 3, /*window_tokens=*/4);
  add_and_prefill(m, 1, toks(8));  // blocks 0, 1
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());  // both cached in both groups
  // Another sequence takes all three window blocks: the cached 0 and 1 are evicted from the window group.
  add_and_prefill(m, 2, toks(12, 500));
  EXPECT_EQ(m.metrics().groups[1].n_used, 3);
  EXPECT_EQ(m.metrics().groups[1].n_evictions, 2);
  // A fourth block has no window block to take: allocation fails as if the pool were full.
  EXPECT_FALSE(m.can_allocate(seq_id(2), 1));
  EXPECT_EQ(m.allocation_blocker(seq_id(2), 1), alloc_blocker::pool);
  EXPECT_NE(m.short_classes(seq_id(2), 1) & (std::uint64_t{1} << k_max_kv_classes), 0u);  // group 1, class 0
  EXPECT_FALSE(m.allocate(seq_id(2), 1).has_value());
  EXPECT_EQ(*m.release_window(seq_id(2), 12), 2);  // blocks 0, 1 of seq 2 (positions 0..7) are out
  EXPECT_TRUE(m.can_allocate(seq_id(2), 1));
  ASSERT_TRUE(m.free_sequence(seq_id(2)).ok());
  // The first prompt's window blocks are gone: a query at 8 needs block 1
  // (positions 5..8), so no cached block can be used, though the full group has both.
  std::vector<token_id> p = toks(8);
  p.push_back(1);
  EXPECT_EQ(m.n_cached_prompt_blocks(p), 0);
  const auto hit = m.add_sequence(seq_id(3), p);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(*hit, 0);
  expect_ok(m);
  // Computing the prompt again caches its window blocks: the next request hits.
  std::vector<token_id> stored(p.begin(), p.end() - 1);
  ASSERT_TRUE(m.allocate(seq_id(3), 8).has_value());
  ASSERT_TRUE(m.commit(seq_id(3), stored).ok());
  expect_ok(m);
  EXPECT_EQ(m.n_cached_prompt_blocks(p), 2);
}

// Token-granular compaction on a sliding window: the full group's table is
// rewritten as before; the window group rewrites only the blocks the next
// query reads, the others become NULL, and each group gets its own gather.
TEST(kv_manager_window, compaction_rewrites_each_group_and_the_window_keeps_only_its_blocks) {
  kv_manager m = window_manager(32, 12, /*window_tokens=*/6);
  std::vector<kv_op> ops;
  m.set_op_listener([&](const kv_op& op) { ops.push_back(op); });
  const seq_id a(1);
  add_and_prefill(m, 1, toks(24));  // 6 blocks
  ASSERT_TRUE(m.release_window(a, 24).ok());
  expect_ok(m);
  ops.clear();
  // Keep 2 sinks and the last 10 tokens: slots [2, 12) from slots 14..23.
  kv_compaction c;
  c.first = 2;
  c.n_slots = 12;
  c.gather = std::make_shared<kv_gather>();
  for (int i = 0; i < 10; ++i) {
    c.tokens.push_back(100 + 14 + i);
    c.positions.push_back(14 + i);
    c.gather->sources.push_back(14 + i);
  }
  ASSERT_TRUE(m.compact(a, c).ok());
  expect_ok(m);
  EXPECT_EQ(m.n_stored_tokens(a), 12);
  EXPECT_EQ(m.block_table(a, 0).size(), 3u);
  // The next query at 24 reads positions 19..24: slots 7..11, blocks 1 and 2.
  EXPECT_EQ(n_null(m.block_table(a, 1)), 1);
  int gathers[2] = {0, 0};
  for (const kv_op& op : ops) {
    if (op.kind != kv_op_kind::gather) continue;
    ++gathers[op.group];
    EXPECT_EQ(op.gather->group, op.group);
    EXPECT_EQ(op.gather->dst_table, std::vector<block_id>(m.block_table(a, op.group).begin(), m.block_table(a, op.group).end()));
    if (op.group == 1) {
      EXPECT_EQ(op.gather->first, 4);  // block 0 is not the window's
      // Slot 4 (position 16) is out of the next query's window; its source
      // block (slot 16, block 4) is still held, the ones before are NULL.
      for (const std::int32_t src : op.gather->sources) EXPECT_TRUE(src == -1 || src >= 16) << src;
    }
  }
  EXPECT_EQ(gathers[0], 1);
  EXPECT_EQ(gathers[1], 1);
  ASSERT_TRUE(m.free_sequence(a).ok());
  expect_ok(m);
  EXPECT_EQ(m.metrics().groups[0].n_used + m.metrics().groups[1].n_used, 0);
}

// Every group has the pool's classes, and the blocks at one table index are
// of one class in every group: a typed prompt's window blocks are typed too.
TEST(kv_manager_window, typed_runs_take_the_same_class_in_every_group) {
  kv_manager m = window_manager(16, 8, /*window_tokens=*/8, /*class_count=*/2);
  const kv_class_run runs[] = {{0, 8, 1}};
  sequence_options o;
  o.classes = runs;
  add_and_prefill(m, 1, toks(13), o);
  for (std::int32_t g = 0; g < 2; ++g) {
    const auto table = m.block_table(seq_id(1), g);
    ASSERT_EQ(table.size(), 4u);
    EXPECT_EQ(m.block_class(table[0]), 1) << g;
    EXPECT_EQ(m.block_class(table[1]), 1) << g;
    EXPECT_EQ(m.block_class(table[2]), 0) << g;
    EXPECT_EQ(m.group_of(table[0]), g);
  }
  ASSERT_TRUE(m.free_sequence(seq_id(1)).ok());
  expect_ok(m);
}

}  // namespace
}  // namespace pagoda
