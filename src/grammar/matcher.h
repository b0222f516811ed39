// Matching text against a parsed grammar, byte by byte: a pushdown
// recogniser over a set of stacks (as llama.cpp's grammar sampler keeps
// one). A stack holds the positions (indices into rules::elements) still to
// match, innermost last; its top is always a character element, or the stack
// is empty (the grammar has matched in full along it). Taking a code point
// keeps the stacks whose top class contains it, moves each past that
// element and expands rule references at the new top into one stack per
// alternative. A rule's last element is never pushed (its continuation is
// what lies below), so right recursion (`x*`) keeps stacks short.
//
// Text arrives as bytes: a UTF-8 character split across tokens is held as a
// partial code point, and a stack survives a partial one only if its class
// holds some code point that starts with those bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "grammar/gbnf.h"

namespace pagoda::grammar {

// A set of stacks, flattened: stack k is data[ends[k-1], ends[k]) (bottom
// first), sorted and without duplicates, plus the partial UTF-8 character.
struct match_state {
  std::vector<std::uint32_t> data;
  std::vector<std::uint32_t> ends;
  std::uint32_t partial = 0;   // the bits of the partial character so far
  std::uint8_t n_partial = 0;  // continuation bytes it still needs

  bool dead() const { return ends.empty(); }
  // Whether the text so far is a whole sentence of the grammar.
  bool accepts() const;
  // The state as bytes: equal states have equal keys (the mask cache's key).
  std::string key() const;
};

// The state before any text: root's alternatives, expanded.
match_state initial_state(const rules& g);

// The state after one more byte; false (and `out` unspecified) if no stack
// survives it.
bool advance_byte(const rules& g, const match_state& in, std::uint8_t byte, match_state& out);

// advance_byte over each byte of `text`; false (and `s` unspecified) if a byte is refused.
bool advance(const rules& g, match_state& s, std::string_view text);

// Whether `text` is a whole sentence of the grammar.
bool matches(const rules& g, std::string_view text);

}  // namespace pagoda::grammar
