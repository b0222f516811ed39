// How the SIMD KV kernels of every level walk a run of tiles: software
// prefetch (SSE's prefetch instruction, which every x86-64 has) and spans of
// consecutive tiles summed with accumulators kept in registers.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace pagoda::kv_simd {

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
// A sparse read's run is the tiles of every selected block of a head, gathered
// across its ranges (paged_attention), so the distance spans range boundaries:
// a jump to the next range is prefetched like the next tile of a full read.
inline const std::uint8_t* tile_ahead(const void* const* tiles, int i, int n_tiles, int ahead) {
  return static_cast<const std::uint8_t*>(tiles[i + ahead < n_tiles ? i + ahead : i]);
}

// Into L2 (prefetcht1), not L1: the tile prefetch_ahead further on is 32 KiB
// away, the size of L1, and a T0 prefetch holds one of L1's few miss buffers
// until its line arrives from DRAM, so that too few lines were in flight to
// hide the latency. On a Zen 4 at 32K tokens, one thread (split/SPEC in
// attention_bench, T0 -> T1): AVX-512 int4/token q.k 1.9-2.4 -> 1.0-1.3 ms a
// step, int8 a.v 7.4-9.5 -> 2.7-2.9 ms, f16 q.k 6.0-8.9 -> 4.3-4.4 ms; at the
// AVX2 level f16 q.k and a.v 2x; in L2 (2K tokens) no change beyond noise.
// Quest's sparse read (scattered 4 KiB tiles, nothing for the hardware
// prefetchers to follow) gained most: 2.0 -> 1.4 ms a step at 32K, 1/8 of the
// blocks (quest_bench, bench/RESULTS.md "The sparse read through L2").
inline void prefetch_line(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// Asks for bytes [begin, end) of p (whole lines; a line that straddles begin
// belongs to the slice before it).
inline void prefetch_slice(const void* p, std::size_t begin, std::size_t end) {
  const char* c = static_cast<const char*>(p);
  for (std::size_t i = (begin + 63) & ~std::size_t{63}; i < end; i += 64) prefetch_line(c + i);
}

// Up to k_span_tiles consecutive tiles of a run (from tile i0 on), the tile
// prefetch_ahead after each, and their valid token counts: what an a.v kernel
// sums before storing its accumulators. A span holds at most max(128,
// block_size) tokens when made with span_tiles().
inline constexpr int k_span_tiles = 8;
struct tile_span {
  const std::uint8_t* tile[k_span_tiles];
  const std::uint8_t* later[k_span_tiles];
  int nt[k_span_tiles];
  int n = 0;

  tile_span(const void* const* tiles, int i0, int n_span, int n_tiles, int n_tokens, int block_size, int ahead) {
    n = std::min(n_span, n_tiles - i0);
    for (int k = 0; k < n; ++k) {
      const int i = i0 + k;
      tile[k] = static_cast<const std::uint8_t*>(tiles[i]);
      later[k] = tile_ahead(tiles, i, n_tiles, ahead);
      nt[k] = std::min(block_size, n_tokens - i * block_size);
    }
  }
};

// Tiles per span: 128 tokens' worth (one tile when tiles are larger).
inline int span_tiles(int block_size) { return std::clamp(128 / block_size, 1, k_span_tiles); }

// Tiles per span of the float a.v kernels: span_tiles(), but one tile in a
// long decode run (up to 4 rows over 2 MiB or more of a head's values, where
// a layer of 8 or more heads outgrows the last-level cache). Their channel
// chunks make several passes over a span (AVX-512: 64 channels of 4 rows,
// AVX2: 16), and over one 4 KiB tile the later passes hit L1; over eight
// tiles they were slower, likely because the tiles' lines at one offset
// share an L1 set (tiles are 4 KiB-aligned; no hardware counter here to
// confirm it). Before this, AVX-512 took long runs as pairs of rows
// by all 128 channels in one pass, which converts every element twice (on an
// AMD EPYC it had beaten spans of eight tiles, 70-73% -> 76-78% of STREAM;
// one tile was not measured there).
// Intel Xeon (AVX-512, no BF16), 32K tokens, one thread, attention_bench
// split/f16: a.v 6.6-6.8 -> 5.1-5.4 ms (AVX-512), 6.9-7.0 -> 5.8 ms (AVX2);
// decode/f16 0.66 -> 0.76 of STREAM. In cache (2K tokens) spans stay: AVX-512
// was 2-4% slower with one tile there. Each lane's FMAs and their order are
// the same whatever the span, so results are too.
inline int av_span_tiles(int block_size, int n_q, int n_tiles, std::size_t tile_bytes) {
  const bool long_run = n_q <= 4 && static_cast<std::size_t>(n_tiles) * tile_bytes >= (std::size_t{2} << 20);
  return long_run ? 1 : span_tiles(block_size);
}

}  // namespace pagoda::kv_simd
