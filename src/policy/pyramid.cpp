// pyramid: PyramidKV's per-layer budgets (falling linearly with depth around
// the mean budget) over an h2o or snapkv base, and optionally AdaKV's per-head
// budgets within each layer (the layer's heads compete for its slots by score,
// each head guaranteed a floor). Rows then keep different counts: the shorter
// ones have dead slots at their front (kv_policy.h).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/assert.h"
#include "policy/eviction_internal.h"

namespace pagoda::policy_detail {

std::vector<int> pyramid_layer_budgets(int n_layers, int target, double ratio, int lo, int hi) {
  PAGODA_ASSERT(n_layers > 0 && lo >= 0 && lo <= hi && ratio >= 1.0, "pyramid of {} layers, budgets in [{}, {}]",
                n_layers, lo, hi);
  const double total = std::clamp(static_cast<double>(n_layers) * target, static_cast<double>(n_layers) * lo,
                                  static_cast<double>(n_layers) * hi);
  // Shape: weights falling linearly from 2r/(1+r) to 2/(1+r): mean 1, first/last r.
  std::vector<double> weight(static_cast<std::size_t>(n_layers), 1.0);
  for (int l = 0; n_layers > 1 && l < n_layers; ++l) {
    const double depth = static_cast<double>(l) / (n_layers - 1);
    weight[static_cast<std::size_t>(l)] = (2.0 * ratio - depth * 2.0 * (ratio - 1.0)) / (1.0 + ratio);
  }
  // budget_l = clamp(scale * weight_l, lo, hi); the sum grows with scale, so
  // bisect for the scale whose sum is `total`.
  const auto sum_at = [&](double scale) {
    double s = 0;
    for (const double w : weight) s += std::clamp(scale * w, static_cast<double>(lo), static_cast<double>(hi));
    return s;
  };
  double low = 0;
  double high = static_cast<double>(hi) / *std::min_element(weight.begin(), weight.end()) + 1.0;
  for (int i = 0; i < 100; ++i) {
    const double mid = 0.5 * (low + high);
    (sum_at(mid) < total ? low : high) = mid;
  }
  // Integers: floors, then the remainder by largest fraction (the shallower
  // layer first on ties), never past hi.
  std::vector<int> out(weight.size());
  std::vector<double> frac(weight.size());
  long long assigned = 0;
  for (std::size_t l = 0; l < weight.size(); ++l) {
    const double b = std::clamp(high * weight[l], static_cast<double>(lo), static_cast<double>(hi));
    out[l] = static_cast<int>(std::floor(b));
    frac[l] = b - out[l];
    assigned += out[l];
  }
  std::vector<int> order(weight.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return frac[a] > frac[b]; });
  auto remainder = static_cast<long long>(std::llround(total)) - assigned;
  while (remainder > 0) {
    bool grew = false;
    for (const int l : order) {
      if (remainder == 0) break;
      if (out[static_cast<std::size_t>(l)] >= hi) continue;
      ++out[static_cast<std::size_t>(l)];
      --remainder;
      grew = true;
    }
    if (!grew) break;
  }
  return out;
}

double pyramid_default_ratio(int n_layers) {
  // PyramidKV's ratio of first to last layer budget (4) was chosen on models
  // of 32 layers and more. On 5-layer stories260K lower ratios did better,
  // monotonically from 1 to 4 (bench/RESULTS.md, tuned on half of the dev
  // documents), so a shallower model gets a flatter pyramid: 4 from 32 layers
  // on, 1 + 3 (L - 1) / 31 below.
  return 1.0 + 3.0 * std::min(1.0, static_cast<double>(std::max(n_layers, 1) - 1) / 31.0);
}

namespace {

struct pyramid_options {
  kv_budget budget;
  eviction_common common;
  double ratio = 0.0;  // 0: by depth (pyramid_default_ratio)
  bool ada = true;
  double floor = 0.2;  // AdaKV: each head's guaranteed share of its layer budget's scored part
  double cap = 2.0;    // AdaKV: a head keeps at most cap x its layer budget (memory follows the widest row)
};

// One head of a layer during AdaKV's joint choice.
struct head_work {
  row_choice choice;       // its live slots, candidates and their scores
  std::vector<int> order;  // candidate indices: order[0 .. n_floor) is its floor
  int n_protected = 0;
  int n_floor = 0;
  int room = 0;          // candidates it may still take after its floor (its cap)
  std::vector<int> won;  // candidate indices it took in the joint choice
};

// A candidate in the joint choice over a layer's heads.
struct layer_cand {
  float key = 0;  // rank_key(score)
  std::int32_t pos = 0;
  int head = 0;
  int index = 0;  // into its head's candidates
};

// Best first: score, then the newer position, then the lower head.
bool better_cand(const layer_cand& a, const layer_cand& b) {
  if (a.key != b.key) return a.key > b.key;
  if (a.pos != b.pos) return a.pos > b.pos;
  return a.head < b.head;
}

class pyramid_policy final : public scored_policy {
 public:
  pyramid_policy(kv_policy_spec spec, std::unique_ptr<row_scorer> scorer, pyramid_options opts)
      : scored_policy(std::move(spec), opts.common, std::move(scorer)), opts_(opts) {}

