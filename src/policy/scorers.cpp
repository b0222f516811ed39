// The row scorers (eviction_internal.h): which tokens of a row StreamingLLM,
// H2O and SnapKV keep first.
#include <algorithm>
#include <deque>

#include "core/assert.h"
#include "policy/eviction_internal.h"

namespace pagoda::policy_detail {
namespace {

// StreamingLLM: the first `sinks` tokens and the newest. As scores: the older
// candidate ranks higher, so the top ones are the oldest; every other token is
// protected as "newest". A row keeps at least its newest token: with a budget
// of `sinks` or less, sinks give way to it.
class window_scorer final : public row_scorer {
 public:
  explicit window_scorer(int sinks) : sinks_(sinks) {}
  kv_policy_needs needs() const override { return {}; }
  int protected_newest(const eviction_input& in, int target) const override {
    return target - std::min(sinks_, target - 1);
  }
  void score(const eviction_input& in, int r, const row_slots& cands, std::vector<float>& out) const override {
    // cands are oldest first; rank by index, not by position, which a float
    // would round past 2^24.
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = -static_cast<float>(i);
  }

 private:
  int sinks_ = 4;
};

// H2O: the `recent` newest tokens, then the heavy hitters by accumulated
// attention. `recent` defaults to half the row's target (rounded up), as the
// H2O paper splits its budget evenly between heavy hitters and recent tokens.
class totals_scorer final : public row_scorer {
 public:
  explicit totals_scorer(std::optional<kv_budget> recent) : recent_(recent) {}
  kv_policy_needs needs() const override {
    kv_policy_needs n;
    n.totals = true;
    return n;
  }
  bool ready(const eviction_input& in) const override {
    // The policy asked for totals (needs()), so the engine must provide them:
    // scoring zeros would be garbage that looks like a decision.
    PAGODA_ASSERT(!in.totals.empty(),
                  "h2o-style eviction needs accumulated attention (kv_policy_needs::totals) and the input has none");
    return true;
  }
  int protected_newest(const eviction_input& in, int target) const override {
    if (!recent_) return (target + 1) / 2;
    return std::min(recent_->resolve(in.n_seen), target);
  }
  void score(const eviction_input& in, int r, const row_slots& cands, std::vector<float>& out) const override {
    const auto n_rows = static_cast<std::size_t>(in.n_rows());
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = in.totals[static_cast<std::size_t>(cands.slot[i]) * n_rows + static_cast<std::size_t>(r)];
    }
  }

 private:
  std::optional<kv_budget> recent_;
};

// SnapKV: the last `window` query rows of the last step vote (the sum of their
// attention weights per slot), votes are max-pooled over `kernel` neighbouring
// candidates (in position order, which is slot order in the cache), and the
// newest `window` tokens (the observation window's own) are kept. When the
// step had fewer query rows, those vote; the newest `window` tokens are still
// kept.
class votes_scorer final : public row_scorer {
 public:
  votes_scorer(int window, int kernel, bool once) : window_(window), kernel_(kernel), once_(once) {}
  kv_policy_needs needs() const override {
    kv_policy_needs n;
    n.window_rows = window_;
    return n;
  }
  // once=1: only while the prompt is computed: between the chunks of a
  // prompt longer than the budget (by the slack rule, as once=0) and, whatever
  // the slack, on the step that computed its last token; never in decode.
  act_when when(const eviction_input& in) const override {
    if (!once_) return act_when::slack;
    if (in.prompt_done_now) return act_when::now;
    return in.n_seen < in.n_prompt ? act_when::slack : act_when::never;
  }
  int observation_rows() const override { return window_; }
  bool ready(const eviction_input& in) const override {
    const attention_stats* w = in.window;
    if (w == nullptr || w->n_window <= 0) return false;  // no observation this step: keep everything
    PAGODA_ASSERT(w->n_layers == in.n_layers && w->n_kv_heads == in.n_kv_heads && w->n_kv == in.n_slots,
                  "observation window of {} layers x {} heads x {} slots for an input of {} x {} x {}", w->n_layers,
                  w->n_kv_heads, w->n_kv, in.n_layers, in.n_kv_heads, in.n_slots);
    PAGODA_ASSERT(w->window.size() == static_cast<std::size_t>(in.n_rows()) * w->n_window * w->n_kv,
                  "observation window holds {} weights", w->window.size());
    return true;
  }
  int protected_newest(const eviction_input& in, int target) const override { return std::min(window_, target); }
  void score(const eviction_input& in, int r, const row_slots& cands, std::vector<float>& out) const override;

 private:
  int window_ = 16;
  int kernel_ = 7;
  bool once_ = false;
};

void votes_scorer::score(const eviction_input& in, int r, const row_slots& cands, std::vector<float>& out) const {
  const attention_stats& w = *in.window;
  const auto n_kv = static_cast<std::size_t>(w.n_kv);
  const int n_obs = std::min(window_, w.n_window);
  const float* rows = w.window.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(w.n_window) * n_kv;
  std::vector<float> votes(out.size(), 0.0f);
  for (int q = w.n_window - n_obs; q < w.n_window; ++q) {
    const float* weights = rows + static_cast<std::size_t>(q) * n_kv;
    for (std::size_t i = 0; i < votes.size(); ++i) votes[i] += weights[cands.slot[i]];
  }
  // Max-pool: out[i] = max(votes[i - half .. i + half]), clipped at the ends,
  // with a deque of indices whose votes fall (each index enters and leaves once).
  const int half = kernel_ / 2;
  const int m = static_cast<int>(votes.size());
  std::deque<int> best;
  int next = 0;
  for (int i = 0; i < m; ++i) {
    for (; next < m && next <= i + half; ++next) {
      while (!best.empty() && votes[static_cast<std::size_t>(best.back())] <= votes[static_cast<std::size_t>(next)]) {
        best.pop_back();
      }
      best.push_back(next);
    }
    while (best.front() < i - half) best.pop_front();
    out[static_cast<std::size_t>(i)] = votes[static_cast<std::size_t>(best.front())];
  }
}

}  // namespace

std::unique_ptr<row_scorer> make_window_scorer(int sinks) { return std::make_unique<window_scorer>(sinks); }

result<std::unique_ptr<row_scorer>> make_h2o_scorer(param_reader& params) {
  PAGODA_ASSIGN_OR_RETURN(const std::optional<kv_budget> recent, params.optional_budget("recent"));
  return std::unique_ptr<row_scorer>(std::make_unique<totals_scorer>(recent));
}

result<std::unique_ptr<row_scorer>> make_snapkv_scorer(param_reader& params) {
  PAGODA_ASSIGN_OR_RETURN(const int window, params.integer("window", 16, 1, 1 << 16));
  PAGODA_ASSIGN_OR_RETURN(const int kernel, params.integer("kernel", 7, 1, 1023));
  if (kernel % 2 == 0) return params.bad_value("kernel", std::to_string(kernel), "the pooling kernel must be odd");
  PAGODA_ASSIGN_OR_RETURN(const bool once, params.flag("once", false));
  return std::unique_ptr<row_scorer>(std::make_unique<votes_scorer>(window, kernel, once));
}

}  // namespace pagoda::policy_detail
