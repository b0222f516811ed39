// Per-segment KV policies and types in requests (policy/kv_policy.h,
// make_segmented_policy; KV classes, kv_manager.h): parts of a prompt that
// carry a policy or a KV type of their own. In a chat request a message or one
// of its content parts may carry `"kv": {"policy": "...", "type": "int4"}`
// (a part's own fields override its message's),
// and `kv_policy_by_role` gives one to every message of a role that names
// none; a completion's `prompt` may be an array of parts
// `{"text": "...", "kv": {...}}`. Each part's text is found in the rendered
// prompt, in order, and its token span is read off the prompt's own tokens:
// the prompt is tokenized once, each token is matched to the bytes of the
// text it spells, and a part owns the tokens that end inside it (a token that
// straddles a boundary goes to the part it ends in). The work is linear in
// the prompt, however many parts it has; the parts with a KV choice are
// capped (k_max_kv_parts) because each becomes a segment the engine keeps.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/tokenizer.h"
#include "pagoda/request.h"
#include "server/api_error.h"

namespace pagoda::server {

// The most parts of one request that may carry a KV policy or type (a
// completion's prompt parts; a chat's messages and content parts with a `kv`
// or a kv_policy_by_role entry): each is a segment with a policy of its own
// in the engine. Beyond it the request is a 400 naming the limit.
inline constexpr int k_max_kv_parts = 256;

// What a part asks of the KV cache ("" = not given).
struct kv_choice {
  std::string policy;  // "NAME[:key=value,...]"
  std::string type;    // a KV type, as --kv-cache-dtype takes it
  bool reuse_chunk = false;  // "reuse": "chunk" (CacheBlend chunk reuse)
  float recompute = -1.0f;   // its "recompute" fraction; < 0: the engine's default
  bool any() const { return !policy.empty() || !type.empty() || reuse_chunk; }
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

// Where each of `prompt`'s tokens ends in `text` (byte offsets, one per
// token, non-decreasing), when `prompt` is what tokenizer::encode(text,
// add_bos, parse_special = true) gave: the tokens' pieces are matched against
// the text in one pass. The BOS add_bos put first, and an SPM word-start piece
// that is only the "▁" the encoder prefixed, take no bytes. nullopt when the
// tokens do not spell the text back (characters the vocabulary can only
// write as <unk> are taken one byte each; anything else is a mismatch).
std::optional<std::vector<std::size_t>> token_ends_in_text(const tokenizer& vocab, std::string_view text,
                                                           std::span<const token_id> prompt, bool add_bos);

// The segments of `prompt` (the tokens of `text`, as encode(text, add_bos, true) gave them)
// for the pieces with a policy or a type: each piece is looked for in `text`
// after the previous one. Errors: a piece not found (a chat template that
// rewrites content), tokens that do not spell the text back, a bad policy.
// `n_bytes_matched`, when given, receives the bytes of token text matched
// against the prompt: the placement's work, which tests check stays linear.
api_result<std::vector<prompt_segment>> place_segments(const tokenizer& vocab, bool add_bos, const std::string& text,
                                                       std::span<const token_id> prompt,
                                                       std::span<const text_piece> pieces,
                                                       std::size_t* n_bytes_matched = nullptr);

}  // namespace pagoda::server
