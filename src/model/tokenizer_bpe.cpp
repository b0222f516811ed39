// Byte-level BPE over a raw text fragment (tokenizer.ggml.model = "gpt2").
#include <algorithm>
#include <string>

#include "model/tokenizer.h"
#include "model/tokenizer_merge.h"
#include "model/unicode.h"

namespace pagoda {

void tokenizer::encode_bpe(std::string_view raw, std::vector<token_id>& out) const {
  // Bytes the vocabulary cannot spell (0xC0, 0xFF, ... in vocabularies trained on
  // valid UTF-8) become U+FFFD, as llama.cpp does for invalid UTF-8. The unknown
  // token is no answer: byte-level vocabularies often make it EOS.
  const auto missing = [&](char c) { return byte_tokens_[static_cast<std::uint8_t>(c)] == k_no_token; };
  std::string replaced;
  if (std::any_of(raw.begin(), raw.end(), missing)) {
    replaced.reserve(raw.size() + 8);
    for (char c : raw) {
      if (missing(c)) {
        unicode::append_utf8(replaced, unicode::k_replacement_char);
      } else {
        replaced.push_back(c);
      }
    }
    raw = replaced;
  }

  std::vector<std::string_view> words;
  pretokenizer_->split(raw, words);

  detail::merge_workspace ws;
  std::string mapped;
  for (std::string_view word : words) {
    if (word.empty()) continue;
    if (ignore_merges_) {
      mapped.clear();
      for (char c : word) mapped.append(unicode::byte_to_unicode(static_cast<std::uint8_t>(c)));
      if (const token_id id = find_token(mapped); id != k_no_token) {
        out.push_back(id);
        continue;
      }
    }

    // Byte-level: every byte is one symbol, its token the byte's alphabet character.
    ws.symbols.clear();
    const auto n = static_cast<std::int32_t>(word.size());
    for (std::int32_t i = 0; i < n; ++i) {
      ws.symbols.push_back({static_cast<std::uint32_t>(i), 1, i - 1, i + 1 < n ? i + 1 : -1,
                            byte_tokens_[static_cast<std::uint8_t>(word[i])]});
    }
    detail::merge_pairs(ws, [&](const detail::merge_symbol& l,
                                const detail::merge_symbol& r) -> std::optional<detail::merge_result> {
      if (l.id == k_no_token || r.id == k_no_token) return std::nullopt;
      const std::uint64_t key = (static_cast<std::uint64_t>(l.id) << 32) | static_cast<std::uint32_t>(r.id);
      const auto it = merges_.find(key);
      if (it == merges_.end()) return std::nullopt;
      return detail::merge_result{static_cast<double>(it->second.rank), it->second.result};
    });

    for (std::int32_t i = 0; i >= 0; i = ws.symbols[i].next) {
      // Only a byte of U+FFFD itself can lack a token here; it is dropped.
      if (const token_id id = ws.symbols[i].id; id != k_no_token) out.push_back(id);
    }
  }
}

}  // namespace pagoda
