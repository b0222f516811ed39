// Regex to GBNF (grammar/convert.h says which subset).
#include <fmt/format.h>

#include "grammar/convert.h"
#include "grammar/gbnf.h"

namespace pagoda::grammar {

namespace {

// A code point as a GBNF class member.
std::string class_char(std::uint32_t cp) {
  if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9')) return std::string(1, static_cast<char>(cp));
  return cp <= 0xFFFF ? fmt::format("\\u{:04X}", cp) : fmt::format("\\U{:08X}", cp);
}

class regex_parser {
 public:
  // in_json_string: the text goes inside a JSON string (a schema's
  // pattern), so it never holds a quote, a backslash or a control character.
  regex_parser(std::string_view re, bool in_json_string) : s_(re), json_(in_json_string) {}

  result<std::string> run() {
    if (pos_ < s_.size() && s_[pos_] == '^') ++pos_;
    PAGODA_ASSIGN_OR_RETURN(std::string e, alternation());
    if (pos_ < s_.size()) return fail("unexpected ')'");
    return e;
  }

 private:
  status fail(const std::string& what) const {
    return error(errc::invalid_argument, "regex: at offset {}: {}", pos_, what);
  }
  bool at_end() const { return pos_ >= s_.size(); }

  result<std::string> alternation() {
    std::vector<std::string> alts;
    PAGODA_ASSIGN_OR_RETURN(std::string first, sequence());
    alts.push_back(std::move(first));
    while (!at_end() && s_[pos_] == '|') {
      ++pos_;
      PAGODA_ASSIGN_OR_RETURN(std::string next, sequence());
      alts.push_back(std::move(next));
    }
    std::string out = "(";
    for (std::size_t i = 0; i < alts.size(); ++i) out += (i ? " | " : "") + (alts[i].empty() ? "\"\"" : alts[i]);
    return out + ")";
  }

  result<std::string> sequence() {
    std::string out;
    while (!at_end() && s_[pos_] != '|' && s_[pos_] != ')') {
      if (s_[pos_] == '$' && pos_ + 1 == s_.size()) {
        ++pos_;
        break;
      }
      PAGODA_ASSIGN_OR_RETURN(std::string a, atom());
      PAGODA_ASSIGN_OR_RETURN(std::string q, quantifier());
      if (!out.empty()) out += ' ';
      out += a + q;
    }
    return out;
  }

  result<std::string> quantifier() {
    if (at_end()) return std::string();
    std::string q;
    const char c = s_[pos_];
    if (c == '*' || c == '+' || c == '?') {
      q = std::string(1, c);
      ++pos_;
    } else if (c == '{') {
      const std::size_t close = s_.find('}', pos_);
      if (close == std::string_view::npos) return fail("unterminated {m,n}");
      q = std::string(s_.substr(pos_, close - pos_ + 1));
      for (std::size_t i = 1; i + 1 < q.size(); ++i)
        if (!(q[i] >= '0' && q[i] <= '9') && q[i] != ',') return fail(fmt::format("bad repetition {}", q));
      pos_ = close + 1;
    } else {
      return q;
    }
    if (!at_end() && (s_[pos_] == '?' || s_[pos_] == '+')) ++pos_;  // lazy or possessive: the same set of strings
    if (!at_end() && (s_[pos_] == '*' || s_[pos_] == '{')) return fail("a quantifier after a quantifier");
    return q;
  }

  // The escape after a backslash as a class body (\d -> 0-9), or "" if it is a single character.
  std::string shorthand(char e) const {
    switch (e) {
      case 'd': return "0-9";
      case 'w': return "a-zA-Z0-9_";
      case 's': return json_ ? " " : " \\t\\n\\r\\x0B\\x0C";
      default: return {};
    }
  }

  result<std::uint32_t> escaped_char(char e) {
    switch (e) {
      case 'n': return 0x0Au;
      case 't': return 0x09u;
      case 'r': return 0x0Du;
      case 'f': return 0x0Cu;
      case 'v': return 0x0Bu;
      case '0': return 0u;
      default: break;
    }
    if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9'))
      return fail(fmt::format("the escape \\{} is not supported", e));
    return static_cast<std::uint32_t>(static_cast<unsigned char>(e));
  }