  // The mean budget: the widest row keeps more (the first layer's, an AdaKV
  // head up to `cap` times that), so a prompt's chunks are sized from the mean.
  int kept_at(int n_seen) const override { return opts_.budget.resolve(n_seen); }

  std::vector<int> layer_budgets(const eviction_input& in) const {
    const double ratio = opts_.ratio > 0 ? opts_.ratio : pyramid_default_ratio(in.n_layers);
    return pyramid_layer_budgets(in.n_layers, opts_.budget.resolve(in.n_seen), ratio, 1, std::max(1, in.n_seen));
  }
  // The most one head of a layer with budget b may keep.
  int head_cap(int b) const { return std::max(b, static_cast<int>(std::floor(opts_.cap * b))); }

  void min_keep(const eviction_input& in, std::span<const int> live, std::span<int> out) const override {
    const std::vector<int> budgets = layer_budgets(in);
    const int n_heads = in.n_kv_heads;
    for (int l = 0; l < in.n_layers; ++l) {
      const int b = budgets[static_cast<std::size_t>(l)];
      const auto row = out.begin() + l * n_heads;
      if (!opts_.ada) {
        std::fill_n(row, n_heads, b);
        continue;
      }
      // AdaKV: each head gives up the same share of what the layer must lose
      // (exact while the scores keep their order between compactions).
      long long layer_live = 0;
      long long can_keep = 0;
      for (int h = 0; h < n_heads; ++h) {
        row[h] = live[static_cast<std::size_t>(l * n_heads + h)];
        layer_live += row[h];
        can_keep += std::min(row[h], head_cap(b));
      }
      const long long lose = layer_live - std::min(static_cast<long long>(b) * n_heads, can_keep);
      const auto each = static_cast<int>((lose + n_heads - 1) / n_heads);
      for (int h = 0; h < n_heads; ++h) row[h] = std::clamp(row[h] - each, 0, head_cap(b));
    }
  }

  eviction_decision decide(const eviction_input& in) const override {
    if (in.n_slots == 0 || !scorer_->ready(in)) return {};
    const std::vector<int> budgets = layer_budgets(in);
    const int n_rows = in.n_rows();
    std::vector<int> live(static_cast<std::size_t>(n_rows));
    for (int r = 0; r < n_rows; ++r) live[static_cast<std::size_t>(r)] = live_count(in, r);
    decision_builder out(n_rows);
    row_choice work;
    for (int l = 0; l < in.n_layers; ++l) {
      const int b = budgets[static_cast<std::size_t>(l)];
      if (opts_.ada) {
        decide_layer_ada(in, l, b, out);
        continue;
      }
      for (int h = 0; h < in.n_kv_heads; ++h) {
        const int r = l * in.n_kv_heads + h;
        choose_row(*scorer_, in, r, b, 0, work, out.row(r), nullptr);
      }
    }
    return out.finish(live, kv_fold::drop);
  }

 private:
  void decide_layer_ada(const eviction_input& in, int layer, int budget, decision_builder& out) const;

