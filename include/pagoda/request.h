// What a caller asks the engine for: a prompt of token ids and how to continue
// it. Part of Pagoda's public API (engine.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// Token sampling, in vLLM's order: temperature scales the logits, then top-k
// keeps the k most likely, top-p the smallest set whose probability reaches p,
// min-p drops tokens below min_p x the most likely one's probability; a seeded
// draw picks from what remains. temperature <= 0 is greedy (argmax, lowest id
// on ties) and ignores the rest.
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

struct request {
  std::string id;                  // unique among the requests in flight
  std::vector<token_id> prompt;    // tokenized, BOS included as the model wants
  int max_tokens = 16;             // tokens to generate; 0: compute the prompt only (scoring)
  sampling_params sampling = sampling_params::greedy();
  int n = 1;                       // completions sharing the prompt
  std::vector<std::string> stop;   // stop strings (not included in the output)
  std::vector<token_id> stop_token_ids;
  bool ignore_eos = false;
  std::string cache_salt;          // vLLM's cache_salt: only requests with the same salt share KV
  std::string tenant;              // "" = the global cache
  int priority = 0;                // lower runs first (vLLM's convention)
  int logprobs = -1;               // -1: none; k >= 0: the chosen token's and k alternatives
  // Return the logits of every prompt position (perplexity, KL divergence).
  // The prompt is then computed in full: no prefix-cache hits.
  bool prompt_logits = false;
};

}  // namespace pagoda
