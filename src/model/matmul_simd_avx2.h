// Helpers shared by the AVX2 matmul files (matmul_avx2.cpp,
// matmul_kquants_avx2.cpp). Include only from files built with the AVX2 flags;
// internal linkage, as matmul_internal.h explains.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "core/half.h"

namespace pagoda::matmul_detail {
namespace {

// The per-pair horizontal reduction, fixed: halves, then pairs of the rest.
inline float hsum8(__m256 v) {
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));
  return _mm_cvtss_f32(d);
}

// The fp16 at p (any alignment) as f32.
inline float load_half(const std::byte* p) {
  fp16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

}  // namespace
}  // namespace pagoda::matmul_detail
