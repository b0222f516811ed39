// Internal: AVX-512 and AVX2 kernels of the ggml-compatible q8_0 / q4_0 codecs
// (kv_codec_ggml.cpp describes the tiles). Same contracts as kv_codec::qk / av.
#pragma once

#include "quant/kv_codec.h"

namespace pagoda::ggml_kv {

void qk_avx512(const kv_format& fmt, kv_tile_shape shape, const void* const* tiles, int n_tokens, const float* q,
               int n_q, float* scores, int ld);
void av_avx512(const kv_format& fmt, kv_tile_shape shape, const void* const* tiles, int n_tokens, const float* w,
               int ld, int n_q, float* acc);
void qk_avx2(const kv_format& fmt, kv_tile_shape shape, const void* const* tiles, int n_tokens, const float* q,
             int n_q, float* scores, int ld);
void av_avx2(const kv_format& fmt, kv_tile_shape shape, const void* const* tiles, int n_tokens, const float* w,
             int ld, int n_q, float* acc);

}  // namespace pagoda::ggml_kv
