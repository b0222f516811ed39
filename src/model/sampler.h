// Token sampling: logit bias and repetition/frequency/presence penalties,
// greedy, temperature, top-k, top-p, min-p, seeded (sampling_params, in
// pagoda/request.h, says in which order and with which semantics).
//
// No step sorts the vocabulary. Without top-k, a draw weighs every token in
// vectorised passes (the maximum, then exp and sums by blocks of ids) and
// picks by the cumulative sum in id order: min-p is a threshold on each
// weight; top-p buckets the tokens by logit and sorts only the bucket where
// the cumulative weight reaches top_p. Top-k keeps its k best in one pass
// (a heap of k) and draws among them alone.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "pagoda/request.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

token_id argmax(std::span<const float> logits);

// exp(x) for x <= 0: the weight a draw gives a token whose tempered logit is
// x below the best one's. A branch-free polynomial the compiler vectorises;
// std::exp is its reference twin: within 1 ulp of exp rounded from double on
// every float of [-87, 0] (checked exhaustively once; sampler_test samples
// them). Exactly 1 at 0; 0 below -87 and for NaN (a token e^-87 times less
// likely than the best one is never drawn, and no weight is subnormal). Not
// monotone to the ulp, so the cuts order tokens by logit, never by weight.
float sampling_weight(float x);

// A probability distribution over token ids, kept sparse: the tokens a draw
// can return, by increasing id, each with its probability (positive, summing
// to 1 up to rounding). Speculative rejection sampling compares the target's
// and the draft's (spec/rejection.h).
struct token_distribution {
  std::vector<std::pair<token_id, float>> tokens;
  // The probability of t: 0 outside the support. O(log n).
  float of(token_id t) const;
  static token_distribution point(token_id t) { return {{{t, 1.0f}}}; }
};

class sampler {
 public:
  explicit sampler(const sampling_params& params);
  // The next token after `prompt` and `output` (the tokens generated so far,
  // which the penalties look at). REQUIRES: every token id < logits.size().
  token_id sample(std::span<const float> logits, std::span<const token_id> prompt = {},
                  std::span<const token_id> output = {});
  // `logits` with logit_bias and the penalties applied (what sample() draws from
  // before temperature); the logits themselves when nothing adjusts them.
  std::span<const float> adjust(std::span<const float> logits, std::span<const token_id> prompt,
                                std::span<const token_id> output);

  // Log-probabilities under the unmodified softmax of logits (vLLM's raw
  // logprobs). Both go through log_softmax_at, so a token's log_prob is
  // bit-identical to its entry in top_log_probs.
  static float log_prob(std::span<const float> logits, token_id token);
  // The k most likely tokens with their log-probabilities, best first (lowest id on ties).
  static std::vector<std::pair<token_id, float>> top_log_probs(std::span<const float> logits, int k);

  // What a draw from `logits` (already adjusted) picks among: each token it
  // can return, by id, with its unnormalised probability (sampling_weight of
  // its tempered logit minus the best one's; greedy: the argmax alone, 1).
  // Tests hold it against a full-sort reference. Does not advance the RNG.
  std::vector<std::pair<token_id, float>> distribution(std::span<const float> logits);

  // The law sample(logits, prompt, output) draws from, without drawing:
  // logit_bias and penalties, then temperature, top-k, top-p and min-p as
  // sample() applies them, normalised. Greedy: the argmax of the adjusted
  // logits alone, probability 1. Does not advance the RNG.
  // REQUIRES: every token id < logits.size().
  token_distribution probabilities(std::span<const float> logits, std::span<const token_id> prompt = {},
                                   std::span<const token_id> output = {});
  // A token drawn from d with this sampler's RNG (the stream sample() draws
  // with). A d of one token is returned without advancing the RNG, so greedy
  // verification uses no randomness. REQUIRES: d has a token.
  token_id draw_from(const token_distribution& d);
  // A number uniform in [0, 1) from the same RNG (rejection sampling's
  // acceptance test).
  double uniform();

 private:
  // A token with its tempered logit and weight. Ordered by `better`: higher
  // logit first, lowest id on ties (the order top-k and top-p cut).
  struct candidate {
    float logit;
    float weight;
    token_id id;
  };
  // Where weigh() left the draw's distribution.
  enum class weighed { dense, sparse };
  static constexpr std::size_t k_block = 256;  // ids per entry of block_sums_
  static constexpr int k_buckets = 256;         // of cut_top_p

  token_id draw(std::span<const float> logits);
  // Fills weights_ (dense: every id, by id, with block_sums_ and total_) or
  // candidates_[0, n_kept_) (sparse, top-k only) with what the next draw
  // picks among.
  weighed weigh(std::span<const float> logits);
  // weights_[i] = sampling_weight(tempered logit i - top), 0 below min_weight.
  void weigh_all(std::span<const float> logits, float inv_t, float top, float min_weight);
  // block_sums_ and total_ from weights_.
  void sum_blocks();
  // The top-p cut (and min-p) when top-k is off, on weights_: buckets the
  // tokens by logit and sorts only the bucket where the cumulative weight
  // reaches top_p; what is cut weighs 0. REQUIRES: weigh_all ran.
  void cut_top_p(std::span<const float> logits, float inv_t, float top);
  token_id pick_dense();
  token_id pick_sparse();

  sampling_params params_;
  std::mt19937_64 rng_;
  std::vector<candidate> candidates_;  // top-k's, best first (or cut_top_p's edge bucket); reused
  std::size_t n_kept_ = 0;             // candidates_[0, n_kept_) survive the cuts
  std::vector<float> weights_;         // [n_vocab] dense draws: each token's weight, 0 if cut
  std::vector<double> block_sums_;     // [n_vocab / k_block] sums of weights_ by block
  double total_ = 0;                   // sum of block_sums_
  std::vector<std::uint8_t> buckets_;  // [n_vocab] cut_top_p's bucket of each token
  std::vector<float> adjusted_;        // [n_vocab] logits after bias and penalties
  std::vector<int> counts_;            // [n_vocab] occurrences in the output; zero between calls
  std::vector<std::uint8_t> seen_;     // [n_vocab] in the prompt or the output; zero between calls
};

}  // namespace pagoda
