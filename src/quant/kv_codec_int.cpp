// int8 / int4 / int2 KV codecs: encode, decode, reference qk/av, dispatch.
#include "quant/kv_codec_int.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "core/cpu.h"
#include "core/half.h"
#include "quant/kv_codec_registry.h"

namespace pagoda {
namespace int_kv {

tile_layout layout_of(const kv_format& fmt, kv_tile_shape s) {
  tile_layout L;
  L.bits = fmt.type == kv_type::int8 ? 8 : fmt.type == kv_type::int4 ? 4 : 2;
  L.cpb = 8 / L.bits;
  L.lanes = 4 * L.cpb;
  L.key = fmt.role == kv_role::key;
  L.mode = fmt.scale_mode;
  L.n_groups = 1;
  L.group_size = s.head_dim;
  if (fmt.scale_mode == kv_scale_mode::group && fmt.group_size > 0) {
    L.group_size = fmt.group_size;
    L.n_groups = s.head_dim / fmt.group_size;
  }
  if (L.key) {
    L.n_outer = (s.head_dim + L.lanes - 1) / L.lanes;
    L.codes_bytes = static_cast<std::size_t>(L.n_outer) * s.block_size * 4;
  } else {
    L.n_outer = (s.block_size + L.lanes - 1) / L.lanes;
    L.codes_bytes = static_cast<std::size_t>(L.n_outer) * s.head_dim * 4;
  }
  switch (L.mode) {
    case kv_scale_mode::per_token: L.n_scales = s.block_size; break;
    case kv_scale_mode::group: L.n_scales = static_cast<std::size_t>(L.n_groups) * s.block_size; break;
    case kv_scale_mode::per_channel: L.n_scales = s.head_dim; break;
    default: L.n_scales = 0; break;
  }
  L.scale_off = L.codes_bytes;
  L.offset_off = L.scale_off + sizeof(fp16_t) * L.n_scales;
  L.bytes = L.offset_off + sizeof(fp16_t) * L.n_scales;
  return L;
}

bool simd_supported(const tile_layout& L, kv_tile_shape s) {
  if (L.mode != kv_scale_mode::group) return true;
  return L.key ? L.group_size % L.lanes == 0 : L.group_size % 16 == 0;
}

namespace {

struct qparam {
  float scale = 0;   // S
  float offset = 0;  // M
};

inline fp16_t load_h(const std::uint8_t* p, std::size_t i) {
  fp16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return h;
}
inline void store_h(std::uint8_t* p, std::size_t i, fp16_t h) { std::memcpy(p + 2 * i, &h, 2); }

// Scale and offset of one scale group, rounded to their fp16 storage, fitted to
// the group's finite elements only (kv_codec.h: non-finite input); a group with
// none gets scale 0 and offset 0.
qparam fit(const tile_layout& L, const float* x, std::size_t stride, int n, fp16_t& s16, fp16_t& m16) {
  qparam p;
  float lo = INFINITY, hi = -INFINITY;
  for (int i = 0; i < n; ++i) {
    const float v = x[i * stride];
    if (!std::isfinite(v)) continue;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  if (lo > hi) lo = hi = 0.0f;
  s16 = f32_to_fp16((hi - lo) / static_cast<float>(L.u_max()));
  m16 = f32_to_fp16(lo);
  p.scale = fp16_to_f32(s16);
  p.offset = fp16_to_f32(m16);
  return p;
}

// The code of x: NaN is taken as 0 and, like +-inf and any value outside the
// range, clamps to the nearest end (kv_codec.h: non-finite input). The clamp
// happens in float, before the conversion to int, which is then always defined.
inline int quantize(const tile_layout& L, float x, qparam p) {
  if (!(p.scale > 0) || !std::isfinite(p.scale)) return 0;
  if (std::isnan(x)) x = 0.0f;
  float u = std::nearbyint((x - p.offset) / p.scale);
  if (std::isnan(u)) u = 0.0f;  // inf - inf: an infinite offset (static scales)
  return static_cast<int>(std::clamp(u, 0.0f, static_cast<float>(L.u_max())));
}

inline float dequantize(int u, qparam p) { return p.scale * static_cast<float>(u) + p.offset; }

inline void set_code(const tile_layout& L, kv_tile_shape s, std::uint8_t* tile, int t, int d, int u) {
  int shift;
  std::size_t b = code_byte(L, s, t, d, shift);
  auto mask = static_cast<std::uint8_t>(((1u << L.bits) - 1) << shift);
  tile[b] = static_cast<std::uint8_t>((tile[b] & ~mask) | (u << shift));
}

inline int get_code(const tile_layout& L, kv_tile_shape s, const std::uint8_t* tile, int t, int d) {
  int shift;
  std::size_t b = code_byte(L, s, t, d, shift);
  return (tile[b] >> shift) & ((1 << L.bits) - 1);
}

// The scale and offset that apply to value (t, d).
inline qparam param_at(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const std::uint8_t* tile,
                       int t, int d) {
  qparam p;
  if (L.mode == kv_scale_mode::static_scales) {
    p.scale = sp->scale[d];
    p.offset = sp->offset[d];
    return p;
  }
  std::size_t i = scale_index(L, s, t, d);
  p.scale = fp16_to_f32(load_h(tile + L.scale_off, i));
  p.offset = fp16_to_f32(load_h(tile + L.offset_off, i));
  return p;
}

status check(const kv_format& fmt, kv_tile_shape s) {
  PAGODA_RETURN_IF_ERROR(check_tile_shape(fmt, s, k_max_block_size));
  switch (fmt.scale_mode) {
    case kv_scale_mode::per_token:
    case kv_scale_mode::per_channel:
    case kv_scale_mode::static_scales:
      return {};
    case kv_scale_mode::group:
      if (fmt.group_size <= 0 || s.head_dim % fmt.group_size != 0)
        return error(errc::invalid_argument, "{}: group size {} does not divide head_dim {}", kv_format_name(fmt),
                     fmt.group_size, s.head_dim);
      return {};
    default:
      return error(errc::invalid_argument, "KV type {} needs a scale mode (token, channel, gN or static)",
                   kv_type_name(fmt.type));
  }
}

std::size_t tile_bytes(const kv_format& fmt, kv_tile_shape s) { return layout_of(fmt, s).bytes; }

void encode(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const float* x, int t0, int n,
            void* tile_v) {
  PAGODA_DASSERT(t0 >= 0 && t0 + n <= s.block_size);
  const tile_layout L = layout_of(fmt, s);
  auto* tile = static_cast<std::uint8_t*>(tile_v);
  const int hd = s.head_dim;
  fp16_t s16 = 0, m16 = 0;
  switch (L.mode) {
    case kv_scale_mode::per_channel: {
      PAGODA_ASSERT(t0 == 0 && n == s.block_size, "per-channel KV tiles are encoded whole (sealed)");
      std::memset(tile, 0, L.codes_bytes);
      for (int d = 0; d < hd; ++d) {
        qparam p = fit(L, x + d, hd, n, s16, m16);
        store_h(tile + L.scale_off, d, s16);
        store_h(tile + L.offset_off, d, m16);
        for (int t = 0; t < n; ++t) set_code(L, s, tile, t, d, quantize(L, x[static_cast<std::size_t>(t) * hd + d], p));
      }
      break;
    }
    case kv_scale_mode::per_token:
    case kv_scale_mode::group:
      for (int i = 0; i < n; ++i) {
        const int t = t0 + i;
        const float* row = x + static_cast<std::size_t>(i) * hd;
        for (int g = 0; g < L.n_groups; ++g) {
          qparam p = fit(L, row + g * L.group_size, 1, L.group_size, s16, m16);
          std::size_t si = scale_index(L, s, t, g * L.group_size);
          store_h(tile + L.scale_off, si, s16);
          store_h(tile + L.offset_off, si, m16);
          for (int d = g * L.group_size; d < (g + 1) * L.group_size; ++d) set_code(L, s, tile, t, d, quantize(L, row[d], p));
        }
        if (L.key)  // padding channels of the last word
          for (int d = hd; d < L.n_outer * L.lanes; ++d) set_code(L, s, tile, t, d, 0);
      }
      break;
    case kv_scale_mode::static_scales:
      for (int i = 0; i < n; ++i) {
        const float* row = x + static_cast<std::size_t>(i) * hd;
        for (int d = 0; d < hd; ++d) set_code(L, s, tile, t0 + i, d, quantize(L, row[d], {sp->scale[d], sp->offset[d]}));
        if (L.key)
          for (int d = hd; d < L.n_outer * L.lanes; ++d) set_code(L, s, tile, t0 + i, d, 0);
      }
      break;
    default:
      PAGODA_ASSERT(false, "int KV codec without a scale mode");
  }
}

// Channels [d0, d0 + n) of token t into out[n].
void decode_channels(const tile_layout& L, kv_tile_shape s, const kv_static_params* sp, const std::uint8_t* tile,
                     int t, int d0, int n, float* out) {
  for (int i = 0; i < n; ++i)
    out[i] = dequantize(get_code(L, s, tile, t, d0 + i), param_at(L, s, sp, tile, t, d0 + i));
}

void decode(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* tile, int t0, int n,
            float* out) {
  const tile_layout L = layout_of(fmt, s);
  for (int i = 0; i < n; ++i)
    decode_channels(L, s, sp, static_cast<const std::uint8_t*>(tile), t0 + i, 0, s.head_dim,
                    out + static_cast<std::size_t>(i) * s.head_dim);
}

// The references (also the scalar level's kernels, and every level's for
// formats without SIMD kernels there) decode k_ref_chunk channels of a token at
// a time into a stack buffer, so they allocate nothing whatever head_dim is,
// and use exact float arithmetic on the decoded values: a score is summed over
// the channels in order, through scores[] between chunks.
constexpr int k_ref_chunk = 64;

void qk_ref(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
            int n_tokens, const float* q, int n_q, float* scores, int ld) {
  const tile_layout L = layout_of(fmt, s);
  float k[k_ref_chunk];
  for (int t = 0; t < n_tokens; ++t) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[t / s.block_size]);
    for (int d0 = 0; d0 < s.head_dim; d0 += k_ref_chunk) {
      const int n = std::min(k_ref_chunk, s.head_dim - d0);
      decode_channels(L, s, sp, tile, t % s.block_size, d0, n, k);
      for (int r = 0; r < n_q; ++r) {
        const float* qr = q + static_cast<std::size_t>(r) * s.head_dim + d0;
        float& out = scores[static_cast<std::size_t>(r) * ld + t];
        float sum = d0 == 0 ? 0.0f : out;
        for (int d = 0; d < n; ++d) sum += qr[d] * k[d];
        out = sum;
      }
    }
  }
}

void av_ref(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles,
            int n_tokens, const float* w, int ld, int n_q, float* acc) {
  const tile_layout L = layout_of(fmt, s);
  float v[k_ref_chunk];
  for (int t = 0; t < n_tokens; ++t) {
    const auto* tile = static_cast<const std::uint8_t*>(tiles[t / s.block_size]);
    for (int d0 = 0; d0 < s.head_dim; d0 += k_ref_chunk) {
      const int n = std::min(k_ref_chunk, s.head_dim - d0);
      decode_channels(L, s, sp, tile, t % s.block_size, d0, n, v);
      for (int r = 0; r < n_q; ++r) {
        const float wt = w[static_cast<std::size_t>(r) * ld + t];
        float* a = acc + static_cast<std::size_t>(r) * s.head_dim + d0;
        for (int d = 0; d < n; ++d) a[d] += wt * v[d];
      }
    }
  }
}

void qk(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
        const float* q, int n_q, float* scores, int ld) {
  const simd_level level = active_simd_level();
  if (level == simd_level::avx512 && simd_supported(layout_of(fmt, s), s))
    return qk_avx512(fmt, s, sp, tiles, n_tokens, q, n_q, scores, ld);
  if (level == simd_level::avx2 && avx2_supported(layout_of(fmt, s), s))
    return qk_avx2(fmt, s, sp, tiles, n_tokens, q, n_q, scores, ld);
  qk_ref(fmt, s, sp, tiles, n_tokens, q, n_q, scores, ld);
}

void av(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
        const float* w, int ld, int n_q, float* acc) {
  const simd_level level = active_simd_level();
  if (level == simd_level::avx512 && simd_supported(layout_of(fmt, s), s))
    return av_avx512(fmt, s, sp, tiles, n_tokens, w, ld, n_q, acc);
  if (level == simd_level::avx2 && avx2_supported(layout_of(fmt, s), s))
    return av_avx2(fmt, s, sp, tiles, n_tokens, w, ld, n_q, acc);
  av_ref(fmt, s, sp, tiles, n_tokens, w, ld, n_q, acc);
}

// Per channel, over the calibrated range [lo, hi]; values outside clip to its ends.
void make_static(const kv_format& fmt, int head_dim, const float* lo, const float* hi, float* scale, float* offset) {
  const float levels = fmt.type == kv_type::int8 ? 255.0f : fmt.type == kv_type::int4 ? 15.0f : 3.0f;
  for (int d = 0; d < head_dim; ++d) {
    scale[d] = std::max(hi[d] - lo[d], 0.0f) / levels;
    offset[d] = lo[d];
  }
}

}  // namespace
}  // namespace int_kv

#define PAGODA_INT_CODEC(ident, type, name)                                                                     \
  const kv_codec ident = {type,          name,         int_kv::check,  int_kv::tile_bytes, int_kv::encode,       \
                          int_kv::decode, int_kv::qk,  int_kv::av,     int_kv::qk_ref,     int_kv::av_ref,       \
                          int_kv::make_static}

PAGODA_INT_CODEC(k_codec_int8, kv_type::int8, "int8");
PAGODA_INT_CODEC(k_codec_int4, kv_type::int4, "int4");
PAGODA_INT_CODEC(k_codec_int2, kv_type::int2, "int2");

#undef PAGODA_INT_CODEC

}  // namespace pagoda
