// AVX-512 qk/av for the float-like codecs. Per-lane operation order is fixed
// (one FMA per channel for qk, one FMA per token for av, in increasing order,
// then one scale multiply), so results never depend on n_q, n_tokens or the
// tile's neighbours.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "core/half.h"
#include "quant/kv_codec_float.h"
#include "quant/kv_codec_float_span.h"
#include "quant/kv_simd_avx512.h"

namespace pagoda::float_kv {
namespace {

using kv_simd::lane_mask;
using kv_simd::load_h16;
using kv_simd::prefetch_line;

// Loads 16 consecutive elements as f32; `post` is a constant factor the load
// leaves out (E4M3 is widened to fp16 with its exponent bias off by 8).
template <elem E>
struct loader;
template <>
struct loader<elem::f32> {
  static constexpr int bytes = 4;
  static constexpr float post = 1.0f;
  static __m512 load16(const std::uint8_t* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
};
template <>
struct loader<elem::f16> {
  static constexpr int bytes = 2;
  static constexpr float post = 1.0f;
  static __m512 load16(const std::uint8_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
};
template <>
struct loader<elem::bf16> {
  static constexpr int bytes = 2;
  static constexpr float post = 1.0f;
  static __m512 load16(const std::uint8_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
};
template <>
struct loader<elem::e4m3> {
  static constexpr int bytes = 1;
  static constexpr float post = 256.0f;
  // S.EEEE.MMM sign-extended to 16 bits and shifted left 7 is the fp16
  // S.0EEEE.MMM0000000 once bit 14 (a copy of the sign) is cleared: the same
  // value divided by 2^8, subnormals included.
  static __m512 load16(const std::uint8_t* p, __mmask16 m) {
    __m256i w = _mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(m, p));
    w = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xbfff)));
    return _mm512_cvtph_ps(w);
  }
};
template <>
struct loader<elem::e5m2> {
  static constexpr int bytes = 1;
  static constexpr float post = 1.0f;
  // E5M2 is the top byte of an fp16.
  static __m512 load16(const std::uint8_t* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p)), 8));
  }
};

// One vector of 16 token lanes of a tile: where its elements start, the same
// place in the tile prefetched meanwhile, which lanes are valid, its scale
// multiplier and where its scores go.
struct token_vector {
  const std::uint8_t* k;
  const std::uint8_t* ahead;
  __mmask16 m;
  __m512 mult;
  float* scores;
};

