// f32 and f16 KV codecs: exact storage (f16 rounds to nearest even), no scales.
#include "quant/kv_codec_float.h"

#include "core/assert.h"
#include "core/cpu.h"
#include "quant/kv_codec_registry.h"

namespace pagoda {
namespace float_kv {
namespace {

inline float load(float v) { return v; }
inline float load(fp16_t v) { return fp16_to_f32(v); }
inline void store(float& dst, float v) { dst = v; }
inline void store(fp16_t& dst, float v) { dst = f32_to_fp16(v); }

template <typename T>
std::size_t tile_bytes(const kv_format&, kv_tile_shape s) {
  return sizeof(T) * static_cast<std::size_t>(s.block_size) * s.head_dim;
}

template <typename T>
void encode(const kv_format& fmt, kv_tile_shape s, const float* x, int t0, int n, void* tile, kv_static_scales) {
  PAGODA_DASSERT(t0 >= 0 && t0 + n <= s.block_size);
  T* p = static_cast<T*>(tile);
  for (int i = 0; i < n; ++i) {
    const float* row = x + static_cast<std::size_t>(i) * s.head_dim;
    int t = t0 + i;
    if (fmt.role == kv_role::key) {
      for (int d = 0; d < s.head_dim; ++d) store(p[static_cast<std::size_t>(d) * s.block_size + t], row[d]);
    } else {
      for (int d = 0; d < s.head_dim; ++d) store(p[static_cast<std::size_t>(t) * s.head_dim + d], row[d]);
    }
  }
}

template <typename T>
void decode(const kv_format& fmt, kv_tile_shape s, const void* tile, int t0, int n, float* out) {
  const T* p = static_cast<const T*>(tile);
  for (int i = 0; i < n; ++i) {
    int t = t0 + i;
    float* row = out + static_cast<std::size_t>(i) * s.head_dim;
    for (int d = 0; d < s.head_dim; ++d)
      row[d] = fmt.role == kv_role::key ? load(p[static_cast<std::size_t>(d) * s.block_size + t])
                                        : load(p[static_cast<std::size_t>(t) * s.head_dim + d]);
  }
}

template <typename T>
void qk_ref(const kv_format&, kv_tile_shape s, const void* tile, int n_tokens, const float* q, int n_q, float* scores,
            int ld) {
  const T* k = static_cast<const T*>(tile);
  for (int r = 0; r < n_q; ++r)
    for (int t = 0; t < n_tokens; ++t) {
      float sum = 0.0f;
      for (int d = 0; d < s.head_dim; ++d)
        sum += q[static_cast<std::size_t>(r) * s.head_dim + d] * load(k[static_cast<std::size_t>(d) * s.block_size + t]);
      scores[static_cast<std::size_t>(r) * ld + t] = sum;
    }
}

template <typename T>
void av_ref(const kv_format&, kv_tile_shape s, const void* tile, int n_tokens, const float* w, int ld, int n_q,
            float* acc) {
  const T* v = static_cast<const T*>(tile);
  for (int r = 0; r < n_q; ++r)
    for (int t = 0; t < n_tokens; ++t) {
      float wt = w[static_cast<std::size_t>(r) * ld + t];
      for (int d = 0; d < s.head_dim; ++d)
        acc[static_cast<std::size_t>(r) * s.head_dim + d] += wt * load(v[static_cast<std::size_t>(t) * s.head_dim + d]);
    }
}

void qk_f32(const kv_format& f, kv_tile_shape s, const void* tile, int n, const float* q, int n_q, float* sc, int ld) {
  if (active_simd_level() == simd_level::avx512)
    return qk_f32_avx512(s, static_cast<const float*>(tile), n, q, n_q, sc, ld);
  qk_ref<float>(f, s, tile, n, q, n_q, sc, ld);
}
void qk_f16(const kv_format& f, kv_tile_shape s, const void* tile, int n, const float* q, int n_q, float* sc, int ld) {
  if (active_simd_level() == simd_level::avx512)
    return qk_f16_avx512(s, static_cast<const fp16_t*>(tile), n, q, n_q, sc, ld);
  qk_ref<fp16_t>(f, s, tile, n, q, n_q, sc, ld);
}
void av_f32(const kv_format& f, kv_tile_shape s, const void* tile, int n, const float* w, int ld, int n_q, float* acc) {
  if (active_simd_level() == simd_level::avx512)
    return av_f32_avx512(s, static_cast<const float*>(tile), n, w, ld, n_q, acc);
  av_ref<float>(f, s, tile, n, w, ld, n_q, acc);
}
void av_f16(const kv_format& f, kv_tile_shape s, const void* tile, int n, const float* w, int ld, int n_q, float* acc) {
  if (active_simd_level() == simd_level::avx512)
    return av_f16_avx512(s, static_cast<const fp16_t*>(tile), n, w, ld, n_q, acc);
  av_ref<fp16_t>(f, s, tile, n, w, ld, n_q, acc);
}

}  // namespace
}  // namespace float_kv

const kv_codec k_codec_f32 = {
    kv_type::f32,           "f32",
    false,                  float_kv::tile_bytes<float>,
    float_kv::encode<float>, float_kv::decode<float>,
    float_kv::qk_f32,       float_kv::av_f32,
    float_kv::qk_ref<float>, float_kv::av_ref<float>,
};

const kv_codec k_codec_f16 = {
    kv_type::f16,            "f16",
    false,                   float_kv::tile_bytes<fp16_t>,
    float_kv::encode<fp16_t>, float_kv::decode<fp16_t>,
    float_kv::qk_f16,        float_kv::av_f16,
    float_kv::qk_ref<fp16_t>, float_kv::av_ref<fp16_t>,
};

}  // namespace pagoda
