#include "kv/block_pool.h"

#include <algorithm>
#include <deque>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace pagoda {
namespace {

const tenant_id k_t0(0);
const tenant_id k_t1(1);

std::vector<std::int32_t> ids(const std::vector<block_id>& v) {
  std::vector<std::int32_t> out;
  for (const block_id b : v) out.push_back(b.value);
  return out;
}

std::vector<std::int32_t> queue_of(const block_pool& p) { return ids(p.free_queue()); }

void expect_counts(const block_pool& p, std::int32_t used, std::int32_t cached, std::int32_t free) {
  EXPECT_EQ(p.n_used(), used);
  EXPECT_EQ(p.n_cached(), cached);
  EXPECT_EQ(p.n_free(), free);
  EXPECT_EQ(p.n_used() + p.n_cached() + p.n_free(), p.n_blocks());
  const status st = p.check_invariants();
  EXPECT_TRUE(st.ok()) << st.message();
}

TEST(block_pool, starts_all_free_in_id_order) {
  block_pool p(5);
  EXPECT_EQ(p.n_blocks(), 5);
  EXPECT_EQ(p.n_takeable(), 5);
  EXPECT_EQ(queue_of(p), (std::vector<std::int32_t>{0, 1, 2, 3, 4}));
  expect_counts(p, 0, 0, 5);
}

TEST(block_pool, empty_pool_takes_nothing) {
  block_pool p(0);
  EXPECT_FALSE(p.take(k_t0).has_value());
  expect_counts(p, 0, 0, 0);
}

TEST(block_pool, take_pops_head_until_empty) {
  block_pool p(3);
  for (std::int32_t i = 0; i < 3; ++i) {
    const auto t = p.take(k_t0);
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->id.value, i);
    EXPECT_FALSE(t->evicted);
    EXPECT_EQ(p.ref_count(t->id), 1);
    EXPECT_EQ(p.owner(t->id), k_t0);
  }
  EXPECT_FALSE(p.take(k_t0).has_value());
  expect_counts(p, 3, 0, 0);
}

TEST(block_pool, released_unhashed_blocks_are_reused_before_cached_ones) {
  block_pool p(4);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(p.take(k_t0).has_value());
  p.set_hashed(block_id(0));
  p.set_hashed(block_id(1));
  p.unref(block_id(0));  // cached -> tail
  p.unref(block_id(2));  // free -> head
  p.unref(block_id(1));  // cached -> tail
  p.unref(block_id(3));  // free -> head
  EXPECT_EQ(queue_of(p), (std::vector<std::int32_t>{3, 2, 0, 1}));
  expect_counts(p, 0, 2, 2);

  // Free blocks first, then cached ones in release order, each an eviction.
  std::vector<std::int32_t> order;
  std::vector<bool> evicted;
  while (const auto t = p.take(k_t1)) {
    order.push_back(t->id.value);
    evicted.push_back(t->evicted);
  }
  EXPECT_EQ(order, (std::vector<std::int32_t>{3, 2, 0, 1}));
  EXPECT_EQ(evicted, (std::vector<bool>{false, false, true, true}));
  EXPECT_FALSE(p.is_hashed(block_id(0)));
  EXPECT_EQ(p.owner(block_id(0)), k_t1);
  expect_counts(p, 4, 0, 0);
}

TEST(block_pool, ref_on_cached_block_is_a_hit_that_leaves_the_queue) {
  block_pool p(3);
  const block_id b = p.take(k_t0)->id;
  p.set_hashed(b);
  p.unref(b);
  EXPECT_TRUE(p.in_free_queue(b));
  expect_counts(p, 0, 1, 2);

  p.ref(b);
  EXPECT_EQ(p.ref_count(b), 1);
  EXPECT_TRUE(p.is_hashed(b));
  EXPECT_FALSE(p.in_free_queue(b));
  EXPECT_EQ(queue_of(p), (std::vector<std::int32_t>{1, 2}));
  expect_counts(p, 1, 0, 2);

  p.ref(b);
  EXPECT_EQ(p.ref_count(b), 2);
  p.unref(b);
  EXPECT_FALSE(p.in_free_queue(b));
  p.unref(b);
  EXPECT_EQ(queue_of(p), (std::vector<std::int32_t>{1, 2, 0}));
  expect_counts(p, 0, 1, 2);
}