  // One code point of the pattern (UTF-8).
  result<std::uint32_t> code_point() {
    const auto c = static_cast<unsigned char>(s_[pos_]);
    int n = c < 0x80 ? 0 : (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2 : (c & 0xF8) == 0xF0 ? 3 : -1;
    if (n < 0) return fail("invalid UTF-8");
    std::uint32_t cp = n == 0 ? c : c & (0x3F >> n);
    ++pos_;
    for (int i = 0; i < n; ++i) {
      if (pos_ >= s_.size() || (static_cast<unsigned char>(s_[pos_]) & 0xC0) != 0x80) return fail("invalid UTF-8");
      cp = (cp << 6) | (static_cast<unsigned char>(s_[pos_++]) & 0x3F);
    }
    return cp;
  }

  result<std::string> char_class() {
    ++pos_;  // [
    std::string out = "[";
    bool negated = false;
    if (!at_end() && s_[pos_] == '^') {
      out += '^' + excluded();
      negated = true;
      ++pos_;
    }
    bool first = true;
    while (!at_end() && (s_[pos_] != ']' || first)) {
      first = false;
      std::uint32_t lo = 0;
      if (s_[pos_] == '\\') {
        if (pos_ + 1 >= s_.size()) return fail("a backslash at the end");
        const char e = s_[pos_ + 1];
        pos_ += 2;
        if (const std::string sh = shorthand(e); !sh.empty()) {
          out += sh;
          continue;
        }
        if (e == 'D' || e == 'W' || e == 'S') return fail(fmt::format("\\{} inside a class is not supported", e));
        PAGODA_ASSIGN_OR_RETURN(lo, escaped_char(e));
      } else {
        PAGODA_ASSIGN_OR_RETURN(lo, code_point());
      }
      out += class_char(lo);
      if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
        ++pos_;
        std::uint32_t hi = 0;
        if (s_[pos_] == '\\') {
          if (pos_ + 1 >= s_.size()) return fail("a backslash at the end");
          const char e = s_[pos_ + 1];
          pos_ += 2;
          PAGODA_ASSIGN_OR_RETURN(hi, escaped_char(e));
        } else {
          PAGODA_ASSIGN_OR_RETURN(hi, code_point());
        }
        if (hi < lo) return fail("a class range whose end comes before its start");
        if (!negated && needs_escape(lo, hi)) return refuse_escaped();
        out += "-" + class_char(hi);
      } else if (!negated && needs_escape(lo, lo)) {
        return refuse_escaped();
      }
    }
    if (at_end()) return fail("unterminated [");
    ++pos_;
    return out + "]";
  }

  result<std::string> atom() {
    const char c = s_[pos_];
    if (c == '(') {
      ++pos_;
      if (!at_end() && s_[pos_] == '?') {
        if (pos_ + 1 < s_.size() && s_[pos_ + 1] == ':') {
          pos_ += 2;
        } else {
          return fail("(? groups other than (?: are not supported (lookaround, named groups, flags)");
        }
      }
      PAGODA_ASSIGN_OR_RETURN(std::string inner, alternation());
      if (at_end() || s_[pos_] != ')') return fail("expected ')'");
      ++pos_;
      return inner;
    }
    if (c == '[') return char_class();
    if (c == '.') {
      ++pos_;
      return "[^\\n" + excluded() + "]";
    }
    if (c == '*' || c == '+' || c == '?' || c == '{') return fail(fmt::format("'{}' with nothing to repeat", c));
    if (c == '^' || c == '$') return fail(fmt::format("'{}' is supported only at the start or the end", c));
    if (c == '\\') {
      if (pos_ + 1 >= s_.size()) return fail("a backslash at the end");
      const char e = s_[pos_ + 1];
      pos_ += 2;
      if (const std::string sh = shorthand(e); !sh.empty()) return "[" + sh + "]";
      if (e == 'D' || e == 'W' || e == 'S')
        return "[^" + excluded() + shorthand(static_cast<char>(e - 'A' + 'a')) + "]";
      if (e >= '1' && e <= '9') return fail("backreferences are not supported");
      if (e == 'b' || e == 'B') return fail("word boundaries are not supported");
      PAGODA_ASSIGN_OR_RETURN(std::uint32_t cp, escaped_char(e));
      if (needs_escape(cp, cp)) return refuse_escaped();
      return "[" + class_char(cp) + "]";
    }
    PAGODA_ASSIGN_OR_RETURN(std::uint32_t cp, code_point());
    if (needs_escape(cp, cp)) return refuse_escaped();
    return "[" + class_char(cp) + "]";
  }

  // Whether [lo, hi] holds a character a JSON string must escape.
  bool needs_escape(std::uint32_t lo, std::uint32_t hi) const {
    return json_ && (lo <= 0x1F || (lo <= 0x22 && hi >= 0x22) || (lo <= 0x5C && hi >= 0x5C));
  }
  status refuse_escaped() const {
    return fail("a pattern that can match a quote, a backslash or a control character is not supported");
  }
  // What a negated class leaves out on top of its members.
  std::string excluded() const { return json_ ? "\\u0022\\u005C\\u0000-\\u001F" : ""; }

  std::string_view s_;
  bool json_;
  std::size_t pos_ = 0;
};

}  // namespace

result<std::string> regex_expression(std::string_view regex, bool in_json_string) {
  return regex_parser(regex, in_json_string).run();
}

result<std::string> regex_to_gbnf(std::string_view regex) {
  PAGODA_ASSIGN_OR_RETURN(std::string e, regex_expression(regex, false));
  return "root ::= " + e + "\n";
}

result<std::string> choice_to_gbnf(const std::vector<std::string>& choices) {
  if (choices.empty()) return error(errc::invalid_argument, "guided_choice: an empty list allows no output");
  std::string out = "root ::= ";
  for (std::size_t i = 0; i < choices.size(); ++i) {
    if (choices[i].empty()) return error(errc::invalid_argument, "guided_choice: choice {} is empty", i);
    out += (i ? " | " : "") + gbnf_literal(choices[i]);
  }
  return out + "\n";
}

}  // namespace pagoda::grammar
