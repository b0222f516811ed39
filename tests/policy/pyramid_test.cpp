// pyramid: PyramidKV's layer budgets and AdaKV's head budgets, on
// hand-built statistics.
#include <gtest/gtest.h>

#include <numeric>

#include "policy/eviction_internal.h"
#include "policy/kv_policy.h"
#include "policy/policy_test_util.h"

namespace pagoda {
namespace {

using policy_detail::pyramid_layer_budgets;
using test::concat;
using test::kept;
using test::kv_case;
using test::make_policy;
using test::range;

int sum(const std::vector<int>& v) { return std::accumulate(v.begin(), v.end(), 0); }

TEST(pyramid_budgets, linear_with_depth_around_the_mean) {
  // weights 1.6, 1.2, 0.8, 0.4 (first / last = 4, mean 1)
  EXPECT_EQ(pyramid_layer_budgets(4, 10, 4.0, 1, 100), (std::vector<int>{16, 12, 8, 4}));
  EXPECT_EQ(pyramid_layer_budgets(2, 10, 3.0, 1, 100), (std::vector<int>{15, 5}));
  EXPECT_EQ(pyramid_layer_budgets(3, 7, 1.0, 1, 100), (std::vector<int>{7, 7, 7}));
  EXPECT_EQ(pyramid_layer_budgets(1, 9, 4.0, 1, 100), (std::vector<int>{9}));
}

TEST(pyramid_budgets, rounding_keeps_the_sum) {
  // 3 layers, ratio 4: weights 1.6, 1.0, 0.4 -> 8, 5, 2 for a mean of 5.
  EXPECT_EQ(pyramid_layer_budgets(3, 5, 4.0, 1, 100), (std::vector<int>{8, 5, 2}));
  for (int layers = 1; layers <= 12; ++layers) {
    for (int target = 1; target <= 40; target += 3) {
      const std::vector<int> b = pyramid_layer_budgets(layers, target, 4.0, 1, 1000);
      EXPECT_EQ(sum(b), layers * target) << layers << " layers, target " << target;
      EXPECT_TRUE(std::is_sorted(b.rbegin(), b.rend())) << "not falling with depth";
    }
  }
}

TEST(pyramid_budgets, bounds_push_the_difference_to_other_layers) {
  // 16 would pass 12: the first layer stops there and the rest grow (then the
  // second stops too): 12, 12, 10.67 -> 11, 5.33 -> 5.
  EXPECT_EQ(pyramid_layer_budgets(4, 10, 4.0, 1, 12), (std::vector<int>{12, 12, 11, 5}));
  // A floor lifts the last layers and the first give way.
  const std::vector<int> lifted = pyramid_layer_budgets(4, 10, 4.0, 6, 100);
  EXPECT_EQ(sum(lifted), 40);
  EXPECT_GE(*std::min_element(lifted.begin(), lifted.end()), 6);
  // More than the bounds allow: everything at the bound.
  EXPECT_EQ(pyramid_layer_budgets(3, 50, 4.0, 1, 20), (std::vector<int>{20, 20, 20}));
}

// Two layers, one head: layer 0 keeps 15, layer 1 keeps 5 (budget 10, ratio 3).
TEST(pyramid_policy, layers_keep_their_budget_the_way_their_base_does) {
  kv_case c = kv_case::contiguous(20, 2, 1);
  for (int s = 0; s < 20; ++s) c.total(0, s) = static_cast<float>(s);
  c.total(1, 0) = 10;
  c.total(1, 3) = 9;
  const eviction_decision d = make_policy("pyramid:base=h2o,budget=10,ratio=3,ada=0,slack=0")->evict(c.input());
  ASSERT_FALSE(d.empty());
  EXPECT_EQ(d.count, (std::vector<std::int32_t>{15, 5}));
  EXPECT_EQ(d.width, 15);
  // layer 0: 8 recent (12..19) + the 7 heaviest of 0..11 (5..11)
  EXPECT_EQ(kept(d, 0), range(5, 20));
  // layer 1: 3 recent + 0 and 3
  EXPECT_EQ(kept(d, 1), (std::vector<int>{0, 3, 17, 18, 19}));
}

// One layer, two heads, budget 6 each, 2 recent, floor 50% of the 4 scored:
// head 0's scores are all higher, so the shared pool goes to it.
kv_case ada_case() {
  kv_case c = kv_case::contiguous(20, 1, 2);
  for (int s = 0; s < 20; ++s) {
    c.total(0, s) = 10.0f + static_cast<float>(s);
    c.total(1, s) = 0.01f * static_cast<float>(s);
  }
  return c;
}

TEST(pyramid_policy, ada_shares_a_layer_budget_by_score_above_each_heads_floor) {
  const kv_case c = ada_case();
  const eviction_decision d = make_policy("pyramid:base=h2o,budget=6,recent=2,floor=0.5,slack=0")->evict(c.input());
  ASSERT_FALSE(d.empty());
  // Each head: 18, 19 protected, its 2 best (16, 17) as the floor; the 4 left
  // of 12 go to head 0 (15, 14, 13, 12).
  EXPECT_EQ(kept(d, 0), range(12, 20));
  EXPECT_EQ(kept(d, 1), range(16, 20));
  EXPECT_EQ(d.count[0] + d.count[1], 12);
}

TEST(pyramid_policy, ada_caps_a_head_at_cap_times_its_budget) {
  const kv_case c = ada_case();
  const eviction_decision d =
      make_policy("pyramid:base=h2o,budget=6,recent=2,floor=0.5,cap=1,slack=0")->evict(c.input());
  EXPECT_EQ(kept(d, 0), range(14, 20));
  EXPECT_EQ(kept(d, 1), range(14, 20));
  // cap 1.2: head 0 stops at 7 (floor of 7.2); the last slot of the pool goes to head 1.
  const eviction_decision wider =
      make_policy("pyramid:base=h2o,budget=6,recent=2,floor=0.5,cap=1.2,slack=0")->evict(c.input());
  EXPECT_EQ(wider.count, (std::vector<std::int32_t>{7, 5}));
}

TEST(pyramid_policy, ada_floor_zero_can_leave_a_head_its_recent_tokens_only) {
  const kv_case c = ada_case();
  const eviction_decision d =
      make_policy("pyramid:base=h2o,budget=6,recent=2,floor=0,cap=4,slack=0")->evict(c.input());
  EXPECT_EQ(kept(d, 0), range(10, 20));
  EXPECT_EQ(kept(d, 1), range(18, 20));
}

TEST(pyramid_policy, ada_hands_a_short_heads_budget_to_the_others) {
  kv_case c = ada_case();
  c.kill_front(1, 17);  // head 1 holds 3 tokens
  const eviction_decision d = make_policy("pyramid:base=h2o,budget=6,recent=2,floor=0.5,slack=0")->evict(c.input());
  EXPECT_EQ(kept(d, 1), range(17, 20));
  EXPECT_EQ(kept(d, 0), range(11, 20));  // 12 - 3
}

// AdaKV's widest head is known only after scoring: the slack rule estimates
// it (each head of a layer gives up the same share), so the steps after a
// compaction do not decide again until `slack` tokens have come.
TEST(pyramid_policy, ada_acts_once_per_slack_after_compacting) {
  kv_case c = ada_case();
  const std::unique_ptr<kv_policy> p = make_policy("pyramid:base=h2o,budget=6,recent=2,floor=0.5,slack=4");
  const eviction_decision first = p->evict(c.input());
  ASSERT_EQ(first.count, (std::vector<std::int32_t>{8, 4}));
  for (int k = 1; k <= 4; ++k) {
    kv_case next = c;
    next.compact(first, k);
    // The estimate is exact here: each head is k over what it kept.
    std::vector<int> estimate(2);
    const std::vector<int> live = {8 + k, 4 + k};
    dynamic_cast<const policy_detail::eviction_policy&>(*p).min_keep(next.input(), live, estimate);
    EXPECT_EQ(estimate, (std::vector<int>{8, 4})) << k << " tokens after compacting";
    const eviction_decision d = p->evict(next.input());
    EXPECT_EQ(d.empty(), k < 4) << k << " tokens after compacting";
    if (!d.empty()) {
      EXPECT_EQ(d.count, (std::vector<std::int32_t>{8, 4}));
      EXPECT_EQ(d.width, next.n_slots - 4);
    }
  }
}

TEST(pyramid_policy, snapkv_base_by_default) {
  kv_case c = kv_case::contiguous(40, 2, 2);
  c.use_window(4);
  for (int r = 0; r < 4; ++r) c.weight(r, 3, 5 + r) = 1.0f;
  const std::unique_ptr<kv_policy> p = make_policy("pyramid:budget=12,window=4,kernel=1,slack=0,ratio=4");
  EXPECT_EQ(p->needs().window_rows, 4);
  const eviction_decision d = p->evict(c.input());
  ASSERT_FALSE(d.empty());
  // layers: 12 x 1.6 = 19.2 and 4.8 -> 19, 5 (sum 24)
  EXPECT_EQ(d.count[0] + d.count[1], 2 * 19);
  EXPECT_EQ(d.count[2] + d.count[3], 2 * 5);
  for (int r = 0; r < 4; ++r) {
    const std::vector<std::int32_t> k = kept(d, r);
    EXPECT_TRUE(std::binary_search(k.begin(), k.end(), 5 + r)) << "row " << r << " lost its voted token";
    for (int s = 36; s < 40; ++s) EXPECT_TRUE(std::binary_search(k.begin(), k.end(), s)) << "row " << r;
  }
}

// Rows with their own budgets: the slack is what the rows lose on average
// (here 5 and 15 of 20), so compaction still comes once per `slack` tokens.
TEST(pyramid_policy, slack_is_the_mean_loss_per_row) {
  kv_case c = kv_case::contiguous(20, 2, 1);
  c.total(0, 0) = 1;
  EXPECT_TRUE(make_policy("pyramid:base=h2o,budget=10,ratio=3,ada=0,slack=11")->evict(c.input()).empty());
  EXPECT_FALSE(make_policy("pyramid:base=h2o,budget=10,ratio=3,ada=0,slack=10")->evict(c.input()).empty());
  EXPECT_FALSE(make_policy("pyramid:base=h2o,budget=10,ratio=3,ada=0")->evict(c.input()).empty());
}

}  // namespace
}  // namespace pagoda

namespace pagoda::policy_detail {
namespace {

// Without a ratio, pyramid's first-to-last layer budget ratio follows depth:
// PyramidKV's 4 from 32 layers on, flat for one layer, 1.39 for stories260K's 5.
TEST(pyramid, default_ratio_follows_depth) {
  EXPECT_DOUBLE_EQ(pyramid_default_ratio(1), 1.0);
  EXPECT_NEAR(pyramid_default_ratio(5), 1.0 + 12.0 / 31.0, 1e-12);
  EXPECT_DOUBLE_EQ(pyramid_default_ratio(32), 4.0);
  EXPECT_DOUBLE_EQ(pyramid_default_ratio(80), 4.0);
  // The budgets it gives a 5-layer model still fall with depth and keep the mean.
  const std::vector<int> b = pyramid_layer_budgets(5, 100, pyramid_default_ratio(5), 1, 1000);
  EXPECT_EQ(std::accumulate(b.begin(), b.end(), 0), 500);
  for (std::size_t l = 1; l < b.size(); ++l) EXPECT_LT(b[l], b[l - 1]);
}

}  // namespace
}  // namespace pagoda::policy_detail
