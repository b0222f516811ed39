// POST /tokenize and POST /detokenize, in vLLM's shapes and llama.cpp's:
//
//   /tokenize    {"prompt": "text", "add_special_tokens": true, "return_token_strs": false}        (vLLM)
//                {"messages": [...], "add_generation_prompt": true}                                (vLLM, chat)
//                {"content": "text", "add_special": false, "with_pieces": false}                  (llama.cpp)
//             -> {"tokens": [ids], "count": n, "max_model_len": m}
//                (+ "token_strs": [...] when asked; with_pieces: tokens [{"id", "piece"}])
//   /detokenize  {"tokens": [ids]} -> {"prompt": "text", "content": "text"}
//
// Defaults follow each server: vLLM adds the BOS token unless told not to,
// llama.cpp's `content` does not; special-token text is parsed as special
// tokens (both do). Chat messages are rendered by the same parser as
// /v1/chat/completions, so the ids are the ones a completion would see.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "server/api_error.h"
#include "server/openai_request.h"

namespace pagoda::server {

api_result<nlohmann::json> tokenize_response(const nlohmann::json& body, const api_context& ctx,
                                             const std::string& tenant);
api_result<nlohmann::json> detokenize_response(const nlohmann::json& body, const api_context& ctx);

}  // namespace pagoda::server
