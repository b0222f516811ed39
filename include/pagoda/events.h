// What the engine reports back, step by step. Part of Pagoda's public API (engine.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pagoda/types.h"

namespace pagoda {

struct token_logprob {
  token_id token;
  float logprob;
  std::vector<std::pair<token_id, float>> top;  // the k most likely, best first
  // Prompt logprobs only (request::prompt_logprobs): 1 + the number of tokens
  // more likely than `token` (vLLM's rank); 0 elsewhere.
  int rank = 0;
};

struct request_usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;  // over all n completions
  int cached_tokens = 0;      // prompt tokens served from the prefix cache (or loaded from a KV source)
  // Of cached_tokens, those loaded from each tier of the KV source (the
  // warehouse: disk, then Redis); the rest came from memory. Empty: none loaded.
  std::vector<int> loaded_tokens_by_tier;
  // Prompt tokens whose KV came from a reused chunk (request parts marked
  // "reuse": "chunk") and were not recomputed; apart from cached_tokens.
  int reused_chunk_tokens = 0;
  // Prompt tokens that are an image's (request::images), and of them those
  // served from the prefix cache (or loaded): part of prompt_tokens and cached_tokens.
  int image_tokens = 0;
  int cached_image_tokens = 0;
  // An evicting KV policy (docs/policies.md): the tokens the completions
  // computed (their context, summed over completions) and how many of them
  // their KV keeps: what the policy keeps of each completion's context at its
  // end, slack included. Both 0 when no completion's policy evicts.
  int kv_tokens_seen = 0;
  int kv_tokens_kept = 0;
  // What attention read (sparse-read policies such as quest and retrieval
  // read part of what they keep): summed over the completions' query tokens,
  // layers and KV heads, the KV tokens each could see and those it read, for
  // the prompt and for decoding. read == visible when every row read all.
  std::int64_t kv_prompt_tokens_visible = 0;
  std::int64_t kv_prompt_tokens_read = 0;
  std::int64_t kv_decode_tokens_visible = 0;
  std::int64_t kv_decode_tokens_read = 0;
};

// What one step produced for one completion of one request.
struct engine_event {
  std::string request_id;
  int index = 0;                        // completion index, 0 .. n-1
  std::vector<token_id> tokens;         // tokens sampled this step (0, 1, or several with speculative decoding)
  std::string text;                     // text released this step (stop strings held back)
  std::vector<token_logprob> logprobs;  // one per token, when asked for
  // With request::prompt_logits: rows [n][n_vocab] for prompt positions
  // first_prompt_position .. + n - 1; row p holds the logits after prompt[0..p].
  std::vector<float> prompt_logits;
  int first_prompt_position = 0;
  // With request::prompt_logprobs: entry i is prompt token
  // first_prompt_logprob + i's logprob given the tokens before it (with its
  // rank and the k most likely there); first_prompt_logprob >= 1 (the first
  // prompt token has none). Each prompt token's entry comes once.
  std::vector<token_logprob> prompt_logprobs;
  int first_prompt_logprob = 0;
  // "" while running; "stop", "length", "abort", or "error" (then `error` says why).
  std::string finish_reason;
  std::string error;
  bool request_finished = false;        // the last completion of the request finished
  request_usage usage;                  // valid when request_finished
};

}  // namespace pagoda
