// f32, f16, bf16 (exact storage, round to nearest even) and fp8 E4M3/E5M2 with a
// scale per token, per head (static) or none.
#include "quant/kv_codec_float.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/assert.h"
#include "core/cpu.h"
#include "core/half.h"
#include "quant/fp8.h"
#include "quant/kv_codec_registry.h"

namespace pagoda {
namespace float_kv {

tile_info info_of(const kv_format& fmt, kv_tile_shape s) {
  tile_info t;
  switch (fmt.type) {
    case kv_type::f32: t.e = elem::f32; t.elem_bytes = 4; break;
    case kv_type::f16: t.e = elem::f16; t.elem_bytes = 2; break;
    case kv_type::bf16: t.e = elem::bf16; t.elem_bytes = 2; break;
    case kv_type::fp8_e4m3: t.e = elem::e4m3; t.elem_bytes = 1; break;
    case kv_type::fp8_e5m2: t.e = elem::e5m2; t.elem_bytes = 1; break;
    default: PAGODA_ASSERT(false, "not a float KV type: {}", kv_type_name(fmt.type));
  }
  t.per_token_scales = fmt.scale_mode == kv_scale_mode::per_token;
  t.data_bytes = static_cast<std::size_t>(t.elem_bytes) * s.block_size * s.head_dim;
  t.bytes = t.data_bytes + (t.per_token_scales ? sizeof(fp16_t) * s.block_size : 0);
  return t;
}

namespace {

float fp8_max(elem e) { return e == elem::e4m3 ? k_e4m3_max : k_e5m2_max; }

float load_raw(elem e, const std::uint8_t* p, std::size_t i) {
  switch (e) {
    case elem::f32: {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case elem::f16: {
      fp16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return fp16_to_f32(h);
    }
    case elem::bf16: {
      bf16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return bf16_to_f32(h);
    }
    case elem::e4m3: return e4m3_to_f32(p[i]);
    case elem::e5m2: return e5m2_to_f32(p[i]);
  }
  return 0;
}

void store_raw(elem e, std::uint8_t* p, std::size_t i, float v) {
  switch (e) {
    case elem::f32: std::memcpy(p + 4 * i, &v, 4); break;
    case elem::f16: {
      fp16_t h = f32_to_fp16(v);
      std::memcpy(p + 2 * i, &h, 2);
      break;
    }
    case elem::bf16: {
      bf16_t h = f32_to_bf16(v);
      std::memcpy(p + 2 * i, &h, 2);
      break;
    }
    case elem::e4m3: p[i] = f32_to_e4m3(v); break;
    case elem::e5m2: p[i] = f32_to_e5m2(v); break;
  }
}

std::size_t elem_index(const kv_format& fmt, kv_tile_shape s, int t, int d) {
  return fmt.role == kv_role::key ? static_cast<std::size_t>(d) * s.block_size + t
                                  : static_cast<std::size_t>(t) * s.head_dim + d;
}

float token_scale(const tile_info& ti, const std::uint8_t* tile, int t) {
  fp16_t h;
  std::memcpy(&h, tile + ti.data_bytes + 2 * static_cast<std::size_t>(t), 2);
  return fp16_to_f32(h);
}

// The decoded value of token t, channel d.
float value(const kv_format& fmt, kv_tile_shape s, const tile_info& ti, float hs, const std::uint8_t* tile, int t,
            int d) {
  float v = load_raw(ti.e, tile, elem_index(fmt, s, t, d));
  return ti.per_token_scales ? v * token_scale(ti, tile, t) : v * hs;
}

status check(const kv_format& fmt, kv_tile_shape s) {
  PAGODA_RETURN_IF_ERROR(check_tile_shape(fmt, s, k_max_block_size));
  bool fp8 = fmt.type == kv_type::fp8_e4m3 || fmt.type == kv_type::fp8_e5m2;
  bool ok = fmt.scale_mode == kv_scale_mode::none ||
            (fp8 && (fmt.scale_mode == kv_scale_mode::per_token || fmt.scale_mode == kv_scale_mode::static_scales));
  if (!ok)
    return error(errc::invalid_argument, "KV type {} has no scale mode '{}' ({})", kv_type_name(fmt.type),
                 kv_scale_mode_name(fmt.scale_mode), fp8 ? "fp8 takes token, static or none" : "it takes none");
  return {};
}

std::size_t tile_bytes(const kv_format& fmt, kv_tile_shape s) { return info_of(fmt, s).bytes; }

void encode(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const float* x, int t0, int n,
            void* tile_v) {
  PAGODA_DASSERT(t0 >= 0 && t0 + n <= s.block_size);
  const tile_info ti = info_of(fmt, s);
  auto* tile = static_cast<std::uint8_t*>(tile_v);
  const float hs = head_scale(fmt, sp);
  for (int i = 0; i < n; ++i) {
    const float* row = x + static_cast<std::size_t>(i) * s.head_dim;
    const int t = t0 + i;
    float inv = 1.0f / hs;
    if (ti.per_token_scales) {  // fitted to the finite elements (kv_codec.h)
      float amax = 0;
      for (int d = 0; d < s.head_dim; ++d)
        if (std::isfinite(row[d])) amax = std::max(amax, std::fabs(row[d]));
      fp16_t h = f32_to_fp16(amax / fp8_max(ti.e));
      std::memcpy(tile + ti.data_bytes + 2 * static_cast<std::size_t>(t), &h, 2);
      float sc = fp16_to_f32(h);
      inv = sc > 0 ? 1.0f / sc : 0.0f;
    }
    for (int d = 0; d < s.head_dim; ++d)
      store_raw(ti.e, tile, elem_index(fmt, s, t, d), inv == 1.0f ? row[d] : row[d] * inv);
  }
}

void decode(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* tile_v, int t0, int n,
            float* out) {
  const tile_info ti = info_of(fmt, s);
  const auto* tile = static_cast<const std::uint8_t*>(tile_v);
  const float hs = head_scale(fmt, sp);
  // Unscaled f16 values are token-major rows of consecutive halves: converted
  // in bulk (gather_attention decodes scattered value rows one at a time).
  if (ti.e == elem::f16 && fmt.role == kv_role::value && !ti.per_token_scales && hs == 1.0f &&
      active_simd_level() >= simd_level::avx2)
    return f16_to_f32_avx2(tile + static_cast<std::size_t>(t0) * s.head_dim * 2,
                           static_cast<std::size_t>(n) * s.head_dim, out);
  for (int i = 0; i < n; ++i)
    for (int d = 0; d < s.head_dim; ++d)
      out[static_cast<std::size_t>(i) * s.head_dim + d] = value(fmt, s, ti, hs, tile, t0 + i, d);
}

void qk_ref(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
            int n_tokens, const float* q, int n_q, float* scores, int ld) {
  const tile_info ti = info_of(fmt, s);
  const float hs = head_scale(fmt, sp);
  for (int t = 0; t < n_tokens; ++t) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[t / s.block_size]);
    for (int r = 0; r < n_q; ++r) {
      float sum = 0.0f;
      for (int d = 0; d < s.head_dim; ++d)
        sum += q[static_cast<std::size_t>(r) * s.head_dim + d] * value(fmt, s, ti, hs, tile, t % s.block_size, d);
      scores[static_cast<std::size_t>(r) * ld + t] = sum;
    }
  }
}

void av_ref(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
            int n_tokens, const float* w, int ld, int n_q, float* acc) {
  const tile_info ti = info_of(fmt, s);
  const float hs = head_scale(fmt, sp);
  for (int r = 0; r < n_q; ++r)
    for (int t = 0; t < n_tokens; ++t) {
      const auto* tile = static_cast<const std::uint8_t*>(tiles[t / s.block_size]);
      float wt = w[static_cast<std::size_t>(r) * ld + t];
      for (int d = 0; d < s.head_dim; ++d)
        acc[static_cast<std::size_t>(r) * s.head_dim + d] += wt * value(fmt, s, ti, hs, tile, t % s.block_size, d);
    }
}

void qk(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
        const float* q, int n_q, float* scores, int ld) {
  switch (active_simd_level()) {
    case simd_level::avx512: return qk_avx512(fmt, s, sp, tiles, n_tokens, q, n_q, scores, ld);
    case simd_level::avx2: return qk_avx2(fmt, s, sp, tiles, n_tokens, q, n_q, scores, ld);
    case simd_level::scalar: return qk_ref(fmt, s, sp, tiles, n_tokens, q, n_q, scores, ld);
  }
}

void av(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
        const float* w, int ld, int n_q, float* acc) {
  switch (active_simd_level()) {
    case simd_level::avx512: return av_avx512(fmt, s, sp, tiles, n_tokens, w, ld, n_q, acc);
    case simd_level::avx2: return av_avx2(fmt, s, sp, tiles, n_tokens, w, ld, n_q, acc);
    case simd_level::scalar: return av_ref(fmt, s, sp, tiles, n_tokens, w, ld, n_q, acc);
  }
}

// One scale per head (vLLM's per-head k_scale / v_scale): the head's largest
// calibrated magnitude maps to the largest finite fp8 value.
void make_static_fp8(const kv_format& fmt, int head_dim, const float* lo, const float* hi, float* scale,
                     float* offset) {
  float amax = 0;
  for (int d = 0; d < head_dim; ++d) amax = std::max({amax, std::fabs(lo[d]), std::fabs(hi[d])});
  float sc = amax > 0 ? amax / (fmt.type == kv_type::fp8_e4m3 ? k_e4m3_max : k_e5m2_max) : 1.0f;
  for (int d = 0; d < head_dim; ++d) {
    scale[d] = sc;
    offset[d] = 0;
  }
}

}  // namespace
}  // namespace float_kv

#define PAGODA_FLOAT_CODEC(ident, type, name, make_static)                                               \
  const kv_codec ident = {type,         name,         float_kv::check,  float_kv::tile_bytes, float_kv::encode, \
                          float_kv::decode, float_kv::qk, float_kv::av, float_kv::qk_ref,     float_kv::av_ref, \
                          make_static}

PAGODA_FLOAT_CODEC(k_codec_f32, kv_type::f32, "f32", nullptr);
PAGODA_FLOAT_CODEC(k_codec_f16, kv_type::f16, "f16", nullptr);
PAGODA_FLOAT_CODEC(k_codec_bf16, kv_type::bf16, "bf16", nullptr);
PAGODA_FLOAT_CODEC(k_codec_fp8_e4m3, kv_type::fp8_e4m3, "fp8_e4m3", float_kv::make_static_fp8);
PAGODA_FLOAT_CODEC(k_codec_fp8_e5m2, kv_type::fp8_e5m2, "fp8_e5m2", float_kv::make_static_fp8);

#undef PAGODA_FLOAT_CODEC

}  // namespace pagoda
