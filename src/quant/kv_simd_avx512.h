// Small helpers shared by the AVX-512 KV kernels. Include only from *_avx512.cpp files.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "quant/kv_prefetch.h"

namespace pagoda::kv_simd {

// The first n of 16 lanes (n may be <= 0 or >= 16).
inline __mmask16 lane_mask(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << std::max(n, 0)) - 1);
}

// 16 fp16 values as f32.
inline __m512 load_h16(const std::uint8_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

// acc += the unsigned bytes of u times the signed bytes of s, four products per
// 32-bit lane (vpdpbusd), in place. GCC 12 moves the accumulators of a register
// array to fresh registers and back around every _mm512_dpbusd_epi32 (and
// spills some): the q.k loop ran five times as many instructions as dot
// products. The asm form keeps each accumulator in its register.
inline void dpbusd(__m512i& acc, __m512i u, __m512i s) { __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s)); }

// acc += the signed 16-bit words of a times those of b, two products per
// 32-bit lane (vpdpwssd), in place, for the same reason as dpbusd.
inline void dpwssd(__m512i& acc, __m512i a, __m512i b) { __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b)); }

}  // namespace pagoda::kv_simd
