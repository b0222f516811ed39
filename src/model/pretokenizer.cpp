#include "model/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "model/unicode.h"

namespace pagoda {

namespace {

// The rule sets, by the tokenizer.ggml.pre names that select them. Patterns are
// those of the models' tokenizer.json files as llama.cpp lists them
// (llama-vocab.cpp); case-insensitive contractions are spelled out as [sS] so
// that PCRE2's Unicode case folding (which maps 's' to U+017F) cannot widen them.
struct rule_set {
  std::vector<std::string_view> names;
  std::vector<std::string> patterns;
  bool ignore_merges = false;  // a word that is itself a token is emitted whole
  bool add_bos = false;        // the family's tokenizer adds BOS by default
};

// GPT-2's word rule, shared by several families.
constexpr std::string_view k_gpt2_words =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
constexpr std::string_view k_contractions = R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]))";

std::string llama3_words(std::string_view digits) {
  return std::string(k_contractions) + R"(|[^\r\n\p{L}\p{N}]?\p{L}+|)" + std::string(digits) +
         R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
}

// Words split by case (upper-then-lower runs), as in GPT-4o and Tekken.
std::string cased_words(std::string_view contraction_suffix, std::string_view digits) {
  const std::string upper = R"([\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])";
  const std::string lower = R"([\p{Ll}\p{Lm}\p{Lo}\p{M}])";
  const std::string lead = R"([^\r\n\p{L}\p{N}]?)";
  const std::string suffix(contraction_suffix);
  return lead + upper + "*" + lower + "+" + suffix + "|" + lead + upper + "+" + lower + "*" + suffix + "|" +
         std::string(digits) + R"(| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
}

// Cased letters (Unicode L&) as DeepSeek LLM lists them, written as escapes.
constexpr std::string_view k_deepseek_letters =
    R"(A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293})"
    R"(\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386})"
    R"(\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F})"
    R"(\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA})"
    R"(\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A})"
    R"(\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D})"
    R"(\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4})"
    R"(\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3})"
    R"(\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107})"
    R"(\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D})"
    R"(\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184})"
    R"(\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D})"
    R"(\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E})"
    R"(\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A})"
    R"(\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB})"
    R"(\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943})";
constexpr std::string_view k_cjk = R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)";

