// Internal: the walk the SIMD levels' q8_0 / q4_0 kernels share
// (kv_codec_ggml_avx2.cpp, kv_codec_ggml_avx512.cpp): qk token by token, av
// tile by tile and block of 32 channels by block, each over row blocks of up to 4 rows
// (int_kv::for_row_blocks). K is a level's kernel set, a type of that file's
// own (so each file's instantiations are its own, built with its flags):
//   template <bool Q8, int NR> static void qk_token(const std::uint8_t* row, int nb, std::size_t bb,
//       int head_dim, const float* q, float* scores, int ld, int t);   rows' scores of token t
//   template <bool Q8, int NR> static void av_block(const void* const* tiles, kv_tile_shape s, int nb,
//       std::size_t bb, int b, int n_tokens, const float* w, int ld, float* acc);   block b's channels
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/ggml_blocks.h"
#include "quant/kv_codec.h"
#include "quant/kv_codec_int.h"
#include "quant/kv_prefetch.h"

namespace pagoda::ggml_kv {

template <bool Q8>
constexpr std::size_t block_bytes() {
  return Q8 ? sizeof(block_q8_0) : sizeof(block_q4_0);
}

template <class K, bool Q8>
void qk_walk(kv_tile_shape s, const void* const* tiles, int n_tokens, const float* q, int n_q, float* scores, int ld) {
  const int nb = (s.head_dim + 31) / 32;
  const std::size_t bb = block_bytes<Q8>();
  const std::size_t tile_bytes = bb * nb * s.block_size;
  for (int t = 0; t < n_tokens; ++t) {
    const int i = t / s.block_size, slot = t % s.block_size;
    if (slot == 0 && (i + 1) * s.block_size < n_tokens) kv_simd::prefetch_tile(tiles[i + 1], tile_bytes);
    const auto* row = static_cast<const std::uint8_t*>(tiles[i]) + static_cast<std::size_t>(slot) * nb * bb;
    int_kv::for_row_blocks(n_q, [&]<int NR>(int r0) {
      K::template qk_token<Q8, NR>(row, nb, bb, s.head_dim, q + static_cast<std::size_t>(r0) * s.head_dim,
                                   scores + static_cast<std::size_t>(r0) * ld, ld, t);
    });
  }
}

// Tile by tile, and within a tile block by block of 32 channels: each pass
// over a block's channels reads a quarter of every token row (head_dim 128),
// so passes over the whole run read each line from memory once per block;
// over one tile they hit L1 after the first. Each channel still sums its
// tokens in order (the accumulators go through memory between tiles, exactly),
// so the results are the same as over the whole run.
template <class K, bool Q8>
void av_walk(kv_tile_shape s, const void* const* tiles, int n_tokens, const float* w, int ld, int n_q, float* acc) {
  const int nb = (s.head_dim + 31) / 32;
  const std::size_t bb = block_bytes<Q8>();
  const std::size_t tile_bytes = bb * nb * s.block_size;
  const int n_tiles = (n_tokens + s.block_size - 1) / s.block_size;
  for (int i = 0; i < n_tiles; ++i) {
    if (i + 1 < n_tiles) kv_simd::prefetch_tile(tiles[i + 1], tile_bytes);
    const int t0 = i * s.block_size, nt = std::min(s.block_size, n_tokens - t0);
    for (int b = 0; b < nb; ++b)
      int_kv::for_row_blocks(n_q, [&]<int NR>(int r0) {
        K::template av_block<Q8, NR>(tiles + i, s, nb, bb, b, nt, w + static_cast<std::size_t>(r0) * ld + t0, ld,
                                     acc + static_cast<std::size_t>(r0) * s.head_dim);
      });
  }
}

template <class K>
void qk_with(const kv_format& fmt, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* q, int n_q,
             float* scores, int ld) {
  if (fmt.type == kv_type::q8_0) qk_walk<K, true>(s, tiles, n_tokens, q, n_q, scores, ld);
  else qk_walk<K, false>(s, tiles, n_tokens, q, n_q, scores, ld);
}

template <class K>
void av_with(const kv_format& fmt, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* w, int ld,
             int n_q, float* acc) {
  if (fmt.type == kv_type::q8_0) av_walk<K, true>(s, tiles, n_tokens, w, ld, n_q, acc);
  else av_walk<K, false>(s, tiles, n_tokens, w, ld, n_q, acc);
}

}  // namespace pagoda::ggml_kv
