// GBNF, llama.cpp's grammar format, parsed into a flat rule table that the
// matcher (grammar/matcher.h) walks.
//
//   root   ::= "{" ws pair ("," ws pair)* "}"   # a comment
//   pair   ::= [a-z]+ ":" ws [0-9]{1,3}
//   ws     ::= [ \t\n]*
//
// Rules are `name ::= alternatives`; an alternative is a sequence of
// literals ("..." with \n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH escapes), char
// classes ([a-z_], negated [^"\\], with the same escapes), `.` (any
// character), rule names and parenthesised groups, each optionally followed
// by *, +, ?, {m}, {m,}, {m,n}. A rule ends at the end of its line unless a
// group is open or the line ends with `|`. `root` is where matching starts.
//
// Characters are Unicode code points (UTF-8 in the text matched). Repetition
// and groups become rules of their own (right-recursive, so a long run of
// `x*` keeps the matcher's stacks short). Refused with a message naming the
// place: syntax errors, an undefined rule, a rule defined twice, no `root`,
// left recursion (a rule that can reach itself before taking a character:
// the matcher would never finish expanding it), and a grammar past
// k_max_grammar_bytes of text or k_max_elements elements after expansion.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pagoda/status.h"

namespace pagoda::grammar {

inline constexpr std::size_t k_max_grammar_bytes = 256 * 1024;
inline constexpr std::size_t k_max_elements = 200'000;
inline constexpr int k_max_repetition = 10'000;  // the largest m or n of {m,n}

// One position of an alternative: a character to take, a rule to expand, or
// the end of the alternative.
struct element {
  enum kind_t : std::uint8_t { chr, ref, end };
  kind_t kind = end;
  std::uint32_t value = 0;  // chr: index into grammar::classes; ref: rule id
};

// A set of code points: sorted, disjoint inclusive ranges, possibly negated.
struct char_class {
  std::vector<std::pair<std::uint32_t, std::uint32_t>> ranges;
  bool negated = false;
  bool contains(std::uint32_t cp) const;
  // Whether some code point of [lo, hi] is in the set (a partial UTF-8
  // character that could still complete into one).
  bool intersects(std::uint32_t lo, std::uint32_t hi) const;
};

struct rules {
  // Every alternative's elements, each alternative closed by an `end` element.
  std::vector<element> elements;
  // [rule id]: the offsets in `elements` where its alternatives start.
  std::vector<std::vector<std::uint32_t>> alternatives;
  std::vector<std::string> names;  // [rule id]; generated rules get "name_N"
  std::vector<char_class> classes;
  std::uint32_t root = 0;
};

// Parses and checks GBNF text (see above).
result<rules> parse_gbnf(std::string_view text);

// `s` as a GBNF literal: quoted, with ", \ and control characters escaped.
std::string gbnf_literal(std::string_view s);

}  // namespace pagoda::grammar
