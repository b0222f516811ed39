// Speculative rejection sampling (rejection.h).
#include "spec/rejection.h"

#include <cstdint>

#include "core/assert.h"

namespace pagoda {

namespace {

// max(0, p - q), normalised by its draw: the tokens p gives more than q did,
// by increasing id (both inputs are).
token_distribution residual(const token_distribution& p, const token_distribution& q) {
  token_distribution r;
  auto qi = q.tokens.begin();
  for (const auto& [t, pt] : p.tokens) {
    while (qi != q.tokens.end() && qi->first < t) ++qi;
    const float qt = qi != q.tokens.end() && qi->first == t ? qi->second : 0.0f;
    if (pt > qt) r.tokens.emplace_back(t, pt - qt);
  }
  return r;
}

}  // namespace

sampling_params draft_sampling_params(const sampling_params& target) {
  sampling_params d = target;
  // splitmix64's finaliser of the seed past a fixed offset: a bijection, so
  // distinct requests' drafts keep distinct streams, and none is the seed's own.
  std::uint64_t z = target.seed + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  d.seed = z ^ (z >> 31);
  return d;
}

draft_draw draw_draft(sampler& draft, std::span<const float> logits, std::span<const token_id> prompt,
                      std::span<const token_id> output) {
  draft_draw out;
  out.q = draft.probabilities(logits, prompt, output);
  out.token = draft.draw_from(out.q);
  return out;
}

std::vector<token_id> accept_distribution_drafts(std::span<const token_id> drafts,
                                                 std::span<const token_distribution> q_rows,
                                                 const std::function<token_distribution(int row)>& p_of_row,
                                                 sampler& target) {
  PAGODA_ASSERT(q_rows.size() == drafts.size(), "{} drafts with {} draft distributions", drafts.size(), q_rows.size());
  std::vector<token_id> out;
  for (std::size_t i = 0;; ++i) {
    const token_distribution p = p_of_row(static_cast<int>(i));
    PAGODA_ASSERT(!p.tokens.empty(), "the target's distribution of row {} is empty", i);
    if (i == drafts.size()) {
      out.push_back(target.draw_from(p));  // every draft accepted: the bonus token
      return out;
    }
    const token_id d = drafts[i];
    const float pd = p.of(d);
    const float qd = q_rows[i].of(d);
    PAGODA_ASSERT(qd > 0.0f, "draft {} at position {} has no probability under its own distribution", d, i);
    // u < p/q as u q < p (no division); a ratio of 1 or more accepts without
    // a draw, and p(d) = 0 rejects without one (greedy uses no randomness).
    if (pd > 0.0f && (pd >= qd || target.uniform() * qd < pd)) {
      out.push_back(d);
      continue;
    }
    // Rejected: p(d) < q(d), so p gives more than q somewhere else. Only
    // rounding (p and q are normalised apart) can leave nothing there: p
    // itself is then the draw, within that rounding.
    const token_distribution r = residual(p, q_rows[i]);
    out.push_back(target.draw_from(r.tokens.empty() ? p : r));
    return out;
  }
}

}  // namespace pagoda
