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

namespace {

// True where a word starts: a "▁" that follows a character other than "▁".
bool is_word_start(std::string_view text, std::size_t pos) {
  const std::size_t n = unicode::k_spm_space.size();
  if (pos == 0 || text.substr(pos, n) != unicode::k_spm_space) return false;
  return pos < n || text.substr(pos - n, n) != unicode::k_spm_space;
}

}  // namespace

bool tokenizer::spm_tokens_cross_words() const {
  for (token_id id = 0; id < n_vocab(); ++id) {
    if (find_mergeable_spm(texts_[id]) != id) continue;
    const std::string_view text = texts_[id];
    for (std::size_t pos = text.find(unicode::k_spm_space, 1); pos != std::string_view::npos;
         pos = text.find(unicode::k_spm_space, pos + 1)) {
      if (is_word_start(text, pos)) return true;
    }
  }
  return false;
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
  const std::string_view view(text);

  // Merging runs over [begin, end). Where no token spans a word start, words
  // merge independently with the same result, and small heaps stay in cache.
  detail::merge_workspace ws;
  const auto encode_range = [&](std::size_t begin, std::size_t end) {
    // One symbol per character; a byte that is not part of valid UTF-8 is its own symbol.
    ws.symbols.clear();
    for (std::size_t pos = begin; pos < end;) {
      const std::size_t n = unicode::char_size(view.substr(0, end), pos);
      const auto index = static_cast<std::int32_t>(ws.symbols.size());
      ws.symbols.push_back({static_cast<std::uint32_t>(pos), static_cast<std::uint32_t>(n), index - 1,
                            pos + n < end ? index + 1 : -1, find_mergeable_spm(view.substr(pos, n))});
      pos += n;
    }
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
  };

  if (text.empty()) return;
  if (spm_cross_words_) {
    encode_range(0, text.size());
    return;
  }
  std::size_t begin = 0;
  for (std::size_t pos = view.find(unicode::k_spm_space, 1); pos != std::string_view::npos;
       pos = view.find(unicode::k_spm_space, pos + 1)) {
    if (!is_word_start(view, pos)) continue;
    encode_range(begin, pos);
    begin = pos;
  }
  encode_range(begin, text.size());
}

}  // namespace pagoda
