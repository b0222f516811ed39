// The int4 Quest bound (quest.h: quest_bounds4): its SIMD kernels give the
// reference twin's bits at every level, its codes round outward within a
// step, and it is an upper bound of the f32 bound (hence of every score:
// quest_test.cpp's property test checks it against every codec's scores)
// that stays within its stated slack, whatever the channel scales.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "core/simd_levels.h"
#include "policy/quest.h"

namespace pagoda {
namespace {

// Random summaries with some channels 6x wider, coded with channel scales
// taken from the first `sampled` blocks only (the later ones may exceed them,
// as blocks sealed after a row's first codes do).
struct coded4_case {
  int hd, rows, n;
  std::vector<float> lo, hi, q, scales;
  std::vector<key_summary> sums;
  std::vector<std::uint8_t> codes;
  std::vector<quest_block8> blocks;
  quest_query4 q4;
  coded4_case(int hd_, int rows_, int n_, unsigned seed, int sampled = 4) : hd(hd_), rows(rows_), n(n_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    lo.resize(static_cast<std::size_t>(n) * hd);
    hi.resize(lo.size());
    for (std::size_t i = 0; i < lo.size(); ++i) {
      const float wide = i % 11 == 0 ? 6.0f : 1.0f, late = i / hd >= static_cast<std::size_t>(sampled) ? 3.0f : 1.0f;
      const float a = nd(rng) * wide * late, b = nd(rng) * wide;
      lo[i] = std::min(a, b);
      hi[i] = std::max(a, b);
    }
    for (int i = 0; i < n; ++i)
      sums.push_back({&lo[static_cast<std::size_t>(i) * hd], &hi[static_cast<std::size_t>(i) * hd], nullptr});
    scales.resize(hd);
    quest_channel_scales(std::span<const key_summary>(sums).first(std::min(n, sampled)), hd, scales.data());
    const std::size_t per = quest4_padded_dim(hd);
    codes.resize(per * n);
    for (int i = 0; i < n; ++i) blocks.push_back(quest_encode_block4(sums[i], hd, scales.data(), codes.data() + per * i));
    std::normal_distribution<float> qd(0.0f, 1.0f);
    q.resize(static_cast<std::size_t>(rows) * hd);
    for (float& x : q) x = qd(rng);
    quest_encode_query4(q.data(), rows, hd, scales.data(), q4);
  }
  // Channel d's code of block i, side 0 (min: nibble 8 - code) or 1 (max: nibble code + 8).
  int code(int i, int side, int d) const {
    const int pd = quest4_padded_dim(hd);
    const std::uint8_t* s = codes.data() + static_cast<std::size_t>(i) * pd + side * pd / 2;
    const std::uint8_t byte = s[d / 128 * 64 + d % 64];
    const int nib = d % 128 < 64 ? byte & 0xF : byte >> 4;
    return side == 0 ? 8 - nib : nib - 8;
  }
};

class quest_int4_level : public ::testing::TestWithParam<simd_level> {
 protected:
  test::simd_level_guard guard_;
};

// Integer sums are exact: every level gives the reference twin's bits.
TEST_P(quest_int4_level, bounds_equal_the_reference_twin_bitwise) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  for (int hd : {8, 40, 64, 100, 128, 160, 256})  // 128 and 256 padded channels
    for (int rows : {0, 1, 3, 4, 5, 9, 32}) {
      coded4_case c(hd, rows, 29, 10 * hd + rows);
      // Blocks with a non-finite summary (quest_encode_block's scale +inf),
      // one among the kernels' groups of eight and one in the rest, are
      // +inf whatever their codes (here l1 makes every row's sum negative).
      c.blocks[3].scale = c.blocks[26].scale = INFINITY;
      c.blocks[3].l1 = c.blocks[26].l1 = -(1 << 24);
      std::vector<float> got(c.n), want(c.n);
      quest_bounds4(c.q4, c.codes.data(), c.blocks.data(), c.n, got.data());
      quest_bounds4_ref(c.q4, c.codes.data(), c.blocks.data(), c.n, want.data());
      for (int i = 0; i < c.n; ++i)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i]))
            << "hd " << hd << " rows " << rows << " block " << i;
    }
}

