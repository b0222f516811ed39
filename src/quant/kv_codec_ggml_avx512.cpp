// AVX-512 qk/av for the ggml-compatible q8_0 / q4_0 tiles (token-major blocks
// of 32). Values are widened to f32 in registers, 16 at a time (half a block),
// times the block's scale. qk: per token, one FMA chain per row over the
// half-blocks in order, then a fixed-order horizontal sum; av: per channel
// vector one FMA per token in order. Lanes never mix tokens (qk) or rows.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/ggml_blocks.h"
#include "quant/kv_codec_ggml.h"
#include "quant/kv_simd_avx512.h"

namespace pagoda::ggml_kv {
namespace {

using kv_simd::lane_mask;
using kv_simd::prefetch_tile;

// Values [16 * half, 16 * half + 16) of a block, scaled.
template <bool Q8>
inline __m512 load_half(const std::uint8_t* block, int half) {
  fp16_t d16;
  std::memcpy(&d16, block, 2);
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(d16));
  __m512i v;
  if constexpr (Q8) {
    v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * half)));
  } else {
    // q4_0: byte j holds value j (low nibble) and value j + 16 (high nibble), minus 8.
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2)));
    if (half) b = _mm512_srli_epi32(b, 4);
    v = _mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), _mm512_set1_epi32(8));
  }
  return _mm512_mul_ps(_mm512_cvtepi32_ps(v), d);
}

template <bool Q8, int NR>
inline void qk_token(const std::uint8_t* row, int nb, std::size_t bb, int head_dim, const float* q, float* scores,
                     int ld, int t) {
  __m512 acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b)
    for (int half = 0; half < 2; ++half) {
      const int d0 = b * 32 + half * 16;
      if (d0 >= head_dim) break;
      const __mmask16 m = lane_mask(head_dim - d0);
      const __m512 k = load_half<Q8>(row + b * bb, half);
      for (int j = 0; j < NR; ++j)
        acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + static_cast<std::size_t>(j) * head_dim + d0), k, acc[j]);
    }
  for (int j = 0; j < NR; ++j) scores[static_cast<std::size_t>(j) * ld + t] = _mm512_reduce_add_ps(acc[j]);
}

template <bool Q8>
void qk_run(kv_tile_shape s, const void* const* tiles, int n_tokens, const float* q, int n_q, float* scores, int ld) {
  const int nb = (s.head_dim + 31) / 32;
  const std::size_t bb = Q8 ? sizeof(block_q8_0) : sizeof(block_q4_0);
  const std::size_t tile_bytes = bb * nb * s.block_size;
  for (int t = 0; t < n_tokens; ++t) {
    const int i = t / s.block_size, slot = t % s.block_size;
    if (slot == 0 && (i + 1) * s.block_size < n_tokens) prefetch_tile(tiles[i + 1], tile_bytes);
    const auto* row = static_cast<const std::uint8_t*>(tiles[i]) + static_cast<std::size_t>(slot) * nb * bb;
    int r = 0;
    for (; r + 4 <= n_q; r += 4)
      qk_token<Q8, 4>(row, nb, bb, s.head_dim, q + static_cast<std::size_t>(r) * s.head_dim,
                      scores + static_cast<std::size_t>(r) * ld, ld, t);
    for (; r < n_q; ++r)
      qk_token<Q8, 1>(row, nb, bb, s.head_dim, q + static_cast<std::size_t>(r) * s.head_dim,
                      scores + static_cast<std::size_t>(r) * ld, ld, t);
  }
}

// acc rows [NR][head_dim] += w[NR][t] * v_t over one block's 32 channels.
template <bool Q8, int NR>
void av_block(const void* const* tiles, kv_tile_shape s, int nb, std::size_t bb, int b, int n_tokens, const float* w,
              int ld, float* acc) {
  const int d0 = b * 32;
  const __mmask16 m0 = lane_mask(s.head_dim - d0), m1 = lane_mask(s.head_dim - d0 - 16);
  __m512 a[NR][2];
  for (int j = 0; j < NR; ++j) {
    a[j][0] = _mm512_maskz_loadu_ps(m0, acc + static_cast<std::size_t>(j) * s.head_dim + d0);
    a[j][1] = _mm512_maskz_loadu_ps(m1, acc + static_cast<std::size_t>(j) * s.head_dim + d0 + 16);
  }
  for (int t = 0; t < n_tokens; ++t) {
    const auto* blk = static_cast<const std::uint8_t*>(tiles[t / s.block_size]) +
                      (static_cast<std::size_t>(t % s.block_size) * nb + b) * bb;
    const __m512 v0 = load_half<Q8>(blk, 0), v1 = load_half<Q8>(blk, 1);
    for (int j = 0; j < NR; ++j) {
      const __m512 wj = _mm512_set1_ps(w[static_cast<std::size_t>(j) * ld + t]);
      a[j][0] = _mm512_fmadd_ps(wj, v0, a[j][0]);
      a[j][1] = _mm512_fmadd_ps(wj, v1, a[j][1]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    _mm512_mask_storeu_ps(acc + static_cast<std::size_t>(j) * s.head_dim + d0, m0, a[j][0]);
    _mm512_mask_storeu_ps(acc + static_cast<std::size_t>(j) * s.head_dim + d0 + 16, m1, a[j][1]);
  }
}

template <bool Q8>
void av_run(kv_tile_shape s, const void* const* tiles, int n_tokens, const float* w, int ld, int n_q, float* acc) {
  const int nb = (s.head_dim + 31) / 32;
  const std::size_t bb = Q8 ? sizeof(block_q8_0) : sizeof(block_q4_0);
  for (int b = 0; b < nb; ++b) {
    int r = 0;
    for (; r + 4 <= n_q; r += 4)
      av_block<Q8, 4>(tiles, s, nb, bb, b, n_tokens, w + static_cast<std::size_t>(r) * ld, ld,
                      acc + static_cast<std::size_t>(r) * s.head_dim);
    for (; r < n_q; ++r)
      av_block<Q8, 1>(tiles, s, nb, bb, b, n_tokens, w + static_cast<std::size_t>(r) * ld, ld,
                      acc + static_cast<std::size_t>(r) * s.head_dim);
  }
}

}  // namespace

void qk_avx512(const kv_format& fmt, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* q, int n_q,
               float* scores, int ld) {
  if (fmt.type == kv_type::q8_0) qk_run<true>(s, tiles, n_tokens, q, n_q, scores, ld);
  else qk_run<false>(s, tiles, n_tokens, q, n_q, scores, ld);
}

void av_avx512(const kv_format& fmt, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* w, int ld,
               int n_q, float* acc) {
  if (fmt.type == kv_type::q8_0) av_run<true>(s, tiles, n_tokens, w, ld, n_q, acc);
  else av_run<false>(s, tiles, n_tokens, w, ld, n_q, acc);
}

}  // namespace pagoda::ggml_kv
