// Loading a vocabulary from GGUF, special-token matching, decoding and the
// accessors. The two merge algorithms live in tokenizer_spm.cpp and
// tokenizer_bpe.cpp.
#include "model/tokenizer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/assert.h"
#include "model/gguf.h"
#include "model/unicode.h"

namespace pagoda {

namespace {


// Tokens that end a turn in the chat formats Pagoda knows, by text. They count
// as end-of-generation when the vocabulary marks them control or user-defined.
constexpr std::string_view k_eot_names[] = {
    "<|eot_id|>", "<|im_end|>",      "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
    "_<EOT>",     "<|EOT|>",         "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",
    "<end_of_utterance>",
};
constexpr std::string_view k_eom_name = "<|eom_id|>";

bool is_special_type(token_type t) {
  return t == token_type::control || t == token_type::user_defined || t == token_type::unknown;
}

// Reads an optional special-token id. Absent keys keep `id`; negative values and
// 0xFFFFFFFF (how converters write "none") clear it.
status read_special_id(const gguf::file& file, std::string_view key, std::int32_t n_vocab, token_id& id) {
  const gguf::value* v = file.find(key);
  if (v == nullptr) return ok_status();
  std::int64_t raw = 0;
  switch (v->type) {
    case gguf::value_type::u8:
    case gguf::value_type::u16:
    case gguf::value_type::u32:
    case gguf::value_type::u64:
      if (v->u >= 0xFFFFFFFFull) {
        id = k_no_token;
        return ok_status();
      }
      raw = static_cast<std::int64_t>(v->u);
      break;
    case gguf::value_type::i8:
    case gguf::value_type::i16:
    case gguf::value_type::i32:
    case gguf::value_type::i64:
      raw = v->i;
      break;
    default:
      return error(errc::invalid_argument, "{} has type {}, expected an integer token id", key,
                   gguf::value_type_name(v->type));
  }
  if (raw < 0) {
    id = k_no_token;
    return ok_status();
  }
  if (raw >= n_vocab) {
    return error(errc::out_of_range, "{} = {} is out of range (the vocabulary has {} tokens)", key, raw, n_vocab);
  }
  id = static_cast<token_id>(raw);
  return ok_status();
}

status read_optional_bool(const gguf::file& file, std::string_view key, bool& flag) {
  if (file.find(key) == nullptr) return ok_status();
  auto v = file.get_bool(key);
  if (!v.ok()) return v.error();
  flag = *v;
  return ok_status();
}

// "<0x41>" -> 0x41, or -1.
int parse_byte_token(std::string_view text) {
  if (text.size() != 6 || !text.starts_with("<0x") || text[5] != '>') return -1;
  int value = 0;
  for (char c : text.substr(3, 2)) {
    int digit = -1;
    if (c >= '0' && c <= '9') digit = c - '0';
    if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

// SentencePiece piece -> text: "▁" back to " ".
std::string unescape_spm(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t pos = 0; pos < text.size();) {
    if (text.substr(pos, unicode::k_spm_space.size()) == unicode::k_spm_space) {
      out.push_back(' ');
      pos += unicode::k_spm_space.size();
    } else {
      out.push_back(text[pos++]);
    }
  }
  return out;
}

// Byte-level piece -> bytes: each character of the byte alphabet back to its
// byte; characters outside the alphabet (rare, in added tokens) stay as they are.
std::string unescape_byte_level(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t pos = 0; pos < text.size();) {
    const auto s = unicode::scan_utf8(text, pos);
    const int byte = s.kind == unicode::utf8_scan::valid ? unicode::unicode_to_byte(s.cp) : -1;
    const std::size_t n = s.kind == unicode::utf8_scan::valid ? s.size : 1;
    if (byte >= 0) {
      out.push_back(static_cast<char>(byte));
    } else {
      out.append(text.substr(pos, n));
    }
    pos += n;
  }
  return out;
}

}  // namespace

const char* token_type_name(token_type t) {
  switch (t) {
    case token_type::undefined: return "undefined";
    case token_type::normal: return "normal";
    case token_type::unknown: return "unknown";
    case token_type::control: return "control";
    case token_type::user_defined: return "user_defined";
    case token_type::unused: return "unused";
    case token_type::byte: return "byte";
  }
  return "invalid";
}

result<std::unique_ptr<tokenizer>> tokenizer::from_gguf(const gguf::file& file) {
  std::unique_ptr<tokenizer> tok(new tokenizer());
  PAGODA_RETURN_IF_ERROR(tok->load_vocab(file).with_context("tokenizer"));
  PAGODA_RETURN_IF_ERROR(tok->load_special_ids(file).with_context("tokenizer"));
  if (tok->kind_ == tokenizer_kind::bpe) PAGODA_RETURN_IF_ERROR(tok->load_merges(file).with_context("tokenizer"));
  tok->build_tables();
  return tok;
}

status tokenizer::load_vocab(const gguf::file& file) {
  auto model = file.get_string("tokenizer.ggml.model");
  if (!model.ok()) {
    if (model.error().code() == errc::not_found) {
      return error(errc::not_found, "tokenizer.ggml.model is missing: the file carries no vocabulary");
    }
    return model.error();
  }
  model_name_ = std::string(*model);
  if (model_name_ == "llama") {
    kind_ = tokenizer_kind::spm;
  } else if (model_name_ == "gpt2") {
    kind_ = tokenizer_kind::bpe;
  } else {
    return error(errc::unsupported, "tokenizer.ggml.model '{}' is not supported (supported: llama, gpt2)",
                 model_name_);
  }

  auto tokens = file.get_string_array("tokenizer.ggml.tokens");
  if (!tokens.ok()) return tokens.error();
  const std::size_t n = tokens->size();
  if (n == 0) return error(errc::corrupt, "tokenizer.ggml.tokens is empty");
  if (n > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    return error(errc::corrupt, "tokenizer.ggml.tokens has {} entries, more than token ids can address", n);
  }
  texts_.assign(tokens->begin(), tokens->end());

  scores_.assign(n, 0.0f);
  if (file.find("tokenizer.ggml.scores") != nullptr) {
    auto scores = file.get_f32_array("tokenizer.ggml.scores");
    if (!scores.ok()) return scores.error();
    if (scores->size() != n) {
      return error(errc::corrupt, "tokenizer.ggml.scores has {} entries but tokenizer.ggml.tokens has {}",
                   scores->size(), n);
    }
    for (std::size_t i = 0; i < scores->size(); ++i)
      if (std::isnan((*scores)[i])) return error(errc::corrupt, "tokenizer.ggml.scores[{}] is NaN", i);
    scores_ = std::move(*scores);
  } else if (kind_ == tokenizer_kind::spm) {
    return error(errc::not_found, "tokenizer.ggml.scores is missing; the llama (SentencePiece) tokenizer merges by score");
  }

  types_.assign(n, token_type::normal);
  if (file.find("tokenizer.ggml.token_type") != nullptr) {
    auto types = file.get_i32_array("tokenizer.ggml.token_type");
    if (!types.ok()) return types.error();
    if (types->size() != n) {
      return error(errc::corrupt, "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
                   types->size(), n);
    }
    for (std::size_t i = 0; i < n; ++i) {
      const std::int32_t t = (*types)[i];
      if (t < 0 || t > static_cast<std::int32_t>(token_type::byte)) {
        return error(errc::corrupt, "tokenizer.ggml.token_type[{}] = {} is not a token type (0..6)", i, t);
      }
      types_[i] = static_cast<token_type>(t);
    }
  }

  if (kind_ == tokenizer_kind::bpe) {
    pre_name_ = "default";
    if (file.find("tokenizer.ggml.pre") != nullptr) {
      auto pre = file.get_string("tokenizer.ggml.pre");
      if (!pre.ok()) return pre.error();
      if (!pre->empty()) pre_name_ = std::string(*pre);
    }
    auto rules = pretokenizer::for_name(pre_name_);
    if (!rules.ok()) return rules.error().with_context("tokenizer.ggml.pre");
    pretokenizer_ = std::move(*rules);
    ignore_merges_ = pretokenizer_->ignore_merges();
  } else if (auto pre = file.get_string("tokenizer.ggml.pre"); pre.ok()) {
    pre_name_ = std::string(*pre);  // informational: SentencePiece has no pre-tokenizer
  }

  // Later duplicates win, as in llama.cpp; empty texts cannot be looked up.
  text_to_id_.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (!texts_[i].empty()) text_to_id_[texts_[i]] = static_cast<token_id>(i);
  }
  return ok_status();
}

