// UTF-8 helpers and the byte-level BPE alphabet the tokenizers need.
//
// Validity is strict UTF-8 (RFC 3629): no overlong forms, no surrogates,
// nothing above U+10FFFF. It is the same definition PCRE2 uses, so a run of
// bytes these functions call invalid is also invalid to the pre-tokenizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pagoda::unicode {

inline constexpr char32_t k_replacement_char = 0xFFFD;
// U+2581 LOWER ONE EIGHTH BLOCK: SentencePiece's stand-in for a space.
inline constexpr std::string_view k_spm_space = "\xE2\x96\x81";

// What the bytes at one position of a buffer hold.
struct utf8_scan {
  enum kind_t : std::uint8_t {
    valid,       // a whole sequence of `size` bytes encoding `cp`
    incomplete,  // a correct start of a sequence cut short by the end of the buffer
    invalid,     // one byte that cannot start, or cannot continue, a sequence
  };
  kind_t kind = invalid;
  std::uint32_t size = 1;  // bytes consumed: sequence length, or the bytes present
  char32_t cp = 0;         // the code point when kind == valid
};

// REQUIRES: pos < text.size().
utf8_scan scan_utf8(std::string_view text, std::size_t pos);

// Bytes of the first character at `pos`: the length of a valid sequence, else 1
// (an invalid or truncated sequence is treated one byte at a time).
// REQUIRES: pos < text.size().
inline std::size_t char_size(std::string_view text, std::size_t pos) {
  const auto s = scan_utf8(text, pos);
  return s.kind == utf8_scan::valid ? s.size : 1;
}

bool is_valid_utf8(std::string_view text);

void append_utf8(std::string& out, char32_t cp);

// Appends `text` with every byte that is not part of a valid sequence replaced
// by U+FFFD, so the result is always valid UTF-8.
void append_sanitized(std::string& out, std::string_view text);

// Bytes at the end of `text` that form a correct but unfinished sequence (0..3):
// a streaming decoder holds them back until the rest arrives.
std::size_t incomplete_utf8_tail(std::string_view text);

// GPT-2's byte-level alphabet: every byte maps to one printable code point
// (printable Latin-1 bytes map to themselves, the other 68 to U+0100..U+0143),
// so any byte string becomes a string of visible characters and back.
// Returns the UTF-8 encoding (1 or 2 bytes) of the code point for `byte`.
std::string_view byte_to_unicode(std::uint8_t byte);
// The byte a code point of that alphabet stands for, or -1 when it is not one.
int unicode_to_byte(char32_t cp);

}  // namespace pagoda::unicode
