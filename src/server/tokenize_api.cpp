#include "server/tokenize_api.h"

#include <algorithm>

#include <fmt/format.h>

namespace pagoda::server {

using nlohmann::json;

namespace {

std::optional<api_error> check_model(const json& body, const api_context& ctx) {
  auto it = body.find("model");
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) return bad_request("model", "'model' must be a string");
  const std::string& name = it->get_ref<const std::string&>();
  if (std::find(ctx.model_names.begin(), ctx.model_names.end(), name) != ctx.model_names.end()) return std::nullopt;
  return bad_request("model",
                     fmt::format("The model '{}' does not exist; this server serves '{}'", name.substr(0, 200),
                                 ctx.model_names.front()),
                     "model_not_found");
}

// An optional boolean field; `error` set when it is there and not a boolean.
bool read_bool(const json& body, const char* name, bool def, std::optional<api_error>& error) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return def;
  if (!it->is_boolean()) {
    error = bad_request(name, fmt::format("'{}' must be a boolean", name));
    return def;
  }
  return it->get<bool>();
}

// The ids of a chat conversation, rendered as /v1/chat/completions would.
api_result<std::vector<token_id>> chat_tokens(const json& body, const api_context& ctx, const std::string& tenant) {
  json chat = {{"messages", body["messages"]}, {"max_tokens", 1}};
  if (body.contains("add_generation_prompt")) chat["add_generation_prompt"] = body["add_generation_prompt"];
  api_result<api_call> call = parse_request(api_kind::chat, chat, ctx, tenant);
  if (!call.ok()) return call.error;
  return std::move(call.value->requests.front().prompt);
}

api_error too_many_tokens(std::string param, std::string what, const api_context& ctx) {
  api_error e = bad_request(std::move(param),
                            fmt::format("{} more than this server's limit of {} tokens (--max-tokenize-tokens)", what,
                                        ctx.limits.max_tokenize_tokens),
                            "too_many_tokens");
  e.http_status = 413;
  return e;
}

}  // namespace

api_result<json> tokenize_response(const json& body, const api_context& ctx, const std::string& tenant) {
  if (!body.is_object()) return bad_request("", "The request body must be a JSON object");
  if (auto e = check_model(body, ctx)) return *e;
  const int n_sources = static_cast<int>(body.contains("prompt")) + static_cast<int>(body.contains("content")) +
                        static_cast<int>(body.contains("messages"));
  if (n_sources != 1)
    return bad_request("prompt", "Send exactly one of 'prompt' (vLLM), 'content' (llama.cpp) or 'messages'");
  std::optional<api_error> err;
  const bool llama_cpp = body.contains("content");
  const bool with_pieces = read_bool(body, "with_pieces", false, err);
  const bool token_strs = read_bool(body, "return_token_strs", false, err);
  std::vector<token_id> tokens;
  if (body.contains("messages")) {
    api_result<std::vector<token_id>> t = chat_tokens(body, ctx, tenant);
    if (!t.ok()) return t.error;
    tokens = std::move(*t.value);
  } else {
    const char* key = llama_cpp ? "content" : "prompt";
    const json& text = body[key];
    if (!text.is_string()) return bad_request(key, fmt::format("'{}' must be a string", key));
    // Refused before encoding when the text is surely too long: no token
    // covers more than max_token_bytes of it. (Encoding costs time in the
    // text's length; the bound keeps both time and output small.)
    const std::size_t n_bytes = text.get_ref<const std::string&>().size();
    if (n_bytes / ctx.max_token_bytes > static_cast<std::size_t>(ctx.limits.max_tokenize_tokens))
      return too_many_tokens(key, fmt::format("The text of {} bytes holds", n_bytes), ctx);
    const bool add_special = llama_cpp ? read_bool(body, "add_special", false, err)
                                       : read_bool(body, "add_special_tokens", true, err);
    const bool parse_special = read_bool(body, "parse_special", true, err);
    if (err) return *err;
    tokens = ctx.vocab->encode(text.get_ref<const std::string&>(), add_special && ctx.vocab->add_bos_default(),
                               parse_special);
  }
  if (err) return *err;
  if (tokens.size() > static_cast<std::size_t>(ctx.limits.max_tokenize_tokens))
    return too_many_tokens(llama_cpp ? "content" : body.contains("messages") ? "messages" : "prompt",
                           fmt::format("The input is {} tokens,", tokens.size()), ctx);
  json out = {{"count", tokens.size()}, {"max_model_len", ctx.limits.max_model_len}};
  if (with_pieces) {
    json pieces = json::array();
    for (token_id t : tokens) pieces.push_back({{"id", t}, {"piece", ctx.vocab->token_to_piece(t, true)}});
    out["tokens"] = std::move(pieces);
  } else {
    out["tokens"] = tokens;
  }
  if (token_strs) {
    json strs = json::array();
    for (token_id t : tokens) strs.push_back(std::string(ctx.vocab->token_text(t)));
    out["token_strs"] = std::move(strs);
  }
  return out;
}

api_result<json> detokenize_response(const json& body, const api_context& ctx) {
  if (!body.is_object()) return bad_request("", "The request body must be a JSON object");
  if (auto e = check_model(body, ctx)) return *e;
  auto it = body.find("tokens");
  if (it == body.end() || !it->is_array()) return bad_request("tokens", "'tokens' must be an array of token ids");
  if (it->size() > static_cast<std::size_t>(ctx.limits.max_tokenize_tokens))
    return too_many_tokens("tokens", fmt::format("'tokens' holds {},", it->size()), ctx);
  std::vector<token_id> tokens;
  tokens.reserve(it->size());
  for (std::size_t i = 0; i < it->size(); ++i) {
    const json& t = (*it)[i];
    const std::string param = fmt::format("tokens[{}]", i);
    if (!t.is_number_integer()) return bad_request(param, "a token id must be an integer");
    const std::int64_t id = t.get<std::int64_t>();
    if (id < 0 || id >= ctx.vocab->n_vocab())
      return bad_request(param, fmt::format("token id {} is not in the vocabulary (0..{})", id, ctx.vocab->n_vocab() - 1));
    tokens.push_back(static_cast<token_id>(id));
  }
  const std::string text = ctx.vocab->decode(tokens);
  return json{{"prompt", text}, {"content", text}};
}

}  // namespace pagoda::server
