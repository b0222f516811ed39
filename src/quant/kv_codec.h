// KV codecs: one trait table indexed by kv_type (DESIGN.md), like ggml's type_traits.
//
// The unit a codec works on is a TILE: one block's tokens for one KV head of one
// layer, i.e. block_size tokens x head_dim values plus whatever scales the codec
// keeps. A codec decides the tile's byte layout (e.g. keys channel-major so a
// SIMD lane holds one token, values token-major), and attention runs on tiles
// directly through qk/av: it never materialises a decoded copy of the cache.
//
// Roles: a tile holds either keys (read by qk) or values (read by av). The role
// is part of the format because layouts and scale granularity differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "pagoda/status.h"

namespace pagoda {

enum class kv_type : std::uint8_t { f32, f16, bf16, fp8_e4m3, fp8_e5m2, int8, int4, int2, q8_0, q4_0 };
inline constexpr int k_n_kv_types = 10;

enum class kv_role : std::uint8_t { key, value };

// Scale granularity of the integer codecs (ignored by float codecs).
enum class kv_scale_mode : std::uint8_t {
  none,         // float codecs
  per_token,    // one scale (and offset) per token and head
  per_channel,  // one scale (and offset) per channel over a block's tokens (KIVI keys)
  group,        // groups of group_size along head_dim, per token (ggml-style)
};

struct kv_tile_shape {
  int block_size = 16;  // tokens per block
  int head_dim = 0;     // values per token per head
};

// How one tensor (K or V of one layer) is stored.
struct kv_format {
  kv_type type = kv_type::f32;
  kv_role role = kv_role::key;
  kv_scale_mode scale_mode = kv_scale_mode::none;
  int group_size = 0;  // for kv_scale_mode::group
};

// Static (calibrated) scales for one head: per channel, [head_dim]; nullptr = dynamic.
using kv_static_scales = const float*;

struct kv_codec {
  kv_type type;
  const char* name;
  // Tiles of this codec are only encoded whole: a partially filled newest block is
  // staged in f16 until full, then sealed (KIVI's residual window).
  bool sealed;

  // Bytes of one tile (data + scales), 64-byte multiple not required.
  std::size_t (*tile_bytes)(const kv_format& fmt, kv_tile_shape shape);

  // Encodes tokens x[n][head_dim] into tile slots [t0, t0 + n).
  // REQUIRES: t0 + n <= block_size; for sealed codecs t0 == 0 and n == block_size.
  void (*encode)(const kv_format& fmt, kv_tile_shape shape, const float* x, int t0, int n, void* tile,
                 kv_static_scales scales);
  // Decodes slots [t0, t0 + n) into out[n][head_dim] (tests, tools; not attention).
  void (*decode)(const kv_format& fmt, kv_tile_shape shape, const void* tile, int t0, int n, float* out);

  // Keys: scores[r * ld + t] = <q[r], k_t> for r < n_q, t < n_tokens. q is [n_q][head_dim] f32.
  // Lanes are independent: a score never depends on n_tokens or n_q (batch invariance).
  void (*qk)(const kv_format& fmt, kv_tile_shape shape, const void* tile, int n_tokens, const float* q, int n_q,
             float* scores, int ld);
  // Values: acc[r][d] += sum_{t < n_tokens} w[r * ld + t] * v_t[d], in increasing t.
  void (*av)(const kv_format& fmt, kv_tile_shape shape, const void* tile, int n_tokens, const float* w, int ld,
             int n_q, float* acc);
  // Plain reference twins of qk and av (no SIMD), the oracle for tests.
  void (*qk_ref)(const kv_format& fmt, kv_tile_shape shape, const void* tile, int n_tokens, const float* q, int n_q,
                 float* scores, int ld);
  void (*av_ref)(const kv_format& fmt, kv_tile_shape shape, const void* tile, int n_tokens, const float* w, int ld,
                 int n_q, float* acc);
};

// nullptr when the type has no codec yet.
const kv_codec* get_kv_codec(kv_type type);

const char* kv_type_name(kv_type type);
// Accepts Pagoda's names and vLLM's / llama.cpp's spellings ("fp16", "half", "fp8", ...).
result<kv_type> parse_kv_type(std::string_view name);

// The format a type gets for a role when nothing else is asked for.
kv_format default_kv_format(kv_type type, kv_role role);

}  // namespace pagoda