// The covering term: block codes that are exact (min -7, max 7 steps) and
// query channels that round down by 0.49 of a step still give a bound of at
// least sum_d q_d x max_d; without l1 / 2 it would fall short.
TEST_P(quest_int4_level, bound_covers_the_query_rounding) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int hd = 128;
  std::vector<float> lo(hd, -7.0f), hi(hd, 7.0f), scales(hd, 1.0f), q(hd, 50.49f);
  q[0] = 127.0f;  // query scale 1: the others are 50.49 steps, coded 50
  std::vector<std::uint8_t> codes(quest4_padded_dim(hd));
  const quest_block8 b = quest_encode_block4({lo.data(), hi.data(), nullptr}, hd, scales.data(), codes.data());
  quest_query4 q4;
  quest_encode_query4(q.data(), 1, hd, scales.data(), q4);
  ASSERT_EQ(q4.q.scale[0], 1.0f);
  ASSERT_EQ(q4.q.pos[1], 50);
  float bound = 0;
  quest_bounds4(q4, codes.data(), &b, 1, &bound);
  double exact = 0;
  for (int d = 0; d < hd; ++d) exact += 7.0 * q[d];
  EXPECT_GE(bound, exact * (1 - 1e-7));
  EXPECT_LT(bound, exact * (1 + 1.0 / 1024) + 0.51 * b.scale * b.l1) << "the covering term is l1 / 2 steps";
}

// Channel scales are powers of two, at least 1/64 of the largest, at or
// above each channel's median magnitude; 1 for zero rows.
TEST(quest_int4_bounds, channel_scales_are_powers_of_two_over_the_median) {
  coded4_case c(40, 1, 9, 5, 9);
  float largest = 0;
  for (float s : c.scales) largest = std::max(largest, s);
  for (int d = 0; d < c.hd; ++d) {
    int e = 0;
    EXPECT_EQ(std::frexp(c.scales[d], &e), 0.5f) << d;
    EXPECT_GE(c.scales[d], largest / 64) << d;
    std::vector<float> mags;
    for (const key_summary& s : c.sums) mags.push_back(std::max(std::fabs(s.min[d]), std::fabs(s.max[d])));
    std::nth_element(mags.begin(), mags.begin() + 4, mags.end());
    EXPECT_GE(c.scales[d], mags[4]) << d;
    EXPECT_LT(c.scales[d], 2 * std::max(mags[4], largest / 64)) << d;
  }
  std::vector<float> zero(8, 0.0f), out(8);
  const key_summary z{zero.data(), zero.data(), nullptr};
  quest_channel_scales(std::span<const key_summary>(&z, 1), 8, out.data());
  for (float s : out) EXPECT_EQ(s, 1.0f);
}

// Codes round outward by less than one step in y = x / s_d: scale x code_lo
// <= y_min < scale x (code_lo + 1), scale x (code_hi - 1) < y_max <= scale x
// code_hi (in double), codes in [-7, 7], padding coded 0, l1 their magnitudes.
TEST(quest_int4_bounds, codes_round_outward_by_less_than_a_step) {
  for (int hd : {8, 40, 128, 160}) {
    coded4_case c(hd, 1, 300, 7 * hd);
    for (int i = 0; i < c.n; ++i) {
      const double sc = c.blocks[i].scale;
      std::int32_t l1 = 0;
      for (int d = 0; d < quest4_padded_dim(hd); ++d) {
        const int lo = c.code(i, 0, d), hi = c.code(i, 1, d);
        l1 += std::abs(lo) + std::abs(hi);
        if (d >= hd) {
          ASSERT_EQ(lo, 0);
          ASSERT_EQ(hi, 0);
          continue;
        }
        const double mn = c.sums[i].min[d] / static_cast<double>(c.scales[d]);
        const double mx = c.sums[i].max[d] / static_cast<double>(c.scales[d]);
        ASSERT_LE(sc * lo, mn) << i << " " << d;
        ASSERT_GT(sc * (lo + 1), mn) << i << " " << d;
        ASSERT_GE(sc * hi, mx) << i << " " << d;
        ASSERT_LT(sc * (hi - 1), mx) << i << " " << d;
        ASSERT_LE(std::abs(lo), 7);
        ASSERT_LE(std::abs(hi), 7);
      }
      ASSERT_EQ(l1, c.blocks[i].l1);
    }
  }
}

