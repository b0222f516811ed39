// Per-segment KV policies in requests (policy/kv_policy.h, make_segmented_policy):
// parts of a prompt that carry a policy of their own. In a chat request a
// message or one of its content parts may carry `"kv": {"policy": "..."}`,
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

// A piece of prompt text and the policy it asks for ("" = none given).
struct text_piece {
  std::string text;
  std::string kv_policy;
  std::string param;  // where it came from, for messages ("messages[2].content[1]")
};

// Reads `"kv": {"policy": "NAME[:...]"}` at `obj[name]` (absent: nothing);
// errors name the field ("messages[1].kv.policy"). Anything else in the
// object is refused (per-segment KV types are not supported).
std::optional<api_error> read_kv_object(const nlohmann::json& obj, const std::string& param, std::string& policy);

// The segments of `prompt` (tokens of `text`, as encode(text) gives them) for
// the pieces with a policy: each piece is looked for in `text` after the
// previous one. Errors: a piece not found (a chat template that rewrites
// content), a bad policy.
api_result<std::vector<prompt_segment>> place_segments(const tokenizer& vocab, bool add_bos, const std::string& text,
                                                       std::size_t n_prompt_tokens, std::span<const text_piece> pieces);

}  // namespace pagoda::server
