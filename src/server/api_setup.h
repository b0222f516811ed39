// Building the server's api_context from a loaded model and the serve flags
// (shared by `pagoda serve` and the tests, so both run the same setup).
#pragma once

#include <string>

#include "model/llama.h"
#include "server/openai_request.h"

namespace pagoda::server {

struct api_options {
  std::string model_path;         // as given on the command line
  std::string served_model_name;  // "" = the file name without extension
  std::string chat_template;      // a family name; "" = recognised from the model
  int max_prompt_tokens = 0;      // 0 = the context minus one
  int max_tokens_limit = 0;       // 0 = the context minus one (a streaming window: k_max_streaming_tokens)
  std::string default_kv_policy;  // the engine's --kv-policy (api_context::default_kv_policy)
  int max_n = 16;
  int max_tokenize_tokens = 0;    // 0 = the larger of 65536 and the context
};

// The chat family: the override by name, else the one the GGUF's
// tokenizer.chat_template matches, else plain (with `warning` set when the
// model has a template no family matches). errc::invalid_argument for an
// unknown override, listing the names.
result<chat_format> choose_chat_format(const llama_model& model, const std::string& override_name, std::string* warning);
result<chat_format> choose_chat_format(const gguf::file& file, const std::string& override_name, std::string* warning);

// REQUIRES: model outlives the context (it keeps a pointer to the vocabulary).
result<api_context> make_api_context(const llama_model& model, int max_model_len, const api_options& opts,
                                     std::string* warning);
// The same from the file and its vocabulary alone (the router: no weights).
// REQUIRES: vocab outlives the context.
result<api_context> make_api_context(const gguf::file& file, const tokenizer& vocab, int max_model_len,
                                     const api_options& opts, std::string* warning);

}  // namespace pagoda::server
