// f32/f16 codecs: storage round trips and SIMD qk/av against their reference twins.
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/aligned_buffer.h"
#include "core/cpu.h"
#include "core/half.h"
#include "quant/kv_codec.h"

namespace pagoda {
namespace {

struct level_guard {
  simd_level saved = active_simd_level();
  ~level_guard() { set_simd_level(saved); }
};

std::vector<float> random_vec(std::mt19937& rng, std::size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TEST(kv_codec, parse_names_and_aliases) {
  EXPECT_EQ(*parse_kv_type("f16"), kv_type::f16);
  EXPECT_EQ(*parse_kv_type("FP16"), kv_type::f16);
  EXPECT_EQ(*parse_kv_type("float32"), kv_type::f32);
  auto bad = parse_kv_type("f7");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code(), errc::invalid_argument);
  EXPECT_NE(bad.error().message().find("f7"), std::string::npos);
}

class float_codec : public ::testing::TestWithParam<kv_type> {};

TEST_P(float_codec, encode_decode_round_trip) {
  const kv_codec* c = get_kv_codec(GetParam());
  ASSERT_NE(c, nullptr);
  std::mt19937 rng(1);
  for (kv_role role : {kv_role::key, kv_role::value}) {
    kv_format fmt = default_kv_format(GetParam(), role);
    kv_tile_shape shape{16, 24};
    aligned_buffer tile(c->tile_bytes(fmt, shape));
    auto x = random_vec(rng, 16 * 24);
    // Written in three pieces, as a sequence fills a block over several steps.
    c->encode(fmt, shape, x.data(), 0, 5, tile.data(), nullptr);
    c->encode(fmt, shape, x.data() + 5 * 24, 5, 1, tile.data(), nullptr);
    c->encode(fmt, shape, x.data() + 6 * 24, 6, 10, tile.data(), nullptr);
    std::vector<float> y(16 * 24);
    c->decode(fmt, shape, tile.data(), 0, 16, y.data());
    for (std::size_t i = 0; i < x.size(); ++i) {
      float want = GetParam() == kv_type::f16 ? fp16_to_f32(f32_to_fp16(x[i])) : x[i];
      ASSERT_EQ(y[i], want) << i;
    }
  }
}

// SIMD vs reference on random shapes. Both sum the same head_dim products of the
// same stored values; they differ only by fused vs separate rounding, so the
// difference is bounded by ~head_dim * eps * sum|q_d k_d|: we allow 1e-5 of that sum.
TEST_P(float_codec, simd_matches_reference) {
  level_guard guard;
  const kv_codec* c = get_kv_codec(GetParam());
  std::mt19937 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    int bs = std::vector<int>{1, 8, 16, 32}[trial % 4];
    int hd = std::vector<int>{8, 64, 80, 128, 24}[trial % 5];
    int n_q = 1 + trial % 7;
    int n_tok = 1 + static_cast<int>(rng() % bs);
    kv_tile_shape shape{bs, hd};
    kv_format kf = default_kv_format(GetParam(), kv_role::key);
    kv_format vf = default_kv_format(GetParam(), kv_role::value);
    aligned_buffer kt(c->tile_bytes(kf, shape)), vt(c->tile_bytes(vf, shape));
    auto kx = random_vec(rng, static_cast<std::size_t>(bs) * hd);
    auto vx = random_vec(rng, static_cast<std::size_t>(bs) * hd);
    c->encode(kf, shape, kx.data(), 0, bs, kt.data(), nullptr);
    c->encode(vf, shape, vx.data(), 0, bs, vt.data(), nullptr);
    auto q = random_vec(rng, static_cast<std::size_t>(n_q) * hd);
    auto w = random_vec(rng, static_cast<std::size_t>(n_q) * bs);
    int ld = bs;

    std::vector<float> s_ref(n_q * ld, -1.0f), s_simd(n_q * ld, -1.0f);
    std::vector<float> a_ref(n_q * hd, 0.5f), a_simd(n_q * hd, 0.5f);
    c->qk_ref(kf, shape, kt.data(), n_tok, q.data(), n_q, s_ref.data(), ld);
    c->av_ref(vf, shape, vt.data(), n_tok, w.data(), ld, n_q, a_ref.data());
    set_simd_level(simd_level::avx512);
    c->qk(kf, shape, kt.data(), n_tok, q.data(), n_q, s_simd.data(), ld);
    c->av(vf, shape, vt.data(), n_tok, w.data(), ld, n_q, a_simd.data());
    std::vector<float> kd(static_cast<std::size_t>(bs) * hd), vd(kd.size());
    c->decode(kf, shape, kt.data(), 0, bs, kd.data());
    c->decode(vf, shape, vt.data(), 0, bs, vd.data());
    for (int r = 0; r < n_q; ++r) {
      for (int t = 0; t < n_tok; ++t) {
        double mag = 0;
        for (int d = 0; d < hd; ++d) mag += std::fabs(q[r * hd + d] * kd[t * hd + d]);
        ASSERT_NEAR(s_simd[r * ld + t], s_ref[r * ld + t], 1e-5 * mag + 1e-30) << trial;
      }
      for (int t = n_tok; t < ld; ++t) ASSERT_EQ(s_simd[r * ld + t], -1.0f) << "wrote past n_tokens";
      for (int d = 0; d < hd; ++d) {
        double mag = 0.5;
        for (int t = 0; t < n_tok; ++t) mag += std::fabs(w[r * ld + t] * vd[t * hd + d]);
        ASSERT_NEAR(a_simd[r * hd + d], a_ref[r * hd + d], 1e-5 * mag) << trial;
      }
    }
  }
}

// A score or value sum of one query row is bitwise the same whether computed
// alone or with other rows, and whatever the number of valid tokens after it.
TEST_P(float_codec, lanes_are_independent) {
  const kv_codec* c = get_kv_codec(GetParam());
  std::mt19937 rng(3);
  kv_tile_shape shape{16, 64};
  kv_format kf = default_kv_format(GetParam(), kv_role::key);
  kv_format vf = default_kv_format(GetParam(), kv_role::value);
  aligned_buffer kt(c->tile_bytes(kf, shape)), vt(c->tile_bytes(vf, shape));
  auto kx = random_vec(rng, 16 * 64), vx = random_vec(rng, 16 * 64);
  c->encode(kf, shape, kx.data(), 0, 16, kt.data(), nullptr);
  c->encode(vf, shape, vx.data(), 0, 16, vt.data(), nullptr);
  auto q = random_vec(rng, 6 * 64);
  std::vector<float> all(6 * 16), one(16);
  c->qk(kf, shape, kt.data(), 16, q.data(), 6, all.data(), 16);
  for (int r = 0; r < 6; ++r) {
    c->qk(kf, shape, kt.data(), 9, q.data() + r * 64, 1, one.data(), 16);
    for (int t = 0; t < 9; ++t) ASSERT_EQ(one[t], all[r * 16 + t]);
  }
  // av: zero weights past a row's range leave the sum exactly as if they were not there.
  auto w = random_vec(rng, 6 * 16);
  for (int r = 0; r < 6; ++r)
    for (int t = 5; t < 16; ++t) w[r * 16 + t] = 0.0f;
  std::vector<float> acc_all(6 * 64, 0.0f), acc_one(64, 0.0f);
  c->av(vf, shape, vt.data(), 16, w.data(), 16, 6, acc_all.data());
  c->av(vf, shape, vt.data(), 5, w.data() + 3 * 16, 16, 1, acc_one.data());
  for (int d = 0; d < 64; ++d) ASSERT_EQ(acc_one[d], acc_all[3 * 64 + d]);
}

INSTANTIATE_TEST_SUITE_P(types, float_codec, ::testing::Values(kv_type::f32, kv_type::f16),
                         [](const auto& info) { return std::string(kv_type_name(info.param)); });

}  // namespace
}  // namespace pagoda
