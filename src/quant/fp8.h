// FP8 scalar conversions (OCP 8-bit floating point): E4M3 ("fn": no infinities,
// max 448, NaN = S.1111.111) and E5M2 (IEEE-like, max 57344). Encoding rounds to
// nearest even and saturates to the largest finite value, as vLLM's scaled
// conversions do. These are the reference twins of the SIMD conversions.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "core/half.h"

namespace pagoda {

inline constexpr float k_e4m3_max = 448.0f;
inline constexpr float k_e5m2_max = 57344.0f;

inline std::uint8_t f32_to_e4m3(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  auto sign = static_cast<std::uint8_t>((x >> 24) & 0x80u);
  std::uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;   // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;  // >= 448 (and inf): saturate
  if (a < 0x3c800000u) {                     // below 2^-6: subnormal steps of 2^-9
    int m = static_cast<int>(std::nearbyint(std::bit_cast<float>(a) * 512.0f));  // 0..8; 8 is 2^-6
    return static_cast<std::uint8_t>(sign | m);
  }
  std::uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;  // 3 mantissa bits, nearest even
  std::uint32_t code = r - (120u << 3);                        // exponent bias 127 -> 7
  if (code > 0x7eu) code = 0x7eu;
  return static_cast<std::uint8_t>(sign | code);
}

inline std::uint8_t f32_to_e5m2(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  auto sign = static_cast<std::uint8_t>((x >> 24) & 0x80u);
  std::uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;   // NaN
  if (a >= 0x47600000u) return sign | 0x7b;  // >= 57344 (and inf): saturate
  if (a < 0x38800000u) {                     // below 2^-14: subnormal steps of 2^-16
    int m = static_cast<int>(std::nearbyint(std::bit_cast<float>(a) * 65536.0f));  // 0..4
    return static_cast<std::uint8_t>(sign | m);
  }
  std::uint32_t r = (a + 0xfffffu + ((a >> 21) & 1u)) >> 21;  // 2 mantissa bits, nearest even
  std::uint32_t code = r - (112u << 2);                        // exponent bias 127 -> 15
  if (code > 0x7bu) code = 0x7bu;
  return static_cast<std::uint8_t>(sign | code);
}

inline float e4m3_to_f32(std::uint8_t b) {
  int e = (b >> 3) & 15, m = b & 7;
  float v;
  if ((b & 0x7f) == 0x7f) v = NAN;
  else if (e == 0) v = std::ldexp(static_cast<float>(m), -9);
  else v = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}

// E5M2 is the top byte of an IEEE half.
inline float e5m2_to_f32(std::uint8_t b) { return fp16_to_f32(static_cast<fp16_t>(b << 8)); }

}  // namespace pagoda