// Scores of NR rows for NV token vectors (of any tiles) at once: each query
// element is broadcast once for all of them. Each lane is one FMA chain over
// the channels in order, however the vectors are grouped.
template <int NR, int NV, elem E, bool SCALED>
inline void qk_rows(const token_vector* tv, int block_size, int head_dim, const float* q, int ld) {
  using L = loader<E>;
  __m512 acc[NV][NR];
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NR; ++j) acc[v][j] = _mm512_setzero_ps();
  const std::size_t row_bytes = static_cast<std::size_t>(block_size) * L::bytes;
  for (int d = 0; d < head_dim; ++d) {
    __m512 kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = L::load16(tv[v].k + d * row_bytes, tv[v].m);
    for (int v = 0; v < NV; ++v) prefetch_line(tv[v].ahead + d * row_bytes);
    for (int j = 0; j < NR; ++j) {
      const __m512 qb = _mm512_set1_ps(q[static_cast<std::size_t>(j) * head_dim + d]);
      for (int v = 0; v < NV; ++v) acc[v][j] = _mm512_fmadd_ps(qb, kv[v], acc[v][j]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NR; ++j) {
      if constexpr (SCALED) acc[v][j] = _mm512_mul_ps(acc[v][j], tv[v].mult);
      _mm512_mask_storeu_ps(tv[v].scores + static_cast<std::size_t>(j) * ld, tv[v].m, acc[v][j]);
    }
}

template <int NV, elem E, bool SCALED>
void qk_vectors(const token_vector* tv, int block_size, int head_dim, const float* q, int n_q, int ld) {
  token_vector rows[NV];
  int r = 0;
  auto shift = [&](int r0) {
    for (int v = 0; v < NV; ++v) {
      rows[v] = tv[v];
      rows[v].scores = tv[v].scores + static_cast<std::size_t>(r0) * ld;
    }
  };
  for (; r + 4 <= n_q; r += 4) {
    shift(r);
    qk_rows<4, NV, E, SCALED>(rows, block_size, head_dim, q + static_cast<std::size_t>(r) * head_dim, ld);
  }
  shift(r);
  const float* qr = q + static_cast<std::size_t>(r) * head_dim;
  switch (n_q - r) {
    case 3: qk_rows<3, NV, E, SCALED>(rows, block_size, head_dim, qr, ld); break;
    case 2: qk_rows<2, NV, E, SCALED>(rows, block_size, head_dim, qr, ld); break;
    case 1: qk_rows<1, NV, E, SCALED>(rows, block_size, head_dim, qr, ld); break;
    default: break;
  }
}

template <elem E, bool SCALED>
void qk_run(const tile_info& ti, float hs, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* q,
            int n_q, float* scores, int ld) {
  using L = loader<E>;
  const int bs = s.block_size, hd = s.head_dim;
  // Token vectors four at a time, across tile boundaries: 16 accumulators for
  // four rows, twice the FMA latency times its throughput. (Two at a time left
  // exactly as many chains as FMAs in flight, and any late load stalled them:
  // in cache 38 -> 42-45 GB/s.)
  token_vector pending[4];
  int n_pending = 0;
  const int n_tiles = (n_tokens + bs - 1) / bs, ahead = kv_simd::prefetch_ahead(ti.bytes);
  for (int i = 0; i < n_tiles; ++i) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[i]);
    const std::uint8_t* later = kv_simd::tile_ahead(tiles, i, n_tiles, ahead);
    // Per-token scales sit after the elements, where the loop does not reach.
    if (ti.per_token_scales) kv_simd::prefetch_slice(later, ti.data_bytes, ti.bytes);
    const int nt = std::min(bs, n_tokens - i * bs);
    for (int tc = 0; tc < nt; tc += 16) {
      token_vector& v = pending[n_pending++];
      v.k = tile + static_cast<std::size_t>(tc) * L::bytes;
      v.ahead = later + static_cast<std::size_t>(tc) * L::bytes;
      v.m = lane_mask(nt - tc);
      v.mult = _mm512_set1_ps(hs);
      if (SCALED && ti.per_token_scales)
        v.mult = _mm512_mul_ps(load_h16(tile + ti.data_bytes + 2 * tc, v.m), _mm512_set1_ps(L::post));
      v.scores = scores + static_cast<std::size_t>(i) * bs + tc;
      if (n_pending == 4) {
        qk_vectors<4, E, SCALED>(pending, bs, hd, q, n_q, ld);
        n_pending = 0;
      }
    }
  }
  switch (n_pending) {
    case 3: qk_vectors<3, E, SCALED>(pending, bs, hd, q, n_q, ld); break;
    case 2: qk_vectors<2, E, SCALED>(pending, bs, hd, q, n_q, ld); break;
    case 1: qk_vectors<1, E, SCALED>(pending, bs, hd, q, n_q, ld); break;
    default: break;
  }
}

using kv_simd::tile_span;