const std::vector<rule_set>& rule_sets() {
  static const std::vector<rule_set> sets = [] {
    const std::string gpt2(k_gpt2_words);
    const std::string cjk(k_cjk);
    std::vector<rule_set> s;
    s.push_back({{"default"}, {R"([\p{P}\$\+<=>\^~\|]+)", gpt2, R"(\p{N}+)", "[0-9][0-9][0-9]"}});
    s.push_back({{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"},
                 {llama3_words(R"(\p{N}{1,3})")},
                 true,
                 true});
    s.push_back({{"dbrx", "smaug-bpe", "glm4", "chatglm-bpe"}, {llama3_words(R"(\p{N}{1,3})")}});
    s.push_back({{"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"}, {llama3_words(R"(\p{N})")}});
    s.push_back({{"deepseek-llm"},
                 {"[\r\n]", R"(\s?[)" + std::string(k_deepseek_letters) + "]+",
                  R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)", R"(\s+$)", cjk,
                  R"(\p{N}+)"}});
    s.push_back({{"deepseek-coder"}, {"[\r\n]", R"(\s?\p{L}+)", R"(\s?\p{P}+)", cjk, R"(\p{N})"}});
    s.push_back({{"deepseek-v3"},
                 {R"(\p{N}{1,3})", R"([\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+)",
                  R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+)"
                  R"(| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}});
    s.push_back({{"falcon"}, {R"([\p{P}\$\+<=>\^~\|`]+)", gpt2, "[0-9][0-9][0-9]"}});
    s.push_back({{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"},
                 {R"(\p{N})", gpt2}});
    s.push_back({{"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en", "jina-v2-es", "jina-v2-de",
                  "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "trillion", "exaone4", "granite-docling"},
                 {gpt2}});
    s.push_back({{"poro-chat", "bloom", "gpt3-finnish"},
                 {R"( ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+)"}});
    s.push_back({{"gpt-4o", "llama4"}, {cased_words(std::string(k_contractions) + "?", R"(\p{N}{1,3})")}});
    s.push_back({{"tekken"}, {cased_words("", R"(\p{N})")}, true, true});
    return s;
  }();
  return sets;
}

}  // namespace

// One compiled pattern. pcre2_code is immutable after compilation and safe to
// match from many threads at once.
class compiled_regex {
 public:
  explicit compiled_regex(pcre2_code* code) : code_(code) {}
  ~compiled_regex() { pcre2_code_free(code_); }
  compiled_regex(const compiled_regex&) = delete;
  compiled_regex& operator=(const compiled_regex&) = delete;

  const pcre2_code* code() const { return code_; }

 private:
  pcre2_code* code_;
};

namespace {

// Patterns are compiled once per process and shared by every tokenizer.
result<std::shared_ptr<const compiled_regex>> compile_cached(const std::string& pattern) {
  static std::mutex mutex;
  static std::unordered_map<std::string, std::shared_ptr<const compiled_regex>> cache;
  std::lock_guard lock(mutex);
  if (auto it = cache.find(pattern); it != cache.end()) return it->second;

  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  const std::uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_DOLLAR_ENDONLY;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                                   &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof message);
    return error(errc::invalid_argument, "pre-tokenizer pattern '{}': {} at offset {}", pattern,
                 reinterpret_cast<const char*>(message), error_offset);
  }
  // Without JIT (a build or CPU that lacks it) the interpreter gives the same matches, slower.
  (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  auto compiled = std::make_shared<const compiled_regex>(code);
  cache.emplace(pattern, compiled);
  return compiled;
}

// Per-thread match state: match data and a JIT stack cannot be shared between
// concurrent matches.
struct match_state {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;

  match_state() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, nullptr);
    if (context != nullptr && jit_stack != nullptr) pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~match_state() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  match_state(const match_state&) = delete;
  match_state& operator=(const match_state&) = delete;
};

match_state& thread_match_state() {
  thread_local match_state state;
  return state;
}

// Splits one piece into matches and gaps. A match that fails for a resource
// limit (not for want of a match) leaves the rest of the piece as one gap, which
// still tokenizes, only less finely.
void split_piece(const compiled_regex& re, std::string_view piece, std::vector<std::string_view>& out) {
  match_state& state = thread_match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
  std::size_t start = 0;  // where the next search begins
  std::size_t last = 0;   // end of what has been emitted
  while (start < piece.size()) {
    const int rc = pcre2_match(re.code(), subject, piece.size(), start, 0, state.data, state.context);
    if (rc < 0) break;  // PCRE2_ERROR_NOMATCH, or a limit
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data);
    const std::size_t begin = ov[0], end = ov[1];
    if (end <= begin) {  // empty match: it splits nothing, look further on
      start = begin + unicode::char_size(piece, std::min(begin, piece.size() - 1));
      continue;
    }
    if (begin > last) out.push_back(piece.substr(last, begin - last));
    out.push_back(piece.substr(begin, end - begin));
    last = start = end;
  }
  if (last < piece.size()) out.push_back(piece.substr(last));
}

}  // namespace

result<pretokenizer> pretokenizer::from_patterns(std::span<const std::string> patterns) {
  pretokenizer p;
  for (const auto& pattern : patterns) {
    PAGODA_ASSIGN_OR_RETURN(auto compiled, compile_cached(pattern));
    p.patterns_.push_back(std::move(compiled));
  }
  return p;
}

result<pretokenizer> pretokenizer::for_name(std::string_view name) {
  for (const auto& set : rule_sets()) {
    if (std::find(set.names.begin(), set.names.end(), name) == set.names.end()) continue;
    PAGODA_ASSIGN_OR_RETURN(auto p, from_patterns(set.patterns));
    p.ignore_merges_ = set.ignore_merges;
    p.add_bos_ = set.add_bos;
    return p;
  }
  std::string known;
  for (auto n : known_names()) known += (known.empty() ? "" : ", ") + std::string(n);
  return error(errc::unsupported, "pre-tokenizer '{}' is not supported (known: {})", name, known);
}

std::vector<std::string_view> pretokenizer::known_names() {
  std::vector<std::string_view> names;
  for (const auto& set : rule_sets()) names.insert(names.end(), set.names.begin(), set.names.end());
  return names;
}

void pretokenizer::split(std::string_view text, std::vector<std::string_view>& words) const {
  if (text.empty()) return;
  std::vector<std::string_view> pieces{text}, next;
  for (const auto& re : patterns_) {
    next.clear();
    for (auto piece : pieces) split_piece(*re, piece, next);
    pieces.swap(next);
  }
  words.insert(words.end(), pieces.begin(), pieces.end());
}

}  // namespace pagoda
