// What the attention kernel suites share: a shape and KV format to test at a
// SIMD level, the tolerance of a level against the double references, and
// test names. Header-only (tests/CMakeLists.txt builds *_test.cpp and *_util.cpp).
#pragma once

#include <cctype>
#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include "core/cpu.h"
#include "core/simd_levels.h"
#include "quant/kv_format_spec.h"

namespace pagoda::test {

struct attention_shape {
  const char* spec;  // a K/V pair as the CLI spells it ("f32", "k8v4", "int4/token+int2")
  int n_kv_heads, n_rep, head_dim, block_size, n_ctx;
};

// Tolerance of a level's path against the double reference: float rounding
// (2e-5 on O(1) outputs) everywhere but in the SIMD integer kernels, which
// round q and the weights to integers (AVX-512: int8 halves; AVX2: int16,
// kv_codec_int.h's avx2_operand_error) (2e-3) or, for 4- and 2-bit keys with
// per-token or group scales, round q to 8 bits (5e-2; both levels);
// paged_attention_test's matches_reference explains the figures.
inline double simd_tolerance(const std::string& spec, simd_level level) {
  if (level == simd_level::scalar) return 2e-5;
  kv_pair_spec p = *parse_kv_pair_spec(spec);
  const kv_format k = p.k.resolve(kv_role::key, false);
  if ((k.type == kv_type::int4 || k.type == kv_type::int2) &&
      (k.scale_mode == kv_scale_mode::per_token || k.scale_mode == kv_scale_mode::group))
    return 5e-2;
  for (kv_type t : {p.k.type, p.v.type})
    if (t == kv_type::int8 || t == kv_type::int4 || t == kv_type::int2) return 2e-3;
  return 2e-5;
}

// One shape and KV format at one SIMD level (core/simd_levels.h).
class attention_shape_test : public ::testing::TestWithParam<std::tuple<attention_shape, simd_level>> {
 protected:
  const attention_shape& p() const { return std::get<0>(GetParam()); }
  simd_level level() const { return std::get<1>(GetParam()); }
  simd_level_guard guard_;
};

// "int4_token_hd128_bs16_avx2" (with_ctx: "..._bs16_n300_avx2").
inline std::string attention_shape_name(const attention_shape& p, simd_level level, bool with_ctx) {
  std::string n = p.spec;
  for (char& c : n)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  n += "_hd" + std::to_string(p.head_dim) + "_bs" + std::to_string(p.block_size);
  if (with_ctx) n += "_n" + std::to_string(p.n_ctx);
  return n + "_" + simd_level_name(level);
}

}  // namespace pagoda::test
