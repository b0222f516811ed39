// count_reads: what a task's query rows see and read, in tokens and blocks,
// worked out by hand for each case.
#include <gtest/gtest.h>

#include "attention/kv_selector.h"

namespace pagoda {
namespace {

TEST(kv_read_counts, a_full_read_sees_and_reads_every_slot) {
  // One decode row over 40 slots in blocks of 16: 3 blocks.
  EXPECT_EQ(count_reads(40, 1, 0, 16, false, {}), (kv_read_counts{1, 40, 40, 3, 3}));
  // A prompt chunk of 3 rows: the rows see 38, 39 and 40 slots.
  EXPECT_EQ(count_reads(40, 3, 0, 16, false, {}), (kv_read_counts{3, 117, 117, 9, 9}));
  // A window of 10: slots 30-39, in blocks 1 and 2.
  EXPECT_EQ(count_reads(40, 1, 10, 16, false, {}), (kv_read_counts{1, 10, 10, 2, 2}));
}

TEST(kv_read_counts, a_sparse_read_counts_the_chosen_slots_and_their_blocks) {
  const std::vector<slot_range> pages = {{0, 16}, {32, 40}};
  EXPECT_EQ(count_reads(40, 1, 0, 16, true, pages), (kv_read_counts{1, 40, 24, 3, 2}));
  // Two ranges in one block count that block once.
  const std::vector<slot_range> tokens = {{0, 4}, {8, 12}, {20, 21}};
  EXPECT_EQ(count_reads(40, 1, 0, 16, true, tokens), (kv_read_counts{1, 40, 9, 3, 2}));
  // An earlier row reads only what it sees: the first of two rows ends at slot 39.
  EXPECT_EQ(count_reads(40, 2, 0, 16, true, pages), (kv_read_counts{2, 79, 23 + 24, 6, 4}));
}

TEST(kv_read_counts, rows_before_the_first_slot_count_nothing) {
  // More rows than slots cannot happen in a step, but the count stays sane.
  EXPECT_EQ(count_reads(2, 3, 0, 16, false, {}), (kv_read_counts{2, 3, 3, 2, 2}));
  kv_read_counts a{1, 2, 3, 4, 5};
  a += kv_read_counts{1, 1, 1, 1, 1};
  EXPECT_EQ(a, (kv_read_counts{2, 3, 4, 5, 6}));
}

}  // namespace
}  // namespace pagoda