// The int4 bound is at least the f32 bound (exact, in double) and at most
// that plus its slack per row: block scale x (sum_d |q_d| s_d + q' scale x
// l1) (outward rounding, then the query's codes), with blocks beyond the
// channel scales' sample 3x wider. The slack is reached in part.
TEST(quest_int4_bounds, cover_the_f32_bound_and_stay_within_the_slack) {
  for (int hd : {40, 128})
    for (int rows : {1, 4}) {
      coded4_case c(hd, rows, 200, 3 * hd + rows);
      std::vector<float> b4(c.n), b32(c.n);
      quest_bounds4_ref(c.q4, c.codes.data(), c.blocks.data(), c.n, b4.data());
      double loosest = 0;
      for (int i = 0; i < c.n; ++i) {
        double worst_slack = 0;
        for (int r = 0; r < rows; ++r) {
          double l1q = 0;
          for (int d = 0; d < hd; ++d) l1q += std::fabs(c.q[static_cast<std::size_t>(r) * hd + d]) * c.scales[d];
          worst_slack = std::max(worst_slack, c.blocks[i].scale * (l1q + c.q4.q.scale[r] * c.blocks[i].l1));
        }
        quest_bounds_ref(c.q.data(), rows, hd, std::span<const key_summary>(&c.sums[i], 1), &b32[i]);
        const double tol = 1e-6 * (std::fabs(b32[i]) + worst_slack);
        ASSERT_GE(b4[i], b32[i] - tol) << "hd " << hd << " rows " << rows << " block " << i;
        ASSERT_LE(b4[i], b32[i] + worst_slack + tol) << "hd " << hd << " rows " << rows << " block " << i;
        loosest = std::max(loosest, (b4[i] - b32[i]) / worst_slack);
      }
      EXPECT_GT(loosest, 0.05) << "the slack bound is far from what happens: is it computed right?";
    }
}

// Non-finite summaries are read (+inf); zero keys score 0.
TEST(quest_int4_bounds, non_finite_and_zero_blocks) {
  std::vector<float> lo(8, 0.0f), hi(8, 0.0f), scales(8, 1.0f), q = {1, -2, 3, 0.5f, -1, 2, 0, 1, 2, 1, 0, 0, 1, 1, -1, 3};
  std::vector<std::uint8_t> codes(quest4_padded_dim(8));
  quest_query4 q4;
  quest_encode_query4(q.data(), 2, 8, scales.data(), q4);
  float out = -1;
  const quest_block8 zero = quest_encode_block4({lo.data(), hi.data(), nullptr}, 8, scales.data(), codes.data());
  quest_bounds4(q4, codes.data(), &zero, 1, &out);
  EXPECT_EQ(out, 0.0f);
  hi[3] = INFINITY;
  const quest_block8 inf = quest_encode_block4({lo.data(), hi.data(), nullptr}, 8, scales.data(), codes.data());
  quest_bounds4(q4, codes.data(), &inf, 1, &out);
  EXPECT_EQ(out, INFINITY);
}

// Query codes are |q| / scale rounded to the nearest integer (ties to even,
// as nearbyint), on the sign's side, the other side 0: the covering term
// relies on |error| <= 1/2. int4's folded query: the same of q_d s_d.
TEST(quest_int4_bounds, query_codes_round_to_nearest) {
  for (int hd : {40, 128}) {
    coded4_case c(hd, 5, 3, 9 * hd);
    quest_query8 q8;
    quest_encode_query(c.q.data(), c.rows, hd, q8);
    for (int folded = 0; folded < 2; ++folded) {
      const quest_query8& qq = folded ? c.q4.q : q8;
      for (int r = 0; r < c.rows; ++r)
        for (int d = 0; d < hd; ++d) {
          const float x = c.q[static_cast<std::size_t>(r) * hd + d] * (folded ? c.scales[d] : 1.0f);
          const std::size_t at = static_cast<std::size_t>(r) * qq.padded_dim + d;
          const float want = std::nearbyint(std::fabs(x) * (127 / (qq.scale[r] * 127)));
          ASSERT_EQ(x >= 0 ? qq.pos[at] : qq.neg[at], std::min(127.0f, want)) << r << " " << d;
          ASSERT_EQ(x >= 0 ? qq.neg[at] : qq.pos[at], 0) << r << " " << d;
          ASSERT_LE(std::fabs(std::fabs(x) / qq.scale[r] - (x >= 0 ? qq.pos[at] : qq.neg[at])), 0.5 + 1e-5);
        }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(levels, quest_int4_level, ::testing::ValuesIn(test::simd_levels_under_test()),
                         test::level_param_name);

}  // namespace
}  // namespace pagoda
