// The spec parser, the adaptive k and the acceptance rule (speculative.h).
#include "spec/speculative.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "policy/kv_policy.h"
#include "policy/policy_params_internal.h"

namespace pagoda {

std::string spec_config::to_string() const {
  if (!enabled()) return "none";
  return fmt::format("{}:k={},n={},min_n={}", drafter, k, n, min_n);
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
  if (spec.name == "draft" || spec.name == "self" || spec.name == "early-exit")
    return error(errc::unsupported, "drafter '{}' is not built yet; this engine drafts with: ngram", spec.name);
  if (spec.name != "ngram")
    return error(errc::invalid_argument, "unknown drafter '{}'; known: ngram (or none)", spec.name);
  c.drafter = spec.name;
  policy_detail::param_reader r(spec);
  PAGODA_ASSIGN_OR_RETURN(c.k, r.integer("k", c.k, 1, k_max_draft_tokens));
  PAGODA_ASSIGN_OR_RETURN(c.n, r.integer("n", c.n, 1, 16));
  PAGODA_ASSIGN_OR_RETURN(c.min_n, r.integer("min_n", std::min(c.min_n, c.n), 1, 16));
  PAGODA_RETURN_IF_ERROR(r.finish());
  if (c.min_n > c.n) return r.bad_value("min_n", std::to_string(c.min_n), fmt::format("must not exceed n={}", c.n));
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
