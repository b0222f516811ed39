// Token sampling: greedy, temperature, top-k, top-p, min-p, seeded
// (sampling_params, in pagoda/request.h, says in which order).
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
  token_id sample(std::span<const float> logits);
  // Log-probability of each token under the unmodified softmax of logits (for logprobs).
  static float log_prob(std::span<const float> logits, token_id token);
  // The k most likely tokens with their log-probabilities, best first.
  static std::vector<std::pair<token_id, float>> top_log_probs(std::span<const float> logits, int k);

 private:
  sampling_params params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, token_id>> candidates_;  // reused between calls
};

}  // namespace pagoda