TEST(block_pool, take_cached_of_takes_only_that_owners_lru_block) {
  block_pool p(6);
  std::vector<block_id> b;
  for (int i = 0; i < 6; ++i) b.push_back(p.take(i < 3 ? k_t0 : k_t1)->id);
  for (const block_id x : b) p.set_hashed(x);
  // Release order: 3 (t1), 0 (t0), 4 (t1), 1 (t0); 2 and 5 stay used.
  for (const int i : {3, 0, 4, 1}) p.unref(b[static_cast<std::size_t>(i)]);
  EXPECT_EQ(ids(p.cached_of(k_t0)), (std::vector<std::int32_t>{0, 1}));
  EXPECT_EQ(ids(p.cached_of(k_t1)), (std::vector<std::int32_t>{3, 4}));
  EXPECT_EQ(p.n_used(k_t0), 1);
  EXPECT_EQ(p.n_cached(k_t1), 2);

  const auto t = p.take_cached_of(k_t0);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->id.value, 0);
  EXPECT_TRUE(t->evicted);
  EXPECT_EQ(ids(p.cached_of(k_t1)), (std::vector<std::int32_t>{3, 4}));
  EXPECT_EQ(queue_of(p), (std::vector<std::int32_t>{3, 4, 1}));
  EXPECT_EQ(p.take_cached_of(k_t0)->id.value, 1);
  EXPECT_FALSE(p.take_cached_of(k_t0).has_value());
  EXPECT_FALSE(p.take_cached_of(tenant_id(7)).has_value());
  EXPECT_EQ(p.n_used(k_t0), 3);
  EXPECT_EQ(p.n_cached(k_t0), 0);
  expect_counts(p, 4, 2, 0);
}

// A hot chain of 3 blocks (root first) computed once and hit `hits` times,
// released deepest first each time as kv_manager does; then a scan of
// `scan` one-off blocks (taken, hashed, released once) through a pool of 8.
// Returns the chain's ids; evicted: the blocks the scan's takes evicted.
std::vector<block_id> hot_chain_then_scan(block_pool& p, int hits, int scan, std::vector<block_id>& evicted) {
  std::vector<block_id> chain;
  for (int i = 0; i < 3; ++i) chain.push_back(p.take(k_t0)->id);
  for (const block_id b : chain) p.set_hashed(b);
  for (int h = 0; h <= hits; ++h) {
    if (h > 0)
      for (const block_id b : chain) p.ref(b);  // a prefix hit: root to leaf
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) p.unref(*it);
  }
  for (int i = 0; i < scan; ++i) {
    const auto t = p.take(k_t0);
    EXPECT_TRUE(t.has_value());
    if (!t) break;
    if (t->evicted) evicted.push_back(t->id);
    p.set_hashed(t->id);
    p.unref(t->id);
  }
  return chain;
}

TEST(block_pool, a_hot_prefix_survives_a_scan_that_lru_loses) {
  // 5 blocks besides the chain are free; the scan is 12 blocks long.
  block_pool lru(8, cache_eviction::lru);
  std::vector<block_id> evicted;
  auto chain = hot_chain_then_scan(lru, 3, 12, evicted);
  // LRU evicts the chain (leaf first) before the scan's own blocks.
  ASSERT_EQ(evicted.size(), 7u);
  EXPECT_EQ(std::vector<block_id>(evicted.begin(), evicted.begin() + 3),
            (std::vector<block_id>{chain[2], chain[1], chain[0]}));
  expect_counts(lru, 0, 8, 0);

  block_pool lfu(8, cache_eviction::lfu);
  evicted.clear();
  chain = hot_chain_then_scan(lfu, 3, 12, evicted);
  EXPECT_EQ(evicted.size(), 7u);
  for (const block_id b : chain) {
    EXPECT_EQ(std::count(evicted.begin(), evicted.end(), b), 0) << "lfu evicted " << b.value;
    EXPECT_TRUE(lfu.is_hashed(b));
    EXPECT_EQ(lfu.uses(b), 3);
    EXPECT_EQ(lfu.eviction_key(b), 2);  // level floor(log2(1 + 3)) over clock 0
  }
  EXPECT_EQ(lfu.clock(0), 0);  // the scan passed through level 0
  expect_counts(lfu, 0, 8, 0);
}

