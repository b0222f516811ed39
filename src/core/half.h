// IEEE half (fp16) and bfloat16 scalar conversions, exact, round-to-nearest-even.
// SIMD bulk conversions live with the kernels; these are their reference twins.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

namespace pagoda {

using fp16_t = std::uint16_t;
using bf16_t = std::uint16_t;

inline float fp16_to_f32(fp16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      mant &= 0x3ffu;
      bits = sign | static_cast<std::uint32_t>(127 - 15 - e) << 23 | mant << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  return std::bit_cast<float>(bits);
}

inline fp16_t f32_to_fp16(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<fp16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<fp16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {                                              // subnormal or zero in fp16
    if (abs < 0x33000000u) return static_cast<fp16_t>(sign);            // below half the smallest subnormal
    std::uint32_t e = abs >> 23;
    std::uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    std::uint32_t shift = 126 - e;  // 14 - (e - 127) + 13 - 1... brings m to a 10-bit subnormal
    std::uint32_t half = m >> shift;
    std::uint32_t rem = m & ((1u << shift) - 1);
    std::uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<fp16_t>(sign | half);
  }
  std::uint32_t r = abs + 0xc8000fffu + ((abs >> 13) & 1u);  // rebias exponent and round to nearest even
  return static_cast<fp16_t>(sign | (r >> 13));
}

inline float bf16_to_f32(bf16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

inline bf16_t f32_to_bf16(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((x >> 16) | 0x40u);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<bf16_t>(x >> 16);
}

}  // namespace pagoda
