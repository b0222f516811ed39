// Parsing and validating the bodies of POST /v1/completions and
// /v1/chat/completions into engine requests.
//
// Conventions follow the OpenAI API and vLLM's extensions: `max_tokens` /
// `max_completion_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`,
// `n`, `stop`, `stop_token_ids`, `ignore_eos`, `presence_penalty`,
// `frequency_penalty`, `repetition_penalty`, `logit_bias`, `stream`,
// `stream_options.include_usage`, `logprobs` (completions: an integer;
// chat: a boolean with `top_logprobs`), `return_tokens_as_token_ids`,
// `echo` and `prompt_logprobs` (completions: prompt scoring, with
// `max_tokens` 0 for no generation), `cache_salt`, `user`, `priority`, the structured-output fields
// (`response_format`, `guided_json`, `guided_regex`, `guided_choice`,
// `guided_grammar`, `grammar`, `json_schema`: server/structured_output.h),
// and Pagoda's `kv_policy` (docs/policies.md). Unknown fields are ignored, as vLLM does;
// known fields Pagoda cannot honour (min_tokens, tools on completions, suffix, ...) are
// accepted only at their neutral values and are a 400 naming the field
// otherwise. `pagoda batch` reads its lines with the same parser, so both take
// the same fields with the same ranges and messages. Every error names
// the field at fault (`param`), down to `messages[2].content`.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/tokenizer.h"
#include "sched/engine_core.h"
#include "server/api_error.h"
#include "server/chat_template.h"

namespace pagoda::server {

struct tool_request;  // server/tool_calls.h
class image_input;   // server/image_input.h

// Limits a request must stay within (the server's flags).
struct api_limits {
  int max_model_len = 2048;     // prompt + completion
  int max_prompt_tokens = 2048; // one prompt
  int max_tokens = 2048;        // the largest max_tokens a request may ask for
  int max_streaming_tokens = 1 << 24;  // the same under a streaming window (policy/streaming.h), which runs past the context
  int max_choices = 16;         // n x number of prompts
  int max_stop = 16;            // stop strings
  int max_stop_bytes = 1024;    // one stop string
  int max_logprobs = 20;        // alternatives per token
  int max_prompts = 16;         // prompts in one /v1/completions call
  // Tokens a /tokenize may answer and a /detokenize may take (beyond: 413),
  // so their output, pieces included, stays within a bound.
  int max_tokenize_tokens = 65536;
};

// What parsing needs; immutable and shared by every handler thread.
struct api_context {
  const tokenizer* vocab = nullptr;
  // The longest token text in the vocabulary, in bytes: no token covers more
  // bytes of input, so a text of n bytes has at least n / this many tokens.
  std::size_t max_token_bytes = 1;
  std::vector<std::string> model_names;  // accepted values of "model"; the first is the one reported
  chat_format chat = chat_format::plain;
  chat_special_tokens chat_tokens;
  api_limits limits;
  // The KV warehouse's tiers in lookup order ("disk", "redis"); empty without
  // one. Usage then says where cached tokens came from.
  std::vector<std::string> store_tiers;
  // For GET /props (llama_api.h): the model file as given, and the GGUF's
  // own chat template text ("" when it has none).
  std::string model_path;
  std::string chat_template_source;
  // The engine's default KV policy (--kv-policy): a request without its own
  // follows it, and a streaming window (policy/streaming.h) lifts the context
  // limit on max_tokens.
  std::string default_kv_policy;
  // The vision tower (`--mmproj`), which turns chat `image_url` parts into
  // image prompt parts; null: an image part is a 400 saying so.
  // REQUIRES: outlives the context's users.
  image_input* images = nullptr;
};

enum class api_kind { completion, chat };

// A validated call: one engine request per prompt, each with `n` completions.
struct api_call {
  api_kind kind = api_kind::completion;
  std::vector<request> requests;  // ids left empty; the caller names them
  // Chat with tools offered (`tools`, `tool_choice` not "none": server/tool_calls.h,
  // which chat takes apart from the neutral-only list below): the output is
  // parsed for calls; null otherwise.
  std::shared_ptr<const tool_request> tools;
  int n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  int logprobs = -1;           // -1: none; k >= 0: the chosen token plus k alternatives
  bool tokens_as_ids = false;  // vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
  // echo (completions): each choice's text starts with its prompt's, and its
  // logprobs cover the prompt's tokens first (the first one's null).
  bool echo = false;
  std::vector<std::string> echo_texts;  // [requests] when echo: the prompts' texts
  int prompt_logprobs = -1;    // vLLM's prompt_logprobs: -1 none; k >= 0: each prompt token's, with the top k
};

// The body of /v1/completions (kind completion: `prompt`) or
// /v1/chat/completions (kind chat: `messages`, rendered with ctx.chat).
// `body` is the parsed JSON body; `tenant` comes from the API key. Sampling
// without a seed draws a fresh one, so every request is seeded.
//
// Chat `image_url` parts (with ctx.images): each part is replaced by the
// media marker "<__media__>" in its message's content (parts joined by
// newlines, as text parts are), the messages are rendered by the chat
// template, the text is tokenized between the markers and each marker is
// replaced by the image's prompt part (vision::make_image_part: markers,
// placeholders, one image span per chunk), as llama.cpp's server does. The
// images are encoded here, on the calling thread (the server calls it on its
// image thread when has_image_parts).
api_result<api_call> parse_request(api_kind kind, const nlohmann::json& body, const api_context& ctx,
                                   const std::string& tenant);

// Whether a chat body has a content part of type "image_url" (cheap: the
// server routes such bodies to its image thread).
bool has_image_parts(const nlohmann::json& body);

// The text a chat template sees in place of an image part.
inline constexpr std::string_view k_media_marker = "<__media__>";

}  // namespace pagoda::server