TEST(block_pool, chains_leave_deepest_first_under_both_orders) {
  for (const cache_eviction e : {cache_eviction::lru, cache_eviction::lfu}) {
    SCOPED_TRACE(cache_eviction_name(e));
    block_pool p(8, e);
    std::vector<block_id> evicted;
    const auto chain = hot_chain_then_scan(p, 3, 5, evicted);  // fills the free blocks, evicts nothing
    EXPECT_TRUE(evicted.empty());
    // Hold the five scan blocks: the next takes must evict the chain, leaf first.
    std::vector<block_id> held;
    for (const block_id b : p.cached_of(k_t0))
      if (std::find(chain.begin(), chain.end(), b) == chain.end()) held.push_back(b);
    for (const block_id b : held) p.ref(b);
    for (int i = 2; i >= 0; --i) {
      const auto t = p.take(k_t1);
      ASSERT_TRUE(t.has_value());
      EXPECT_TRUE(t->evicted);
      EXPECT_EQ(t->id, chain[static_cast<std::size_t>(i)]);
    }
    if (e == cache_eviction::lfu) {
      EXPECT_EQ(p.clock(0), 2);  // the clock moved up to the chain's key
    }
    expect_counts(p, 8, 0, 0);
  }
}

TEST(block_pool, lfu_take_cached_of_takes_the_owners_least_worth_block) {
  block_pool p(6, cache_eviction::lfu);
  std::vector<block_id> b;
  for (int i = 0; i < 6; ++i) b.push_back(p.take(i < 4 ? k_t0 : k_t1)->id);
  for (const block_id x : b) p.set_hashed(x);
  // t0: block 0 hit 3 times (level 2), block 1 once (level 1), blocks 2 and 3
  // never (level 0); t1's blocks never. Released 0, 1, 4, 2, 3, 5.
  for (int h = 0; h < 3; ++h) p.ref(b[0]);
  p.ref(b[1]);
  for (const int i : {0, 0, 0, 0}) p.unref(b[static_cast<std::size_t>(i)]);
  for (const int i : {1, 1, 4, 2, 3, 5}) p.unref(b[static_cast<std::size_t>(i)]);
  EXPECT_EQ(ids(p.cached_of(k_t0)), (std::vector<std::int32_t>{2, 3, 1, 0}));
  EXPECT_EQ(ids(p.free_queue()), (std::vector<std::int32_t>{4, 2, 3, 5, 1, 0}));
  EXPECT_EQ(p.next_cached_of(k_t0), block_id(2));
  EXPECT_EQ(p.take_cached_of(k_t0)->id.value, 2);
  EXPECT_EQ(p.take_cached_of(k_t0)->id.value, 3);
  EXPECT_EQ(p.take_cached_of(k_t0)->id.value, 1);
  EXPECT_EQ(p.next_cached_of(k_t0), block_id(0));
  EXPECT_EQ(p.take_cached_of(k_t0)->id.value, 0);
  EXPECT_FALSE(p.take_cached_of(k_t0).has_value());
  EXPECT_EQ(p.clock(0), 0);  // an owner paying with its own cache leaves the clock alone
  EXPECT_EQ(ids(p.cached_of(k_t1)), (std::vector<std::int32_t>{4, 5}));
  expect_counts(p, 4, 2, 0);
}

TEST(block_pool, eviction_names_parse_back) {
  for (const cache_eviction e : {cache_eviction::lru, cache_eviction::lfu})
    EXPECT_EQ(parse_cache_eviction(cache_eviction_name(e)), e);
  EXPECT_FALSE(parse_cache_eviction("arc").has_value());
  EXPECT_FALSE(parse_cache_eviction("").has_value());
}

