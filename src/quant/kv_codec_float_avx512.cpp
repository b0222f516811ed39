// AVX-512 qk/av for the f32 and f16 codecs. Per-lane operation order is fixed
// (one FMA per channel for qk, one FMA per token for av, in increasing order),
// so results never depend on n_q, n_tokens or the tile's neighbours.
#include <immintrin.h>

#include <algorithm>

#include "quant/kv_codec_float.h"

namespace pagoda::float_kv {
namespace {

inline __mmask16 lane_mask(int n) { return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const fp16_t* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

template <int NR, typename T>
inline void qk_rows(const T* tile, int block_size, int head_dim, int tc, __mmask16 m, const float* q, float* scores,
                    int ld) {
  __m512 acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
  const T* k = tile + tc;
  for (int d = 0; d < head_dim; ++d) {
    __m512 kv = load16(k + static_cast<std::size_t>(d) * block_size, m);
    for (int j = 0; j < NR; ++j)
      acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[static_cast<std::size_t>(j) * head_dim + d]), kv, acc[j]);
  }
  for (int j = 0; j < NR; ++j) _mm512_mask_storeu_ps(scores + static_cast<std::size_t>(j) * ld + tc, m, acc[j]);
}

template <typename T>
void qk_impl(kv_tile_shape s, const T* tile, int n_tokens, const float* q, int n_q, float* scores, int ld) {
  for (int tc = 0; tc < n_tokens; tc += 16) {
    __mmask16 m = lane_mask(n_tokens - tc);
    int r = 0;
    for (; r + 4 <= n_q; r += 4)
      qk_rows<4>(tile, s.block_size, s.head_dim, tc, m, q + static_cast<std::size_t>(r) * s.head_dim,
                 scores + static_cast<std::size_t>(r) * ld, ld);
    const float* qr = q + static_cast<std::size_t>(r) * s.head_dim;
    float* sr = scores + static_cast<std::size_t>(r) * ld;
    switch (n_q - r) {
      case 3: qk_rows<3>(tile, s.block_size, s.head_dim, tc, m, qr, sr, ld); break;
      case 2: qk_rows<2>(tile, s.block_size, s.head_dim, tc, m, qr, sr, ld); break;
      case 1: qk_rows<1>(tile, s.block_size, s.head_dim, tc, m, qr, sr, ld); break;
      default: break;
    }
  }
}

// acc rows [NR][head_dim] += w[NR][t] * v_t over channels [d0, d0 + 16 * NC).
template <int NR, int NC, typename T>
inline void av_rows(const T* tile, int head_dim, int d0, int n_tokens, const float* w, int ld, float* acc) {
  __mmask16 mc[NC];
  for (int c = 0; c < NC; ++c) mc[c] = lane_mask(std::max(0, head_dim - d0 - 16 * c));
  __m512 a[NR][NC];
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < NC; ++c)
      a[j][c] = _mm512_maskz_loadu_ps(mc[c], acc + static_cast<std::size_t>(j) * head_dim + d0 + 16 * c);
  for (int t = 0; t < n_tokens; ++t) {
    const T* v = tile + static_cast<std::size_t>(t) * head_dim + d0;
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load16(v + 16 * c, mc[c]);
    for (int j = 0; j < NR; ++j) {
      __m512 wj = _mm512_set1_ps(w[static_cast<std::size_t>(j) * ld + t]);
      for (int c = 0; c < NC; ++c) a[j][c] = _mm512_fmadd_ps(wj, vv[c], a[j][c]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < NC; ++c)
      _mm512_mask_storeu_ps(acc + static_cast<std::size_t>(j) * head_dim + d0 + 16 * c, mc[c], a[j][c]);
}

template <int NC, typename T>
void av_chunk(const T* tile, int head_dim, int d0, int n_tokens, const float* w, int ld, int n_q, float* acc) {
  int r = 0;
  for (; r + 4 <= n_q; r += 4)
    av_rows<4, NC>(tile, head_dim, d0, n_tokens, w + static_cast<std::size_t>(r) * ld, ld,
                   acc + static_cast<std::size_t>(r) * head_dim);
  const float* wr = w + static_cast<std::size_t>(r) * ld;
  float* ar = acc + static_cast<std::size_t>(r) * head_dim;
  switch (n_q - r) {
    case 3: av_rows<3, NC>(tile, head_dim, d0, n_tokens, wr, ld, ar); break;
    case 2: av_rows<2, NC>(tile, head_dim, d0, n_tokens, wr, ld, ar); break;
    case 1: av_rows<1, NC>(tile, head_dim, d0, n_tokens, wr, ld, ar); break;
    default: break;
  }
}

template <typename T>
void av_impl(kv_tile_shape s, const T* tile, int n_tokens, const float* w, int ld, int n_q, float* acc) {
  // Channels in chunks of up to 64 (4 vectors); a short tail uses fewer vectors.
  for (int d0 = 0; d0 < s.head_dim; d0 += 64) {
    switch (std::min(4, (s.head_dim - d0 + 15) / 16)) {
      case 4: av_chunk<4>(tile, s.head_dim, d0, n_tokens, w, ld, n_q, acc); break;
      case 3: av_chunk<3>(tile, s.head_dim, d0, n_tokens, w, ld, n_q, acc); break;
      case 2: av_chunk<2>(tile, s.head_dim, d0, n_tokens, w, ld, n_q, acc); break;
      default: av_chunk<1>(tile, s.head_dim, d0, n_tokens, w, ld, n_q, acc); break;
    }
  }
}

}  // namespace

void qk_f32_avx512(kv_tile_shape s, const float* tile, int n, const float* q, int n_q, float* sc, int ld) {
  qk_impl(s, tile, n, q, n_q, sc, ld);
}
void qk_f16_avx512(kv_tile_shape s, const fp16_t* tile, int n, const float* q, int n_q, float* sc, int ld) {
  qk_impl(s, tile, n, q, n_q, sc, ld);
}
void av_f32_avx512(kv_tile_shape s, const float* tile, int n, const float* w, int ld, int n_q, float* acc) {
  av_impl(s, tile, n, w, ld, n_q, acc);
}
void av_f16_avx512(kv_tile_shape s, const fp16_t* tile, int n, const float* w, int ld, int n_q, float* acc) {
  av_impl(s, tile, n, w, ld, n_q, acc);
}

}  // namespace pagoda::float_kv
