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

namespace {

struct pyramid_options {
  kv_budget budget;
  int slack = -1;
  double ratio = 4.0;
  bool ada = true;
  double floor = 0.2;  // AdaKV: each head's guaranteed share of its layer budget's scored part
  double cap = 2.0;    // AdaKV: a head keeps at most cap x its layer budget (memory follows the widest row)
};

// One head of a layer during AdaKV's joint choice.
struct head_work {
  row_choice choice;
  std::vector<int> order;  // candidate indices, best first
  int n_protected = 0;
  int n_picked = 0;  // candidates kept so far: order[0 .. n_picked)
  int most = 0;      // candidates it may keep at most
};

class pyramid_policy final : public scored_policy {
 public:
  pyramid_policy(kv_policy_spec spec, std::unique_ptr<row_scorer> scorer, pyramid_options opts)
      : scored_policy(std::move(spec), opts.slack, std::move(scorer)), opts_(opts) {}

  std::vector<int> layer_budgets(const eviction_input& in) const {
    return pyramid_layer_budgets(in.n_layers, opts_.budget.resolve(in.n_seen), opts_.ratio, 1, std::max(1, in.n_seen));
  }
  // The most one head of a layer with budget b may keep.
  int head_cap(int b) const { return std::max(b, static_cast<int>(std::floor(opts_.cap * b))); }

  void min_keep(const eviction_input& in, std::span<int> out) const override {
    const std::vector<int> budgets = layer_budgets(in);
    const int n_heads = in.n_kv_heads;
    for (int l = 0; l < in.n_layers; ++l) {
      const int b = budgets[static_cast<std::size_t>(l)];
      int floor = b;
      if (opts_.ada) {  // what the layer keeps in all, shared evenly: the widest head keeps at least that
        long long kept = 0;
        for (int h = 0; h < n_heads; ++h) kept += std::min(live_count(in, l * n_heads + h), head_cap(b));
        floor = static_cast<int>(std::min<long long>(static_cast<long long>(b) * n_heads, kept) / n_heads);
      }
      std::fill_n(out.begin() + l * n_heads, n_heads, floor);
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
  void join_heads(std::vector<head_work>& heads, long long pool) const;

  pyramid_options opts_;
};

// AdaKV within one layer: each head keeps its protected newest tokens and the
// floor of its best candidates; the rest of the layer's budget x n_heads goes
// to the best candidates of all heads together, no head past its cap.
void pyramid_policy::decide_layer_ada(const eviction_input& in, int layer, int budget, decision_builder& out) const {
  const int n_heads = in.n_kv_heads;
  const int floor = static_cast<int>(
      std::floor(opts_.floor * (budget - std::clamp(scorer_->protected_newest(in, budget), 0, budget))));
  std::vector<head_work> heads(static_cast<std::size_t>(n_heads));
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
    w.order.resize(static_cast<std::size_t>(m));
    std::iota(w.order.begin(), w.order.end(), 0);
    sort_best_first(w.choice.scores, c.pos, w.order);
    w.most = std::min(m, head_cap(budget) - w.n_protected);
    w.n_picked = std::min(floor, w.most);
    pool -= w.n_protected + w.n_picked;
  }
  join_heads(heads, pool);
  for (int h = 0; h < n_heads; ++h) {
    const head_work& w = heads[static_cast<std::size_t>(h)];
    std::vector<std::int32_t>& keep = out.row(layer * n_heads + h);
    keep.assign(w.choice.live.slot.end() - w.n_protected, w.choice.live.slot.end());
    for (int i = 0; i < w.n_picked; ++i) {
      keep.push_back(w.choice.cands.slot[static_cast<std::size_t>(w.order[static_cast<std::size_t>(i)])]);
    }
  }
}

// Hands `pool` more candidates to the heads, best score first across heads
// (ties: newer position, then lower head), skipping heads at their cap. Each
// head's candidates are sorted already, so the best remaining one of each
// head is next in its own order: a merge of the heads' lists.
void pyramid_policy::join_heads(std::vector<head_work>& heads, long long pool) const {
  const auto better = [&](int a, int b) {  // heads a and b by their next candidate
    const head_work& x = heads[static_cast<std::size_t>(a)];
    const head_work& y = heads[static_cast<std::size_t>(b)];
    const int i = x.order[static_cast<std::size_t>(x.n_picked)];
    const int j = y.order[static_cast<std::size_t>(y.n_picked)];
    const float sx = x.choice.scores[static_cast<std::size_t>(i)];
    const float sy = y.choice.scores[static_cast<std::size_t>(j)];
    const float kx = std::isnan(sx) ? -INFINITY : sx;
    const float ky = std::isnan(sy) ? -INFINITY : sy;
    if (kx != ky) return kx > ky;
    const std::int32_t px = x.choice.cands.pos[static_cast<std::size_t>(i)];
    const std::int32_t py = y.choice.cands.pos[static_cast<std::size_t>(j)];
    if (px != py) return px > py;
    return a < b;
  };
  while (pool > 0) {
    int best = -1;
    for (int h = 0; h < static_cast<int>(heads.size()); ++h) {
      const head_work& w = heads[static_cast<std::size_t>(h)];
      if (w.n_picked >= w.most) continue;
      if (best < 0 || better(h, best)) best = h;
    }
    if (best < 0) return;
    ++heads[static_cast<std::size_t>(best)].n_picked;
    --pool;
  }
}

}  // namespace

result<std::unique_ptr<kv_policy>> make_pyramid_policy(const kv_policy_spec& spec) {
  param_reader params(spec);
  pyramid_options opts;
  PAGODA_ASSIGN_OR_RETURN(const std::string base, params.choice("base", "snapkv", {"snapkv", "h2o"}));
  PAGODA_ASSIGN_OR_RETURN(opts.budget, params.budget("budget", kv_budget{0.25, 0}));
  PAGODA_ASSIGN_OR_RETURN(opts.slack, params.integer("slack", -1, 0, 1 << 24));
  PAGODA_ASSIGN_OR_RETURN(opts.ratio, params.number("ratio", 4.0, 1.0, 1e4));
  PAGODA_ASSIGN_OR_RETURN(opts.ada, params.flag("ada", true));
  PAGODA_ASSIGN_OR_RETURN(opts.floor, params.number("floor", 0.2, 0.0, 1.0));
  PAGODA_ASSIGN_OR_RETURN(opts.cap, params.number("cap", 2.0, 1.0, 1e6));
  result<std::unique_ptr<row_scorer>> scorer = base == "h2o" ? make_h2o_scorer(params) : make_snapkv_scorer(params);
  if (!scorer.ok()) return scorer.error();
  PAGODA_RETURN_IF_ERROR(params.finish());
  return std::unique_ptr<kv_policy>(std::make_unique<pyramid_policy>(spec, std::move(scorer).value(), opts));
}

}  // namespace pagoda::policy_detail
