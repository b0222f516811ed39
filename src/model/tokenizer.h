// Text <-> token ids for the vocabularies GGUF files carry (tokenizer.ggml.*):
//
//  - `llama`: SentencePiece-style BPE. Spaces become U+2581 ("▁"), a "▁" is
//    prefixed to text that starts a sequence or follows a special token
//    (tokenizer.ggml.add_space_prefix), adjacent pieces merge highest score
//    first, and characters no token covers fall back to <0xXX> byte tokens.
//  - `gpt2`: byte-level BPE. Text is cut into words by the pre-tokenizer rules
//    tokenizer.ggml.pre names (pretokenizer.h), every byte maps to one printable
//    character, and tokenizer.ggml.merges are applied lowest rank first.
//
// Special tokens: user-defined tokens written in the text are always matched as
// single tokens (as llama.cpp and Hugging Face do); control tokens (<s>,
// <|im_start|>, ...) only when the caller asks (parse_special), for chat
// templates. Matching is leftmost-longest.
//
// A tokenizer is immutable after loading; every method is const and safe to
// call from many threads at once.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/pretokenizer.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

namespace gguf {
class file;
}

// tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
enum class token_type : std::uint8_t {
  undefined = 0,
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6,
};
const char* token_type_name(token_type t);

enum class tokenizer_kind : std::uint8_t {
  spm,  // tokenizer.ggml.model = "llama"
  bpe,  // tokenizer.ggml.model = "gpt2"
};

class tokenizer {
 public:
  // Reads tokenizer.ggml.* from a GGUF file. The tokenizer copies what it needs;
  // the file may be closed afterwards. Errors name the key at fault: missing
  // tokens, counts that disagree between tokens/scores/token_type, special ids
  // out of range, an unknown model or pre-tokenizer name, malformed merges.
  static result<std::unique_ptr<tokenizer>> from_gguf(const gguf::file& file);

  tokenizer(const tokenizer&) = delete;
  tokenizer& operator=(const tokenizer&) = delete;

  // Text to ids. add_bos prepends BOS when the vocabulary has one (callers
  // usually pass add_bos_default()); EOS is never appended. parse_special also
  // matches control tokens written literally in the text. Any byte string is
  // accepted: invalid UTF-8 is tokenized byte by byte (byte tokens), never rejected.
  // REQUIRES: text.size() < 4 GiB.
  std::vector<token_id> encode(std::string_view text, bool add_bos, bool parse_special = false) const;

  // Ids to text, the inverse of encode: decode(encode(t, false)) == t for SPM
  // and byte-level vocabularies alike (the "▁" the encoder prefixed is dropped
  // again). Control and unknown tokens render as nothing unless render_special,
  // then as their text. Ids outside the vocabulary render as nothing. The result
  // holds the raw bytes, so it may be invalid UTF-8 if the ids are arbitrary;
  // stream_decoder (tokenizer_stream.h) gives valid UTF-8 incrementally.
  std::string decode(std::span<const token_id> tokens, bool render_special = false) const;

  // One token's bytes, without the leading-space rule of decode(). For "▁the"
  // that is " the"; for <0x0A> it is "\n"; for a byte token inside a multi-byte
  // character it is a lone byte.
  std::string token_to_piece(token_id id, bool render_special = false) const;

  // The step decode() and stream_decoder share: appends the bytes of `id` to
  // `out`. `at_text_start` is true where no text precedes (sequence start, or
  // right after a special token); an SPM piece there loses one leading space, as
  // the encoder added it. Updated for the next token.
  void append_decoded(token_id id, bool render_special, bool& at_text_start, std::string& out) const;

  tokenizer_kind kind() const { return kind_; }
  const std::string& model_name() const { return model_name_; }  // tokenizer.ggml.model
  const std::string& pre_name() const { return pre_name_; }      // tokenizer.ggml.pre (BPE)

