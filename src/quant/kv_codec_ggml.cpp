// ggml-compatible q8_0 and q4_0 KV codecs: per token, blocks of 32 values along
// head_dim, each block byte-exact with ggml's block_q8_0 / block_q4_0 and
// quantized with ggml's reference rounding, so quality compares like for like
// with llama.cpp's -ctk/-ctv q8_0 / q4_0.
//
// head_dim need not be a multiple of 32: the last block of each token is padded
// with zeros, as a model whose heads were zero-padded to 32 would store them
// (llama.cpp itself refuses such models). The padding costs memory (stories260K,
// head_dim 8: a 34-byte q8_0 block per 8 values) and changes nothing else: zero
// channels add nothing to q.k and decode to 0.
//
// Tile layout, both roles: token-major [B][ceil(D / 32)] blocks.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "core/cpu.h"
#include "core/ggml_blocks.h"
#include "quant/kv_codec_ggml.h"
#include "quant/kv_codec_registry.h"

namespace pagoda {
namespace ggml_kv {
namespace {

constexpr int k_block = 32;

int n_blocks(int head_dim) { return (head_dim + k_block - 1) / k_block; }

bool is_q8(const kv_format& fmt) { return fmt.type == kv_type::q8_0; }

std::size_t block_bytes(const kv_format& fmt) { return is_q8(fmt) ? sizeof(block_q8_0) : sizeof(block_q4_0); }

// No stack array of these kernels depends on block_size (they work token by
// token and block by block), so any positive shape is taken.
constexpr int k_max_block_size = 1 << 20;

status check(const kv_format& fmt, kv_tile_shape shape) {
  PAGODA_RETURN_IF_ERROR(check_tile_shape(fmt, shape, k_max_block_size));
  if (fmt.scale_mode != kv_scale_mode::group || fmt.group_size != k_block)
    return error(errc::invalid_argument, "{} stores blocks of 32 values along head_dim; it has no other scale mode",
                 kv_type_name(fmt.type));
  return {};
}

std::size_t tile_bytes(const kv_format& fmt, kv_tile_shape s) {
  return block_bytes(fmt) * n_blocks(s.head_dim) * static_cast<std::size_t>(s.block_size);
}

// ggml's quantize_row_q8_0_ref for one block, defined on non-finite input
// (kv_codec.h): the scale comes from the finite elements, NaN is stored as 0
// and +-inf saturate to +-127. Byte-exact with ggml on finite input, where
// |x * id| <= 127 already.
void quantize_q8_0(const float* x, block_q8_0& y) {
  float amax = 0;
  for (int i = 0; i < k_block; ++i)
    if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float id = d ? 1.0f / d : 0.0f;
  y.d = f32_to_fp16(d);
  for (int i = 0; i < k_block; ++i) {
    float v = x[i] * id;
    if (std::isnan(v)) v = 0.0f;  // NaN input, or inf * 0
    y.qs[i] = static_cast<std::int8_t>(std::roundf(std::clamp(v, -127.0f, 127.0f)));
  }
}

// ggml's quantize_row_q4_0_ref for one block, defined on non-finite input like
// quantize_q8_0 (NaN -> code 8, the value 0; +-inf saturate). Byte-exact with
// ggml on finite input, where x * id + 8.5 lies in [0.5, 16.5] and both clamp
// to 15 at the top.
void quantize_q4_0(const float* x, block_q4_0& y) {
  float amax = 0, max = 0;
  for (int i = 0; i < k_block; ++i)
    if (std::isfinite(x[i]) && amax < std::fabs(x[i])) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  const float d = max / -8.0f;
  const float id = d ? 1.0f / d : 0.0f;
  y.d = f32_to_fp16(d);
  auto code = [&](float xi) {
    float v = xi * id + 8.5f;
    if (std::isnan(v)) v = 8.5f;  // NaN input, or inf * 0
    return static_cast<std::uint8_t>(std::clamp(v, 0.0f, 15.5f));
  };
  for (int j = 0; j < k_block / 2; ++j) y.qs[j] = static_cast<std::uint8_t>(code(x[j]) | (code(x[k_block / 2 + j]) << 4));
}

void encode(const kv_format& fmt, kv_tile_shape s, const kv_static_params*, const float* x, int t0, int n,
            void* tile) {
  PAGODA_DASSERT(t0 >= 0 && t0 + n <= s.block_size);
  const int nb = n_blocks(s.head_dim);
  const std::size_t bb = block_bytes(fmt);
  float buf[k_block];
  for (int i = 0; i < n; ++i) {
    const float* row = x + static_cast<std::size_t>(i) * s.head_dim;
    auto* dst = static_cast<std::uint8_t*>(tile) + (static_cast<std::size_t>(t0 + i) * nb) * bb;
    for (int b = 0; b < nb; ++b) {
      int n_real = std::min(k_block, s.head_dim - b * k_block);
      std::fill(buf, buf + k_block, 0.0f);
      std::memcpy(buf, row + b * k_block, sizeof(float) * n_real);
      if (is_q8(fmt)) {
        block_q8_0 y;
        quantize_q8_0(buf, y);
        std::memcpy(dst + b * bb, &y, bb);
      } else {
        block_q4_0 y;
        quantize_q4_0(buf, y);
        std::memcpy(dst + b * bb, &y, bb);
      }
    }
  }
}

// The 32 values of block b of token t (padding channels included).
void decode_block(const kv_format& fmt, kv_tile_shape s, const void* tile, int t, int b, float* vals) {
  const int nb = n_blocks(s.head_dim);
  const std::size_t bb = block_bytes(fmt);
  const auto* src = static_cast<const std::uint8_t*>(tile) + (static_cast<std::size_t>(t) * nb + b) * bb;
  if (is_q8(fmt)) {
    block_q8_0 y;
    std::memcpy(&y, src, bb);
    const float d = fp16_to_f32(y.d);
    for (int i = 0; i < k_block; ++i) vals[i] = d * y.qs[i];
  } else {
    block_q4_0 y;
    std::memcpy(&y, src, bb);
    const float d = fp16_to_f32(y.d);
    for (int j = 0; j < k_block / 2; ++j) {
      vals[j] = d * static_cast<float>((y.qs[j] & 15) - 8);
      vals[j + k_block / 2] = d * static_cast<float>((y.qs[j] >> 4) - 8);
    }
  }
}

void decode(const kv_format& fmt, kv_tile_shape s, const kv_static_params*, const void* tile, int t0, int n,
            float* out) {
  float vals[k_block];
  for (int i = 0; i < n; ++i)
    for (int b = 0; b < n_blocks(s.head_dim); ++b) {
      decode_block(fmt, s, tile, t0 + i, b, vals);
      const int n_real = std::min(k_block, s.head_dim - b * k_block);
      std::memcpy(out + static_cast<std::size_t>(i) * s.head_dim + b * k_block, vals, sizeof(float) * n_real);
    }
}

// The references (also the scalar level's kernels) decode one 32-value block
// at a time into a stack buffer, so they allocate nothing whatever head_dim is,
// and use exact float arithmetic on the decoded values: a score is summed over
// the channels in order, through scores[] between blocks.
void qk_ref(const kv_format& fmt, kv_tile_shape s, const kv_static_params*, const void* const* tiles, int n_tokens,
            const float* q, int n_q, float* scores, int ld) {
  float k[k_block];
  for (int t = 0; t < n_tokens; ++t)
    for (int b = 0; b < n_blocks(s.head_dim); ++b) {
      decode_block(fmt, s, tiles[t / s.block_size], t % s.block_size, b, k);
      const int n_real = std::min(k_block, s.head_dim - b * k_block);
      for (int r = 0; r < n_q; ++r) {
        const float* qr = q + static_cast<std::size_t>(r) * s.head_dim + b * k_block;
        float& out = scores[static_cast<std::size_t>(r) * ld + t];
        float sum = b == 0 ? 0.0f : out;
        for (int d = 0; d < n_real; ++d) sum += qr[d] * k[d];
        out = sum;
      }
    }
}

void av_ref(const kv_format& fmt, kv_tile_shape s, const kv_static_params*, const void* const* tiles, int n_tokens,
            const float* w, int ld, int n_q, float* acc) {
  float v[k_block];
  for (int t = 0; t < n_tokens; ++t)
    for (int b = 0; b < n_blocks(s.head_dim); ++b) {
      decode_block(fmt, s, tiles[t / s.block_size], t % s.block_size, b, v);
      const int n_real = std::min(k_block, s.head_dim - b * k_block);
      for (int r = 0; r < n_q; ++r) {
        const float wt = w[static_cast<std::size_t>(r) * ld + t];
        float* a = acc + static_cast<std::size_t>(r) * s.head_dim + b * k_block;
        for (int d = 0; d < n_real; ++d) a[d] += wt * v[d];
      }
    }
}

void qk(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
        const float* q, int n_q, float* scores, int ld) {
  if (active_simd_level() == simd_level::avx512) return qk_avx512(fmt, s, tiles, n_tokens, q, n_q, scores, ld);
  if (active_simd_level() == simd_level::avx2) return qk_avx2(fmt, s, tiles, n_tokens, q, n_q, scores, ld);
  qk_ref(fmt, s, sp, tiles, n_tokens, q, n_q, scores, ld);
}

void av(const kv_format& fmt, kv_tile_shape s, const kv_static_params* sp, const void* const* tiles, int n_tokens,
        const float* w, int ld, int n_q, float* acc) {
  if (active_simd_level() == simd_level::avx512) return av_avx512(fmt, s, tiles, n_tokens, w, ld, n_q, acc);
  if (active_simd_level() == simd_level::avx2) return av_avx2(fmt, s, tiles, n_tokens, w, ld, n_q, acc);
  av_ref(fmt, s, sp, tiles, n_tokens, w, ld, n_q, acc);
}

}  // namespace
}  // namespace ggml_kv

const kv_codec k_codec_q8_0 = {kv_type::q8_0,   "q8_0",          ggml_kv::check, ggml_kv::tile_bytes,
                               ggml_kv::encode, ggml_kv::decode, ggml_kv::qk,    ggml_kv::av,
                               ggml_kv::qk_ref, ggml_kv::av_ref, nullptr};
const kv_codec k_codec_q4_0 = {kv_type::q4_0,   "q4_0",          ggml_kv::check, ggml_kv::tile_bytes,
                               ggml_kv::encode, ggml_kv::decode, ggml_kv::qk,    ggml_kv::av,
                               ggml_kv::qk_ref, ggml_kv::av_ref, nullptr};

}  // namespace pagoda
