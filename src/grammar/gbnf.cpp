#include "grammar/gbnf.h"

#include <algorithm>
#include <fmt/format.h>
#include <unordered_map>

namespace pagoda::grammar {

bool char_class::contains(std::uint32_t cp) const { return intersects(cp, cp); }

bool char_class::intersects(std::uint32_t lo, std::uint32_t hi) const {
  if (!negated) {
    for (const auto& [a, b] : ranges)
      if (a <= hi && lo <= b) return true;
    return false;
  }
  // Negated: some point of [lo, hi] outside every range. The ranges are
  // sorted and disjoint, so walk them from lo.
  std::uint32_t at = lo;
  for (const auto& [a, b] : ranges) {
    if (b < at) continue;
    if (a > at) return true;
    if (b >= hi) return false;
    at = b + 1;
  }
  return at <= hi;
}

std::string gbnf_literal(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (u < 0x20 || u == 0x7f) {
      out += fmt::format("\\x{:02X}", u);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

namespace {

using alternative = std::vector<element>;  // without its end element

class parser {
 public:
  explicit parser(std::string_view text) : s_(text) {}

  result<rules> run() {
    if (s_.size() > k_max_grammar_bytes)
      return error(errc::invalid_argument, "grammar: {} bytes, more than the limit of {}", s_.size(),
                   k_max_grammar_bytes);
    for (;;) {
      skip_space(true);
      if (pos_ >= s_.size()) break;
      const std::size_t at = pos_;
      std::string name = parse_name();
      if (name.empty()) return fail("expected a rule name");
      skip_space(false);
      if (s_.substr(pos_, 3) != "::=") return fail(fmt::format("expected '::=' after rule name '{}'", name));
      pos_ += 3;
      skip_space(true);
      const std::uint32_t id = rule_id(name);
      if (defined_[id]) return fail_at(at, fmt::format("rule '{}' is defined twice", name));
      defined_[id] = true;
      std::vector<alternative> alts;
      PAGODA_RETURN_IF_ERROR(parse_alternates(id, false, alts));
      alts_[id] = std::move(alts);
      skip_space(false);
      if (pos_ < s_.size() && s_[pos_] != '\n') return fail("expected the end of the line after the rule");
    }
    return finish();
  }

 private:
  status fail(const std::string& what) const { return fail_at(pos_, what); }
  status fail_at(std::size_t at, const std::string& what) const {
    const auto line = 1 + std::count(s_.begin(), s_.begin() + static_cast<std::ptrdiff_t>(std::min(at, s_.size())), '\n');
    return error(errc::invalid_argument, "grammar: line {}: {}", line, what);
  }

  static bool is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  }

  std::string parse_name() {
    const std::size_t b = pos_;
    while (pos_ < s_.size() && is_name_char(s_[pos_])) ++pos_;
    return std::string(s_.substr(b, pos_ - b));
  }

  // Spaces, tabs, carriage returns and comments; newlines too when `newlines`.
  void skip_space(bool newlines) {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
        ++pos_;
      } else if (c == '#') {
        while (pos_ < s_.size() && s_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  std::uint32_t rule_id(const std::string& name) {
    const auto [it, added] = ids_.try_emplace(name, static_cast<std::uint32_t>(names_.size()));
    if (added) {
      names_.push_back(name);
      defined_.push_back(false);
      alts_.emplace_back();
    }
    return it->second;
  }

  std::uint32_t new_rule(std::uint32_t parent, std::vector<alternative> alts) {
    std::string name;
    do {
      name = fmt::format("{}_{}", names_[parent], ++n_generated_);
    } while (ids_.count(name) != 0);
    const std::uint32_t id = rule_id(name);
    defined_[id] = true;
    for (const alternative& a : alts) n_elements_ += a.size() + 1;
    alts_[id] = std::move(alts);
    return id;
  }

  status count(std::size_t n) {
    n_elements_ += n;
    if (n_elements_ > k_max_elements)
      return fail(fmt::format("the grammar expands to more than {} elements", k_max_elements));
    return {};
  }

  status parse_alternates(std::uint32_t rule, bool nested, std::vector<alternative>& alts) {
    alts.emplace_back();
    PAGODA_RETURN_IF_ERROR(parse_sequence(rule, nested, alts.back()));
    while (pos_ < s_.size() && s_[pos_] == '|') {
      ++pos_;
      skip_space(true);
      alts.emplace_back();
      PAGODA_RETURN_IF_ERROR(parse_sequence(rule, nested, alts.back()));
    }
    return count(alts.size());
  }

  std::uint32_t class_index(char_class c) {
    std::string key = c.negated ? "^" : "";
    for (const auto& [a, b] : c.ranges) key += fmt::format("{:x}-{:x},", a, b);
    const auto [it, added] = class_ids_.try_emplace(key, static_cast<std::uint32_t>(classes_.size()));
    if (added) classes_.push_back(std::move(c));
    return it->second;
  }

  element single(std::uint32_t cp) {
    char_class c;
    c.ranges.push_back({cp, cp});
    return {element::chr, class_index(std::move(c))};
  }

  // One code point of the text: UTF-8, or an escape when `escapes`.
  result<std::uint32_t> parse_char() {
    if (pos_ >= s_.size()) return fail("unexpected end of the grammar");
    const auto c = static_cast<unsigned char>(s_[pos_]);
    if (c == '\\') {
      if (pos_ + 1 >= s_.size()) return fail("unexpected end of the grammar after '\\'");
      const char e = s_[pos_ + 1];
      pos_ += 2;
      switch (e) {
        case 'n': return 0x0Au;
        case 'r': return 0x0Du;
        case 't': return 0x09u;
        case '0': return 0u;
        case '\\': case '"': case '[': case ']': case '-': case '^': case '\'': case '/': case '.':
          return static_cast<std::uint32_t>(e);
        case 'x': return parse_hex(2);
        case 'u': return parse_hex(4);
        case 'U': return parse_hex(8);
        default: return fail(fmt::format("unknown escape '\\{}'", e));
      }
    }
    int n = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      cp = c;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return fail("invalid UTF-8 in the grammar");
    }
    ++pos_;
    for (int i = 0; i < n; ++i, ++pos_) {
      if (pos_ >= s_.size() || (static_cast<unsigned char>(s_[pos_]) & 0xC0) != 0x80)
        return fail("invalid UTF-8 in the grammar");
      cp = (cp << 6) | (static_cast<unsigned char>(s_[pos_]) & 0x3F);
    }
    return cp;
  }

  result<std::uint32_t> parse_hex(int digits) {
    std::uint32_t v = 0;
    for (int i = 0; i < digits; ++i, ++pos_) {
      const char h = pos_ < s_.size() ? s_[pos_] : '\0';
      int d = -1;
      if (h >= '0' && h <= '9') d = h - '0';
      if (h >= 'a' && h <= 'f') d = h - 'a' + 10;
      if (h >= 'A' && h <= 'F') d = h - 'A' + 10;
      if (d < 0) return fail(fmt::format("expected {} hex digits in an escape", digits));
      v = v * 16 + static_cast<std::uint32_t>(d);
    }
    if (v > 0x10FFFF) return fail("escape past U+10FFFF");
    return v;
  }

  status parse_class(alternative& seq) {
    ++pos_;  // [
    char_class c;
    if (pos_ < s_.size() && s_[pos_] == '^') {
      c.negated = true;
      ++pos_;
    }
    while (pos_ < s_.size() && s_[pos_] != ']') {
      PAGODA_ASSIGN_OR_RETURN(std::uint32_t lo, parse_char());
      std::uint32_t hi = lo;
      if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
        ++pos_;
        PAGODA_ASSIGN_OR_RETURN(hi, parse_char());
        if (hi < lo) return fail("a character range whose end comes before its start");
      }
      c.ranges.push_back({lo, hi});
    }
    if (pos_ >= s_.size()) return fail("unterminated character class");
    ++pos_;  // ]
    std::sort(c.ranges.begin(), c.ranges.end());
    std::vector<std::pair<std::uint32_t, std::uint32_t>> merged;
    for (const auto& r : c.ranges)
      if (!merged.empty() && r.first <= merged.back().second + 1)
        merged.back().second = std::max(merged.back().second, r.second);
      else
        merged.push_back(r);
    c.ranges = std::move(merged);
    seq.push_back({element::chr, class_index(std::move(c))});
    return count(1);
  }

  result<int> parse_int() {
    const std::size_t b = pos_;
    long v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      v = v * 10 + (s_[pos_++] - '0');
      if (v > k_max_repetition) return fail(fmt::format("a repetition count above {}", k_max_repetition));
    }
    if (pos_ == b) return fail("expected a number in {m,n}");
    return static_cast<int>(v);
  }

  // Replaces seq[start, end) (one item) by its repetition min..max times (max < 0: unbounded).
  status repeat(std::uint32_t rule, alternative& seq, std::size_t start, int min, int max) {
    alternative item(seq.begin() + static_cast<std::ptrdiff_t>(start), seq.end());
    seq.resize(start);
    element x = item.size() == 1 ? item[0] : element{element::ref, new_rule(rule, {item})};
    for (int i = 0; i < min; ++i) seq.push_back(x);
    PAGODA_RETURN_IF_ERROR(count(static_cast<std::size_t>(min)));
    if (max < 0) {
      // star ::= x star | (nothing)
      const std::uint32_t star = new_rule(rule, {});
      alts_[star] = {{x, {element::ref, star}}, {}};
      n_elements_ += 5;
      seq.push_back({element::ref, star});
    } else if (max > min) {
      // opt_1 ::= x | (nothing); opt_k ::= x opt_(k-1) | (nothing)
      std::uint32_t prev = new_rule(rule, {{x}, {}});
      for (int k = 2; k <= max - min; ++k) {
        prev = new_rule(rule, {{x, {element::ref, prev}}, {}});
        PAGODA_RETURN_IF_ERROR(count(0));
      }
      seq.push_back({element::ref, prev});
    }
    return count(1);
  }

  status parse_sequence(std::uint32_t rule, bool nested, alternative& seq) {
    std::size_t last = SIZE_MAX;  // where the last item starts
    for (;;) {
      skip_space(nested);
      if (pos_ >= s_.size()) break;
      const char c = s_[pos_];
      if (c == '"') {
        const std::size_t start = pos_++;
        last = seq.size();
        while (pos_ < s_.size() && s_[pos_] != '"') {
          PAGODA_ASSIGN_OR_RETURN(std::uint32_t cp, parse_char());
          seq.push_back(single(cp));
          PAGODA_RETURN_IF_ERROR(count(1));
        }
        if (pos_ >= s_.size()) return fail_at(start, "unterminated literal");
        ++pos_;
        if (seq.size() == last) last = SIZE_MAX;  // "" is nothing to repeat
      } else if (c == '[') {
        last = seq.size();
        PAGODA_RETURN_IF_ERROR(parse_class(seq));
      } else if (c == '.') {
        ++pos_;
        last = seq.size();
        char_class any;
        any.ranges.push_back({0, 0x10FFFF});
        seq.push_back({element::chr, class_index(std::move(any))});
      } else if (c == '(') {
        ++pos_;
        skip_space(true);
        std::vector<alternative> sub;
        PAGODA_RETURN_IF_ERROR(parse_alternates(rule, true, sub));
        skip_space(true);
        if (pos_ >= s_.size() || s_[pos_] != ')') return fail("expected ')'");
        ++pos_;
        last = seq.size();
        seq.push_back({element::ref, new_rule(rule, std::move(sub))});
      } else if (is_name_char(c)) {
        const std::size_t at = pos_;
        const std::string name = parse_name();
        // A name followed by ::= starts the next rule (only reached when nested).
        std::size_t p = pos_;
        while (p < s_.size() && (s_[p] == ' ' || s_[p] == '\t')) ++p;
        if (s_.substr(p, 3) == "::=") return fail_at(at, fmt::format("rule '{}' starts inside a group", name));
        last = seq.size();
        seq.push_back({element::ref, rule_id(name)});
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (last == SIZE_MAX) return fail(fmt::format("'{}' with nothing before it to repeat", c));
        ++pos_;
        int min = 0, max = -1;
        if (c == '+') min = 1;
        if (c == '?') max = 1;
        if (c == '{') {
          skip_space(false);
          PAGODA_ASSIGN_OR_RETURN(min, parse_int());
          skip_space(false);
          max = min;
          if (pos_ < s_.size() && s_[pos_] == ',') {
            ++pos_;
            skip_space(false);
            max = -1;
            if (pos_ < s_.size() && s_[pos_] != '}') {
              PAGODA_ASSIGN_OR_RETURN(max, parse_int());
              skip_space(false);
            }
          }
          if (pos_ >= s_.size() || s_[pos_] != '}') return fail("expected '}' to close {m,n}");
          ++pos_;
          if (max >= 0 && max < min) return fail(fmt::format("{{{},{}}}: the maximum is below the minimum", min, max));
        }
        PAGODA_RETURN_IF_ERROR(repeat(rule, seq, last, min, max));
        last = SIZE_MAX;
      } else if (c == '|' || c == ')' || c == '\n') {
        break;
      } else {
        return fail(fmt::format("unexpected character '{}'", c));
      }
    }
    return {};
  }

  status check_left_recursion() const {
    const std::size_t n = names_.size();
    std::vector<bool> nullable(n, false);
    for (bool changed = true; changed;) {
      changed = false;
      for (std::size_t r = 0; r < n; ++r) {
        if (nullable[r]) continue;
        for (const alternative& a : alts_[r]) {
          const bool all = std::all_of(a.begin(), a.end(),
                                       [&](const element& e) { return e.kind == element::ref && nullable[e.value]; });
          if (all) {
            nullable[r] = true;
            changed = true;
            break;
          }
        }
      }
    }
    // Edges r -> s where s can be expanded at r's first position.
    std::vector<std::vector<std::uint32_t>> first(n);
    for (std::size_t r = 0; r < n; ++r)
      for (const alternative& a : alts_[r])
        for (const element& e : a) {
          if (e.kind != element::ref) break;
          first[r].push_back(e.value);
          if (!nullable[e.value]) break;
        }
    // Iterative depth-first search; colour 1 = on the path.
    std::vector<std::uint8_t> colour(n, 0);
    std::vector<std::pair<std::uint32_t, std::size_t>> path;
    for (std::uint32_t start = 0; start < n; ++start) {
      if (colour[start] != 0) continue;
      path.push_back({start, 0});
      colour[start] = 1;
      while (!path.empty()) {
        auto& [r, i] = path.back();
        if (i == first[r].size()) {
          colour[r] = 2;
          path.pop_back();
          continue;
        }
        const std::uint32_t next = first[r][i++];
        if (colour[next] == 1) {
          std::string cycle;
          bool on = false;
          for (const auto& p : path) {
            if (p.first == next) on = true;
            if (on) cycle += names_[p.first] + " -> ";
          }
          return error(errc::invalid_argument, "grammar: left recursion: {}{}", cycle, names_[next]);
        }
        if (colour[next] == 0) {
          colour[next] = 1;
          path.push_back({next, 0});
        }
      }
    }
    return {};
  }

  result<rules> finish() {
    for (std::size_t r = 0; r < names_.size(); ++r)
      if (!defined_[r]) return error(errc::invalid_argument, "grammar: rule '{}' is used but not defined", names_[r]);
    const auto root = ids_.find("root");
    if (root == ids_.end()) return error(errc::invalid_argument, "grammar: no 'root' rule");
    PAGODA_RETURN_IF_ERROR(check_left_recursion());
    rules g;
    g.root = root->second;
    g.names = names_;
    g.classes = std::move(classes_);
    g.alternatives.resize(names_.size());
    for (std::size_t r = 0; r < names_.size(); ++r)
      for (const alternative& a : alts_[r]) {
        g.alternatives[r].push_back(static_cast<std::uint32_t>(g.elements.size()));
        g.elements.insert(g.elements.end(), a.begin(), a.end());
        g.elements.push_back({element::end, 0});
      }
    if (g.elements.size() > k_max_elements)
      return error(errc::invalid_argument, "grammar: expands to {} elements, more than the limit of {}",
                   g.elements.size(), k_max_elements);
    return g;
  }

  std::string_view s_;
  std::size_t pos_ = 0;
  std::unordered_map<std::string, std::uint32_t> ids_;
  std::vector<std::string> names_;
  std::vector<bool> defined_;
  std::vector<std::vector<alternative>> alts_;  // [rule]
  std::vector<char_class> classes_;
  std::unordered_map<std::string, std::uint32_t> class_ids_;
  std::size_t n_elements_ = 0;
  int n_generated_ = 0;
};

}  // namespace

result<rules> parse_gbnf(std::string_view text) { return parser(text).run(); }

}  // namespace pagoda::grammar
