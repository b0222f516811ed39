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
#include "quant/kv_codec_ggml_walk.h"
#include "quant/kv_simd_avx512.h"

namespace pagoda::ggml_kv {
namespace {

using kv_simd::lane_mask;

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

// This level's kernels for the shared walk (kv_codec_ggml_walk.h).
struct kernels {
  template <bool Q8, int NR>
  static void qk_token(const std::uint8_t* row, int nb, std::size_t bb, int head_dim, const float* q, float* scores,
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
          acc[j] =
              _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + static_cast<std::size_t>(j) * head_dim + d0), k, acc[j]);
      }
    for (int j = 0; j < NR; ++j) scores[static_cast<std::size_t>(j) * ld + t] = _mm512_reduce_add_ps(acc[j]);
  }

  // acc rows [NR][head_dim] += w[NR][t] * v_t over one block's 32 channels.
  template <bool Q8, int NR>
  static void av_block(const void* const* tiles, kv_tile_shape s, int nb, std::size_t bb, int b, int n_tokens,
                       const float* w, int ld, float* acc) {
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
};

}  // namespace

void qk_avx512(const kv_format& fmt, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* q, int n_q,
               float* scores, int ld) {
  qk_with<kernels>(fmt, s, tiles, n_tokens, q, n_q, scores, ld);
}

void av_avx512(const kv_format& fmt, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* w, int ld,
               int n_q, float* acc) {
  av_with<kernels>(fmt, s, tiles, n_tokens, w, ld, n_q, acc);
}

}  // namespace pagoda::ggml_kv
