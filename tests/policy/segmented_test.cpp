// Per-segment policies: each part of the prompt decided by its own policy on
// its own slots, budgets relative to the part, and the rest by the base.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "policy/kv_policy.h"
#include "policy/policy_test_util.h"

namespace pagoda {
namespace {

using ::testing::HasSubstr;
using test::concat;
using test::kept;
using test::kv_case;
using test::range;

kv_policy_spec spec_of(std::string_view text) {
  result<kv_policy_spec> s = parse_kv_policy_spec(text);
  EXPECT_TRUE(s.ok()) << text;
  return s.ok() ? *s : kv_policy_spec{};
}

kv_segment segment(std::int32_t begin, std::int32_t end, std::string_view policy) {
  return kv_segment{begin, end, spec_of(policy)};
}

std::unique_ptr<kv_policy> segmented(std::string_view base, const std::vector<kv_segment>& segments) {
  result<std::unique_ptr<kv_policy>> p = make_segmented_policy(spec_of(base), segments);
  EXPECT_TRUE(p.ok()) << p.error().message();
  return p.ok() ? std::move(p).value() : nullptr;
}

std::string segmented_error(std::string_view base, const std::vector<kv_segment>& segments) {
  result<std::unique_ptr<kv_policy>> p = make_segmented_policy(spec_of(base), segments);
  EXPECT_FALSE(p.ok());
  return p.ok() ? "" : p.error().message();
}

// 30 tokens: [0, 10) kept whole, [10, 20) a window at half its length, the
// rest (20..29, as if generated) H2O at half.
kv_case three_parts_case() {
  kv_case c = kv_case::contiguous(30);
  c.total(0, 0) = 50;  // segment tokens' totals do not matter to the base
  c.total(0, 21) = 5;
  c.total(0, 24) = 4;
  return c;
}

TEST(segmented_policy, each_part_keeps_its_own_budget) {
  const kv_case c = three_parts_case();
  const std::vector<kv_segment> segs = {segment(0, 10, "none"), segment(10, 20, "window:budget=0.5,sinks=1")};
  const std::unique_ptr<kv_policy> p = segmented("h2o:budget=0.5,slack=0", segs);
  ASSERT_NE(p, nullptr);
  const eviction_decision d = p->evict(c.input());
  ASSERT_FALSE(d.empty());
  // none: 0..9; window of 10 at 50%: sink 10 + 16..19; base of 10 at 50%:
  // recent 27..29 + the heavy 21 and 24.
  EXPECT_EQ(kept(d, 0), concat(concat(range(0, 11), range(16, 20)), {21, 24, 27, 28, 29}));
  EXPECT_TRUE(p->lossy());
  EXPECT_TRUE(p->needs().totals);
  EXPECT_EQ(p->spec().name, "h2o");
}

TEST(segmented_policy, slack_applies_once_to_the_whole_decision) {
  kv_case c = three_parts_case();
  const std::vector<kv_segment> segs = {segment(0, 10, "none"), segment(10, 20, "window:budget=0.5,sinks=1")};
  // The parts free 5 + 5 slots: less than a slack of 16, more than one of 8,
  // though neither part alone frees 8.
  EXPECT_TRUE(segmented("h2o:budget=0.5,slack=16", segs)->evict(c.input()).empty());
  EXPECT_FALSE(segmented("h2o:budget=0.5,slack=8", segs)->evict(c.input()).empty());
  EXPECT_TRUE(segmented("h2o:budget=0.5,slack=11", segs)->evict(c.input()).empty());
  // A "none" base: no slack (exact budgets).
  EXPECT_FALSE(segmented("none", segs)->evict(c.input()).empty());
}

TEST(segmented_policy, observation_window_is_sliced_to_the_segment) {
  kv_case c = kv_case::contiguous(30);
  c.use_window(2);  // the last step's queries (28, 29) vote
  c.weight(0, 1, 3) = 0.5f;
  c.weight(0, 1, 11) = 0.4f;
  c.weight(0, 1, 25) = 0.9f;  // outside the segment
  c.weight(0, 0, 7) = 0.3f;
  const std::unique_ptr<kv_policy> p = segmented("none", {segment(0, 20, "snapkv:budget=0.25,window=2,kernel=1,slack=0")});
  EXPECT_EQ(p->needs().window_rows, 2);
  const eviction_decision d = p->evict(c.input());
  // 25% of 20 = 5: the segment's 2 newest (18, 19) + its 3 best voted.
  EXPECT_EQ(kept(d, 0), concat({3, 7, 11, 18, 19}, range(20, 30)));
}

TEST(segmented_policy, rows_with_dead_slots_split_per_row) {
  kv_case c = kv_case::contiguous(14, 1, 2);
  c.kill_front(1, 5);  // row 1: positions 5..13
  const std::unique_ptr<kv_policy> p = segmented("none", {segment(0, 10, "window:budget=0.5,sinks=1,slack=0")});
  const eviction_decision d = p->evict(c.input());
  ASSERT_FALSE(d.empty());
  EXPECT_EQ(kept(d, 0), concat({0}, range(6, 14)));
  EXPECT_EQ(kept(d, 1), range(5, 14));  // its 5 live segment tokens fit the budget of 5
}

TEST(segmented_policy, once_at_the_prompts_end_acts_despite_the_slack) {
  kv_case c = kv_case::contiguous(30);
  c.block_size = 100;
  c.use_window(2);
  c.weight(0, 1, 3) = 1.0f;
  const std::unique_ptr<kv_policy> p =
      segmented("none", {segment(0, 20, "snapkv:budget=0.25,window=2,kernel=1,once=1")});
  EXPECT_TRUE(p->evict(c.input()).empty());
  c.prompt_done_now = true;
  const eviction_decision d = p->evict(c.input());
  ASSERT_FALSE(d.empty());
  EXPECT_EQ(d.count[0], 5 + 10);
}

TEST(segmented_policy, cluster_anchors_of_every_part_map_back) {
  kv_case c = kv_case::contiguous(24, 1, 2);
  for (int r = 0; r < 2; ++r) {
    for (int s = 0; s < 24; ++s) c.total(r, s) = static_cast<float>((s * 7 + r * 3) % 11);
  }
  const std::unique_ptr<kv_policy> p =
      segmented("cluster:budget=0.5,recent=2,k=1,slack=0", {segment(0, 12, "cluster:budget=8,recent=4,k=2")});
  const eviction_decision d = p->evict(c.input());
  ASSERT_EQ(d.fold, kv_fold::cluster);
  ASSERT_EQ(d.anchors_per_row, 3);
  for (int r = 0; r < 2; ++r) {
    const std::vector<std::int32_t> k = kept(d, r);
    const std::vector<std::int32_t> a = test::anchors_of(d, r);
    EXPECT_LT(a[0], 12);  // the segment's two
    EXPECT_LT(a[1], 12);
    EXPECT_GE(a[2], 12);  // the base's one
    for (const std::int32_t s : a) EXPECT_TRUE(std::binary_search(k.begin(), k.end(), s)) << s;
    EXPECT_EQ(d.count[r], 8 + 6);
  }
}

TEST(segmented_policy, no_segments_is_the_base_policy) {
  const kv_case c = three_parts_case();
  const result<std::unique_ptr<kv_policy>> p = make_segmented_policy(spec_of("h2o:budget=0.5,slack=0"), {});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(kept((*p)->evict(c.input()), 0), kept(test::make_policy("h2o:budget=0.5,slack=0")->evict(c.input()), 0));
}

TEST(segmented_policy, all_none_is_not_lossy) {
  const kv_case c = kv_case::contiguous(30);
  const std::unique_ptr<kv_policy> p = segmented("none", {segment(0, 10, "none")});
  EXPECT_FALSE(p->lossy());
  EXPECT_TRUE(p->evict(c.input()).empty());
}

TEST(segmented_policy, what_cannot_compose_is_refused) {
  EXPECT_THAT(segmented_error("none", {segment(0, 10, "none"), segment(5, 15, "none")}),
              HasSubstr("segment [5, 15): segments must be sorted and disjoint"));
  EXPECT_THAT(segmented_error("none", {segment(5, 5, "none")}), HasSubstr("segment [5, 5): empty or negative"));
  EXPECT_THAT(segmented_error("none", {segment(-1, 5, "none")}), HasSubstr("empty or negative"));
  EXPECT_THAT(segmented_error("h2o", {segment(0, 10, "merge")}),
              HasSubstr("the base policy (h2o) folds evicted tokens differently from segment [0, 10) (merge)"));
  EXPECT_THAT(segmented_error("none", {segment(0, 10, "window:positions=cache")}),
              HasSubstr("segment [0, 10): window:positions=cache: positions=cache cannot be combined with segments"));
  EXPECT_THAT(segmented_error("window:positions=cache", {segment(0, 10, "none")}),
              HasSubstr("the base policy: window:positions=cache"));
  EXPECT_EQ(segmented_error("none", {segment(0, 10, "h2o:bugdet=1")}),
            "segment [0, 10): h2o: unknown parameter 'bugdet'; known: budget, slack, chunk, recent");
  EXPECT_THAT(segmented_error("none", {segment(0, 10, "lru")}), HasSubstr("segment [0, 10): unknown KV policy 'lru'"));
  // A "none" part folds nothing: it composes with anything.
  EXPECT_NE(segmented("merge", {segment(0, 10, "none")}), nullptr);
  EXPECT_NE(segmented("window", {segment(0, 10, "h2o"), segment(10, 20, "snapkv")}), nullptr);
}

}  // namespace
}  // namespace pagoda
