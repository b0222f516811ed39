// Keys with per-channel or static scales: the AVX-512 q.k folds the scales
// into the query as one int16 word per channel (kv_codec_int_avx512.cpp,
// fold_quantize_rows) and sums them in int32 lanes. At the largest codes and a
// query whose every channel is at its row's maximum, the sums are at their
// largest: wide_levels must keep them within int32 at any head_dim. Checked at
// every SIMD level against the reference twin, within operand_error's bound
// (kv_codec_int.h); the general shapes are in kv_codec_test.cpp. The AVX2
// kernels round the operand of per-token keys and values to int16 instead
// (avx2_levels): the same check for them at the largest head_dim and block_size.
#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "core/aligned_buffer.h"
#include "core/cpu.h"
#include "core/simd_levels.h"
#include "quant/kv_codec.h"
#include "quant/kv_codec_int.h"

namespace pagoda {
namespace {

class fold_level : public ::testing::TestWithParam<simd_level> {
 protected:
  test::simd_level_guard guard_;
};

TEST_P(fold_level, largest_sums_fit_int32_at_any_head_dim) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const kv_codec* c = get_kv_codec(kv_type::int8);
  for (kv_scale_mode mode : {kv_scale_mode::per_channel, kv_scale_mode::static_scales}) {
    for (int hd : {128, 256, 512, 1024, 2048}) {
      const int bs = 16, n_q = 4;
      const kv_tile_shape shape{bs, hd};
      const kv_format kf{kv_type::int8, kv_role::key, mode, 0};
      ASSERT_TRUE(c->check(kf, shape).ok());
      // Every channel spans [0, 1]: token 0 at code 0, the others at code 255.
      std::vector<float> x(static_cast<std::size_t>(bs) * hd, 1.0f);
      std::fill_n(x.begin(), hd, 0.0f);
      std::vector<float> lo(hd, 0.0f), hi(hd, 1.0f), scale(hd), offset(hd);
      c->make_static(kf, hd, lo.data(), hi.data(), scale.data(), offset.data());
      const kv_static_params params{scale.data(), offset.data()};
      const kv_static_params* sp = mode == kv_scale_mode::static_scales ? &params : nullptr;
      aligned_buffer tile(c->tile_bytes(kf, shape));
      c->encode(kf, shape, sp, x.data(), 0, bs, tile.data());
      const void* tiles[] = {tile.data()};
      // Rows of equal elements, one negative: every operand word at +-levels.
      std::vector<float> q(static_cast<std::size_t>(n_q) * hd);
      for (int r = 0; r < n_q; ++r)
        std::fill_n(q.begin() + static_cast<std::ptrdiff_t>(r) * hd, hd, r == 1 ? -0.75f : 1.0f + r);
      std::vector<float> s_ref(n_q * bs), s_simd(n_q * bs);
      c->qk_ref(kf, shape, sp, tiles, bs, q.data(), n_q, s_ref.data(), bs);
      c->qk(kf, shape, sp, tiles, bs, q.data(), n_q, s_simd.data(), bs);
      const double eps = GetParam() == simd_level::avx512 ? int_kv::operand_error(int_kv::layout_of(kf, shape)) : 0;
      // Scale of a channel: 1 / 255 up to fp16 rounding; codes 255 on tokens 1..15.
      const double s_max = (mode == kv_scale_mode::static_scales ? scale[0] : 1.0 / 255) * 1.001;
      for (int r = 0; r < n_q; ++r) {
        const double q_max = std::fabs(q[static_cast<std::size_t>(r) * hd]);
        for (int t = 0; t < bs; ++t) {
          const double codes = t == 0 ? 0.0 : 255.0 * hd;
          const double mag = q_max * (s_max * codes);
          const double tol = 1e-5 * mag + 1e-6 + eps * q_max * s_max * codes * 1.001;
          ASSERT_NEAR(s_simd[r * bs + t], s_ref[r * bs + t], tol)
              << kv_scale_mode_name(mode) << " head_dim " << hd << " row " << r << " token " << t;
        }
      }
    }
  }
}

// Keys and values with per-token scales: every token spans [0, 1] (channel 0
// at code 0, the others at the largest code) and every operand element is at
// its row's maximum, so a q.k sum over a token's channels, or an a.v sum over
// a span's tokens, is as large as the shape allows: int32 sums for int8 codes,
// and for 4- and 2-bit keys also the AVX2 q.k's int16 partial sums.
TEST_P(fold_level, per_token_sums_fit_int32_at_any_shape) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  for (kv_type type : {kv_type::int8, kv_type::int4, kv_type::int2})
  for (kv_tile_shape shape : {kv_tile_shape{16, 2048}, kv_tile_shape{16, 256}, kv_tile_shape{1024, 16},
                              kv_tile_shape{256, 32}, kv_tile_shape{64, 512}}) {
    const kv_codec* c = get_kv_codec(type);
    const int u_max = type == kv_type::int8 ? 255 : type == kv_type::int4 ? 15 : 3;
    const int bs = shape.block_size, hd = shape.head_dim, n_q = 4;
    std::vector<float> x(static_cast<std::size_t>(bs) * hd, 1.0f);
    for (int t = 0; t < bs; ++t) x[static_cast<std::size_t>(t) * hd] = 0.0f;
    // Rows of equal elements, one negative.
    auto row_value = [](int r) { return r == 1 ? -0.75f : 1.0f + r; };
    const double s_max = 1.0 / u_max * 1.001;  // a token's scale up to fp16 rounding
    for (kv_role role : {kv_role::key, kv_role::value}) {
      const kv_format f{type, role, kv_scale_mode::per_token, 0};
      ASSERT_TRUE(c->check(f, shape).ok());
      aligned_buffer tile(c->tile_bytes(f, shape));
      c->encode(f, shape, nullptr, x.data(), 0, bs, tile.data());
      const void* tiles[] = {tile.data()};
      const int_kv::tile_layout L = int_kv::layout_of(f, shape);
      const double eps = GetParam() == simd_level::avx512 ? int_kv::operand_error(L)
                         : GetParam() == simd_level::avx2 ? int_kv::avx2_operand_error(L, shape)
                                                          : 0;
      const int n_x = role == kv_role::key ? hd : bs;  // operand elements per row
      std::vector<float> op(static_cast<std::size_t>(n_q) * n_x);
      for (int r = 0; r < n_q; ++r) std::fill_n(op.begin() + static_cast<std::ptrdiff_t>(r) * n_x, n_x, row_value(r));
      const int n_out = role == kv_role::key ? bs : hd;
      std::vector<float> ref(static_cast<std::size_t>(n_q) * n_out), simd(ref.size());
      if (role == kv_role::key) {
        c->qk_ref(f, shape, nullptr, tiles, bs, op.data(), n_q, ref.data(), bs);
        c->qk(f, shape, nullptr, tiles, bs, op.data(), n_q, simd.data(), bs);
      } else {
        c->av_ref(f, shape, nullptr, tiles, bs, op.data(), bs, n_q, ref.data());
        c->av(f, shape, nullptr, tiles, bs, op.data(), bs, n_q, simd.data());
      }
      for (int r = 0; r < n_q; ++r) {
        const double x_max = std::fabs(row_value(r));
        for (int i = 0; i < n_out; ++i) {
          // Keys: token i's codes; values: channel i's codes over the tokens.
          const double codes = role == kv_role::key ? u_max * (hd - 1.0) : (i == 0 ? 0.0 : u_max * 1.0 * bs);
          const double mag = x_max * s_max * codes;
          const double tol = 1e-5 * mag + 1e-6 + eps * x_max * s_max * codes * 1.001;
          ASSERT_NEAR(simd[static_cast<std::size_t>(r) * n_out + i], ref[static_cast<std::size_t>(r) * n_out + i], tol)
              << kv_type_name(type) << (role == kv_role::key ? " key" : " value") << " block " << bs << " head_dim "
              << hd << " row " << r << " at " << i;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(levels, fold_level, ::testing::ValuesIn(test::simd_levels_under_test()),
                         test::level_param_name);

}  // namespace
}  // namespace pagoda