// acc rows [NR][head_dim] += w[NR][t] * tscale[t] * v_t over the span's tokens t
// (w and tscale from the span's first token, tiles block_size apart) and
// channels [d0, d0 + 16 * NC); the same lines of the `later` tiles are prefetched.
template <int NR, int NC, elem E, bool SCALED>
inline void av_rows(const tile_span& sp, int block_size, int head_dim, int d0, const float* w, int ld,
                    const float* tscale, float* acc) {
  using L = loader<E>;
  __mmask16 mc[NC];
  for (int c = 0; c < NC; ++c) mc[c] = lane_mask(head_dim - d0 - 16 * c);
  __m512 a[NR][NC];
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < NC; ++c)
      a[j][c] = _mm512_maskz_loadu_ps(mc[c], acc + static_cast<std::size_t>(j) * head_dim + d0 + 16 * c);
  for (int k = 0; k < sp.n; ++k) {
    const float* wk = w + static_cast<std::size_t>(k) * block_size;
    const float* sk = tscale + static_cast<std::size_t>(k) * block_size;
    for (int t = 0; t < sp.nt[k]; ++t) {
      const std::size_t at = (static_cast<std::size_t>(t) * head_dim + d0) * L::bytes;
      __m512 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = L::load16(sp.tile[k] + at + 16 * c * L::bytes, mc[c]);
      for (int c = 0; c < NC; ++c)
        if ((16 * c * L::bytes) % 64 == 0) prefetch_line(sp.later[k] + at + 16 * c * L::bytes);  // once per line
      for (int j = 0; j < NR; ++j) {
        float wt = wk[static_cast<std::size_t>(j) * ld + t];
        if constexpr (SCALED) wt *= sk[t];
        __m512 wj = _mm512_set1_ps(wt);
        for (int c = 0; c < NC; ++c) a[j][c] = _mm512_fmadd_ps(wj, vv[c], a[j][c]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < NC; ++c)
      _mm512_mask_storeu_ps(acc + static_cast<std::size_t>(j) * head_dim + d0 + 16 * c, mc[c], a[j][c]);
}

template <int NC, elem E, bool SCALED>
void av_chunk(const tile_span& sp, int block_size, int head_dim, int d0, const float* w, int ld, int n_q,
              const float* tscale, float* acc) {
  int r = 0;
  for (; r + 4 <= n_q; r += 4)
    av_rows<4, NC, E, SCALED>(sp, block_size, head_dim, d0, w + static_cast<std::size_t>(r) * ld, ld, tscale,
                              acc + static_cast<std::size_t>(r) * head_dim);
  const float* wr = w + static_cast<std::size_t>(r) * ld;
  float* ar = acc + static_cast<std::size_t>(r) * head_dim;
  switch (n_q - r) {
    case 3: av_rows<3, NC, E, SCALED>(sp, block_size, head_dim, d0, wr, ld, tscale, ar); break;
    case 2: av_rows<2, NC, E, SCALED>(sp, block_size, head_dim, d0, wr, ld, tscale, ar); break;
    case 1: av_rows<1, NC, E, SCALED>(sp, block_size, head_dim, d0, wr, ld, tscale, ar); break;
    default: break;
  }
}

template <elem E, bool SCALED>
void av_run(const tile_info& ti, float hs, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* w,
            int ld, int n_q, float* acc) {
  const int bs = s.block_size, hd = s.head_dim;
  // Spans of up to 128 tokens (one tile when tiles are larger), so that the
  // accumulators are not stored and reloaded at every tile boundary; one tile
  // in a long decode run (av_span_tiles).
  const int n_tiles = (n_tokens + bs - 1) / bs, ahead = kv_simd::prefetch_ahead(ti.bytes);
  const int span = kv_simd::av_span_tiles(bs, n_q, n_tiles, ti.bytes);
  float tscale[k_max_block_size];  // span * block_size <= max(128, block_size) (check())
  for (int i0 = 0; i0 < n_tiles; i0 += span) {
    const tile_span sp(tiles, i0, span, n_tiles, n_tokens, bs, ahead);
    span_scales<SCALED>(sp, ti, bs, hs, loader<E>::post, tscale);
    const float* wi = w + static_cast<std::size_t>(i0) * bs;
    // Channels in chunks of up to 64 (4 vectors); a short tail uses fewer vectors.
    for (int d0 = 0; d0 < hd; d0 += 64) {
      switch (std::min(4, (hd - d0 + 15) / 16)) {
        case 4: av_chunk<4, E, SCALED>(sp, bs, hd, d0, wi, ld, n_q, tscale, acc); break;
        case 3: av_chunk<3, E, SCALED>(sp, bs, hd, d0, wi, ld, n_q, tscale, acc); break;
        case 2: av_chunk<2, E, SCALED>(sp, bs, hd, d0, wi, ld, n_q, tscale, acc); break;
        default: av_chunk<1, E, SCALED>(sp, bs, hd, d0, wi, ld, n_q, tscale, acc); break;
      }
    }
  }
}

}  // namespace

void qk_avx512(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
               int n_tokens, const float* q, int n_q, float* scores, int ld) {
  const tile_info ti = info_of(fmt, s);
  with_elem(ti.e, head_scale(fmt, sp), [&]<elem E>(float hs) {
    if (ti.per_token_scales || hs != 1.0f) qk_run<E, true>(ti, hs, s, tiles, n_tokens, q, n_q, scores, ld);
    else qk_run<E, false>(ti, hs, s, tiles, n_tokens, q, n_q, scores, ld);
  });
}

void av_avx512(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
               int n_tokens, const float* w, int ld, int n_q, float* acc) {
  const tile_info ti = info_of(fmt, s);
  with_elem(ti.e, head_scale(fmt, sp), [&]<elem E>(float hs) {
    if (ti.per_token_scales || hs != 1.0f) av_run<E, true>(ti, hs, s, tiles, n_tokens, w, ld, n_q, acc);
    else av_run<E, false>(ti, hs, s, tiles, n_tokens, w, ld, n_q, acc);
  });
}

}  // namespace pagoda::float_kv