TEST(block_pool, drop_hash_turns_a_cached_block_free_at_the_head) {
  block_pool p(3);
  const block_id a = p.take(k_t0)->id;
  const block_id b = p.take(k_t0)->id;
  p.set_hashed(a);
  p.set_hashed(b);
  p.unref(a);
  p.unref(b);
  EXPECT_EQ(queue_of(p), (std::vector<std::int32_t>{2, 0, 1}));
  p.drop_hash(b);
  EXPECT_EQ(queue_of(p), (std::vector<std::int32_t>{1, 2, 0}));
  EXPECT_FALSE(p.is_hashed(b));
  EXPECT_FALSE(p.owner(b).valid());
  EXPECT_EQ(p.next_cached_of(k_t0), a);
  expect_counts(p, 0, 1, 2);
}

TEST(block_pool, classes_own_contiguous_id_ranges) {
  block_pool p(std::vector<std::int32_t>{3, 2, 0, 4});
  EXPECT_EQ(p.n_classes(), 4);
  EXPECT_EQ(p.n_blocks(), 9);
  EXPECT_EQ(p.n_takeable(), 9);
  const std::int32_t first[] = {0, 3, 5, 5}, size[] = {3, 2, 0, 4};
  for (std::int32_t c = 0; c < 4; ++c) {
    EXPECT_EQ(p.class_first(c), first[c]);
    EXPECT_EQ(p.class_size(c), size[c]);
    EXPECT_EQ(p.n_takeable(c), size[c]);
    EXPECT_EQ(p.n_free_in(c), size[c]);
    for (std::int32_t i = first[c]; i < first[c] + size[c]; ++i) EXPECT_EQ(p.class_of(block_id(i)), c);
  }
  EXPECT_EQ(ids(p.free_queue(1)), (std::vector<std::int32_t>{3, 4}));
  EXPECT_TRUE(p.free_queue(2).empty());
  EXPECT_EQ(queue_of(p), (std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  expect_counts(p, 0, 0, 9);
}

TEST(block_pool, one_size_is_one_class) {
  block_pool p(4);
  EXPECT_EQ(p.n_classes(), 1);
  EXPECT_EQ(p.class_size(0), 4);
  EXPECT_EQ(p.class_of(block_id(3)), 0);
  EXPECT_EQ(p.n_takeable(0), p.n_takeable());
}

TEST(block_pool, taking_a_class_never_hands_out_another_class) {
  block_pool p(std::vector<std::int32_t>{3, 2});
  EXPECT_EQ(p.take(k_t0, 1)->id.value, 3);
  EXPECT_EQ(p.take(k_t0, 1)->id.value, 4);
  EXPECT_FALSE(p.take(k_t0, 1).has_value());  // class 0 still holds 3 free blocks
  EXPECT_EQ(p.n_takeable(1), 0);
  EXPECT_EQ(p.n_takeable(0), 3);
  EXPECT_EQ(p.n_used_in(1), 2);
  EXPECT_EQ(p.n_used_in(0), 0);
  EXPECT_EQ(p.take(k_t0)->id.value, 0);  // the default class is 0
  expect_counts(p, 3, 0, 2);
}

// Two classes of 3 blocks, all taken and hashed (class 0 by owner0, class 1
// by owner1), then released as cached in the order 4, 0, 5, 1; 2 and 3 stay used.
block_pool two_classes_with_cache(tenant_id owner0, tenant_id owner1) {
  block_pool p(std::vector<std::int32_t>{3, 3});
  std::vector<block_id> b;
  for (int i = 0; i < 3; ++i) b.push_back(p.take(owner0, 0)->id);
  for (int i = 0; i < 3; ++i) b.push_back(p.take(owner1, 1)->id);
  for (const block_id x : b) p.set_hashed(x);
  for (const int i : {4, 0, 5, 1}) p.unref(b[static_cast<std::size_t>(i)]);
  return p;
}

TEST(block_pool, lru_and_eviction_stay_within_a_class) {
  block_pool p = two_classes_with_cache(k_t0, k_t1);
  EXPECT_EQ(ids(p.free_queue(0)), (std::vector<std::int32_t>{0, 1}));
  EXPECT_EQ(ids(p.free_queue(1)), (std::vector<std::int32_t>{4, 5}));
  EXPECT_EQ(p.n_cached_in(0), 2);
  EXPECT_EQ(p.n_cached_in(1), 2);
  expect_counts(p, 2, 4, 0);

  // Class 1 evicts its own least recently released block, never class 0's older one.
  const auto t = p.take(k_t0, 1);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->id.value, 4);
  EXPECT_TRUE(t->evicted);
  EXPECT_EQ(ids(p.free_queue(0)), (std::vector<std::int32_t>{0, 1}));
  // A released unhashed block goes to the head of its own class's queue.
  p.unref(block_id(4));
  EXPECT_EQ(ids(p.free_queue(1)), (std::vector<std::int32_t>{4, 5}));
  p.drop_hash(block_id(1));
  EXPECT_EQ(ids(p.free_queue(0)), (std::vector<std::int32_t>{1, 0}));
  expect_counts(p, 2, 2, 2);
}

TEST(block_pool, cached_lists_are_per_owner_and_class_and_oldest_spans_classes) {
  block_pool p = two_classes_with_cache(k_t0, k_t0);
  EXPECT_EQ(ids(p.cached_of(k_t0, 0)), (std::vector<std::int32_t>{0, 1}));
  EXPECT_EQ(ids(p.cached_of(k_t0, 1)), (std::vector<std::int32_t>{4, 5}));
  EXPECT_EQ(ids(p.cached_of(k_t0)), (std::vector<std::int32_t>{0, 1, 4, 5}));
  EXPECT_EQ(p.n_cached(k_t0), 4);
  EXPECT_EQ(p.n_used(k_t0), 2);
  EXPECT_EQ(p.next_cached_of(k_t0), block_id(4));  // released first, in class 1

  EXPECT_EQ(p.take_cached_of(k_t0, 0)->id.value, 0);
  EXPECT_EQ(p.next_cached_of(k_t0), block_id(4));
  EXPECT_EQ(p.take_cached_of(k_t0, 1)->id.value, 4);
  EXPECT_EQ(p.next_cached_of(k_t0), block_id(5));  // 5 was released before 1
  EXPECT_EQ(p.take_cached_of(k_t0, 1)->id.value, 5);
  EXPECT_FALSE(p.take_cached_of(k_t0, 1).has_value());
  EXPECT_EQ(p.next_cached_of(k_t0), block_id(1));
  EXPECT_FALSE(p.next_cached_of(k_t1).has_value());
  expect_counts(p, 5, 1, 0);
}

TEST(block_pool_death, double_free_aborts) {
  block_pool p(2);
  const block_id b = p.take(k_t0)->id;
  p.unref(b);
  EXPECT_DEATH(p.unref(b), "double free");
}

TEST(block_pool_death, ref_on_free_block_aborts) {
  block_pool p(2);
  EXPECT_DEATH(p.ref(block_id(1)), "free block");
}

TEST(block_pool_death, out_of_range_id_aborts) {
  block_pool p(2);
  EXPECT_DEATH((void)p.ref_count(block_id(2)), "outside pool");
}

TEST(block_pool_death, out_of_range_class_aborts) {
  block_pool p(std::vector<std::int32_t>{2, 2});
  EXPECT_DEATH((void)p.take(k_t0, 2), "block class 2");
  EXPECT_DEATH((void)block_pool(std::vector<std::int32_t>{}), "classes");
}

// A plain reference model of the eviction order, O(n) everywhere: per class a
// deque of free blocks and a clock; cached blocks ordered by (key, release).
struct model_pool {
  struct blk {
    int ref = 0;
    bool hashed = false;
    int owner = -1;
    int cls = 0;
    int uses = 0;
    std::int64_t key = 0;
    std::uint64_t released = 0;  // when it was last released as cached
  };
  cache_eviction eviction;
  std::vector<blk> blocks;
  std::vector<std::deque<int>> free;  // [class]
  std::vector<std::int64_t> clock;    // [class]
  std::uint64_t n_releases = 0;

  model_pool(const std::vector<std::int32_t>& sizes, cache_eviction e)
      : eviction(e), free(sizes.size()), clock(sizes.size(), 0) {
    for (std::size_t c = 0; c < sizes.size(); ++c) {
      for (int k = 0; k < sizes[c]; ++k) {
        free[c].push_back(static_cast<int>(blocks.size()));
        blocks.push_back(blk{.cls = static_cast<int>(c)});
      }
    }
  }
  blk& at(int i) { return blocks[static_cast<std::size_t>(i)]; }
  bool cached(const blk& b) const { return b.ref == 0 && b.hashed; }
  bool before(int a, int b) const {  // a leaves before b (same class)
    const blk &x = blocks[static_cast<std::size_t>(a)], &y = blocks[static_cast<std::size_t>(b)];
    return x.key != y.key ? x.key < y.key : x.released < y.released;
  }
  std::vector<int> cached_order(std::size_t c, int owner = -1) const {
    std::vector<int> out;
    for (std::size_t i = 0; i < blocks.size(); ++i)
      if (cached(blocks[i]) && blocks[i].cls == static_cast<int>(c) && (owner < 0 || blocks[i].owner == owner))
        out.push_back(static_cast<int>(i));
    std::sort(out.begin(), out.end(), [&](int a, int b) { return before(a, b); });
    return out;
  }
  std::vector<std::int32_t> order(std::size_t c) const {
    std::vector<std::int32_t> out(free[c].begin(), free[c].end());
    for (const int i : cached_order(c)) out.push_back(i);
    return out;
  }
  int claim(int i, int owner) {
    blk& b = at(i);
    if (!b.hashed) {
      auto& q = free[static_cast<std::size_t>(b.cls)];
      q.erase(std::find(q.begin(), q.end(), i));
    }
    b = blk{.ref = 1, .owner = owner, .cls = b.cls};
    return i;
  }
  int take(int owner, std::size_t c) {
    if (!free[c].empty()) return claim(free[c].front(), owner);
    const auto order = cached_order(c);
    if (order.empty()) return -1;
    clock[c] = at(order.front()).key;
    return claim(order.front(), owner);
  }
  int take_cached_of(int owner, std::size_t c) {
    const auto order = cached_order(c, owner);
    return order.empty() ? -1 : claim(order.front(), owner);
  }
  void ref(int i) {
    blk& b = at(i);
    if (b.hashed) b.uses = std::min(b.uses + 1, 7);
    ++b.ref;
  }
  void unref(int i) {
    blk& b = at(i);
    if (--b.ref > 0) return;
    if (b.hashed) {
      const int level = b.uses >= 7 ? 3 : b.uses >= 3 ? 2 : b.uses >= 1 ? 1 : 0;
      b.key = clock[static_cast<std::size_t>(b.cls)] + (eviction == cache_eviction::lfu ? level : 0);
      b.released = ++n_releases;
    } else {
      free[static_cast<std::size_t>(b.cls)].push_front(i);
      b.owner = -1;
    }
  }
  void drop_hash(int i) {
    blk& b = at(i);
    b.hashed = false;
    b.owner = -1;
    free[static_cast<std::size_t>(b.cls)].push_front(i);
  }
  int next_cached_of(int owner) const {
    int best = -1;
    std::int64_t best_rel = 0;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const blk& b = blocks[i];
      if (!cached(b) || b.owner != owner) continue;
      const std::int64_t rel = b.key - clock[static_cast<std::size_t>(b.cls)];
      if (best < 0 || rel < best_rel || (rel == best_rel && b.released < blocks[static_cast<std::size_t>(best)].released)) {
        best = static_cast<int>(i);
        best_rel = rel;
      }
    }
    return best;
  }
};

