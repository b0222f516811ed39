// Small helpers shared by the AVX-512 KV kernels. Include only from *_avx512.cpp files.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

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

// Asks for the next tile while this one is computed: tiles of a run sit at
// scattered addresses (a block table), where the hardware prefetchers cannot
// guess the next one. (The ggml-layout kernels; the float and integer ones
// prefetch line by line inside their loops, see prefetch_ahead.)
inline void prefetch_tile(const void* tile, std::size_t bytes) {
  const char* p = static_cast<const char*>(tile);
  for (std::size_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// How many tiles ahead the float and integer kernels prefetch: inside their
// inner loops, each step asks for the lines it reads, in the tile this many
// further on (about 32 KiB ahead), so that requests go out at the rate lines are
// used. A burst of a whole tile per tile (the next one into L1, the third into
// L2) kept too few lines in flight between bursts and stalled the loads behind
// them: interleaved A/B at 32K on one thread, f16 15 -> 19-24 GB/s and int8
// 16 -> 20-22 GB/s (bench/RESULTS.md). 32 KiB rather than 16: 2-8% more f16
// steps/s in 10 of 12 interleaved pairs, int8 and K8V4 level to slightly up.
inline int prefetch_ahead(std::size_t tile_bytes) {
  return static_cast<int>(std::clamp<std::size_t>((std::size_t{32} << 10) / std::max<std::size_t>(tile_bytes, 1), 1, 64));
}

// The tile prefetch_ahead(bytes) after tiles[i] of a run of n_tiles, or tiles[i]
// itself (already in cache, so asking for it again costs a hit) near the end.
inline const std::uint8_t* tile_ahead(const void* const* tiles, int i, int n_tiles, int ahead) {
  return static_cast<const std::uint8_t*>(tiles[i + ahead < n_tiles ? i + ahead : i]);
}

inline void prefetch_line(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// Asks for bytes [begin, end) of p (whole lines; a line that straddles begin
// belongs to the slice before it).
inline void prefetch_slice(const void* p, std::size_t begin, std::size_t end) {
  const char* c = static_cast<const char*>(p);
  for (std::size_t i = (begin + 63) & ~std::size_t{63}; i < end; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

}  // namespace pagoda::kv_simd
