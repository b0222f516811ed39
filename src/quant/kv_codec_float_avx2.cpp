// AVX2 (+FMA, F16C) qk/av for the float-like codecs, the AVX2 level's twins of
// kv_codec_float_avx512.cpp. Per-lane operation order is fixed (one FMA per
// channel for qk, one FMA per token for av, in increasing order, then one scale
// multiply), so results never depend on n_q, n_tokens, how vectors are grouped
// or the tile's neighbours; a vector read through a stack buffer (partial_bytes)
// computes the same lanes as a full one.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "core/half.h"
#include "quant/kv_codec_float.h"
#include "quant/kv_codec_float_span.h"
#include "quant/kv_simd_avx2.h"

namespace pagoda::float_kv {
namespace {

using kv_simd::partial_bytes;
using kv_simd::prefetch_line;

// Loads 8 consecutive elements as f32; `post` is a constant factor the load
// leaves out (E4M3 is widened to fp16 with its exponent bias off by 8).
template <elem E>
struct loader;
template <>
struct loader<elem::f32> {
  static constexpr int bytes = 4;
  static constexpr float post = 1.0f;
  static __m256 load8(const std::uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
};
template <>
struct loader<elem::f16> {
  static constexpr int bytes = 2;
  static constexpr float post = 1.0f;
  static __m256 load8(const std::uint8_t* p) { return kv_simd::load_h8(p); }
};
template <>
struct loader<elem::bf16> {
  static constexpr int bytes = 2;
  static constexpr float post = 1.0f;
  static __m256 load8(const std::uint8_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
};
template <>
struct loader<elem::e4m3> {
  static constexpr int bytes = 1;
  static constexpr float post = 256.0f;
  // As in the AVX-512 loader: S.EEEE.MMM sign-extended to 16 bits, shifted
  // left 7, bit 14 cleared, is the fp16 of the value divided by 2^8.
  static __m256 load8(const std::uint8_t* p) {
    __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    w = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xbfff)));
    return _mm256_cvtph_ps(w);
  }
};
template <>
struct loader<elem::e5m2> {
  static constexpr int bytes = 1;
  static constexpr float post = 1.0f;
  // E5M2 is the top byte of an fp16.
  static __m256 load8(const std::uint8_t* p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
  }
};

// The first n of 8 elements (none when n <= 0), zeros past them, without
// reading past element n.
template <elem E>
inline __m256 load_n(const std::uint8_t* p, int n) {
  using L = loader<E>;
  if (n >= 8) return L::load8(p);
  if (n <= 0) return _mm256_setzero_ps();
  return L::load8(partial_bytes(p, n * L::bytes).b);
}

// One vector of 8 token lanes of a tile: where its elements start, the same
// place in the tile prefetched meanwhile (null: this vector prefetches
// nothing, another one covers its lines), how many lanes are valid and can be
// read (n: tokens written; n_read: tokens of the tile from here, at most 8),
// its scale multiplier and where its scores go.
struct token_vector {
  const std::uint8_t* k;
  const std::uint8_t* ahead;
  int n;
  int n_read;
  __m256 mult;
  float* scores;
};

// Scores of NR rows for NV token vectors (of any tiles) at once: each query
// element is broadcast once for all of them. Each lane is one FMA chain over
// the channels in order, however the vectors are grouped.
template <int NR, int NV, elem E, bool SCALED>
inline void qk_rows(const token_vector* tv, int block_size, int head_dim, const float* q, int ld) {
  using L = loader<E>;
  __m256 acc[NV][NR];
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NR; ++j) acc[v][j] = _mm256_setzero_ps();
  const std::size_t row_bytes = static_cast<std::size_t>(block_size) * L::bytes;
  for (int d = 0; d < head_dim; ++d) {
    __m256 kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = load_n<E>(tv[v].k + d * row_bytes, tv[v].n_read);
    for (int v = 0; v < NV; ++v)
      if (tv[v].ahead) prefetch_line(tv[v].ahead + d * row_bytes);
    for (int j = 0; j < NR; ++j) {
      const __m256 qb = _mm256_broadcast_ss(q + static_cast<std::size_t>(j) * head_dim + d);
      for (int v = 0; v < NV; ++v) acc[v][j] = _mm256_fmadd_ps(qb, kv[v], acc[v][j]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NR; ++j) {
      if constexpr (SCALED) acc[v][j] = _mm256_mul_ps(acc[v][j], tv[v].mult);
      kv_simd::store8(tv[v].scores + static_cast<std::size_t>(j) * ld, acc[v][j], tv[v].n);
    }
}

// All rows for NV token vectors: four rows by two vectors (8 accumulators,
// enough independent FMA chains), fewer rows by four vectors.
template <int NV, elem E, bool SCALED>
void qk_vectors(const token_vector* tv, int block_size, int head_dim, const float* q, int n_q, int ld) {
  auto rows = [&]<int NR, int W>(int r0) {
    for (int v0 = 0; v0 < NV; v0 += W) {
      token_vector part[W];
      const int nv = std::min(W, NV - v0);
      for (int v = 0; v < nv; ++v) {
        part[v] = tv[v0 + v];
        part[v].scores += static_cast<std::size_t>(r0) * ld;
      }
      const float* qr = q + static_cast<std::size_t>(r0) * head_dim;
      if (nv == W) qk_rows<NR, W, E, SCALED>(part, block_size, head_dim, qr, ld);
      else for (int v = 0; v < nv; ++v) qk_rows<NR, 1, E, SCALED>(part + v, block_size, head_dim, qr, ld);
    }
  };
  int r = 0;
  for (; r + 4 <= n_q; r += 4) rows.template operator()<4, 2>(r);
  switch (n_q - r) {
    case 3: rows.template operator()<3, 2>(r); break;
    case 2: rows.template operator()<2, 4>(r); break;
    case 1: rows.template operator()<1, 4>(r); break;
    default: break;
  }
}

template <elem E, bool SCALED>
void qk_run(const tile_info& ti, float hs, kv_tile_shape s, const void* const* tiles, int n_tokens, const float* q,
            int n_q, float* scores, int ld) {
  using L = loader<E>;
  const int bs = s.block_size, hd = s.head_dim;
  // Token vectors four at a time, across tile boundaries.
  token_vector pending[4];
  int n_pending = 0;
  const int n_tiles = (n_tokens + bs - 1) / bs, ahead = kv_simd::prefetch_ahead(ti.bytes);
  for (int i = 0; i < n_tiles; ++i) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[i]);
    const std::uint8_t* later = kv_simd::tile_ahead(tiles, i, n_tiles, ahead);
    // Per-token scales sit after the elements, where the loop does not reach.
    if (ti.per_token_scales) kv_simd::prefetch_slice(later, ti.data_bytes, ti.bytes);
    const int nt = std::min(bs, n_tokens - i * bs);
    for (int tc = 0; tc < nt; tc += 8) {
      token_vector& v = pending[n_pending++];
      const std::size_t at = static_cast<std::size_t>(tc) * L::bytes;
      v.k = tile + at;
      v.ahead = at % 64 == 0 ? later + at : nullptr;  // one vector per line asks for it
      v.n = nt - tc;
      v.n_read = bs - tc;
      v.mult = _mm256_set1_ps(hs);
      if (SCALED && ti.per_token_scales)
        v.mult = _mm256_mul_ps(kv_simd::load_h8(tile + ti.data_bytes + 2 * tc, v.n_read), _mm256_set1_ps(L::post));
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
// channels [d0, d0 + 8 * NC), of which only the first n_ch are valid (a
// partial last vector when n_ch < 8 * NC; FULL: n_ch == 8 * NC, every vector
// loads directly); the line holding each token's first element of the chunk
// is prefetched in the `later` tile (its other line, if any, by the next
// chunk's or token's request).
template <int NR, int NC, elem E, bool SCALED, bool FULL>
inline void av_rows(const tile_span& sp, int block_size, int head_dim, int d0, int n_ch, const float* w, int ld,
                    const float* tscale, float* acc) {
  using L = loader<E>;
  int nc[NC];
  for (int c = 0; c < NC; ++c) nc[c] = FULL ? 8 : n_ch - 8 * c;
  __m256 a[NR][NC];
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < NC; ++c)
      a[j][c] = kv_simd::load8(acc + static_cast<std::size_t>(j) * head_dim + d0 + 8 * c, nc[c]);
  const std::size_t row_bytes = static_cast<std::size_t>(head_dim) * L::bytes;
  for (int k = 0; k < sp.n; ++k) {
    const float* wk = w + static_cast<std::size_t>(k) * block_size;
    const float* sk = tscale + static_cast<std::size_t>(k) * block_size;
    const std::uint8_t* v = sp.tile[k] + static_cast<std::size_t>(d0) * L::bytes;
    const std::uint8_t* ahead = sp.later[k] + static_cast<std::size_t>(d0) * L::bytes;
    for (int t = 0; t < sp.nt[k]; ++t, v += row_bytes, ahead += row_bytes) {
      __m256 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = FULL ? L::load8(v + 8 * c * L::bytes) : load_n<E>(v + 8 * c * L::bytes, nc[c]);
      prefetch_line(ahead);
      for (int j = 0; j < NR; ++j) {
        float wt = wk[static_cast<std::size_t>(j) * ld + t];
        if constexpr (SCALED) wt *= sk[t];
        const __m256 wj = _mm256_set1_ps(wt);
        for (int c = 0; c < NC; ++c) a[j][c] = _mm256_fmadd_ps(wj, vv[c], a[j][c]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < NC; ++c) kv_simd::store8(acc + static_cast<std::size_t>(j) * head_dim + d0 + 8 * c, a[j][c], nc[c]);
}

// Channels [d0, d0 + n_ch) of every row: four rows by two vectors, fewer rows
// by up to four vectors.
template <elem E, bool SCALED>
void av_chunk(const tile_span& sp, int block_size, int head_dim, int d0, int n_ch, const float* w, int ld, int n_q,
              const float* tscale, float* acc) {
  auto rows = [&]<int NR, int NC>(int r) {
    const float* wr = w + static_cast<std::size_t>(r) * ld;
    float* ar = acc + static_cast<std::size_t>(r) * head_dim;
    if (n_ch == 8 * NC) av_rows<NR, NC, E, SCALED, true>(sp, block_size, head_dim, d0, n_ch, wr, ld, tscale, ar);
    else av_rows<NR, NC, E, SCALED, false>(sp, block_size, head_dim, d0, n_ch, wr, ld, tscale, ar);
  };
  int r = 0;
  for (; r + 4 <= n_q; r += 4) rows.template operator()<4, 2>(r);
  switch (n_q - r) {
    case 3: rows.template operator()<3, 2>(r); break;
    case 2: rows.template operator()<2, 2>(r); break;
    case 1: rows.template operator()<1, 2>(r); break;
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
    for (int d0 = 0; d0 < hd; d0 += 16) av_chunk<E, SCALED>(sp, bs, hd, d0, std::min(16, hd - d0), wi, ld, n_q, tscale, acc);
  }
}

}  // namespace

void f16_to_f32_avx2(const std::uint8_t* src, std::size_t n, float* out) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
  for (; i < n; ++i) {
    fp16_t h;
    __builtin_memcpy(&h, src + 2 * i, 2);
    out[i] = fp16_to_f32(h);
  }
}

void qk_avx2(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
               int n_tokens, const float* q, int n_q, float* scores, int ld) {
  const tile_info ti = info_of(fmt, s);
  with_elem(ti.e, head_scale(fmt, sp), [&]<elem E>(float hs) {
    if (ti.per_token_scales || hs != 1.0f) qk_run<E, true>(ti, hs, s, tiles, n_tokens, q, n_q, scores, ld);
    else qk_run<E, false>(ti, hs, s, tiles, n_tokens, q, n_q, scores, ld);
  });
}

void av_avx2(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
               int n_tokens, const float* w, int ld, int n_q, float* acc) {
  const tile_info ti = info_of(fmt, s);
  with_elem(ti.e, head_scale(fmt, sp), [&]<elem E>(float hs) {
    if (ti.per_token_scales || hs != 1.0f) av_run<E, true>(ti, hs, s, tiles, n_tokens, w, ld, n_q, acc);
    else av_run<E, false>(ti, hs, s, tiles, n_tokens, w, ld, n_q, acc);
  });
}

}  // namespace pagoda::float_kv