status tokenizer::load_special_ids(const gguf::file& file) {
  const std::int32_t n = n_vocab();
  if (kind_ == tokenizer_kind::spm) {
    // SentencePiece's conventional ids, used when the file does not say.
    if (n > 0) unk_ = 0;
    if (n > 1) bos_ = 1;
    if (n > 2) eos_ = 2;
  }
  PAGODA_RETURN_IF_ERROR(read_special_id(file, "tokenizer.ggml.bos_token_id", n, bos_));
  PAGODA_RETURN_IF_ERROR(read_special_id(file, "tokenizer.ggml.eos_token_id", n, eos_));
  PAGODA_RETURN_IF_ERROR(read_special_id(file, "tokenizer.ggml.eot_token_id", n, eot_));
  PAGODA_RETURN_IF_ERROR(read_special_id(file, "tokenizer.ggml.eom_token_id", n, eom_));
  PAGODA_RETURN_IF_ERROR(read_special_id(file, "tokenizer.ggml.unknown_token_id", n, unk_));
  PAGODA_RETURN_IF_ERROR(read_special_id(file, "tokenizer.ggml.padding_token_id", n, pad_));
  PAGODA_RETURN_IF_ERROR(read_special_id(file, "tokenizer.ggml.seperator_token_id", n, sep_));

  add_bos_ = kind_ == tokenizer_kind::spm || (pretokenizer_ && pretokenizer_->add_bos_default());
  add_eos_ = false;
  add_space_prefix_ = kind_ == tokenizer_kind::spm;
  PAGODA_RETURN_IF_ERROR(read_optional_bool(file, "tokenizer.ggml.add_bos_token", add_bos_));
  PAGODA_RETURN_IF_ERROR(read_optional_bool(file, "tokenizer.ggml.add_eos_token", add_eos_));
  PAGODA_RETURN_IF_ERROR(read_optional_bool(file, "tokenizer.ggml.add_space_prefix", add_space_prefix_));
  if (kind_ == tokenizer_kind::bpe) add_space_prefix_ = false;  // byte-level BPE encodes spaces as they are

  const auto turn_ender = [&](std::string_view name) {
    const token_id id = find_token(name);
    if (id == k_no_token) return k_no_token;
    const token_type t = types_[id];
    return t == token_type::control || t == token_type::user_defined ? id : k_no_token;
  };
  for (auto name : k_eot_names) {
    const token_id id = turn_ender(name);
    if (id == k_no_token) continue;
    if (eot_ == k_no_token) eot_ = id;
    eog_.push_back(id);
  }
  if (eom_ == k_no_token) eom_ = turn_ender(k_eom_name);
  for (token_id id : {eos_, eot_, eom_}) {
    if (id != k_no_token) eog_.push_back(id);
  }
  std::sort(eog_.begin(), eog_.end());
  eog_.erase(std::unique(eog_.begin(), eog_.end()), eog_.end());
  return ok_status();
}

