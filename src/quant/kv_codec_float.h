// Internal: float KV codecs (f32, f16) and their SIMD kernels.
//
// Tile layouts (block_size = B tokens, head_dim = D):
//   keys   channel-major [D][B]: one SIMD lane per token, so qk needs no
//          horizontal sums and a lane's score never depends on its neighbours;
//   values token-major   [B][D]: av adds whole rows scaled by a weight.
#pragma once

#include "core/half.h"
#include "quant/kv_codec.h"

namespace pagoda::float_kv {

// AVX-512 kernels (kv_codec_float_avx512.cpp). Same contracts as kv_codec::qk / av.
void qk_f32_avx512(kv_tile_shape shape, const float* tile, int n_tokens, const float* q, int n_q, float* scores,
                   int ld);
void qk_f16_avx512(kv_tile_shape shape, const fp16_t* tile, int n_tokens, const float* q, int n_q, float* scores,
                   int ld);
void av_f32_avx512(kv_tile_shape shape, const float* tile, int n_tokens, const float* w, int ld, int n_q,
                   float* acc);
void av_f16_avx512(kv_tile_shape shape, const fp16_t* tile, int n_tokens, const float* w, int ld, int n_q,
                   float* acc);

}  // namespace pagoda::float_kv
