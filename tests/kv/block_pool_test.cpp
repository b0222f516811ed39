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

// A plain reference model of the queue: a deque, with O(n) removal.
struct model_pool {
  struct blk {
    int ref = 0;
    bool hashed = false;
    int owner = -1;
  };
  std::vector<blk> blocks;
  std::deque<int> queue;

  explicit model_pool(int n) : blocks(static_cast<std::size_t>(n)) {
    for (int i = 0; i < n; ++i) queue.push_back(i);
  }
  void remove(int i) { queue.erase(std::find(queue.begin(), queue.end(), i)); }
  int claim(int i, int owner) {
    remove(i);
    blk& b = blocks[static_cast<std::size_t>(i)];
    b = blk{1, false, owner};
    return i;
  }
  std::vector<std::int32_t> order() const { return {queue.begin(), queue.end()}; }
};

TEST(block_pool, random_operations_match_a_reference_model) {
  for (std::uint32_t seed = 1; seed <= 10; ++seed) {
    std::mt19937 rng(seed);
    const int n = 12;
    block_pool p(n);
    model_pool m(n);
    for (int step = 0; step < 3000; ++step) {
      const int op = static_cast<int>(rng() % 6);
      const int i = static_cast<int>(rng() % n);
      auto& mb = m.blocks[static_cast<std::size_t>(i)];
      const block_id b(i);
      const tenant_id owner(static_cast<std::int32_t>(rng() % 3));
      if (op == 0) {
        const auto t = p.take(owner);
        ASSERT_EQ(t.has_value(), !m.queue.empty());
        if (t) {
          const int expect = m.queue.front();
          const bool was_hashed = m.blocks[static_cast<std::size_t>(expect)].hashed;
          ASSERT_EQ(t->id.value, expect);
          ASSERT_EQ(t->evicted, was_hashed);
          m.claim(expect, owner.value);
        }
      } else if (op == 1) {
        const auto t = p.take_cached_of(owner);
        int expect = -1;
        for (const int q : m.queue) {
          const auto& qb = m.blocks[static_cast<std::size_t>(q)];
          if (qb.hashed && qb.owner == owner.value) {
            expect = q;
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
            m.queue.push_back(i);
          } else {
            m.queue.push_front(i);
            mb.owner = -1;
          }
        }
      } else if (op == 4 && mb.ref > 0 && !mb.hashed) {
        p.set_hashed(b);
        mb.hashed = true;
      } else if (op == 5 && mb.ref == 0 && mb.hashed) {
        p.drop_hash(b);
        m.remove(i);
        m.queue.push_front(i);
        mb.hashed = false;
        mb.owner = -1;
      }
      const status st = p.check_invariants();
      ASSERT_TRUE(st.ok()) << "seed " << seed << " step " << step << ": " << st.message();
      ASSERT_EQ(queue_of(p), m.order()) << "seed " << seed << " step " << step;
      for (int k = 0; k < n; ++k) {
        ASSERT_EQ(p.ref_count(block_id(k)), m.blocks[static_cast<std::size_t>(k)].ref);
        ASSERT_EQ(p.is_hashed(block_id(k)), m.blocks[static_cast<std::size_t>(k)].hashed);
        ASSERT_EQ(p.owner(block_id(k)).value, m.blocks[static_cast<std::size_t>(k)].owner);
      }
    }
  }
}

}  // namespace
}  // namespace pagoda
