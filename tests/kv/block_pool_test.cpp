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
  EXPECT_EQ(p.oldest_cached_of(k_t0), a);
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
  EXPECT_EQ(p.oldest_cached_of(k_t0), block_id(4));  // released first, in class 1

  EXPECT_EQ(p.take_cached_of(k_t0, 0)->id.value, 0);
  EXPECT_EQ(p.oldest_cached_of(k_t0), block_id(4));
  EXPECT_EQ(p.take_cached_of(k_t0, 1)->id.value, 4);
  EXPECT_EQ(p.oldest_cached_of(k_t0), block_id(5));  // 5 was released before 1
  EXPECT_EQ(p.take_cached_of(k_t0, 1)->id.value, 5);
  EXPECT_FALSE(p.take_cached_of(k_t0, 1).has_value());
  EXPECT_EQ(p.oldest_cached_of(k_t0), block_id(1));
  EXPECT_FALSE(p.oldest_cached_of(k_t1).has_value());
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

// A plain reference model of the queues: a deque per class, with O(n) removal.
struct model_pool {
  struct blk {
    int ref = 0;
    bool hashed = false;
    int owner = -1;
    int cls = 0;
    std::uint64_t released = 0;  // when it was last released as cached
  };
  std::vector<blk> blocks;
  std::vector<std::deque<int>> queues;  // [class]
  std::uint64_t n_releases = 0;

  explicit model_pool(const std::vector<std::int32_t>& sizes) : queues(sizes.size()) {
    for (std::size_t c = 0; c < sizes.size(); ++c) {
      for (int k = 0; k < sizes[c]; ++k) {
        queues[c].push_back(static_cast<int>(blocks.size()));
        blocks.push_back(blk{.cls = static_cast<int>(c)});
      }
    }
  }
  std::deque<int>& queue_of_block(int i) { return queues[static_cast<std::size_t>(blocks[static_cast<std::size_t>(i)].cls)]; }
  void remove(int i) {
    auto& q = queue_of_block(i);
    q.erase(std::find(q.begin(), q.end(), i));
  }
  int claim(int i, int owner) {
    remove(i);
    blk& b = blocks[static_cast<std::size_t>(i)];
    b = blk{1, false, owner, b.cls};
    return i;
  }
  int oldest_cached_of(int owner) const {
    int best = -1;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const blk& b = blocks[i];
      if (b.ref == 0 && b.hashed && b.owner == owner &&
          (best < 0 || b.released < blocks[static_cast<std::size_t>(best)].released))
        best = static_cast<int>(i);
    }
    return best;
  }
  std::vector<std::int32_t> order(std::size_t c) const { return {queues[c].begin(), queues[c].end()}; }
};

void run_against_model(const std::vector<std::int32_t>& sizes, std::uint32_t seed) {
  std::mt19937 rng(seed);
  block_pool p(sizes);
  model_pool m(sizes);
  const int n = p.n_blocks();
  const auto n_classes = static_cast<std::uint32_t>(sizes.size());
  for (int step = 0; step < 3000; ++step) {
    const int op = static_cast<int>(rng() % 6);
    const int i = static_cast<int>(rng() % static_cast<std::uint32_t>(n));
    const auto cls = static_cast<std::int32_t>(rng() % n_classes);
    auto& q = m.queues[static_cast<std::size_t>(cls)];
    auto& mb = m.blocks[static_cast<std::size_t>(i)];
    const block_id b(i);
    const tenant_id owner(static_cast<std::int32_t>(rng() % 3));
    if (op == 0) {
      const auto t = p.take(owner, cls);
      ASSERT_EQ(t.has_value(), !q.empty());
      if (t) {
        const int expect = q.front();
        const bool was_hashed = m.blocks[static_cast<std::size_t>(expect)].hashed;
        ASSERT_EQ(t->id.value, expect);
        ASSERT_EQ(t->evicted, was_hashed);
        m.claim(expect, owner.value);
      }
    } else if (op == 1) {
      const auto t = p.take_cached_of(owner, cls);
      int expect = -1;
      for (const int k : q) {
        const auto& qb = m.blocks[static_cast<std::size_t>(k)];
        if (qb.hashed && qb.owner == owner.value) {
          expect = k;
          break;
        }
      }
      ASSERT_EQ(t.has_value(), expect >= 0);
      if (t) {
        ASSERT_EQ(t->id.value, expect);
        m.claim(expect, owner.value);
      }
    } else if (op == 2 && (mb.ref > 0 || mb.hashed)) {
      p.ref(b);
      if (mb.ref == 0) m.remove(i);
      ++mb.ref;
    } else if (op == 3 && mb.ref > 0) {
      p.unref(b);
      if (--mb.ref == 0) {
        if (mb.hashed) {
          m.queue_of_block(i).push_back(i);
          mb.released = ++m.n_releases;
        } else {
          m.queue_of_block(i).push_front(i);
          mb.owner = -1;
        }
      }
    } else if (op == 4 && mb.ref > 0 && !mb.hashed) {
      p.set_hashed(b);
      mb.hashed = true;
    } else if (op == 5 && mb.ref == 0 && mb.hashed) {
      p.drop_hash(b);
      m.remove(i);
      m.queue_of_block(i).push_front(i);
      mb.hashed = false;
      mb.owner = -1;
    }
    const status st = p.check_invariants();
    ASSERT_TRUE(st.ok()) << "step " << step << ": " << st.message();
    for (std::size_t c = 0; c < sizes.size(); ++c)
      ASSERT_EQ(ids(p.free_queue(static_cast<std::int32_t>(c))), m.order(c)) << "step " << step << " class " << c;
    const auto oldest = p.oldest_cached_of(owner);
    ASSERT_EQ(oldest ? oldest->value : -1, m.oldest_cached_of(owner.value)) << "step " << step;
    for (int k = 0; k < n; ++k) {
      ASSERT_EQ(p.ref_count(block_id(k)), m.blocks[static_cast<std::size_t>(k)].ref);
      ASSERT_EQ(p.is_hashed(block_id(k)), m.blocks[static_cast<std::size_t>(k)].hashed);
      ASSERT_EQ(p.owner(block_id(k)).value, m.blocks[static_cast<std::size_t>(k)].owner);
    }
  }
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

}  // namespace
}  // namespace pagoda
