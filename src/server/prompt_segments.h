// Per-segment KV policies and types in requests (policy/kv_policy.h,
// make_segmented_policy; KV classes, kv_manager.h): parts of a prompt that
// carry a policy or a KV type of their own. In a chat request a message or one
// of its content parts may carry `"kv": {"policy": "...", "type": "int4"}`
// (a part's own fields override its message's),
// and `kv_policy_by_role` gives one to every message of a role that names
// none; a completion's `prompt` may be an array of parts
// `{"text": "...", "kv": {...}}`. Each part's text is found in the rendered
// prompt, in order, and its token span is counted by tokenizing the text up
// to its start and end (a token that straddles a boundary goes to the part
// it ends in).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/tokenizer.h"
#include "pagoda/request.h"
#include "server/api_error.h"

namespace pagoda::server {

// What a part asks of the KV cache ("" = not given).
struct kv_choice {
  std::string policy;  // "NAME[:key=value,...]"
  std::string type;    // a KV type, as --kv-cache-dtype takes it
  bool any() const { return !policy.empty() || !type.empty(); }
};

// A piece of prompt text and what it asks of the KV cache.
struct text_piece {
  std::string text;
  kv_choice kv;
  std::string param;  // where it came from, for messages ("messages[2].content[1]")
};

// Reads `"kv": {"policy": "NAME[:...]", "type": "TYPE"}` at `obj[name]`
// (absent: nothing; a field given replaces kv's); errors name the field
// ("messages[1].kv.policy"). Whether the engine keeps a type is the engine's
// to say when the request is added. Other fields are refused.
std::optional<api_error> read_kv_object(const nlohmann::json& obj, const std::string& param, kv_choice& kv);

// The segments of `prompt` (tokens of `text`, as encode(text) gives them) for
// the pieces with a policy or a type: each piece is looked for in `text` after the
// previous one. Errors: a piece not found (a chat template that rewrites
// content), a bad policy.
api_result<std::vector<prompt_segment>> place_segments(const tokenizer& vocab, bool add_bos, const std::string& text,
                                                       std::size_t n_prompt_tokens, std::span<const text_piece> pieces);

}  // namespace pagoda::server
