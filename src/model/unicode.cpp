#include "model/unicode.h"

#include <array>

#include "core/assert.h"

namespace pagoda::unicode {

utf8_scan scan_utf8(std::string_view text, std::size_t pos) {
  PAGODA_DASSERT(pos < text.size());
  const auto b0 = static_cast<std::uint8_t>(text[pos]);
  if (b0 < 0x80) return {utf8_scan::valid, 1, b0};

  std::uint32_t need = 0;
  char32_t cp = 0;
  // Allowed range of the second byte; it excludes overlongs, surrogates and > U+10FFFF.
  std::uint8_t lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2, cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3, cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4, cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {utf8_scan::invalid, 1, 0};
  }

  for (std::uint32_t i = 1; i < need; ++i) {
    if (pos + i >= text.size()) return {utf8_scan::incomplete, i, 0};
    const auto b = static_cast<std::uint8_t>(text[pos + i]);
    const std::uint8_t l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) return {utf8_scan::invalid, 1, 0};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {utf8_scan::valid, need, cp};
}

bool is_valid_utf8(std::string_view text) {
  for (std::size_t pos = 0; pos < text.size();) {
    const auto s = scan_utf8(text, pos);
    if (s.kind != utf8_scan::valid) return false;
    pos += s.size;
  }
  return true;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    PAGODA_DASSERT(cp <= 0x10FFFF, "code point {:#x} out of range", static_cast<std::uint32_t>(cp));
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

void append_sanitized(std::string& out, std::string_view text) {
  std::size_t run_begin = 0;  // start of the current run of valid bytes
  std::size_t pos = 0;
  while (pos < text.size()) {
    const auto s = scan_utf8(text, pos);
    if (s.kind == utf8_scan::valid) {
      pos += s.size;
      continue;
    }
    out.append(text.substr(run_begin, pos - run_begin));
    append_utf8(out, k_replacement_char);
    pos += 1;
    run_begin = pos;
  }
  out.append(text.substr(run_begin));
}

std::size_t incomplete_utf8_tail(std::string_view text) {
  // A sequence is at most 4 bytes, so an unfinished one starts in the last 3;
  // only the last byte that is not a continuation byte can start it.
  const std::size_t first = text.size() > 3 ? text.size() - 3 : 0;
  for (std::size_t pos = text.size(); pos-- > first;) {
    const auto b = static_cast<std::uint8_t>(text[pos]);
    if ((b & 0xC0) == 0x80) continue;
    const auto s = scan_utf8(text, pos);
    return s.kind == utf8_scan::incomplete ? text.size() - pos : 0;
  }
  return 0;
}

namespace {

struct byte_alphabet {
  std::array<std::string, 256> encoded;  // byte -> UTF-8 of its code point
  std::array<std::int16_t, 0x144> decoded;  // code point -> byte, -1 if none

  byte_alphabet() {
    decoded.fill(-1);
    char32_t next_extra = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t cp = printable ? static_cast<char32_t>(b) : next_extra++;
      append_utf8(encoded[b], cp);
      decoded[cp] = static_cast<std::int16_t>(b);
    }
    PAGODA_ASSERT(next_extra == 0x144, "byte alphabet must use U+0100..U+0143");
  }
};

const byte_alphabet& alphabet() {
  static const byte_alphabet table;
  return table;
}

}  // namespace

std::string_view byte_to_unicode(std::uint8_t byte) { return alphabet().encoded[byte]; }

int unicode_to_byte(char32_t cp) {
  return cp < alphabet().decoded.size() ? alphabet().decoded[cp] : -1;
}

}  // namespace pagoda::unicode
