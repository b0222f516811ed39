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
    if (key != "policy" && key != "type" && key != "reuse" && key != "recompute")
      return bad_request(name + "." + key,
                         fmt::format("unknown field '{}' in '{}' (known: policy, type, reuse, recompute)", key, name));
  if (const auto r = it->find("reuse"); r != it->end() && !r->is_null()) {
    if (!r->is_string() || r->get<std::string>() != "chunk")
      return bad_request(name + ".reuse", fmt::format("'{}.reuse' must be \"chunk\" (the part's KV computed alone "
                                                      "and reused wherever it appears)", name));
    kv.reuse_chunk = true;
  }
  if (const auto r = it->find("recompute"); r != it->end() && !r->is_null()) {
    if (!kv.reuse_chunk)
      return bad_request(name + ".recompute", fmt::format("'{}.recompute' goes with \"reuse\": \"chunk\"", name));
    if (!r->is_number() || !(r->get<double>() >= 0.0 && r->get<double>() <= 1.0))
      return bad_request(name + ".recompute", fmt::format("'{}.recompute' must be a number in [0, 1]", name));
    kv.recompute = r->get<float>();
  }
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

namespace {

constexpr std::string_view k_spm_space = "\xE2\x96\x81";  // "▁": SentencePiece's space

// Matches a normal token's piece at text[at...]; returns the bytes it spans or
// npos. In an SPM vocabulary a space of the piece stands for a space or a
// literal "▁" of the text (the encoder wrote both as "▁").
std::size_t match_piece(std::string_view piece, std::string_view text, std::size_t at, bool spm) {
  std::size_t n = 0;
  for (const char c : piece) {
    if (at + n < text.size() && text[at + n] == c) {
      ++n;
    } else if (spm && c == ' ' && text.substr(at + n, k_spm_space.size()) == k_spm_space) {
      n += k_spm_space.size();
    } else {
      return std::string_view::npos;
    }
  }
  return n;
}

}  // namespace

std::optional<std::vector<std::size_t>> token_ends_in_text(const tokenizer& vocab, std::string_view text,
                                                           std::span<const token_id> prompt, bool add_bos) {
  const bool spm = vocab.kind() == tokenizer_kind::spm;
  std::vector<std::size_t> ends;
  ends.reserve(prompt.size());
  std::size_t at = 0;
  bool fragment_start = true;  // SPM: the encoder prefixed a "▁" here (text start, or after a special token)
  for (std::size_t i = 0; i < prompt.size(); ++i) {
    const token_id id = prompt[i];
    if (!vocab.valid_id(id)) return std::nullopt;
    const token_type type = vocab.type_of(id);
    if (i == 0 && add_bos && vocab.bos() != k_no_token) {
      if (id != vocab.bos()) return std::nullopt;
      ends.push_back(0);  // the BOS the encoder added
      continue;
    }
    if (type == token_type::control || type == token_type::unknown || type == token_type::user_defined) {
      const std::string_view name = vocab.token_text(id);
      if (!name.empty() && text.substr(at, name.size()) == name) at += name.size();  // written in the text
      else if (type == token_type::unknown && at < text.size()) ++at;  // a byte no token covers
      else return std::nullopt;
      ends.push_back(at);
      fragment_start = true;
      continue;
    }
    std::string piece = vocab.token_to_piece(id);
    std::string_view p = piece;
    if (fragment_start && spm && vocab.add_space_prefix() && p.starts_with(' ')) p.remove_prefix(1);
    const std::size_t n = match_piece(p, text, at, spm);
    if (n == std::string_view::npos) return std::nullopt;
    at += n;
    ends.push_back(at);
    fragment_start = false;
  }
  if (at != text.size()) return std::nullopt;
  return ends;
}

api_result<std::vector<prompt_segment>> place_segments(const tokenizer& vocab, bool add_bos, const std::string& text,
                                                       std::span<const token_id> prompt,
                                                       std::span<const text_piece> pieces,
                                                       std::size_t* n_bytes_matched) {
  std::vector<prompt_segment> out;
  const std::optional<std::vector<std::size_t>> ends = token_ends_in_text(vocab, text, prompt, add_bos);
  if (n_bytes_matched) *n_bytes_matched = ends && !ends->empty() ? ends->back() : 0;
  if (!ends)
    return bad_request(pieces.empty() ? std::string() : pieces.front().param,
                       "the prompt holds text its tokens do not spell back (characters this vocabulary cannot "
                       "write), so the parts' KV policies and types have no place; give a policy to the whole "
                       "request instead");
  // Token i spans text[start, end); it lies before byte c when it ends at or
  // before c. A token that takes no bytes (the BOS the encoder added, an SPM
  // "▁" it prefixed) goes with what follows it, the BOS with everything.
  // Offsets only grow from piece to piece, so one cursor walks the tokens once.
  std::size_t n_before = 0;
  auto tokens_before = [&](std::size_t c) {
    for (; n_before < ends->size(); ++n_before) {
      const std::size_t start = n_before == 0 ? 0 : (*ends)[n_before - 1], end = (*ends)[n_before];
      const bool lies_before = end > start ? end <= c : (n_before == 0 && add_bos) || start < c;
      if (!lies_before) break;
    }
    return n_before;
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
    if (p.kv.reuse_chunk && p.text.empty())
      return bad_request(p.param, fmt::format("'{}' is marked for chunk reuse but holds no text", p.param));
    if (!p.kv.any() || p.text.empty()) continue;
    // A token that straddles the start belongs to this part (it ends in it).
    const auto begin = static_cast<std::int32_t>(tokens_before(at));
    const auto end = static_cast<std::int32_t>(tokens_before(from));
    if (end <= begin) {
      if (p.kv.reuse_chunk)
        return bad_request(p.param, fmt::format("'{}' is marked for chunk reuse but holds no token of its own", p.param));
      continue;  // no token of its own
    }
    out.push_back(prompt_segment{begin, end, p.kv.policy, p.kv.type, p.kv.reuse_chunk, p.kv.recompute});
  }
  return out;
}

}  // namespace pagoda::server
