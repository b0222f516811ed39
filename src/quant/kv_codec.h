// KV codecs: one trait table indexed by kv_type (DESIGN.md), like ggml's type_traits.
//
// The unit a codec stores is a TILE: one block's tokens for one KV head of one
// layer, i.e. block_size tokens x head_dim values plus whatever scales the codec
// keeps. A codec decides the tile's byte layout (e.g. keys channel-major so a
// SIMD lane holds one token, values token-major), and attention runs on tiles
// directly through qk/av: it never materialises a decoded copy of the cache.
//
// qk and av take a RUN of tiles (one sequence's blocks for one head, in order)
// so a codec prepares the query (or the weights) once per run, not per tile.
//
// Roles: a tile holds either keys (read by qk) or values (read by av). The role
// is part of the format because layouts and scale granularity differ.
//
// Non-finite input to encode is defined behaviour, never undefined:
//   - f32, f16, bf16 store it as it is (NaN stays NaN, +-inf stays +-inf; f16
//     rounds magnitudes past 65504 to inf); fp8 keeps NaN as NaN and saturates
//     +-inf to its largest finite magnitude, and a per-token fp8 scale is fitted
//     to the token's finite elements only;
//   - integer (int8/int4/int2) and ggml (q8_0/q4_0) codecs fit scales and
//     offsets to the finite elements of each scale group only, store NaN as the
//     code of 0 (int: the code nearest 0 in the group's range) and saturate
//     +inf / -inf to the group's largest / smallest representable value. A
//     group with no finite element decodes to zeros.
// So one bad activation never spreads into the other values of its scale group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "pagoda/status.h"

namespace pagoda {

enum class kv_type : std::uint8_t { f32, f16, bf16, fp8_e4m3, fp8_e5m2, int8, int4, int2, q8_0, q4_0 };
inline constexpr int k_n_kv_types = 10;

enum class kv_role : std::uint8_t { key, value };

// Scale granularity. Which modes a type accepts is the codec's check().
enum class kv_scale_mode : std::uint8_t {
  none,           // f32/f16/bf16; fp8 with scale 1 (vLLM's default without calibration)
  per_token,      // one scale (and offset) per token and head, over all of head_dim
  per_channel,    // one scale (and offset) per channel over a block's tokens (KIVI keys); sealed
  group,          // per token, groups of group_size channels along head_dim (q8_0/q4_0: 32)
  static_scales,  // calibrated per layer, head and channel (pagoda calibrate); nothing per token
};
inline constexpr int k_n_kv_scale_modes = 5;

struct kv_tile_shape {
  int block_size = 16;  // tokens per block
  int head_dim = 0;     // values per token per head
};

// How one tensor (K or V of one layer) is stored.
struct kv_format {
  kv_type type = kv_type::f32;
  kv_role role = kv_role::key;
  kv_scale_mode scale_mode = kv_scale_mode::none;
  int group_size = 0;  // kv_scale_mode::group only

  friend bool operator==(const kv_format&, const kv_format&) = default;
};

// Static (calibrated) parameters of one head, prepared by kv_codec::make_static
// from calibrated ranges: x ~ scale[d] * code + offset[d], each [head_dim].
struct kv_static_params {
  const float* scale = nullptr;
  const float* offset = nullptr;
};

struct kv_codec {
  kv_type type;
  const char* name;

  // OK when this codec can store fmt at this shape; otherwise an error a user
  // can act on ("int4/g3: group size 3 does not divide head_dim 8").
  status (*check)(const kv_format& fmt, kv_tile_shape shape);
  // Bytes of one tile (data + in-tile scales).
  std::size_t (*tile_bytes)(const kv_format& fmt, kv_tile_shape shape);

  // Encodes tokens x[n][head_dim] into tile slots [t0, t0 + n). sp is non-null
  // exactly when fmt.scale_mode is static_scales.
  // REQUIRES: t0 + n <= block_size; for sealed formats (kv_format_sealed) t0 == 0
  // and n == block_size: per-channel scales need the whole block.
  void (*encode)(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const float* x, int t0,
                 int n, void* tile);
  // Decodes slots [t0, t0 + n) into out[n][head_dim] (tests, tools; not attention).
  void (*decode)(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* tile, int t0,
                 int n, float* out);

  // A run of tiles: tiles[i] holds tokens [i * block_size, (i + 1) * block_size);
  // only the first n_tokens tokens are read (every tile full but the last).
  //
  // Keys: scores[r * ld + t] = <q[r], k_t> for r < n_q, t < n_tokens; q is
  // [n_q][head_dim] f32. Nothing else in scores is written.
  // Values: acc[r * head_dim + d] += sum_{t < n_tokens} w[r * ld + t] * v_t[d].
  // Lanes are independent: a row's results never depend on n_q or the other
  // rows, and tokens with weight exactly 0 change nothing, so a row computed
  // inside a prefill chunk equals the same row computed alone (batch invariance).
  void (*qk)(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
             int n_tokens, const float* q, int n_q, float* scores, int ld);
  void (*av)(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
             int n_tokens, const float* w, int ld, int n_q, float* acc);
  // Plain reference twins of qk and av (no SIMD, exact float arithmetic on the
  // decoded values), the oracle for tests.
  void (*qk_ref)(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
                 int n_tokens, const float* q, int n_q, float* scores, int ld);
  void (*av_ref)(const kv_format& fmt, kv_tile_shape shape, const kv_static_params* sp, const void* const* tiles,
                 int n_tokens, const float* w, int ld, int n_q, float* acc);

  // Static parameters of one head from calibrated per-channel ranges [lo, hi]
  // (each [head_dim]) into scale/offset [head_dim]; nullptr when the codec has
  // no static mode.
  void (*make_static)(const kv_format& fmt, int head_dim, const float* lo, const float* hi, float* scale,
                      float* offset);
};

// For codecs' check(): OK when 1 <= block_size <= max_block_size and head_dim >= 1.
// Each codec passes the limit its own kernels' stack arrays need, so that it is
// safe whoever calls it (kv_layout::check has a limit of its own).
status check_tile_shape(const kv_format& fmt, kv_tile_shape shape, int max_block_size);

// nullptr when the type has no codec.
const kv_codec* get_kv_codec(kv_type type);

const char* kv_type_name(kv_type type);
const char* kv_scale_mode_name(kv_scale_mode mode);
// "int4/channel", "int8/token", "q8_0", "f16": the spelling parse_kv_format accepts.
std::string kv_format_name(const kv_format& fmt);

// Accepts Pagoda's names and vLLM's / llama.cpp's spellings ("fp16", "half", "fp8", ...).
result<kv_type> parse_kv_type(std::string_view name);

// The format a type gets for a role when nothing else is asked for: int8 per
// token; int4/int2 keys per channel and values per token (KIVI); fp8 per token;
// q8_0/q4_0 groups of 32.
kv_format default_kv_format(kv_type type, kv_role role);

// Whether tiles of this format are only encoded whole: the newest, partially
// filled block stays in f16 staging until it is full (KIVI's residual window).
bool kv_format_sealed(const kv_format& fmt);

// Bits one stored element costs, in-tile scales and padding included.
double kv_format_bits_per_element(const kv_format& fmt, kv_tile_shape shape);

}  // namespace pagoda