  pyramid_options opts_;
};

// Hands `pool` more candidates to the heads: the best of all the heads'
// open candidates (better_cand), each head up to its room. As a greedy walk
// down the joint order that skips full heads, but by selection: take the best
// `pool`; if some heads got more than their room, they keep their best `room`
// and leave, and the rest of the pool is chosen again among the others.
void join_heads(std::vector<head_work>& heads, std::vector<layer_cand>& open, long long pool) {
  std::vector<int> count(heads.size());
  std::vector<layer_cand> mine;
  while (pool > 0 && !open.empty()) {
    const std::size_t take = static_cast<std::size_t>(std::min<long long>(pool, static_cast<long long>(open.size())));
    if (take < open.size()) {
      std::nth_element(open.begin(), open.begin() + static_cast<std::ptrdiff_t>(take - 1), open.end(), better_cand);
    }
    std::fill(count.begin(), count.end(), 0);
    for (std::size_t i = 0; i < take; ++i) ++count[static_cast<std::size_t>(open[i].head)];
    bool over = false;
    for (std::size_t h = 0; h < heads.size(); ++h) over |= count[h] > heads[h].room;
    if (!over) {
      for (std::size_t i = 0; i < take; ++i) heads[static_cast<std::size_t>(open[i].head)].won.push_back(open[i].index);
      return;
    }
    for (std::size_t h = 0; h < heads.size(); ++h) {
      head_work& w = heads[h];
      if (count[h] <= w.room) continue;
      mine.clear();
      for (std::size_t i = 0; i < take; ++i) {
        if (open[i].head == static_cast<int>(h)) mine.push_back(open[i]);
      }
      if (w.room > 0) {
        std::nth_element(mine.begin(), mine.begin() + (w.room - 1), mine.end(), better_cand);
        for (int i = 0; i < w.room; ++i) w.won.push_back(mine[static_cast<std::size_t>(i)].index);
      }
      pool -= w.room;
      w.room = 0;
    }
    std::erase_if(open, [&](const layer_cand& c) { return heads[static_cast<std::size_t>(c.head)].room == 0; });
  }
}

// AdaKV within one layer: each head keeps its protected newest tokens and the
// floor of its best candidates; the rest of the layer's budget x n_heads goes
// to the best candidates of all heads together, no head past its cap.
void pyramid_policy::decide_layer_ada(const eviction_input& in, int layer, int budget, decision_builder& out) const {
  const int n_heads = in.n_kv_heads;
  const int floor = static_cast<int>(
      std::floor(opts_.floor * (budget - std::clamp(scorer_->protected_newest(in, budget), 0, budget))));
  std::vector<head_work> heads(static_cast<std::size_t>(n_heads));
  std::vector<layer_cand> open;
  long long pool = static_cast<long long>(budget) * n_heads;
  for (int h = 0; h < n_heads; ++h) {
    head_work& w = heads[static_cast<std::size_t>(h)];
    const int r = layer * n_heads + h;
    live_slots(in, r, w.choice.live);
    const int n = w.choice.live.size();
    const int t = std::min(budget, n);
    w.n_protected = t > 0 ? std::clamp(scorer_->protected_newest(in, t), 0, t) : 0;
    const int m = n - w.n_protected;
    row_slots& c = w.choice.cands;
    c.slot.assign(w.choice.live.slot.begin(), w.choice.live.slot.begin() + m);
    c.pos.assign(w.choice.live.pos.begin(), w.choice.live.pos.begin() + m);
    w.choice.scores.assign(static_cast<std::size_t>(m), 0.0f);
    if (m > 0) scorer_->score(in, r, c, w.choice.scores);
    const int most = std::min(m, head_cap(budget) - w.n_protected);
    w.n_floor = std::min(floor, most);
    w.room = most - w.n_floor;
    partition_best(w.choice.scores, w.n_floor, w.order);
    pool -= w.n_protected + w.n_floor;
    for (std::size_t i = static_cast<std::size_t>(w.n_floor); i < w.order.size(); ++i) {
      const int k = w.order[i];
      open.push_back({rank_key(w.choice.scores[static_cast<std::size_t>(k)]), c.pos[static_cast<std::size_t>(k)], h, k});
    }
  }
  join_heads(heads, open, pool);
  for (int h = 0; h < n_heads; ++h) {
    const head_work& w = heads[static_cast<std::size_t>(h)];
    std::vector<std::int32_t>& keep = out.row(layer * n_heads + h);
    keep.assign(w.choice.live.slot.end() - w.n_protected, w.choice.live.slot.end());
    for (int i = 0; i < w.n_floor; ++i) {
      keep.push_back(w.choice.cands.slot[static_cast<std::size_t>(w.order[static_cast<std::size_t>(i)])]);
    }
    for (const int k : w.won) keep.push_back(w.choice.cands.slot[static_cast<std::size_t>(k)]);
  }
}

}  // namespace

result<std::unique_ptr<kv_policy>> make_pyramid_policy(const kv_policy_spec& spec) {
  param_reader params(spec);
  pyramid_options opts;
  PAGODA_ASSIGN_OR_RETURN(const std::string base, params.choice("base", "snapkv", {"snapkv", "h2o"}));
  PAGODA_ASSIGN_OR_RETURN(opts.budget, params.budget("budget", kv_budget{0.25, 0}));
  PAGODA_RETURN_IF_ERROR(read_eviction_common(params, opts.common));
  PAGODA_ASSIGN_OR_RETURN(opts.ratio, params.number("ratio", 0.0, 1.0, 1e4));
  PAGODA_ASSIGN_OR_RETURN(opts.ada, params.flag("ada", true));
  PAGODA_ASSIGN_OR_RETURN(opts.floor, params.number("floor", 0.2, 0.0, 1.0));
  PAGODA_ASSIGN_OR_RETURN(opts.cap, params.number("cap", 2.0, 1.0, 1e6));
  result<std::unique_ptr<row_scorer>> scorer = base == "h2o" ? make_h2o_scorer(params) : make_snapkv_scorer(params);
  if (!scorer.ok()) return scorer.error();
  PAGODA_RETURN_IF_ERROR(params.finish());
  return std::unique_ptr<kv_policy>(std::make_unique<pyramid_policy>(spec, std::move(scorer).value(), opts));
}

}  // namespace pagoda::policy_detail
