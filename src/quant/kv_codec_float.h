// Internal: float-like KV codecs (f32, f16, bf16, fp8_e4m3, fp8_e5m2) and their
// SIMD kernels. They share one tile layout and one kernel shape, differing only
// in how an element is loaded and scaled.
//
// Tile layouts (block_size = B tokens, head_dim = D):
//   keys   channel-major [D][B] elements: one SIMD lane per token, so qk needs no
//          horizontal sums and a lane's score never depends on its neighbours;
//   values token-major   [B][D] elements: av adds whole rows scaled by a weight;
//   then, for fp8 per_token, fp16 scales [B] (x = scale_t * fp8).
// fp8 static_scales keep one scale per head outside the tile (vLLM's per-head
// k_scale/v_scale); fp8 none uses scale 1 (vLLM's default without calibration).
#pragma once

#include <cstddef>

#include "quant/kv_codec.h"

namespace pagoda::float_kv {

enum class elem { f32, f16, bf16, e4m3, e5m2 };

// The largest block_size the kernels take (check() enforces it): the SIMD a.v
// kernels keep one span's token scales (at most max(128, block_size) tokens)
// in a stack array of this many entries.
inline constexpr int k_max_block_size = 1024;

struct tile_info {
  elem e = elem::f32;
  int elem_bytes = 4;
  bool per_token_scales = false;
  std::size_t data_bytes = 0;
  std::size_t bytes = 0;
};

tile_info info_of(const kv_format& fmt, kv_tile_shape shape);

// The per-head scale a static or unscaled fp8 tile applies (1 for float types).
inline float head_scale(const kv_format& fmt, const kv_static_params* sp) {
  return fmt.scale_mode == kv_scale_mode::static_scales && sp ? sp->scale[0] : 1.0f;
}

// Calls f.template operator()<E>(hs) for element type e, where hs is the
// head's scale with the factor the SIMD loaders leave out folded in (E4M3 is
// widened with its exponent bias off by 8: x 256).
template <class F>
void with_elem(elem e, float head_scale, F&& f) {
  switch (e) {
    case elem::f32: return f.template operator()<elem::f32>(head_scale);
    case elem::f16: return f.template operator()<elem::f16>(head_scale);
    case elem::bf16: return f.template operator()<elem::bf16>(head_scale);
    case elem::e4m3: return f.template operator()<elem::e4m3>(head_scale * 256.0f);
    case elem::e5m2: return f.template operator()<elem::e5m2>(head_scale);
  }
}

// AVX2 kernels (kv_codec_float_avx2.cpp). Same contracts as kv_codec::qk / av.
void qk_avx2(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
             int n_tokens, const float* q, int n_q, float* scores, int ld);
void av_avx2(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
             int n_tokens, const float* w, int ld, int n_q, float* acc);

// n f16 values at src to f32 (F16C: exact, as fp16_to_f32), for decode's
// token-major rows (kv_codec_float_avx2.cpp).
void f16_to_f32_avx2(const std::uint8_t* src, std::size_t n, float* out);

// AVX-512 kernels (kv_codec_float_avx512.cpp). Same contracts as kv_codec::qk / av.
void qk_avx512(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
               int n_tokens, const float* q, int n_q, float* scores, int ld);
void av_avx512(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
               int n_tokens, const float* w, int ld, int n_q, float* acc);

}  // namespace pagoda::float_kv