status tokenizer::load_merges(const gguf::file& file) {
  auto merges = file.get_string_array("tokenizer.ggml.merges");
  if (!merges.ok()) {
    if (merges.error().code() == errc::not_found) {
      return error(errc::not_found, "tokenizer.ggml.merges is missing; the gpt2 (byte-level BPE) tokenizer needs it");
    }
    return merges.error();
  }
  merges_.reserve(merges->size());
  for (std::size_t rank = 0; rank < merges->size(); ++rank) {
    const std::string_view line = (*merges)[rank];
    // The first space after the first character separates the halves ("Ġ t").
    const std::size_t space = line.size() > 1 ? line.find(' ', 1) : std::string_view::npos;
    if (space == std::string_view::npos || space + 1 >= line.size()) {
      return error(errc::corrupt, "tokenizer.ggml.merges[{}] = '{}' is not two tokens separated by a space", rank,
                   line);
    }
    const std::string_view left = line.substr(0, space), right = line.substr(space + 1);
    const token_id l = find_token(left), r = find_token(right);
    const token_id merged = find_token(std::string(left) + std::string(right));
    // A merge whose parts or result are not tokens can never apply to token symbols.
    if (l == k_no_token || r == k_no_token || merged == k_no_token) continue;
    const std::uint64_t key = (static_cast<std::uint64_t>(l) << 32) | static_cast<std::uint32_t>(r);
    merges_.emplace(key, bpe_merge{static_cast<std::int32_t>(rank), merged});  // the first (best) rank wins
  }
  return ok_status();
}

