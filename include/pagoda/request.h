// What a caller asks the engine for: a prompt of token ids and how to continue
// it. Part of Pagoda's public API (engine.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// Token sampling, in vLLM's order. The logits are first adjusted: logit_bias
// is added, then the penalties apply with vLLM's semantics (the same as the
// OpenAI API's and, for repetition_penalty, llama.cpp's formula, though vLLM
// and Pagoda look at the whole prompt and output where llama.cpp looks at the
// last 64 tokens): repetition_penalty divides the positive logits (multiplies
// the negative ones) of every token seen in the prompt or the output;
// frequency_penalty is subtracted once per occurrence of a token in the
// output, presence_penalty once for a token that occurs in it at all. Then
// temperature scales the logits, top-k keeps the k most likely, top-p the
// smallest set whose probability reaches p, min-p drops tokens below min_p x
// the most likely one's probability; a seeded draw picks from what remains.
// temperature below 1e-5 (vLLM's epsilon) is greedy: the argmax of the
// adjusted logits, lowest id on ties.
struct sampling_params {
  float temperature = 0.8f;
  int top_k = 40;        // <= 0: disabled
  float top_p = 0.95f;   // >= 1: disabled
  float min_p = 0.05f;   // <= 0: disabled
  std::uint64_t seed = 0;
  float presence_penalty = 0.0f;    // [-2, 2]; 0: off
  float frequency_penalty = 0.0f;   // [-2, 2]; 0: off
  float repetition_penalty = 1.0f;  // (0, 2]; 1: off
  std::vector<std::pair<token_id, float>> logit_bias;  // token -> bias in [-100, 100]
  // Constrained decoding (docs/serving.md, "Structured output"): a GBNF
  // grammar (llama.cpp's format, root rule `root`) the output must follow.
  // Before each draw every token whose bytes the grammar cannot take next is
  // masked out (before logit_bias and the penalties); EOS is allowed only
  // where the grammar accepts. "": unconstrained.
  std::string grammar;

  static constexpr float k_greedy_temperature = 1e-5f;
  static sampling_params greedy() { return {0.0f, 0, 1.0f, 0.0f, 0}; }
  bool is_greedy() const { return temperature < k_greedy_temperature; }
  // Whether anything adjusts the logits before temperature (bias or penalties).
  bool adjusts_logits() const {
    return !logit_bias.empty() || presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
  }
  // A clear error for values outside their domain (negative temperature, top_p outside (0, 1], ...).
  status validate() const;
};

// A part of the prompt, positions [begin, end), with a KV policy of its own
// (per-segment policies: a document may be compressed harder than the
// question). Segments are sorted and disjoint; tokens outside them follow the
// request's kv_policy.
struct prompt_segment {
  std::int32_t begin = 0;
  std::int32_t end = 0;
  std::string kv_policy;  // "NAME[:key=value,...]", "none" keeps the segment whole; "": the request's
  // The KV type of the segment's blocks ("int4", as --kv-cache-dtype takes
  // it); "": the engine's default. The engine must keep a class of that type
  // (--kv-segment-dtype). A block takes it only when every one of its tokens
  // is in such segments; a block that straddles a boundary keeps the default.
  std::string kv_type;
  // CacheBlend chunk reuse (docs/serving.md, "Chunk reuse"): the part's KV is
  // computed alone (positions from 0, nothing before it), kept under a key of
  // its own tokens, and reused wherever the same tokens appear again: keys
  // re-rotated to the new position, a `recompute` fraction of its tokens (the
  // most deviating at an early layer) recomputed with the real context. Only
  // whole blocks of the part are reused; its tail is computed in context.
  bool reuse_chunk = false;
  // [0, 1]: the fraction recomputed; < 0: the engine's default (--chunk-recompute).
  float recompute = -1.0f;
};

// An image in the prompt (src/vision): its n_tokens embedding rows stand in
// for the token embeddings of prompt positions [begin, begin + n_tokens); the
// prompt's ids there only count the rows (any id in the vocabulary: the
// image marker, say). Spans are sorted and disjoint. The KV of those
// positions is prefix-cached by content: a block's key takes `content_hash`
// and each token's index within the image in place of the ids, so the same
// image in a later request of the same tenant is a hit, another image of the
// same size a miss. The span is a prompt segment of its own (prompt_segment)
// with kv_type / kv_policy: "" takes the engine's --kv-image-type /
// --kv-image-policy (which may be "" too: the request's).
struct image_span {
  std::int32_t begin = 0;
  std::int32_t n_tokens = 0;
  std::vector<float> embeddings;  // [n_tokens][n_embd]: the projector's output (vision_encoder)
  // Names the rows: a hash of the image's bytes and of the mmproj that
  // encoded them (vision::image_content_hash). Requests that give the same
  // hash must give the same rows.
  std::uint64_t content_hash = 0;
  std::string kv_type;
  std::string kv_policy;
  // The span's tokens attend to each other both ways (llama.cpp's
  // mtmd_decode_use_non_causal: Gemma 3's images): each sees every token of
  // the span, later ones included, and what precedes it; text stays causal.
  // The scheduler computes the rest of such a span in one step (a prompt
  // chunk never ends inside it; a span longer than the step's token budget
  // is refused).
  bool bidirectional = false;
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
  int priority = 0;                // lower runs first (vLLM's convention), within the request's tenant only
  int logprobs = -1;               // -1: none; k >= 0: the chosen token's and k alternatives
  // Return the logits of every prompt position (perplexity, KL divergence).
  // The prompt is then computed in full: no prefix-cache hits.
  bool prompt_logits = false;
  // -1: none; k >= 0: the compact form of prompt scoring (echo with
  // logprobs, vLLM's prompt_logprobs): for every prompt token but the first,
  // its logprob given the tokens before it, its rank and the k most likely
  // tokens there (engine_event::prompt_logprobs), computed by the runner from
  // the logits rows, which never leave it. A prefix-cache hit would skip the
  // positions to score: the request takes only cached blocks whose scores
  // the scheduler kept (sched/prompt_score_cache.h), under full KV only; its
  // blocks enter the prefix cache as any prompt's do. At most
  // k_max_prompt_logprobs.
  int prompt_logprobs = -1;
  static constexpr int k_max_prompt_logprobs = 1024;
  // The KV policy of this request ("NAME[:key=value,...]", docs/policies.md);
  // "" takes the engine's default (--kv-policy), "none" is full KV.
  std::string kv_policy;
  // Speculative decoding ("NAME[:key=value,...]", docs/speculative.md:
  // "ngram:k=4"); "" takes the engine's default (--speculative), "none" is off.
  std::string speculative;
  std::vector<prompt_segment> segments;
  std::vector<image_span> images;  // each becomes a segment; none may overlap `segments`
  // > 0: at most this many prompt tokens per step (the policy acts between
  // steps; perplexity's decode-time setting feeds documents this way).
  int prompt_chunk = 0;
};

}  // namespace pagoda
