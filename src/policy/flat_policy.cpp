// The eviction policies with one budget for every row: window (StreamingLLM),
// h2o, snapkv, merge and cluster. They differ in their scorer (which tokens
// matter) and in how evicted tokens leave (kv_fold); the selection is shared.
#include <algorithm>

#include "policy/eviction_internal.h"

namespace pagoda::policy_detail {
namespace {

struct flat_options {
  kv_budget budget;
  eviction_common common;
  kv_fold fold = kv_fold::drop;
  int cluster_k = 0;        // kv_fold::cluster: anchors per row wanted
  bool reposition = false;  // window:positions=cache
};

class flat_policy final : public scored_policy {
 public:
  flat_policy(kv_policy_spec spec, std::unique_ptr<row_scorer> scorer, flat_options opts)
      : scored_policy(std::move(spec), opts.common, std::move(scorer)), opts_(opts) {}

  kv_fold fold() const override { return opts_.fold; }
  int kept_at(int n_seen) const override { return opts_.budget.resolve(n_seen); }
  bool repositions() const override { return opts_.reposition; }

  void min_keep(const eviction_input& in, std::span<const int> live, std::span<int> out) const override {
    std::fill(out.begin(), out.end(), opts_.budget.resolve(in.n_seen));
  }

  eviction_decision decide(const eviction_input& in) const override {
    if (in.n_slots == 0 || !scorer_->ready(in)) return {};
    const int target = opts_.budget.resolve(in.n_seen);
    const int n_rows = in.n_rows();
    std::vector<int> live(static_cast<std::size_t>(n_rows));
    for (int r = 0; r < n_rows; ++r) live[static_cast<std::size_t>(r)] = live_count(in, r);
    const int n_anchors = anchors_per_row(in, target, live);
    decision_builder out(n_rows);
    row_choice work;
    for (int r = 0; r < n_rows; ++r) {
      choose_row(*scorer_, in, r, target, n_anchors, work, out.row(r), n_anchors > 0 ? &out.anchors(r) : nullptr);
    }
    eviction_decision d = out.finish(live, opts_.fold);
    d.reposition = opts_.reposition && !d.empty() && d.uniform();
    return d;
  }

 private:
  // Cluster: every row gets the same number of anchors, at most k and at most
  // what its score-chosen (non-protected) kept slots number in every row (so
  // none when a row holds nothing: its evicted tokens are then dropped).
  int anchors_per_row(const eviction_input& in, int target, std::span<const int> live) const {
    if (opts_.fold != kv_fold::cluster) return 0;
    int n = opts_.cluster_k;
    for (const int n_live : live) {
      const int t = std::min(target, n_live);
      n = t <= 0 ? 0 : std::min(n, t - std::clamp(scorer_->protected_newest(in, t), 0, t));
    }
    return std::max(n, 0);
  }

  flat_options opts_;
};

// budget, slack and chunk, which every eviction policy takes.
status read_common(param_reader& params, flat_options& opts) {
  PAGODA_ASSIGN_OR_RETURN(opts.budget, params.budget("budget", kv_budget{0.25, 0}));
  return read_eviction_common(params, opts.common);
}

result<std::unique_ptr<kv_policy>> finish(const kv_policy_spec& spec, param_reader& params,
                                          std::unique_ptr<row_scorer> scorer, const flat_options& opts) {
  PAGODA_RETURN_IF_ERROR(params.finish());
  return std::unique_ptr<kv_policy>(std::make_unique<flat_policy>(spec, std::move(scorer), opts));
}

// h2o, merge and cluster: H2O's choice, different folds.
result<std::unique_ptr<kv_policy>> make_h2o_like(const kv_policy_spec& spec, kv_fold fold) {
  param_reader params(spec);
  flat_options opts;
  opts.fold = fold;
  PAGODA_RETURN_IF_ERROR(read_common(params, opts));
  if (fold == kv_fold::cluster) {
    PAGODA_ASSIGN_OR_RETURN(opts.cluster_k, params.integer("k", 8, 1, 4096));
  }
  PAGODA_ASSIGN_OR_RETURN(std::unique_ptr<row_scorer> scorer, make_h2o_scorer(params));
  return finish(spec, params, std::move(scorer), opts);
}

}  // namespace

result<std::unique_ptr<kv_policy>> make_window_policy(const kv_policy_spec& spec) {
  param_reader params(spec);
  flat_options opts;
  PAGODA_RETURN_IF_ERROR(read_common(params, opts));
  PAGODA_ASSIGN_OR_RETURN(const int sinks, params.integer("sinks", 4, 0, 1 << 20));
  PAGODA_ASSIGN_OR_RETURN(const std::string positions, params.choice("positions", "keep", {"keep", "cache"}));
  opts.reposition = positions == "cache";
  return finish(spec, params, make_window_scorer(sinks), opts);
}

result<std::unique_ptr<kv_policy>> make_h2o_policy(const kv_policy_spec& spec) {
  return make_h2o_like(spec, kv_fold::drop);
}

result<std::unique_ptr<kv_policy>> make_merge_policy(const kv_policy_spec& spec) {
  return make_h2o_like(spec, kv_fold::nearest);
}

result<std::unique_ptr<kv_policy>> make_cluster_policy(const kv_policy_spec& spec) {
  return make_h2o_like(spec, kv_fold::cluster);
}

result<std::unique_ptr<kv_policy>> make_snapkv_policy(const kv_policy_spec& spec) {
  param_reader params(spec);
  flat_options opts;
  PAGODA_RETURN_IF_ERROR(read_common(params, opts));
  PAGODA_ASSIGN_OR_RETURN(std::unique_ptr<row_scorer> scorer, make_snapkv_scorer(params));
  return finish(spec, params, std::move(scorer), opts);
}

}  // namespace pagoda::policy_detail
