// Token sampling: logit bias and repetition/frequency/presence penalties,
// greedy, temperature, top-k, top-p, min-p, seeded (sampling_params, in
// pagoda/request.h, says in which order and with which semantics).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "pagoda/request.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

token_id argmax(std::span<const float> logits);

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

 private:
  token_id draw(std::span<const float> logits);

  sampling_params params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, token_id>> candidates_;  // reused between calls
  std::vector<float> adjusted_;                         // [n_vocab] logits after bias and penalties
  std::vector<int> counts_;                             // [n_vocab] occurrences in the output; zero between calls
  std::vector<std::uint8_t> seen_;                      // [n_vocab] in the prompt or the output; zero between calls
};

}  // namespace pagoda
