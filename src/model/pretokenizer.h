// Pre-tokenization for byte-level BPE: the regex rules, selected by
// tokenizer.ggml.pre, that cut text into words before merges run. Merges never
// cross a word boundary, so these rules decide as much of the output as the
// merges do.
//
// A rule set is a list of patterns applied in turn: each pattern splits every
// piece from the previous step into its matches and the gaps between them (both
// kept, in order), as llama.cpp's unicode_regex_split and Hugging Face's
// Split(behavior = "isolated") do. Patterns run on PCRE2 in UTF + UCP mode, so
// \p{L}, \p{N}, \p{P} and \s are the real Unicode classes. Invalid UTF-8 never
// matches a pattern item: it lands in gaps and still reaches the byte-level BPE.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagoda/status.h"

namespace pagoda {

class compiled_regex;

class pretokenizer {
 public:
  // `name` is a tokenizer.ggml.pre value ("default", "llama-bpe", "qwen2", ...);
  // errc::unsupported for a name without rules here.
  static result<pretokenizer> for_name(std::string_view name);
  // Rules from explicit patterns (tests, and models whose rules come from elsewhere).
  static result<pretokenizer> from_patterns(std::span<const std::string> patterns);

  // The names for_name accepts, for error messages and documentation.
  static std::vector<std::string_view> known_names();

  // Appends to `words` the pieces of `text`, in order; they concatenate back to
  // `text` exactly and none is empty. Thread-safe: compiled patterns are shared,
  // match state is per thread.
  void split(std::string_view text, std::vector<std::string_view>& words) const;

  // Family traits that travel with the rules (llama-3 style vocabularies).
  // ignore_merges: a word that is itself a token becomes that token without merging.
  bool ignore_merges() const { return ignore_merges_; }
  // The family adds BOS unless tokenizer.ggml.add_bos_token says otherwise.
  bool add_bos_default() const { return add_bos_; }

 private:
  std::vector<std::shared_ptr<const compiled_regex>> patterns_;
  bool ignore_merges_ = false;
  bool add_bos_ = false;
};

}  // namespace pagoda
