// Speculative rejection sampling for drafts drawn from a distribution (a
// draft model's, the target reading a compressed view of its own KV, early
// exit): the emitted tokens follow the target's distribution exactly, however
// the draft's differs from it (Leviathan et al. 2023; Chen et al. 2023).
//
// The draft side draws each draft token d_i from its own q_i and keeps q_i;
// the target side computes p_i from its logits row after the i-th token of
// the step and accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)). At
// the first rejection it emits a token drawn from max(0, p_i - q_i),
// normalised, and stops; when all k drafts are accepted it emits one more
// drawn from p_k. Each emitted token then has the target's law given the
// tokens before it: P(emit x) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x).
//
// Point-mass drafts (the n-gram drafter's) are the case q_i = point(d_i);
// accept_point_drafts (speculative.h) is that case with the sampler's random
// stream consumed as plain decoding does.
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "model/sampler.h"
#include "pagoda/request.h"
#include "pagoda/types.h"

namespace pagoda {

// The sampling parameters of a request's draft: the target's cuts, penalties
// and bias (q is shaped as p is, so that they agree as often as they can),
// with a seed of its own. The draft's RNG must be independent of the
// target's: with one stream, a draft's draw and the acceptance test of the
// same position would read the same numbers, and the emitted law would no
// longer be p.
sampling_params draft_sampling_params(const sampling_params& target);

// A draft token and the distribution it was drawn from.
struct draft_draw {
  token_id token;
  token_distribution q;
};

// The draft side of one position: q from the draft model's logits row under
// the draft's sampler (draft_sampling_params; prompt and output are what its
// penalties read, the verified tokens and the drafts before this one), and a
// token drawn from q with that sampler's RNG. Greedy: q is the point mass on
// the argmax, and no randomness is used.
draft_draw draw_draft(sampler& draft, std::span<const float> logits, std::span<const token_id> prompt,
                      std::span<const token_id> output);

// Verifies drafts[0, k) drawn from q_rows[0, k) against the target and
// returns the emitted tokens: the accepted drafts, then the token drawn at the
// first rejection or, when every draft is accepted, the bonus token (1 to
// k + 1 tokens). `target` is the request's own sampler: its RNG makes the
// acceptance tests and the draws.
//
// p_of_row(i) is the target's distribution after the i-th token of the step
// (the last verified token, then drafts[0, i)): sampler::probabilities of
// logits row i, with drafts[0, i) appended to the output its penalties read.
// It is called once per row, in order, and only for the rows reached: row i
// only once drafts[0, i) are accepted, so a runner computes each p when it is
// needed and may append drafts[i - 1] to the sequence's history then.
//
// Greedy (p and q point masses on their argmax) uses no randomness and emits
// exactly the target's argmax chain: a draft is accepted iff it is the
// target's argmax, and a rejection emits the target's argmax.
// REQUIRES: q_rows.size() == drafts.size(), q_rows[i].of(drafts[i]) > 0 (the
// draft was drawn from it), and every p has a token.
std::vector<token_id> accept_distribution_drafts(std::span<const token_id> drafts,
                                                 std::span<const token_distribution> q_rows,
                                                 const std::function<token_distribution(int row)>& p_of_row,
                                                 sampler& target);

}  // namespace pagoda