// max_clock (if given): the highest clock a class reached (0 under lru).
void run_against_model(const std::vector<std::int32_t>& sizes, std::uint32_t seed,
                       cache_eviction eviction = cache_eviction::lru, std::int64_t* max_clock = nullptr) {
  std::mt19937 rng(seed);
  block_pool p(sizes, eviction);
  model_pool m(sizes, eviction);
  const int n = p.n_blocks();
  const auto n_classes = static_cast<std::uint32_t>(sizes.size());
  for (int step = 0; step < 3000; ++step) {
    // Refs (ops 2 and 6) come twice as often as the rest, so that blocks climb levels and clocks move.
    const int op = static_cast<int>(rng() % 7);
    const int i = static_cast<int>(rng() % static_cast<std::uint32_t>(n));
    const auto cls = static_cast<std::int32_t>(rng() % n_classes);
    auto& mb = m.at(i);
    const block_id b(i);
    const tenant_id owner(static_cast<std::int32_t>(rng() % 3));
    if (op == 0) {
      const auto t = p.take(owner, cls);
      const bool was_hashed = m.free[static_cast<std::size_t>(cls)].empty();  // else a free block goes first
      const int expect = m.take(owner.value, static_cast<std::size_t>(cls));
      ASSERT_EQ(t.has_value(), expect >= 0);
      if (t) {
        ASSERT_EQ(t->id.value, expect);
        ASSERT_EQ(t->evicted, was_hashed);
      }
    } else if (op == 1) {
      const auto t = p.take_cached_of(owner, cls);
      const int expect = m.take_cached_of(owner.value, static_cast<std::size_t>(cls));
      ASSERT_EQ(t.has_value(), expect >= 0);
      if (t) {
        ASSERT_EQ(t->id.value, expect);
      }
    } else if ((op == 2 || op == 6) && (mb.ref > 0 || mb.hashed)) {
      p.ref(b);
      m.ref(i);
    } else if (op == 3 && mb.ref > 0) {
      p.unref(b);
      m.unref(i);
    } else if (op == 4 && mb.ref > 0 && !mb.hashed) {
      p.set_hashed(b);
      mb.hashed = true;
      mb.uses = 0;
    } else if (op == 5 && mb.ref == 0 && mb.hashed) {
      p.drop_hash(b);
      m.drop_hash(i);
    }
    const status st = p.check_invariants();
    ASSERT_TRUE(st.ok()) << "step " << step << ": " << st.message();
    for (std::size_t c = 0; c < sizes.size(); ++c) {
      ASSERT_EQ(ids(p.free_queue(static_cast<std::int32_t>(c))), m.order(c)) << "step " << step << " class " << c;
      ASSERT_EQ(p.clock(static_cast<std::int32_t>(c)), m.clock[c]) << "step " << step << " class " << c;
      for (int t = 0; t < 3; ++t) {
        std::vector<std::int32_t> expect;
        for (const int k : m.cached_order(c, t)) expect.push_back(k);
        ASSERT_EQ(ids(p.cached_of(tenant_id(t), static_cast<std::int32_t>(c))), expect) << "step " << step;
      }
    }
    const auto next = p.next_cached_of(owner);
    ASSERT_EQ(next ? next->value : -1, m.next_cached_of(owner.value)) << "step " << step;
    for (int k = 0; k < n; ++k) {
      const auto& x = m.blocks[static_cast<std::size_t>(k)];
      ASSERT_EQ(p.ref_count(block_id(k)), x.ref);
      ASSERT_EQ(p.is_hashed(block_id(k)), x.hashed);
      ASSERT_EQ(p.owner(block_id(k)).value, x.owner);
      ASSERT_EQ(p.uses(block_id(k)), x.uses) << "block " << k << " step " << step;
      if (x.ref == 0 && x.hashed) {
        ASSERT_EQ(p.eviction_key(block_id(k)), x.key) << "block " << k;
      }
    }
  }
  if (max_clock) *max_clock = *std::max_element(m.clock.begin(), m.clock.end());
}

TEST(block_pool, random_operations_match_a_reference_model) {
  for (std::uint32_t seed = 1; seed <= 10; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    run_against_model({12}, seed);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(block_pool, random_operations_with_classes_match_a_reference_model) {
  for (std::uint32_t seed = 1; seed <= 10; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    run_against_model({5, 4, 3}, seed);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// The same under lfu: per class and per owner, every order, clock, key and use count as the model says.
TEST(block_pool, lfu_random_operations_match_a_reference_model) {
  std::int64_t max_clock = 0;  // the clocks moved: blocks of several levels were evicted
  for (std::uint32_t seed = 1; seed <= 10; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    for (const auto& sizes : {std::vector<std::int32_t>{12}, std::vector<std::int32_t>{5, 4, 3}}) {
      std::int64_t clock = 0;
      run_against_model(sizes, seed, cache_eviction::lfu, &clock);
      if (::testing::Test::HasFatalFailure()) return;
      max_clock = std::max(max_clock, clock);
    }
  }
  EXPECT_GE(max_clock, 2);
}

}  // namespace
}  // namespace pagoda
