// OpenAI response objects built from engine events: `text_completion` and
// `chat.completion` bodies, their streamed chunks (`chat.completion.chunk`),
// `usage` with `prompt_tokens_details.cached_tokens`, and logprobs in each
// endpoint's shape.
//
// Choice i of a call with several prompts is prompt i / n, completion i % n
// (OpenAI's and vLLM's numbering).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/tokenizer.h"
#include "sched/engine_core.h"
#include "server/openai_request.h"
#include "server/tool_calls.h"

namespace pagoda::server {

class response_builder {
 public:
  // REQUIRES: vocab outlives the builder.
  response_builder(const api_call& call, std::string id, std::string model, std::int64_t created_unix_s,
                   const tokenizer& vocab);

  // The KV warehouse's tiers in lookup order ("disk", "redis"): usage then
  // also says where cached tokens came from (prompt_tokens_details.cached_tokens_by_tier).
  void set_store_tiers(std::vector<std::string> tiers) { store_tiers_ = std::move(tiers); }

  // Records an event of the engine request for prompt `prompt_index`.
  void add(int prompt_index, const engine_event& e);

  // Non-streaming: the whole response, once every request finished.
  nlohmann::json body() const;

  // Streaming. The chunks to send first (chat: each choice's role).
  std::vector<nlohmann::json> opening_chunks() const;
  // The chunks an event yields (none when it released no text, no logprobs and
  // no finish reason), appended to `out`. Call add() with the event as well.
  void chunks_for(int prompt_index, const engine_event& e, std::vector<nlohmann::json>& out);
  // The final usage chunk (choices: []), sent when include_usage.
  nlohmann::json usage_chunk() const;

  const std::string& id() const { return id_; }
  // Usage so far, summed over the events added.
  const request_usage& usage() const { return usage_; }

 private:
  struct choice {
    std::string text;
    std::optional<tool_call_stream> tool_stream;  // streaming with tools: made at the first event
    std::vector<token_logprob> logprobs;
    std::string finish_reason;
    std::size_t logprob_text_offset = 0;  // completions' text_offset of the next token
    bool echoed = false;                  // streaming with echo: the prompt's chunk went out
  };
  // A prompt's scoring (echo, prompt_logprobs), shared by its n choices.
  struct prompt_scores {
    std::vector<token_id> tokens;
    std::vector<token_logprob> scores;  // [1, scored]: entry i - 1 is prompt token i's
    bool complete() const { return scores.size() + 1 >= tokens.size(); }
  };

  nlohmann::json chunk_base() const;
  nlohmann::json usage_json() const;
  // Echo: prompt p's text and, with logprobs, its tokens' entries (the first's null).
  nlohmann::json echo_logprobs_json(int prompt_index, std::size_t& offset) const;
  // vLLM's prompt_logprobs of prompt p: null, then per token {id: {logprob, rank, decoded_token}}.
  nlohmann::json prompt_logprobs_json(int prompt_index) const;
  // Streaming with echo: choice c's prompt chunk, once its prompt's scores are all in.
  void echo_chunk(std::size_t c, std::vector<nlohmann::json>& out);
  // Logprobs of `lps` in this endpoint's shape; `offset` is the completions' running text_offset.
  nlohmann::json logprobs_json(const std::vector<token_logprob>& lps, std::size_t& offset) const;
  std::string piece(token_id t) const;
  // Chat with tools: choice i's text parsed for calls; `out` (its choice
  // object) gets the calls and their finish reason when it was calls.
  void apply_tool_calls(std::size_t i, const choice& ch, nlohmann::json& out) const;
  // Streaming with tools: the event's text as content and tool-call deltas.
  void tool_chunks(std::size_t c, const engine_event& e, nlohmann::json logprobs, std::vector<nlohmann::json>& out);

  api_kind kind_;
  int n_;
  bool include_usage_;
  bool want_logprobs_;
  bool tokens_as_ids_;
  bool echo_;
  int logprobs_;         // echo's: the alternatives per prompt token
  int prompt_logprobs_;  // -1: no prompt_logprobs field in the choices
  std::vector<std::string> echo_texts_;
  std::vector<prompt_scores> prompts_;
  std::string id_;
  std::string model_;
  std::shared_ptr<const tool_request> tools_;  // api_call::tools
  std::int64_t created_;
  const tokenizer& vocab_;
  std::vector<choice> choices_;
  request_usage usage_;
  std::vector<std::string> store_tiers_;
};

// "data: {json}\n\n", invalid UTF-8 replaced.
std::string sse_event(const nlohmann::json& j);
inline constexpr const char* k_sse_done = "data: [DONE]\n\n";
// JSON text for a response body, invalid UTF-8 replaced (generated text may
// hold a partial character only when a request ends mid-character).
std::string dump_json(const nlohmann::json& j);

}  // namespace pagoda::server
