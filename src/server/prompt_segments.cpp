#include "server/prompt_segments.h"

#include <fmt/format.h>

#include "policy/kv_policy.h"
#include "quant/kv_format_spec.h"

namespace pagoda::server {

std::optional<api_error> read_kv_object(const nlohmann::json& obj, const std::string& param, kv_choice& kv) {
  const auto it = obj.find("kv");
  if (it == obj.end() || it->is_null()) return std::nullopt;
  const std::string name = param + ".kv";
  if (!it->is_object())
    return bad_request(name, fmt::format("'{}' must be an object like {{\"policy\": \"h2o:budget=0.25\", \"type\": "
                                         "\"int4\"}}", name));
  for (const auto& [key, value] : it->items())
    if (key != "policy" && key != "type")
      return bad_request(name + "." + key, fmt::format("unknown field '{}' in '{}' (known: policy, type)", key, name));
  if (const auto t = it->find("type"); t != it->end() && !t->is_null()) {
    if (!t->is_string()) return bad_request(name + ".type", fmt::format("'{}.type' must be a string", name));
    const std::string text = t->get<std::string>();
    if (text.size() > 64) return bad_request(name + ".type", "a KV type is at most 64 bytes");
    if (auto spec = parse_kv_pair_spec(text); !spec.ok()) return bad_request(name + ".type", spec.error().message());
    kv.type = text;
  }
  const auto p = it->find("policy");
  if (p == it->end() || p->is_null()) return std::nullopt;
  if (!p->is_string()) return bad_request(name + ".policy", fmt::format("'{}.policy' must be a string", name));
  const std::string text = p->get<std::string>();
  if (text.size() > 1024) return bad_request(name + ".policy", "a KV policy is at most 1024 bytes");
  auto spec = parse_kv_policy_spec(text);
  if (!spec.ok()) return bad_request(name + ".policy", spec.error().message());
  if (status st = check_kv_policy(*spec); !st.ok()) return bad_request(name + ".policy", st.message());
  kv.policy = text;
  return std::nullopt;
}

api_result<std::vector<prompt_segment>> place_segments(const tokenizer& vocab, bool add_bos, const std::string& text,
                                                       std::size_t n_prompt_tokens, std::span<const text_piece> pieces) {
  std::vector<prompt_segment> out;
  // Tokens of text[0, c): where character c falls in the prompt's tokens.
  auto tokens_before = [&](std::size_t c) {
    if (c >= text.size()) return n_prompt_tokens;
    return std::min(vocab.encode(text.substr(0, c), add_bos, /*parse_special=*/true).size(), n_prompt_tokens);
  };
  std::size_t from = 0;
  for (const text_piece& p : pieces) {
    const std::size_t at = p.text.empty() ? from : text.find(p.text, from);
    if (at == std::string::npos)
      return bad_request(p.param, fmt::format("the text of '{}' does not appear as it is in the rendered prompt, so the "
                                              "parts' KV policies and types have no place; give a policy to the whole "
                                              "request instead",
                                              p.param));
    from = at + p.text.size();
    if (!p.kv.any() || p.text.empty()) continue;
    // A token that straddles the start belongs to the part before.
    const auto begin = static_cast<std::int32_t>(tokens_before(at));
    const auto end = static_cast<std::int32_t>(tokens_before(from));
    if (end <= begin) continue;  // no token of its own
    if (!out.empty() && out.back().end > begin) out.back().end = begin;  // shared token: the earlier part ends before it
    if (!out.empty() && out.back().end <= out.back().begin) out.pop_back();
    out.push_back(prompt_segment{begin, end, p.kv.policy, p.kv.type});
  }
  return out;
}

}  // namespace pagoda::server
