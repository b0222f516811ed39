// The one-budget eviction policies (window, h2o, snapkv, merge, cluster) on
// hand-built statistics whose right answers are worked out beside each case.
#include <gtest/gtest.h>

#include <cmath>

#include "policy/kv_policy.h"
#include "policy/policy_test_util.h"

namespace pagoda {
namespace {

using test::concat;
using test::kept;
using test::kv_case;
using test::make_policy;
using test::range;

// ---- window (StreamingLLM) ----

TEST(window_policy, keeps_sinks_and_the_newest_in_every_row) {
  const kv_case c = kv_case::contiguous(20, 2, 2);
  const eviction_decision d = make_policy("window:budget=8,sinks=4,slack=0")->evict(c.input());
  ASSERT_FALSE(d.empty());
  EXPECT_EQ(d.n_rows, 4);
  EXPECT_EQ(d.width, 8);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(kept(d, r), concat(range(0, 4), range(16, 20))) << "row " << r;
  EXPECT_TRUE(d.uniform());
  EXPECT_FALSE(d.reposition);
  EXPECT_EQ(d.fold, kv_fold::drop);
}

TEST(window_policy, fraction_and_count_budgets_agree) {
  const kv_case c = kv_case::contiguous(20);
  const eviction_decision a = make_policy("window:budget=0.4,slack=0")->evict(c.input());
  const eviction_decision b = make_policy("window:budget=40%,slack=0")->evict(c.input());
  const eviction_decision n = make_policy("window:budget=8,slack=0")->evict(c.input());
  EXPECT_EQ(kept(a, 0), kept(n, 0));
  EXPECT_EQ(kept(b, 0), kept(n, 0));
  // 25% of 20 tokens rounds up: 5 = 4 sinks + 1.
  EXPECT_EQ(kept(make_policy("window:slack=0")->evict(c.input()), 0), concat(range(0, 4), {19}));
}

TEST(window_policy, positions_cache_asks_for_repositioning) {
  const kv_case c = kv_case::contiguous(20, 2, 1);
  const eviction_decision d = make_policy("window:budget=8,positions=cache,slack=0")->evict(c.input());
  EXPECT_TRUE(d.reposition);
  EXPECT_FALSE(make_policy("window:budget=8,positions=keep,slack=0")->evict(c.input()).reposition);
}

// Exact budgets: with no slack a policy acts whenever a slot can go, whatever
// the block size; slack=K waits until the rows would lose K each.
TEST(window_policy, budgets_are_exact_unless_a_slack_is_given) {
  kv_case c = kv_case::contiguous(20);
  c.block_size = 16;
  EXPECT_EQ(make_policy("window:budget=8")->evict(c.input()).width, 8);
  EXPECT_EQ(make_policy("window:budget=19")->evict(c.input()).width, 19);  // one slot over: it goes
  EXPECT_FALSE(make_policy("window:budget=8,slack=12")->evict(c.input()).empty());
  EXPECT_TRUE(make_policy("window:budget=8,slack=13")->evict(c.input()).empty());
  // Within budget: nothing to free, whatever the slack.
  EXPECT_TRUE(make_policy("window:budget=20,slack=0")->evict(c.input()).empty());
  EXPECT_TRUE(make_policy("window:budget=1.0,slack=0")->evict(c.input()).empty());
}

// A prompt longer than the budget and a chunk goes in chunks (kv_policy.h,
// prompt_chunking): by default the budget at the prompt's end in whole blocks,
// at most 256; at least SnapKV's observation window, which the last chunk holds.
TEST(prompt_chunks, are_the_budget_in_blocks_or_the_chunk_asked_for) {
  const auto chunks = [](const char* spec, int n_prompt, int block_size = 16) {
    const prompt_chunking c = make_policy(spec)->prompt_chunks(n_prompt, block_size);
    return std::pair{c.chunk, c.min_last};
  };
  EXPECT_EQ(chunks("h2o:budget=0.25", 4096), std::pair(256, 0));  // 1024, at most 256
  EXPECT_EQ(chunks("h2o:budget=0.25", 400), std::pair(112, 0));   // 100 in blocks of 16
  EXPECT_EQ(chunks("window:budget=100", 4096), std::pair(112, 0));
  EXPECT_EQ(chunks("window:budget=3", 4096), std::pair(16, 0));  // at least a block
  EXPECT_EQ(chunks("snapkv:budget=0.25", 4096), std::pair(256, 16));
  // SnapKV: a chunk whose budget keeps twice the window (else it keeps the window alone), at most 256.
  EXPECT_EQ(chunks("snapkv:budget=0.25", 400), std::pair(128, 16));  // 100 would keep 25 < 32
  EXPECT_EQ(chunks("snapkv:budget=8,window=32", 4096), std::pair(256, 32));
  EXPECT_EQ(chunks("h2o:budget=0.25,chunk=50", 4096), std::pair(50, 0));  // as asked, not in blocks
  EXPECT_EQ(chunks("snapkv:budget=0.25,chunk=8", 4096), std::pair(16, 16));
  EXPECT_EQ(chunks("pyramid:budget=0.25", 4096), std::pair(256, 16));
  // Whole: a prompt within the budget and one chunk, chunk=0, or no eviction.
  EXPECT_EQ(chunks("h2o:budget=300", 550), std::pair(0, 0));
  EXPECT_EQ(chunks("h2o:budget=300", 560), std::pair(256, 0));
  EXPECT_EQ(chunks("h2o:budget=0.25,chunk=0", 4096), std::pair(0, 0));
  EXPECT_EQ(chunks("none", 4096), std::pair(0, 0));
  EXPECT_EQ(chunks("quest", 4096), std::pair(0, 0));
}

TEST(window_policy, a_budget_below_the_sinks_still_keeps_the_newest) {
  const kv_case c = kv_case::contiguous(20);
  EXPECT_EQ(kept(make_policy("window:budget=3,sinks=4,slack=0")->evict(c.input()), 0), (std::vector<int>{0, 1, 19}));
  EXPECT_EQ(kept(make_policy("window:budget=1,slack=0")->evict(c.input()), 0), (std::vector<int>{19}));
  EXPECT_EQ(kept(make_policy("window:budget=3,sinks=0,slack=0")->evict(c.input()), 0), range(17, 20));
}

TEST(window_policy, sinks_and_recents_are_by_position_not_slot) {
  kv_case c = kv_case::contiguous(10);
  c.positions = {7, 2, 9, 0, 5, 1, 8, 3, 6, 4};  // slot -> position
  const eviction_decision d = make_policy("window:budget=4,sinks=2,slack=0")->evict(c.input());
  // positions 0, 1 (slots 3, 5) and 8, 9 (slots 6, 2)
  EXPECT_EQ(kept(d, 0), (std::vector<int>{2, 3, 5, 6}));
}

TEST(window_policy, dead_slots_are_never_kept_and_sinks_are_the_oldest_live) {
  kv_case c = kv_case::contiguous(20, 1, 2);
  c.kill_front(1, 4);  // row 1 holds positions 4..19
  const eviction_decision d = make_policy("window:budget=8,positions=cache,slack=0")->evict(c.input());
  EXPECT_EQ(kept(d, 0), concat(range(0, 4), range(16, 20)));
  EXPECT_EQ(kept(d, 1), concat(range(4, 8), range(16, 20)));
  EXPECT_FALSE(d.uniform());
  EXPECT_FALSE(d.reposition);  // rows differ: positions cannot restart
}

TEST(window_policy, a_row_within_budget_keeps_all_its_live_slots) {
  kv_case c = kv_case::contiguous(20, 1, 2);
  c.kill_front(1, 15);  // row 1: 5 live
  const eviction_decision d = make_policy("window:budget=8,slack=0")->evict(c.input());
  EXPECT_EQ(d.count, (std::vector<std::int32_t>{8, 5}));
  EXPECT_EQ(kept(d, 1), range(15, 20));
  EXPECT_EQ(d.keep[1 * 8 + 5], -1);  // padding past a row's count
}

// ---- h2o ----

kv_case h2o_case() {
  kv_case c = kv_case::contiguous(12, 1, 2);
  for (int s = 0; s < 9; ++s) {
    c.total(0, s) = 1;
    c.total(1, s) = 0.25f;
  }
  c.total(0, 1) = 5;
  c.total(0, 5) = 4;
  c.total(0, 7) = 3;
  c.total(1, 0) = 9;
  c.total(1, 2) = 8;
  c.total(1, 8) = 7;
  c.total(1, 1) = 0.5f;
  return c;
}

TEST(h2o_policy, recent_half_and_heavy_hitters_per_head) {
  const kv_case c = h2o_case();
  const eviction_decision d = make_policy("h2o:budget=6,slack=0")->evict(c.input());
  // recent: ceil(6 / 2) = 3 newest; heavy: the 3 highest totals of each head among the rest.
  EXPECT_EQ(kept(d, 0), (std::vector<int>{1, 5, 7, 9, 10, 11}));
  EXPECT_EQ(kept(d, 1), (std::vector<int>{0, 2, 8, 9, 10, 11}));
  EXPECT_EQ(d.fold, kv_fold::drop);
  EXPECT_FALSE(d.uniform());
}

TEST(h2o_policy, recent_as_count_and_as_fraction) {
  const kv_case c = h2o_case();
  // recent=1: 11, then the 5 best of head 0: 1, 5, 7 and two of the 1.0 ties: the newest, 8 and 6.
  EXPECT_EQ(kept(make_policy("h2o:budget=6,recent=1,slack=0")->evict(c.input()), 0),
            (std::vector<int>{1, 5, 6, 7, 8, 11}));
  // recent=25% of 12 seen = 3: the default split here.
  EXPECT_EQ(kept(make_policy("h2o:budget=50%,recent=0.25,slack=0")->evict(c.input()), 1),
            (std::vector<int>{0, 2, 8, 9, 10, 11}));
}

TEST(h2o_policy, ties_go_to_the_newer_token_and_nan_ranks_last) {
  kv_case c = kv_case::contiguous(12);
  c.total(0, 0) = 0;  // all zero
  EXPECT_EQ(kept(make_policy("h2o:budget=6,slack=0")->evict(c.input()), 0), range(6, 12));
  c.total(0, 1) = 5;
  c.total(0, 3) = 2;
  c.total(0, 4) = 2;
  c.total(0, 8) = NAN;
  // heavy 3: slot 1, then 4 and 3 (2.0), NaN never ahead of a number.
  EXPECT_EQ(kept(make_policy("h2o:budget=6,slack=0")->evict(c.input()), 0), (std::vector<int>{1, 3, 4, 9, 10, 11}));
  EXPECT_EQ(kept(make_policy("h2o:budget=5,slack=0")->evict(c.input()), 0), (std::vector<int>{1, 4, 9, 10, 11}));
}

TEST(h2o_policy, dead_slots_count_for_nothing) {
  kv_case c = h2o_case();
  c.kill_front(1, 3);
  for (int s = 0; s < 3; ++s) c.total(1, s) = 100;  // garbage under dead slots
  const eviction_decision d = make_policy("h2o:budget=6,slack=0")->evict(c.input());
  // row 1: live 3..11; heavy among 3..8: 8 (7.0), then 0.25 ties -> the newest, 7 and 6.
  EXPECT_EQ(kept(d, 1), (std::vector<int>{6, 7, 8, 9, 10, 11}));
}

TEST(h2o_policy, without_totals_it_stops_with_a_message) {
  kv_case c = kv_case::contiguous(12);
  const std::unique_ptr<kv_policy> p = make_policy("h2o:budget=6,slack=0");
  EXPECT_DEATH(p->evict(c.input()), "needs accumulated attention");
  c.totals.assign(5, 1.0f);  // wrong size
  EXPECT_DEATH(p->evict(c.input()), "accumulated attention holds 5 values");
}

// ---- snapkv ----

kv_case snapkv_case(int window_rows) {
  kv_case c = kv_case::contiguous(20);
  c.use_window(window_rows);
  const int last = window_rows - 1;  // the last four rows vote
  c.weight(0, last, 2) = 0.5f;
  c.weight(0, last - 3, 9) = 0.3f;
  c.weight(0, last - 2, 9) = 0.3f;
  c.weight(0, last - 1, 12) = 0.2f;
  return c;
}

TEST(snapkv_policy, the_observation_window_votes_and_is_kept) {
  const kv_case c = snapkv_case(4);
  const eviction_decision d = make_policy("snapkv:budget=7,window=4,kernel=1,slack=0")->evict(c.input());
  // votes: 9 = 0.6, 2 = 0.5, 12 = 0.2; plus the window's own tokens 16..19.
  EXPECT_EQ(kept(d, 0), (std::vector<int>{2, 9, 12, 16, 17, 18, 19}));
}

TEST(snapkv_policy, only_the_last_window_rows_vote) {
  kv_case c = snapkv_case(6);
  c.weight(0, 0, 5) = 1.0f;  // row 0 is outside a window of 4
  EXPECT_EQ(kept(make_policy("snapkv:budget=7,window=4,kernel=1,slack=0")->evict(c.input()), 0),
            (std::vector<int>{2, 9, 12, 16, 17, 18, 19}));
  // window=6 lets it vote, and keeps 6 newest: 5 (1.0) and 9 (0.6) win.
  EXPECT_EQ(kept(make_policy("snapkv:budget=8,window=6,kernel=1,slack=0")->evict(c.input()), 0),
            (std::vector<int>{5, 9, 14, 15, 16, 17, 18, 19}));
}

TEST(snapkv_policy, fewer_rows_than_the_window_vote_with_what_there_is) {
  kv_case c = kv_case::contiguous(20);
  c.use_window(2);
  c.weight(0, 0, 3) = 0.9f;
  c.weight(0, 1, 7) = 0.8f;
  EXPECT_EQ(kept(make_policy("snapkv:budget=6,window=4,kernel=1,slack=0")->evict(c.input()), 0),
            (std::vector<int>{3, 7, 16, 17, 18, 19}));
}

TEST(snapkv_policy, max_pooling_spreads_a_vote_to_its_neighbours) {
  kv_case c = kv_case::contiguous(20);
  c.use_window(4);
  c.weight(0, 3, 5) = 1.0f;
  c.weight(0, 3, 10) = 0.1f;
  EXPECT_EQ(kept(make_policy("snapkv:budget=6,window=4,kernel=1,slack=0")->evict(c.input()), 0),
            (std::vector<int>{5, 10, 16, 17, 18, 19}));
  // kernel 3: 4, 5, 6 all pool to 1.0; the tie goes to the newer, 6 and 5.
  EXPECT_EQ(kept(make_policy("snapkv:budget=6,window=4,kernel=3,slack=0")->evict(c.input()), 0),
            (std::vector<int>{5, 6, 16, 17, 18, 19}));
}

TEST(snapkv_policy, without_an_observation_window_it_keeps_everything) {
  const kv_case c = kv_case::contiguous(20);
  EXPECT_TRUE(make_policy("snapkv:budget=6,slack=0")->evict(c.input()).empty());
  kv_case empty = kv_case::contiguous(20);
  empty.use_window(0);
  EXPECT_TRUE(make_policy("snapkv:budget=6,slack=0")->evict(empty.input()).empty());
}

TEST(snapkv_policy, a_window_of_the_wrong_shape_stops_with_a_message) {
  kv_case c = kv_case::contiguous(20);
  c.window.reset(1, 1, 19, 4);
  c.has_window = true;
  EXPECT_DEATH(make_policy("snapkv:budget=6,slack=0")->evict(c.input()), "observation window of 1 layers x 1 heads x 19");
}

TEST(snapkv_policy, once_acts_at_the_prompts_end_only_and_ignores_slack) {
  kv_case c = snapkv_case(4);
  const std::unique_ptr<kv_policy> p = make_policy("snapkv:budget=7,window=4,kernel=1,once=1,slack=100");
  EXPECT_TRUE(p->evict(c.input()).empty());
  c.prompt_done_now = true;
  EXPECT_EQ(kept(p->evict(c.input()), 0), (std::vector<int>{2, 9, 12, 16, 17, 18, 19}));
  // once=0 obeys the slack.
  EXPECT_TRUE(make_policy("snapkv:budget=7,window=4,kernel=1,slack=100")->evict(c.input()).empty());
}

// once=1 between the chunks of a long prompt: it acts (by the slack rule) so
// the prompt never sits whole in the cache; in decode it never does.
TEST(snapkv_policy, once_acts_between_a_prompts_chunks_but_not_in_decode) {
  kv_case c = snapkv_case(4);
  const std::unique_ptr<kv_policy> p = make_policy("snapkv:budget=7,window=4,kernel=1,once=1");
  c.n_prompt = 40;  // 20 of 40 prompt tokens computed
  EXPECT_EQ(kept(p->evict(c.input()), 0), (std::vector<int>{2, 9, 12, 16, 17, 18, 19}));
  EXPECT_TRUE(make_policy("snapkv:budget=7,window=4,kernel=1,once=1,slack=100")->evict(c.input()).empty());
  c.n_prompt = 10;  // decoding
  EXPECT_TRUE(p->evict(c.input()).empty());
}

// ---- merge and cluster ----

TEST(merge_policy, chooses_as_h2o_and_folds_into_the_nearest) {
  const kv_case c = h2o_case();
  const eviction_decision h = make_policy("h2o:budget=6,slack=0")->evict(c.input());
  const eviction_decision m = make_policy("merge:budget=6,slack=0")->evict(c.input());
  EXPECT_EQ(m.keep, h.keep);
  EXPECT_EQ(m.count, h.count);
  EXPECT_EQ(m.fold, kv_fold::nearest);
  EXPECT_EQ(m.anchors_per_row, 0);
}

TEST(cluster_policy, anchors_are_the_best_evicted_and_are_kept) {
  kv_case c = kv_case::contiguous(12, 1, 2);
  for (int s = 0; s < 12; ++s) {
    c.total(0, s) = static_cast<float>(s + 1);   // head 0: newer is heavier
    c.total(1, s) = static_cast<float>(12 - s);  // head 1: older is heavier
  }
  const eviction_decision d = make_policy("cluster:budget=8,recent=4,k=2,slack=0")->evict(c.input());
  ASSERT_EQ(d.fold, kv_fold::cluster);
  ASSERT_EQ(d.anchors_per_row, 2);
  // recent 8..11; then 6 by score, the last 2 of which would be evicted first.
  // Head 0: 7, 6 heavy, then anchors 5, 4. Head 1: 0, 1 heavy, anchors 2, 3.
  EXPECT_EQ(kept(d, 0), range(4, 12));
  EXPECT_EQ(test::anchors_of(d, 0), (std::vector<int>{4, 5}));
  EXPECT_EQ(kept(d, 1), concat(range(0, 4), range(8, 12)));
  EXPECT_EQ(test::anchors_of(d, 1), (std::vector<int>{2, 3}));
}

TEST(cluster_policy, anchors_shrink_to_what_the_budget_leaves) {
  kv_case c = kv_case::contiguous(12);
  c.total(0, 0) = 1;
  const eviction_decision few = make_policy("cluster:budget=4,recent=2,k=8,slack=0")->evict(c.input());
  EXPECT_EQ(few.anchors_per_row, 2);
  EXPECT_EQ(few.fold, kv_fold::cluster);
  // Nothing but recent tokens: nothing to cluster into, the evicted are dropped.
  const eviction_decision none = make_policy("cluster:budget=4,recent=4,slack=0")->evict(c.input());
  EXPECT_EQ(none.anchors_per_row, 0);
  EXPECT_EQ(none.fold, kv_fold::drop);
  EXPECT_EQ(kept(none, 0), range(8, 12));
}

}  // namespace
}  // namespace pagoda
