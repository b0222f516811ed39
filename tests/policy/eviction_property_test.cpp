// Property test: every policy on random inputs (several layers and heads,
// dead slots, slots out of position order, ties in the statistics, missing
// observation windows). Every decision is well formed, rows keep exactly what
// the policy's budget says, and the tokens a policy promises to keep (sinks,
// the newest) are kept.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <set>

#include "policy/eviction_internal.h"
#include "policy/kv_policy.h"
#include "policy/policy_test_util.h"

namespace pagoda {
namespace {

using test::kv_case;

int uniform(std::mt19937& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// A sequence as eviction might have left it: per row, some dead slots in
// front and live positions with gaps, sometimes not in slot order.
kv_case random_case(std::mt19937& rng) {
  kv_case c;
  c.n_layers = uniform(rng, 1, 3);
  c.n_kv_heads = uniform(rng, 1, 3);
  c.n_slots = uniform(rng, 0, 48);
  c.n_seen = c.n_slots + uniform(rng, 0, 30);
  c.n_prompt = uniform(rng, 0, c.n_seen);
  c.n_new = uniform(rng, 1, 8);
  c.block_size = uniform(rng, 1, 16);
  c.prompt_done_now = uniform(rng, 0, 3) == 0;
  c.per_row = true;
  const bool shuffled = uniform(rng, 0, 4) == 0;
  const bool same_rows = uniform(rng, 0, 2) == 0;
  std::vector<std::int32_t> all(static_cast<std::size_t>(c.n_seen));
  std::iota(all.begin(), all.end(), 0);
  for (int r = 0; r < c.n_rows(); ++r) {
    const int dead = same_rows || c.n_slots == 0 ? 0 : uniform(rng, 0, c.n_slots);
    std::vector<std::int32_t> live;
    if (r == 0 || !same_rows) {
      std::sample(all.begin(), all.end(), std::back_inserter(live), c.n_slots - dead, rng);
      if (shuffled) std::shuffle(live.begin(), live.end(), rng);
    } else {
      live.assign(c.positions.begin(), c.positions.begin() + c.n_slots);
    }
    c.positions.insert(c.positions.end(), static_cast<std::size_t>(dead), -1);
    c.positions.insert(c.positions.end(), live.begin(), live.end());
  }
  const bool coarse = uniform(rng, 0, 1) == 0;  // few distinct values: many ties
  const auto value = [&] { return coarse ? 0.5f * uniform(rng, 0, 3) : std::uniform_real_distribution<float>(0, 1)(rng); };
  c.totals.resize(static_cast<std::size_t>(c.n_slots * c.n_rows()));
  for (float& t : c.totals) t = value();
  if (uniform(rng, 0, 4) > 0) {
    c.use_window(uniform(rng, 0, 6));
    for (float& w : c.window.window) w = value();
  }
  return c;
}

// Row r's live slots sorted by position, oldest first.
std::vector<std::int32_t> live_by_position(const eviction_input& in, int r) {
  policy_detail::row_slots rs;
  policy_detail::live_slots(in, r, rs);
  return rs.slot;
}

bool keeps(const eviction_decision& d, int r, std::int32_t slot) {
  const std::span<const std::int32_t> row = d.row(r);
  return std::binary_search(row.begin(), row.end(), slot);
}

// What any decision must be.
void check_well_formed(const eviction_input& in, const eviction_decision& d, const std::string& what) {
  if (d.empty()) return;
  ASSERT_EQ(d.n_rows, in.n_rows()) << what;
  ASSERT_EQ(d.count.size(), static_cast<std::size_t>(d.n_rows)) << what;
  ASSERT_EQ(d.keep.size(), static_cast<std::size_t>(d.n_rows * d.width)) << what;
  EXPECT_EQ(d.width, *std::max_element(d.count.begin(), d.count.end())) << what;
  bool evicts = false;
  for (int r = 0; r < d.n_rows; ++r) {
    const std::span<const std::int32_t> row = d.row(r);
    EXPECT_LE(static_cast<int>(row.size()), policy_detail::live_count(in, r)) << what;
    evicts |= static_cast<int>(row.size()) < policy_detail::live_count(in, r);
    for (std::size_t i = 0; i < row.size(); ++i) {
      ASSERT_TRUE(row[i] >= 0 && row[i] < in.n_slots) << what << ": row " << r << " slot " << row[i];
      EXPECT_GE(in.row_positions(r)[row[i]], 0) << what << ": row " << r << " keeps dead slot " << row[i];
      if (i > 0) {
        EXPECT_LT(row[i - 1], row[i]) << what << ": row " << r << " not sorted and unique";
      }
    }
  }
  EXPECT_TRUE(evicts) << what << ": a decision that evicts nothing";
  if (d.anchors_per_row > 0) {
    EXPECT_EQ(d.fold, kv_fold::cluster) << what;
    ASSERT_EQ(d.anchors.size(), static_cast<std::size_t>(d.n_rows * d.anchors_per_row)) << what;
    for (int r = 0; r < d.n_rows; ++r) {
      const std::vector<std::int32_t> a = test::anchors_of(d, r);
      EXPECT_EQ(std::set<std::int32_t>(a.begin(), a.end()).size(), a.size()) << what << ": repeated anchor";
      for (const std::int32_t s : a) EXPECT_TRUE(keeps(d, r, s)) << what << ": anchor " << s << " not kept";
    }
  }
  if (d.reposition) {
    EXPECT_TRUE(d.uniform()) << what;
  }
}

struct flat_case {
  std::string spec;
  kv_budget budget;
  int slack;  // -1: not given (none: exact budgets)
  // The newest tokens a row keeping t must keep, and the oldest.
  std::function<int(const eviction_input&, int)> newest;
  std::function<int(int)> oldest;
  bool needs_window = false;
};

std::vector<flat_case> flat_cases() {
  const auto half = [](const eviction_input&, int t) { return (t + 1) / 2; };
  const auto none = [](int) { return 0; };
  return {
      {"window:budget=0.25,slack=0", {0.25, 0}, 0, [](const eviction_input&, int t) { return t - std::min(4, t - 1); },
       [](int t) { return std::min(4, t - 1); }},
      {"window:budget=5,sinks=2", {0, 5}, -1, [](const eviction_input&, int t) { return t - std::min(2, t - 1); },
       [](int t) { return std::min(2, t - 1); }},
      {"window:budget=0.5,sinks=0,positions=cache,slack=3", {0.5, 0}, 3, [](const eviction_input&, int t) { return t; },
       none},
      {"h2o:budget=0.25,slack=0", {0.25, 0}, 0, half, none},
      {"h2o:budget=7,recent=0.1", {0, 7}, -1,
       [](const eviction_input& in, int t) { return std::min(kv_budget{0.1, 0}.resolve(in.n_seen), t); }, none},
      {"merge:budget=12.5%,slack=0", {0.125, 0}, 0, half, none},
      {"cluster:budget=0.5,k=3,slack=2", {0.5, 0}, 2, half, none},
      {"snapkv:budget=0.25,window=3,kernel=3,slack=0", {0.25, 0}, 0,
       [](const eviction_input&, int t) { return std::min(3, t); }, none, true},
      {"snapkv:budget=6,window=16", {0, 6}, -1, [](const eviction_input&, int t) { return std::min(16, t); }, none,
       true},
  };
}

void check_flat(const flat_case& fc, const eviction_input& in, const eviction_decision& d) {
  const int target = fc.budget.resolve(in.n_seen);
  const int slack = std::max(fc.slack, 0);
  long long excess = 0;  // what the rows would lose in all: the slack is a mean per row
  for (int r = 0; r < in.n_rows(); ++r) excess += std::max(0, policy_detail::live_count(in, r) - target);
  const bool has_window = in.window != nullptr && in.window->n_window > 0;
  const bool over = slack == 0 ? excess >= 1 : excess >= static_cast<long long>(slack) * in.n_rows();
  const bool should_act = over && (!fc.needs_window || has_window);
  EXPECT_EQ(!d.empty(), should_act) << fc.spec << ": rows would lose " << excess << " slots";
  if (d.empty()) return;
  for (int r = 0; r < in.n_rows(); ++r) {
    const std::vector<std::int32_t> live = live_by_position(in, r);
    const int t = std::min(target, static_cast<int>(live.size()));
    EXPECT_EQ(d.count[static_cast<std::size_t>(r)], t) << fc.spec << ": row " << r;
    if (t == 0) continue;
    const int n_new = fc.newest(in, t);
    const int n_old = fc.oldest(t);
    for (int i = 0; i < n_new; ++i) {
      EXPECT_TRUE(keeps(d, r, live[live.size() - 1 - static_cast<std::size_t>(i)])) << fc.spec << ": a newest token";
    }
    for (int i = 0; i < n_old; ++i) {
      EXPECT_TRUE(keeps(d, r, live[static_cast<std::size_t>(i)])) << fc.spec << ": a sink";
    }
  }
}

TEST(eviction_property, flat_policies_on_random_inputs) {
  std::mt19937 rng(12);
  const std::vector<flat_case> cases = flat_cases();
  std::vector<std::unique_ptr<kv_policy>> policies;
  for (const flat_case& fc : cases) policies.push_back(test::make_policy(fc.spec));
  int acted = 0;
  for (int iter = 0; iter < 400; ++iter) {
    const kv_case c = random_case(rng);
    const eviction_input in = c.input();
    for (std::size_t i = 0; i < cases.size(); ++i) {
      const eviction_decision d = policies[i]->evict(in);
      acted += !d.empty();
      check_well_formed(in, d, cases[i].spec);
      check_flat(cases[i], in, d);
      if (::testing::Test::HasFailure()) FAIL() << "iteration " << iter << ", " << cases[i].spec;
    }
  }
  EXPECT_GT(acted, 1000);  // the cases do exercise eviction
}

// AdaKV's choice for one layer over an h2o base, written plainly: every
// head's candidates fully sorted, the floor from the top, then one walk down
// the joint order of all heads that skips full heads.
std::vector<std::vector<std::int32_t>> reference_ada(const eviction_input& in, int layer, int b) {
  struct cand {
    float key;
    std::int32_t pos;
    int head;
    std::int32_t slot;
  };
  const auto better = [](const cand& x, const cand& y) {
    if (x.key != y.key) return x.key > y.key;
    if (x.pos != y.pos) return x.pos > y.pos;
    return x.head < y.head;
  };
  const int cap = 2 * b;
  const int floor = static_cast<int>(0.2 * (b - (b + 1) / 2));
  const int n_heads = in.n_kv_heads;
  std::vector<std::vector<std::int32_t>> keep(static_cast<std::size_t>(n_heads));
  std::vector<int> room(static_cast<std::size_t>(n_heads));
  std::vector<cand> open;
  long long pool = static_cast<long long>(b) * n_heads;
  for (int h = 0; h < n_heads; ++h) {
    const int r = layer * n_heads + h;
    const std::vector<std::int32_t> live = live_by_position(in, r);
    const int n = static_cast<int>(live.size());
    const int protect = (std::min(b, n) + 1) / 2;
    std::vector<cand> mine;
    for (int i = 0; i < n; ++i) {
      const std::int32_t s = live[static_cast<std::size_t>(i)];
      if (i >= n - protect) {
        keep[static_cast<std::size_t>(h)].push_back(s);
        continue;
      }
      const float t = in.totals[static_cast<std::size_t>(s) * in.n_rows() + r];
      mine.push_back({std::isnan(t) ? -INFINITY : t, in.row_positions(r)[s], h, s});
    }
    std::sort(mine.begin(), mine.end(), better);
    const int most = std::min(static_cast<int>(mine.size()), cap - protect);
    const int nf = std::min(floor, most);
    for (int i = 0; i < nf; ++i) keep[static_cast<std::size_t>(h)].push_back(mine[static_cast<std::size_t>(i)].slot);
    room[static_cast<std::size_t>(h)] = most - nf;
    open.insert(open.end(), mine.begin() + nf, mine.end());
    pool -= protect + nf;
  }
  std::sort(open.begin(), open.end(), better);
  for (const cand& c : open) {
    if (pool <= 0) break;
    if (room[static_cast<std::size_t>(c.head)] == 0) continue;
    --room[static_cast<std::size_t>(c.head)];
    --pool;
    keep[static_cast<std::size_t>(c.head)].push_back(c.slot);
  }
  for (auto& k : keep) std::sort(k.begin(), k.end());
  return keep;
}

// pyramid: the layers' budgets add up as documented; AdaKV's heads share
// each layer's total, above their floors and below their cap.
void check_pyramid(const eviction_input& in, const eviction_decision& d, bool ada, const std::string& what) {
  if (d.empty()) return;
  const int target = kv_budget{0.25, 0}.resolve(in.n_seen);
  const std::vector<int> budgets =
      policy_detail::pyramid_layer_budgets(in.n_layers, target, policy_detail::pyramid_default_ratio(in.n_layers), 1,
                                           std::max(1, in.n_seen));
  for (int l = 0; l < in.n_layers; ++l) {
    const int b = budgets[static_cast<std::size_t>(l)];
    const int cap = 2 * b;
    const int recent = (b + 1) / 2;  // h2o's default split of the layer budget
    const int floor = static_cast<int>(0.2 * (b - recent));
    long long kept = 0;
    long long want = 0;
    for (int h = 0; h < in.n_kv_heads; ++h) {
      const int r = l * in.n_kv_heads + h;
      const std::vector<std::int32_t> live = live_by_position(in, r);
      const int n = static_cast<int>(live.size());
      const int count = d.count[static_cast<std::size_t>(r)];
      kept += count;
      want += std::min(n, cap);
      if (!ada) {
        EXPECT_EQ(count, std::min(b, n)) << what << ": row " << r;
        continue;
      }
      const int protect = std::min((std::min(b, n) + 1) / 2, n);
      EXPECT_GE(count, std::min(n, protect + floor)) << what << ": row " << r << " below its floor";
      EXPECT_LE(count, cap) << what << ": row " << r << " past its cap";
      for (int i = 0; i < protect; ++i) {
        EXPECT_TRUE(keeps(d, r, live[live.size() - 1 - static_cast<std::size_t>(i)])) << what << ": a recent token";
      }
    }
    if (ada) {
      EXPECT_EQ(kept, std::min<long long>(static_cast<long long>(b) * in.n_kv_heads, want)) << what;
      const std::vector<std::vector<std::int32_t>> ref = reference_ada(in, l, b);
      for (int h = 0; h < in.n_kv_heads; ++h) {
        EXPECT_EQ(test::kept(d, l * in.n_kv_heads + h), ref[static_cast<std::size_t>(h)])
            << what << ": layer " << l << " head " << h << " differs from the plain AdaKV choice";
      }
    }
  }
}

TEST(eviction_property, pyramid_on_random_inputs) {
  std::mt19937 rng(34);
  const std::unique_ptr<kv_policy> plain = test::make_policy("pyramid:base=h2o,ada=0,slack=0");
  const std::unique_ptr<kv_policy> ada = test::make_policy("pyramid:base=h2o,slack=0");
  const std::unique_ptr<kv_policy> snap = test::make_policy("pyramid:window=2,slack=1");
  int acted = 0;
  for (int iter = 0; iter < 400; ++iter) {
    const kv_case c = random_case(rng);
    const eviction_input in = c.input();
    const eviction_decision a = plain->evict(in);
    const eviction_decision b = ada->evict(in);
    const eviction_decision s = snap->evict(in);
    acted += !a.empty() + !b.empty() + !s.empty();
    check_well_formed(in, a, "pyramid ada=0");
    check_well_formed(in, b, "pyramid ada=1");
    check_well_formed(in, s, "pyramid snapkv");
    check_pyramid(in, a, false, "pyramid ada=0");
    check_pyramid(in, b, true, "pyramid ada=1");
    if (::testing::Test::HasFailure()) FAIL() << "iteration " << iter;
  }
  EXPECT_GT(acted, 300);
}

// Segments: a "none" segment is kept whole; a window segment keeps its
// budget of its own length and its sink.
TEST(eviction_property, segmented_on_random_inputs) {
  std::mt19937 rng(56);
  int acted = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const kv_case c = random_case(rng);
    const eviction_input in = c.input();
    const std::int32_t a = uniform(rng, 0, std::max(0, c.n_seen - 2));
    const std::int32_t b = uniform(rng, a + 1, std::max(a + 1, c.n_seen));
    const std::int32_t e = uniform(rng, b + 1, b + 20);
    result<kv_policy_spec> none_spec = parse_kv_policy_spec("none");
    result<kv_policy_spec> win_spec = parse_kv_policy_spec("window:budget=0.5,sinks=1");
    result<kv_policy_spec> base = parse_kv_policy_spec(uniform(rng, 0, 1) ? "h2o:slack=0" : "snapkv:slack=0");
    const std::vector<kv_segment> segs = {kv_segment{a, b, *none_spec}, kv_segment{b, e, *win_spec}};
    result<std::unique_ptr<kv_policy>> p = make_segmented_policy(*base, segs);
    ASSERT_TRUE(p.ok()) << p.error().message();
    const eviction_decision d = (*p)->evict(in);
    acted += !d.empty();
    check_well_formed(in, d, "segmented");
    if (d.empty()) continue;
    const int seg_target = kv_budget{0.5, 0}.resolve(std::max(0, std::min(e, c.n_seen) - b));
    for (int r = 0; r < in.n_rows(); ++r) {
      int in_win = 0;
      std::int32_t oldest = -1;
      for (const std::int32_t s : live_by_position(in, r)) {
        const std::int32_t pos = in.row_positions(r)[s];
        if (pos >= a && pos < b) {
          EXPECT_TRUE(keeps(d, r, s)) << "the none segment lost position " << pos;
        }
        if (pos >= b && pos < e) {
          in_win += 1;
          if (oldest < 0) oldest = s;
        }
      }
      int kept_win = 0;
      for (const std::int32_t s : d.row(r)) {
        const std::int32_t pos = in.row_positions(r)[s];
        kept_win += pos >= b && pos < e;
      }
      EXPECT_EQ(kept_win, std::min(in_win, seg_target)) << "window segment [" << b << ", " << e << ") row " << r;
      if (oldest >= 0 && seg_target > 1) {
        EXPECT_TRUE(keeps(d, r, oldest)) << "the segment's sink";
      }
    }
    if (::testing::Test::HasFailure()) FAIL() << "iteration " << iter;
  }
  EXPECT_GT(acted, 50);
}

}  // namespace
}  // namespace pagoda