void tokenizer::build_tables() {
  const std::int32_t n = n_vocab();

  byte_tokens_.fill(k_no_token);
  if (kind_ == tokenizer_kind::spm) {
    for (token_id id = 0; id < n; ++id) {
      const int b = types_[id] == token_type::byte ? parse_byte_token(texts_[id]) : -1;
      if (b >= 0 && byte_tokens_[b] == k_no_token) byte_tokens_[b] = id;
    }
    for (int b = 0; b < 0x80; ++b) {  // vocabularies without byte tokens: the ASCII character itself
      if (byte_tokens_[b] == k_no_token) byte_tokens_[b] = find_token(std::string(1, static_cast<char>(b)));
    }
    spm_cross_words_ = spm_tokens_cross_words();
  } else {
    for (int b = 0; b < 256; ++b) byte_tokens_[b] = find_token(unicode::byte_to_unicode(static_cast<std::uint8_t>(b)));
  }

  pieces_.resize(n);
  for (token_id id = 0; id < n; ++id) {
    const std::string_view text = texts_[id];
    switch (types_[id]) {
      case token_type::control:
      case token_type::unknown:
        break;  // rendered only on request, from texts_
      case token_type::user_defined:
        pieces_[id] = std::string(text);  // literal text, matched as written
        break;
      case token_type::byte:
        if (kind_ == tokenizer_kind::spm) {
          const int b = parse_byte_token(text);
          pieces_[id] = b >= 0 ? std::string(1, static_cast<char>(b)) : unescape_spm(text);
          break;
        }
        [[fallthrough]];
      default:
        pieces_[id] = kind_ == tokenizer_kind::spm ? unescape_spm(text) : unescape_byte_level(text);
    }
  }

  // Special tokens to find in text: control and unknown (on request) and user-defined (always).
  std::vector<token_id> specials;
  for (token_id id = 0; id < n; ++id) {
    if (is_special_type(types_[id]) && !texts_[id].empty()) specials.push_back(id);
  }
  std::stable_sort(specials.begin(), specials.end(),
                   [&](token_id a, token_id b) { return texts_[a].size() > texts_[b].size(); });
  for (token_id id : specials) special_by_first_byte_[static_cast<std::uint8_t>(texts_[id][0])].push_back(id);
}

void tokenizer::split_special(std::string_view text, bool parse_special, std::vector<fragment>& out) const {
  std::size_t raw_begin = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    token_id match = k_no_token;
    for (token_id id : special_by_first_byte_[static_cast<std::uint8_t>(text[pos])]) {
      if (!parse_special && types_[id] != token_type::user_defined) continue;
      if (text.substr(pos).starts_with(texts_[id])) {
        match = id;  // buckets are longest first, so this is the longest match here
        break;
      }
    }
    if (match == k_no_token) {
      ++pos;
      continue;
    }
    if (pos > raw_begin) out.push_back({text.substr(raw_begin, pos - raw_begin), k_no_token});
    out.push_back({{}, match});
    pos += texts_[match].size();
    raw_begin = pos;
  }
  if (raw_begin < text.size()) out.push_back({text.substr(raw_begin), k_no_token});
}

std::vector<token_id> tokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  PAGODA_ASSERT(text.size() < std::numeric_limits<std::uint32_t>::max(), "text of {} bytes is too long to tokenize",
                text.size());
  std::vector<token_id> out;
  out.reserve(text.size() / 3 + 2);
  if (add_bos && bos_ != k_no_token) out.push_back(bos_);

  std::vector<fragment> fragments;
  split_special(text, parse_special, fragments);
  bool after_special = true;  // SPM: the text start counts as following a special token
  for (const fragment& f : fragments) {
    if (f.id != k_no_token) {
      out.push_back(f.id);
      after_special = true;
      continue;
    }
    if (kind_ == tokenizer_kind::spm) {
      encode_spm(f.text, add_space_prefix_ && after_special, out);
    } else {
      encode_bpe(f.text, out);
    }
    after_special = false;
  }
  return out;
}

void tokenizer::append_decoded(token_id id, bool render_special, bool& at_text_start, std::string& out) const {
  if (!valid_id(id)) return;
  if (is_special_type(types_[id])) {
    if (render_special || types_[id] == token_type::user_defined) out.append(texts_[id]);
    at_text_start = true;
    return;
  }
  std::string_view piece = pieces_[id];
  if (at_text_start && add_space_prefix_ && !piece.empty() && piece.front() == ' ') piece.remove_prefix(1);
  out.append(piece);
  at_text_start = false;
}

std::string tokenizer::decode(std::span<const token_id> tokens, bool render_special) const {
  std::string out;
  bool at_text_start = true;
  for (token_id id : tokens) append_decoded(id, render_special, at_text_start, out);
  return out;
}

std::string tokenizer::token_to_piece(token_id id, bool render_special) const {
  if (!valid_id(id)) return {};
  if (types_[id] == token_type::control || types_[id] == token_type::unknown) {
    return render_special ? texts_[id] : std::string();
  }
  return pieces_[id];
}

bool tokenizer::is_eog(token_id id) const { return std::binary_search(eog_.begin(), eog_.end(), id); }

std::string_view tokenizer::token_text(token_id id) const { return valid_id(id) ? texts_[id] : std::string_view(); }

float tokenizer::token_score(token_id id) const { return valid_id(id) ? scores_[id] : 0.0f; }

token_type tokenizer::type_of(token_id id) const { return valid_id(id) ? types_[id] : token_type::undefined; }

token_id tokenizer::find_token(std::string_view text) const {
  auto it = text_to_id_.find(text);
  return it == text_to_id_.end() ? k_no_token : it->second;
}

}  // namespace pagoda
