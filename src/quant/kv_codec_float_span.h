// Internal to the float SIMD levels' a.v (kv_codec_float_avx2.cpp,
// kv_codec_float_avx512.cpp): the per-span work they share before their
// channel chunks. Uses F16C: include it only from the SIMD files.
#pragma once

#include <immintrin.h>

#include "core/half.h"
#include "quant/kv_codec_float.h"
#include "quant/kv_prefetch.h"

namespace pagoda::float_kv {

// For each tile k of the span: the per-token scales of the `later` tile are
// prefetched (they follow the elements, where the kernels' line prefetches do
// not reach), and with SCALED, tscale[k * block_size + t] = the tile's fp16
// scale of token t times post (per-token scales), or hs (a head scale).
template <bool SCALED>
inline void span_scales(const kv_simd::tile_span& sp, const tile_info& ti, int block_size, float hs, float post,
                        float* tscale) {
  for (int k = 0; k < sp.n; ++k) {
    if (ti.per_token_scales) kv_simd::prefetch_slice(sp.later[k], ti.data_bytes, ti.bytes);
    if constexpr (SCALED) {
      for (int t = 0; t < sp.nt[k]; ++t) {
        float& ts = tscale[k * block_size + t];
        if (ti.per_token_scales) {
          fp16_t h;
          __builtin_memcpy(&h, sp.tile[k] + ti.data_bytes + 2 * t, 2);
          ts = _cvtsh_ss(h) * post;
        } else {
          ts = hs;
        }
      }
    }
  }
}

}  // namespace pagoda::float_kv