  std::int32_t n_vocab() const { return static_cast<std::int32_t>(texts_.size()); }
  bool valid_id(token_id id) const { return id >= 0 && id < n_vocab(); }

  // Special ids; k_no_token where the vocabulary has none.
  token_id bos() const { return bos_; }
  token_id eos() const { return eos_; }
  token_id eot() const { return eot_; }  // end of turn (<|eot_id|>, <|im_end|>, <|end|>, ...)
  token_id eom() const { return eom_; }  // end of message (<|eom_id|>)
  token_id unk() const { return unk_; }
  token_id pad() const { return pad_; }
  token_id sep() const { return sep_; }
  // End of generation: EOS, EOT, EOM and every other control token that ends a
  // turn in some chat format. Sorted.
  bool is_eog(token_id id) const;
  std::span<const token_id> eog_tokens() const { return eog_; }

  bool add_bos_default() const { return add_bos_; }  // tokenizer.ggml.add_bos_token
  bool add_eos_default() const { return add_eos_; }  // tokenizer.ggml.add_eos_token
  bool add_space_prefix() const { return add_space_prefix_; }

  // Per-token data; empty / 0 / undefined for ids outside the vocabulary.
  std::string_view token_text(token_id id) const;
  float token_score(token_id id) const;
  token_type type_of(token_id id) const;
  bool is_control(token_id id) const { return type_of(id) == token_type::control; }
  // The id whose text is exactly `text`, or k_no_token.
  token_id find_token(std::string_view text) const;

 private:
  tokenizer() = default;

  struct fragment {
    std::string_view text;     // raw text when id == k_no_token
    token_id id = k_no_token;  // a special token matched in the text
  };
  struct bpe_merge {
    std::int32_t rank;
    token_id result;
  };

  status load_vocab(const gguf::file& file);
  status load_special_ids(const gguf::file& file);
  status load_merges(const gguf::file& file);
  void build_tables();

  void split_special(std::string_view text, bool parse_special, std::vector<fragment>& out) const;
  // SPM: `text` is one raw fragment; prefix_space adds the leading "▁".
  void encode_spm(std::string_view text, bool prefix_space, std::vector<token_id>& out) const;
  void encode_bpe(std::string_view text, std::vector<token_id>& out) const;
  token_id find_mergeable_spm(std::string_view text) const;
  // SPM: whether some token holds a word start (a "▁" after another character),
  // so merges may cross words and a fragment must merge as a whole.
  bool spm_tokens_cross_words() const;

  tokenizer_kind kind_ = tokenizer_kind::spm;
  std::string model_name_;
  std::string pre_name_;

  // Invariant: texts_ is never resized after build_tables(); text_to_id_ keys view into it.
  std::vector<std::string> texts_;
  std::vector<float> scores_;
  std::vector<token_type> types_;
  std::vector<std::string> pieces_;  // decoded bytes of each token (non-special rendering)
  std::unordered_map<std::string_view, token_id> text_to_id_;

  // SPM: the <0xXX> token of each byte. BPE: the token of each byte's character.
  std::array<token_id, 256> byte_tokens_{};
  // BPE: (left id << 32 | right id) -> rank and merged token.
  std::unordered_map<std::uint64_t, bpe_merge> merges_;
  std::optional<pretokenizer> pretokenizer_;
  bool ignore_merges_ = false;
  bool spm_cross_words_ = true;

  // Special tokens the text is scanned for, bucketed by first byte, longest first.
  std::array<std::vector<token_id>, 256> special_by_first_byte_;

  token_id bos_ = k_no_token;
  token_id eos_ = k_no_token;
  token_id eot_ = k_no_token;
  token_id eom_ = k_no_token;
  token_id unk_ = k_no_token;
  token_id pad_ = k_no_token;
  token_id sep_ = k_no_token;
  std::vector<token_id> eog_;
  bool add_bos_ = false;
  bool add_eos_ = false;
  bool add_space_prefix_ = false;
};

}  // namespace pagoda
