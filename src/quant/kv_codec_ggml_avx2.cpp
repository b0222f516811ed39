// AVX2 (+FMA, F16C) qk/av for the ggml-compatible q8_0 / q4_0 tiles
// (token-major blocks of 32), the AVX-512 kernels' shape on 8 lanes: values
// are widened to f32 a quarter block (8) at a time, times the block's scale.
// qk: per token, one FMA chain per row over the quarters in order, then a
// fixed-order horizontal sum; av: per channel vector one FMA per token in
// order. Lanes never mix tokens (qk) or rows.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "core/ggml_blocks.h"
#include "quant/kv_codec_ggml.h"
#include "quant/kv_codec_ggml_walk.h"
#include "quant/kv_simd_avx2.h"

namespace pagoda::ggml_kv {
namespace {

// Values [8 * k, 8 * k + 8) of a block, scaled.
template <bool Q8>
inline __m256 load_quarter(const std::uint8_t* block, int k) {
  fp16_t d16;
  std::memcpy(&d16, block, 2);
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(d16));
  __m256i v;
  if constexpr (Q8) {
    v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * k)));
  } else {
    // q4_0: byte j holds value j (low nibble) and value j + 16 (high nibble), minus 8.
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * (k & 1))));
    if (k >= 2) b = _mm256_srli_epi32(b, 4);
    v = _mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), _mm256_set1_epi32(8));
  }
  return _mm256_mul_ps(_mm256_cvtepi32_ps(v), d);
}

// This level's kernels for the shared walk (kv_codec_ggml_walk.h).
struct kernels {
  template <bool Q8, int NR>
  static void qk_token(const std::uint8_t* row, int nb, std::size_t bb, int head_dim, const float* q, float* scores,
                       int ld, int t) {
    __m256 acc[NR];
    for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b)
      for (int k = 0; k < 4; ++k) {
        const int d0 = b * 32 + k * 8;
        if (d0 >= head_dim) break;
        const __m256 kv = load_quarter<Q8>(row + b * bb, k);
        for (int j = 0; j < NR; ++j)
          acc[j] = _mm256_fmadd_ps(kv_simd::load8(q + static_cast<std::size_t>(j) * head_dim + d0, head_dim - d0), kv,
                                   acc[j]);
      }
    for (int j = 0; j < NR; ++j) scores[static_cast<std::size_t>(j) * ld + t] = kv_simd::hsum8(acc[j]);
  }

  // acc rows [NR][head_dim] += w[NR][t] * v_t over one block's 32 channels.
  template <bool Q8, int NR>
  static void av_block(const void* const* tiles, kv_tile_shape s, int nb, std::size_t bb, int b, int n_tokens,
                       const float* w, int ld, float* acc) {
    const int d0 = b * 32;
    __m256 a[NR][4];
    int n[4];
    for (int k = 0; k < 4; ++k) n[k] = s.head_dim - d0 - 8 * k;
    for (int j = 0; j < NR; ++j)
      for (int k = 0; k < 4; ++k)
        a[j][k] = n[k] > 0 ? kv_simd::load8(acc + static_cast<std::size_t>(j) * s.head_dim + d0 + 8 * k, n[k])
                           : _mm256_setzero_ps();
    for (int t = 0; t < n_tokens; ++t) {
      const auto* blk = static_cast<const std::uint8_t*>(tiles[t / s.block_size]) +
                        (static_cast<std::size_t>(t % s.block_size) * nb + b) * bb;
      __m256 v[4];
      for (int k = 0; k < 4; ++k) v[k] = load_quarter<Q8>(blk, k);
      for (int j = 0; j < NR; ++j) {
        const __m256 wj = _mm256_set1_ps(w[static_cast<std::size_t>(j) * ld + t]);
        for (int k = 0; k < 4; ++k) a[j][k] = _mm256_fmadd_ps(wj, v[k], a[j][k]);
      }
    }
    for (int j = 0; j < NR; ++j)
      for (int k = 0; k < 4; ++k)
        if (n[k] > 0) kv_simd::store8(acc + static_cast<std::size_t>(j) * s.head_dim + d0 + 8 * k, a[j][k], n[k]);
  }
};

}  // namespace

void qk_avx2(const kv_format& fmt, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* q, int n_q,
             float* scores, int ld) {
  qk_with<kernels>(fmt, s, tiles, n_tokens, q, n_q, scores, ld);
}

void av_avx2(const kv_format& fmt, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* w, int ld,
             int n_q, float* acc) {
  av_with<kernels>(fmt, s, tiles, n_tokens, w, ld, n_q, acc);
}

}  // namespace pagoda::ggml_kv
