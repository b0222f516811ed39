// Token sampling: greedy, temperature, top-k, top-p, min-p, seeded.
//
// Order (as vLLM): temperature scales the logits, then top-k keeps the k most
// likely, top-p the smallest set whose probability reaches p, min-p drops tokens
// below min_p x the most likely one's probability; a seeded draw picks from what
// remains. temperature <= 0 is greedy (argmax, lowest id on ties) and ignores
// the rest.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

struct sampling_params {
  float temperature = 0.8f;
  int top_k = 40;        // <= 0: disabled
  float top_p = 0.95f;   // >= 1: disabled
  float min_p = 0.05f;   // <= 0: disabled
  std::uint64_t seed = 0;

  static sampling_params greedy() { return {0.0f, 0, 1.0f, 0.0f, 0}; }
  bool is_greedy() const { return temperature <= 0.0f; }
  // A clear error for values outside their domain (negative temperature, top_p outside (0, 1], ...).
  status validate() const;
};

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
