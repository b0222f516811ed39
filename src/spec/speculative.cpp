// The spec parser, the adaptive k and the acceptance rule (speculative.h).
#include "spec/speculative.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "policy/kv_policy.h"
#include "policy/policy_params_internal.h"

namespace pagoda {

const char* mirror_kv_type(draft_view view) {
  switch (view) {
    case draft_view::int4: return "int4";
    case draft_view::int2: return "int2";
    default: return nullptr;
  }
}

std::string spec_config::to_string() const {
  if (!enabled()) return "none";
  if (drafter == "ngram") return fmt::format("{}:k={},n={},min_n={}", drafter, k, n, min_n);
  if (drafter == "draft") return fmt::format("draft:k={}", k);
  std::string s = fmt::format("{}:k={},layers={}", drafter, k, layers);
  if (view == draft_view::window) s += fmt::format(",view=window,sinks={},window={}", sinks, window);
  if (view == draft_view::quest) s += fmt::format(",view=quest,budget={}", budget);
  if (const char* type = mirror_kv_type(view)) s += fmt::format(",view={}", type);
  return s;
}

std::string quest_view_spec(const spec_config& config) {
  // Quest reads everything below a minimum context (its default grows with
  // 1 / budget); a draft view reads its budget from the first block on.
  return fmt::format("quest:budget={},min_context=0", config.budget);
}

result<spec_config> parse_spec_config(std::string_view text) {
  // The same NAME:k=v grammar as --kv-policy, and the same parameter reader
  // (ranges and unknown keys reported with the drafter's and the key's name).
  PAGODA_ASSIGN_OR_RETURN(const kv_policy_spec spec, parse_kv_policy_spec(text));
  spec_config c;
  if (spec.is_none()) {
    if (!spec.params.empty()) return error(errc::invalid_argument, "none: takes no parameters");
    return c;
  }
  if (spec.name != "ngram" && spec.name != "self" && spec.name != "early-exit" && spec.name != "draft")
    return error(errc::invalid_argument, "unknown drafter '{}'; known: ngram, draft, self, early-exit (or none)", spec.name);
  c.drafter = spec.name;
  policy_detail::param_reader r(spec);
  PAGODA_ASSIGN_OR_RETURN(c.k, r.integer("k", c.k, 1, k_max_draft_tokens));
  if (c.drafter == "draft") {  // the draft model is the engine's (--draft-model)
    PAGODA_RETURN_IF_ERROR(r.finish());
    return c;
  }
  if (c.drafter == "ngram") {
    PAGODA_ASSIGN_OR_RETURN(c.n, r.integer("n", c.n, 1, 16));
    PAGODA_ASSIGN_OR_RETURN(c.min_n, r.integer("min_n", std::min(c.min_n, c.n), 1, 16));
    PAGODA_RETURN_IF_ERROR(r.finish());
    if (c.min_n > c.n) return r.bad_value("min_n", std::to_string(c.min_n), fmt::format("must not exceed n={}", c.n));
    return c;
  }
  // The model drafters: the layer count is checked against the model by the
  // engine (it does not know it here); 0 = every layer.
  PAGODA_ASSIGN_OR_RETURN(c.layers, r.integer("layers", 0, 0, 4096));
  if (c.drafter == "early-exit" && c.layers == 0)
    return error(errc::invalid_argument, "early-exit: layers=L is required (the first L layers draft)");
  const std::string_view fallback = c.drafter == "self" ? "window" : "full";
  PAGODA_ASSIGN_OR_RETURN(const std::string view, r.choice("view", fallback, {"full", "window", "quest", "int4", "int2"}));
  c.view = view == "window" ? draft_view::window
           : view == "quest" ? draft_view::quest
           : view == "int4"  ? draft_view::int4
           : view == "int2"  ? draft_view::int2
                             : draft_view::full;
  if (c.view == draft_view::window) {
    PAGODA_ASSIGN_OR_RETURN(c.sinks, r.integer("sinks", c.sinks, 0, 1 << 20));
    PAGODA_ASSIGN_OR_RETURN(c.window, r.integer("window", c.window, 1, 1 << 24));
  }
  if (c.view == draft_view::quest) {
    PAGODA_ASSIGN_OR_RETURN(c.budget, r.number("budget", c.budget, 1e-6, 1.0));
  }
  PAGODA_RETURN_IF_ERROR(r.finish());
  if (c.drafter == "self" && c.view == draft_view::full && c.layers == 0)
    return error(errc::invalid_argument, "self: view=full with every layer is the target itself; name a view (window, quest, int4, int2) or layers=L");
  return c;
}

int adaptive_k::next() const {
  return std::clamp(static_cast<int>(std::floor(mean_)) + 1, 1, k_max_);
}

void adaptive_k::observe(int n_proposed, int n_accepted) {
  if (n_proposed <= 0) return;  // no guess this step: nothing learned about the drafts
  // Weight 1/2: a sequence that moves from repeating its prompt to new text
  // drops to short drafts within a few steps, and climbs back as fast.
  // Every draft accepted says the step could have carried more: counted as
  // one more, or a sequence at k = 1 would never climb back (mean -> 1, k = 1).
  const int x = n_accepted >= n_proposed ? n_accepted + 1 : n_accepted;
  mean_ = 0.5 * mean_ + 0.5 * x;
}

std::vector<token_id> accept_point_drafts(std::span<const token_id> drafts, const std::function<token_id(int row)>& draw) {
  std::vector<token_id> out;
  for (std::size_t i = 0;; ++i) {
    const token_id t = draw(static_cast<int>(i));
    out.push_back(t);
    if (i == drafts.size() || t != drafts[i]) return out;
  }
}

}  // namespace pagoda
