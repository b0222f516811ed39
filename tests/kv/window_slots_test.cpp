#include "kv/window_slots.h"

#include <random>
#include <set>

#include <gtest/gtest.h>

namespace pagoda {
namespace {

TEST(window_slots, binds_free_slots_first_then_the_least_recently_retained) {
  window_slots w(8, 3);
  EXPECT_EQ(w.n_takeable(), 3);
  std::set<std::int32_t> slots;
  for (int b = 0; b < 3; ++b) {
    const auto got = w.bind(block_id(b));
    EXPECT_FALSE(got.lost.valid());
    slots.insert(got.slot);
    EXPECT_TRUE(w.pinned(block_id(b)));
  }
  EXPECT_EQ(slots.size(), 3u);
  EXPECT_EQ(w.n_takeable(), 0);
  // Retained in the order 1, 0: block 1's K/V are the first to go.
  w.retain(block_id(1));
  w.retain(block_id(0));
  EXPECT_EQ(w.n_takeable(), 2);
  EXPECT_TRUE(w.bound(block_id(1)));
  const auto a = w.bind(block_id(5));
  EXPECT_EQ(a.lost, block_id(1));
  EXPECT_FALSE(w.bound(block_id(1)));
  // Pinning block 0 again takes it out of the retained list: nothing is takeable.
  w.pin(block_id(0));
  EXPECT_EQ(w.n_takeable(), 0);
  EXPECT_EQ(w.peak_pinned(), 3);
  // Unbinding frees the slot whatever its state.
  w.unbind(block_id(0));
  w.unbind(block_id(1));  // unbound already: nothing
  EXPECT_EQ(w.n_takeable(), 1);
  const auto c = w.bind(block_id(7));
  EXPECT_FALSE(c.lost.valid());
  EXPECT_TRUE(w.check_invariants().ok());
}

TEST(window_slots, random_operations_keep_the_invariants) {
  std::mt19937 rng(7);
  const std::int32_t n_blocks = 40, n_slots = 9;
  window_slots w(n_blocks, n_slots);
  for (int i = 0; i < 20000; ++i) {
    const block_id b(std::uniform_int_distribution<std::int32_t>(0, n_blocks - 1)(rng));
    switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
      case 0:
        if (!w.bound(b) && w.n_takeable() > 0) {
          const auto got = w.bind(b);
          if (got.lost.valid()) {
            ASSERT_FALSE(w.bound(got.lost));
          }
          ASSERT_EQ(w.slot_of(b), got.slot);
        }
        break;
      case 1:
        if (w.pinned(b)) w.retain(b);
        break;
      case 2:
        if (w.bound(b) && !w.pinned(b)) w.pin(b);
        break;
      default: w.unbind(b); break;
    }
    ASSERT_TRUE(w.check_invariants().ok()) << w.check_invariants().message() << " at " << i;
    ASSERT_LE(w.n_pinned(), n_slots);
  }
}

}  // namespace
}  // namespace pagoda
