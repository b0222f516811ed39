// SentencePiece-style BPE over a raw text fragment (tokenizer.ggml.model = "llama").
#include <string>

#include "model/tokenizer.h"
#include "model/tokenizer_merge.h"
#include "model/unicode.h"

namespace pagoda {

// Pieces merging may produce: not control, unknown or byte tokens (their texts,
// like "<s>" or "<0x41>", are names, not text), nor user-defined ones (already
// matched whole before merging).
token_id tokenizer::find_mergeable_spm(std::string_view text) const {
  const token_id id = find_token(text);
  if (id == k_no_token) return k_no_token;
  const token_type t = types_[id];
  return t == token_type::normal || t == token_type::undefined || t == token_type::unused ? id : k_no_token;
}

void tokenizer::encode_spm(std::string_view raw, bool prefix_space, std::vector<token_id>& out) const {
  std::string text;
  text.reserve(raw.size() + raw.size() / 4 + unicode::k_spm_space.size());
  if (prefix_space) text.append(unicode::k_spm_space);
  for (char c : raw) {
    if (c == ' ') {
      text.append(unicode::k_spm_space);
    } else {
      text.push_back(c);
    }
  }
  if (text.empty()) return;

  // One symbol per character; a byte that is not part of valid UTF-8 is its own symbol.
  detail::merge_workspace ws;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t n = unicode::char_size(text, pos);
    const auto index = static_cast<std::int32_t>(ws.symbols.size());
    ws.symbols.push_back({static_cast<std::uint32_t>(pos), static_cast<std::uint32_t>(n), index - 1,
                          pos + n < text.size() ? index + 1 : -1, find_mergeable_spm(std::string_view(text).substr(pos, n))});
    pos += n;
  }

  const std::string_view view(text);
  detail::merge_pairs(ws, [&](const detail::merge_symbol& l,
                              const detail::merge_symbol& r) -> std::optional<detail::merge_result> {
    const token_id id = find_mergeable_spm(view.substr(l.begin, l.size + r.size));
    if (id == k_no_token) return std::nullopt;
    return detail::merge_result{-static_cast<double>(scores_[id]), id};  // highest score first
  });

  for (std::int32_t i = 0; i >= 0; i = ws.symbols[i].next) {
    const detail::merge_symbol& s = ws.symbols[i];
    if (s.id != k_no_token) {
      out.push_back(s.id);
      continue;
    }
    // No token covers this character: spell it in byte tokens.
    for (std::uint32_t k = 0; k < s.size; ++k) {
      const token_id b = byte_tokens_[static_cast<std::uint8_t>(text[s.begin + k])];
      if (b != k_no_token) {
        out.push_back(b);
      } else if (unk_ != k_no_token) {
        out.push_back(unk_);
      }
    }
  }
}

}  // namespace pagoda
