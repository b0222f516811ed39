// Quest: its bound is a true upper bound of the scores attention computes
// (every KV codec, every SIMD level), its SIMD bound kernels match their
// reference twin, and the selector picks what the bound says (constructed
// keys with a known answer, the exact top-k of independently computed
// bounds, sinks, unsealed and newest blocks, dead slots, the budget).
#include "policy/quest.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "attention/paged_attention.h"
#include "core/simd_levels.h"
#include "kv/kv_storage.h"
#include "quant/kv_codec_int.h"
#include "quant/kv_format_spec.h"

namespace pagoda {
namespace {

// A one-layer cache with key summaries: n_ctx tokens at positions 0..n_ctx-1,
// K ~ N(0, 1) with some channels 4x wider (as real keys have), written in
// uneven chunks; a scattered block table.
struct quest_cache {
  int n_kv_heads, head_dim, block_size, n_ctx;
  std::unique_ptr<kv_storage> kv;
  std::vector<block_id> table;
  std::vector<float> k, v;  // [n_ctx][n_kv_heads][head_dim]
  std::vector<std::int32_t> pos;

  quest_cache(const std::string& spec, int heads, int hd, int bs, int n, unsigned seed,
              const std::vector<float>* keys = nullptr)
      : n_kv_heads(heads), head_dim(hd), block_size(bs), n_ctx(n) {
    kv_pair_spec pair = *parse_kv_pair_spec(spec);
    kv_layout layout = kv_layout::uniform(1, heads, hd, bs, kv_type::f32, kv_type::f32);
    layout.k_formats[0] = pair.k.resolve(kv_role::key, false);
    layout.v_formats[0] = pair.v.resolve(kv_role::value, false);
    layout.key_summaries = true;
    const int n_blocks = (n + bs - 1) / bs;
    kv = *kv_storage::create(layout, n_blocks + 5);
    std::vector<int> ids(n_blocks + 5);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int i = 0; i < n_blocks; ++i) table.push_back(block_id(ids[i]));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    k.resize(static_cast<std::size_t>(n) * heads * hd);
    v.resize(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) * (i % hd % 7 == 3 ? 4.0f : 1.0f);
    if (keys) k = *keys;
    for (float& x : v) x = nd(rng);
    for (int p = 0; p < n;) {
      const int c = std::min(n - p, 1 + static_cast<int>(rng() % 37));
      const std::size_t at = static_cast<std::size_t>(p) * heads * hd;
      kv->write(0, table, p, c, &k[at], &v[at]);
      p += c;
    }
    pos.resize(n);
    std::iota(pos.begin(), pos.end(), 0);
  }
  paged_kv_view k_view() const { return kv->k_view(0, table, n_ctx); }
};

std::vector<float> random_queries(int rows, int hd, unsigned seed, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> q(static_cast<std::size_t>(rows) * hd);
  for (float& x : q) x = nd(rng);
  return q;
}

// --- the bound kernels against their twin -----------------------------------------

class quest_level : public ::testing::TestWithParam<simd_level> {
 protected:
  test::simd_level_guard guard_;
};

// Float sums of head_dim terms against the double reference: within 1e-5 of
// the sum of the terms' magnitudes (head_dim <= 128 roundings of 6e-8 each).
TEST_P(quest_level, bounds_match_the_reference_twin) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int hd : {8, 13, 40, 64, 100, 128})
    for (int rows : {1, 3, 4, 5, 9, 32}) {
      const int n = 37;
      std::vector<float> lo(static_cast<std::size_t>(n) * hd), hi(lo.size());
      for (std::size_t i = 0; i < lo.size(); ++i) {
        const float a = nd(rng), b = nd(rng);
        lo[i] = std::min(a, b);
        hi[i] = std::max(a, b);
      }
      std::vector<key_summary> blocks(n);
      for (int i = 0; i < n; ++i) blocks[i] = {&lo[static_cast<std::size_t>(i) * hd], &hi[static_cast<std::size_t>(i) * hd], nullptr};
      const auto q = random_queries(rows, hd, 7 + hd + rows);
      std::vector<float> got(n), want(n);
      quest_bounds(q.data(), rows, hd, blocks, got.data());
      quest_bounds_ref(q.data(), rows, hd, blocks, want.data());
      for (int i = 0; i < n; ++i) {
        double mag = 0;  // over every row: at least the winning row's
        for (int r = 0; r < rows; ++r)
          for (int d = 0; d < hd; ++d) {
            const double x = q[static_cast<std::size_t>(r) * hd + d];
            mag += std::max(std::fabs(x * blocks[i].min[d]), std::fabs(x * blocks[i].max[d]));
          }
        ASSERT_NEAR(got[i], want[i], 1e-5 * mag) << "hd " << hd << " rows " << rows << " block " << i;
      }
    }
}

// Random summaries and query groups, as codes.
struct coded_case {
  int hd, rows, n;
  std::vector<float> lo, hi, q;
  std::vector<key_summary> sums;
  std::vector<std::int8_t> codes;
  std::vector<quest_block8> blocks;
  quest_query8 q8;
  coded_case(int hd_, int rows_, int n_, unsigned seed) : hd(hd_), rows(rows_), n(n_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    lo.resize(static_cast<std::size_t>(n) * hd);
    hi.resize(lo.size());
    for (std::size_t i = 0; i < lo.size(); ++i) {
      const float a = nd(rng) * (i % 11 == 0 ? 6.0f : 1.0f), b = nd(rng);
      lo[i] = std::min(a, b);
      hi[i] = std::max(a, b);
    }
    const std::size_t per = 2 * static_cast<std::size_t>(quest_padded_dim(hd));
    codes.resize(per * n);
    for (int i = 0; i < n; ++i) {
      sums.push_back({&lo[static_cast<std::size_t>(i) * hd], &hi[static_cast<std::size_t>(i) * hd], nullptr});
      blocks.push_back(quest_encode_block(sums.back(), hd, codes.data() + per * i));
    }
    q = random_queries(rows, hd, seed + 1);
    quest_encode_query(q.data(), rows, hd, q8);
  }
};

// Integer sums are exact: every level gives the reference twin's bits.
TEST_P(quest_level, int8_bounds_equal_the_reference_twin_bitwise) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  for (int hd : {8, 40, 64, 100, 128, 160, 256})  // 64, 128, 192 and 256 padded channels
    for (int rows : {0, 1, 3, 4, 5, 9, 32}) {
      coded_case c(hd, rows, 29, 10 * hd + rows);
      // Blocks with a non-finite summary (quest_encode_block's scale +inf),
      // one among the kernels' groups of eight and one in the rest, are
      // +inf whatever their codes (here l1 makes every row's sum negative).
      c.blocks[3].scale = c.blocks[26].scale = INFINITY;
      c.blocks[3].l1 = c.blocks[26].l1 = -(1 << 24);
      std::vector<float> got(c.n), want(c.n);
      quest_bounds8(c.q8, c.codes.data(), c.blocks.data(), c.n, got.data());
      quest_bounds8_ref(c.q8, c.codes.data(), c.blocks.data(), c.n, want.data());
      for (int i = 0; i < c.n; ++i)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i]))
            << "hd " << hd << " rows " << rows << " block " << i;
    }
}

// The int8 bound is an upper bound of the f32 one (exact, in double), and
// not much looser: rounding each min and max outward moves it by at most
// block scale x sum_d |q_d|, and the query's codes by at most q scale x block
// scale x l1 (the covering term included), per row.
TEST(quest_int8_bounds, cover_the_f32_bound_and_stay_close_to_it) {
  for (int hd : {40, 128})
    for (int rows : {1, 4}) {
      coded_case c(hd, rows, 200, 3 * hd + rows);
      std::vector<float> b8(c.n), b32(c.n);
      quest_bounds8_ref(c.q8, c.codes.data(), c.blocks.data(), c.n, b8.data());
      double loosest = 0;
      for (int i = 0; i < c.n; ++i) {
        double worst_slack = 0;
        for (int r = 0; r < rows; ++r) {
          double l1q = 0;
          for (int d = 0; d < hd; ++d) l1q += std::fabs(c.q[static_cast<std::size_t>(r) * hd + d]);
          worst_slack = std::max(worst_slack, c.blocks[i].scale * (l1q + c.q8.scale[r] * c.blocks[i].l1));
        }
        quest_bounds_ref(c.q.data(), rows, hd, std::span<const key_summary>(&c.sums[i], 1), &b32[i]);
        const double tol = 1e-6 * (std::fabs(b32[i]) + worst_slack);
        ASSERT_GE(b8[i], b32[i] - tol) << "hd " << hd << " rows " << rows << " block " << i;
        ASSERT_LE(b8[i], b32[i] + worst_slack + tol) << "hd " << hd << " rows " << rows << " block " << i;
        loosest = std::max(loosest, (b8[i] - b32[i]) / worst_slack);
      }
      EXPECT_GT(loosest, 0.05) << "the slack bound is far from what happens: is it computed right?";
    }
  // Non-finite summaries and zero keys.
  std::vector<float> lo(8, 0.0f), hi(8, 0.0f), q = random_queries(2, 8, 1);
  std::vector<std::int8_t> codes(2 * 64);
  quest_query8 q8;
  quest_encode_query(q.data(), 2, 8, q8);
  float out = -1;
  quest_block8 zero = quest_encode_block({lo.data(), hi.data(), nullptr}, 8, codes.data());
  quest_bounds8(q8, codes.data(), &zero, 1, &out);
  EXPECT_EQ(out, 0.0f);
  hi[3] = INFINITY;
  quest_block8 inf = quest_encode_block({lo.data(), hi.data(), nullptr}, 8, codes.data());
  quest_bounds8(q8, codes.data(), &inf, 1, &out);
  EXPECT_EQ(out, INFINITY);
}

// Block codes round outward and by less than one step: scale x code_lo <=
// min < scale x (code_lo + 1), scale x (code_hi - 1) < max <= scale x code_hi
// (in double, where a float times a small integer is exact), |codes| <= 127,
// and l1 is their sum of magnitudes; padding is zero.
TEST(quest_int8_bounds, block_codes_round_outward_by_less_than_a_step) {
  for (int hd : {8, 40, 128}) {
    coded_case c(hd, 1, 300, 7 * hd);
    const int pd = quest_padded_dim(hd);
    for (int i = 0; i < c.n; ++i) {
      const std::int8_t* lo = c.codes.data() + static_cast<std::size_t>(i) * 2 * pd;
      const std::int8_t* hi = lo + pd;
      const double sc = c.blocks[i].scale;
      std::int32_t l1 = 0;
      for (int d = 0; d < pd; ++d) {
        l1 += std::abs(lo[d]) + std::abs(hi[d]);
        if (d >= hd) {
          ASSERT_EQ(lo[d], 0);
          ASSERT_EQ(hi[d], 0);
          continue;
        }
        const double mn = c.sums[i].min[d], mx = c.sums[i].max[d];
        ASSERT_LE(sc * lo[d], mn) << i << " " << d;
        ASSERT_GT(sc * (lo[d] + 1), mn) << i << " " << d;
        ASSERT_GE(sc * hi[d], mx) << i << " " << d;
        ASSERT_LT(sc * (hi[d] - 1), mx) << i << " " << d;
        ASSERT_LE(std::abs(lo[d]), 127);
        ASSERT_LE(std::abs(hi[d]), 127);
      }
      ASSERT_EQ(l1, c.blocks[i].l1);
    }
  }
}

// The covering term: with block codes that are exact (no outward slack) and
// query channels that round down by 0.49 of a step, the int8 bound still
// covers sum_d q_d x max_d; without the l1 / 2 term it would fall short by
// about 0.49 x 100 per channel.
TEST_P(quest_level, int8_bound_covers_the_query_rounding) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int hd = 64, pd = quest_padded_dim(hd);
  std::vector<float> q(hd, 50.49f);
  q[0] = 127.0f;  // scale 1: the others are 50.49 steps, coded 50
  quest_query8 q8;
  quest_encode_query(q.data(), 1, hd, q8);
  ASSERT_EQ(q8.scale[0], 1.0f);
  ASSERT_EQ(q8.pos[1], 50);
  std::vector<std::int8_t> codes(2 * pd, 0);
  for (int d = 0; d < hd; ++d) {
    codes[d] = -100;
    codes[pd + d] = 100;
  }
  const quest_block8 b{1.0f, 200 * hd};
  float bound = 0;
  quest_bounds8(q8, codes.data(), &b, 1, &bound);
  double exact = 0;  // the f32 bound of a block whose min and max are -100 and 100
  for (int d = 0; d < hd; ++d) exact += 100.0 * q[d];
  EXPECT_GE(bound, exact * (1 - 1e-7));
  EXPECT_LT(bound, exact + 0.51 * 200 * hd) << "the covering term is l1 / 2 steps";
}

// The PROPERTY: for every KV codec, every sealed block's bound (from the key
// summaries kv_storage keeps, over its keys as decoded) is at least every
// score the codec's qk computes for that block, per query row:
//   - against qk_ref (exact float arithmetic on the decoded keys), up to the
//     float rounding of two sums of head_dim terms: 1e-5 x S, where S =
//     sum_d |q_d| max(|min_d|, |max_d|);
//   - against the dispatched qk at every level, up to that plus the error of
//     the AVX-512 integer kernels' rounded query (kv_codec_int.h,
//     operand_error): at most e x max_d(|x_d| s_d) x sum_d |u_d| for codes u
//     with scales s, e = 1/254 for 4/2-bit keys with per-token or group scales
//     (x = q), 1/(127 x 508) for the other integer keys. With per-token scales
//     s |u_d| is |k_d - offset| <= max(|k_d|, k_d - min_d' k_d') (the token's
//     decoded key); with per-channel scales (x = q s) it is at most the
//     channel's range, so the term is at most e x max|q| x head_dim x max range.
// The int8 and int4 bounds (quest_bounds8 / quest_bounds4, from codes of the
// same summaries; int4 with another block's channel scales) are held to the
// same tolerances: in exact arithmetic they are at least the f32 bound.
// Queries: random rows, and rows along a token's decoded key (whose score
// then nearly reaches the bound: a bound that dropped a channel's term fails).
// And the bound is not vacuous: it exceeds every exact score by at most
// sum_d |q_d| (max_d - min_d) (each channel's term exceeds q_d k_d by at most
// |q_d| times the channel's range), plus the same rounding.
class quest_bound_property : public ::testing::TestWithParam<std::tuple<const char*, simd_level>> {
 protected:
  test::simd_level_guard guard_;
};

TEST_P(quest_bound_property, bound_is_at_least_every_score) {
  const auto [spec, level] = GetParam();
  PAGODA_USE_SIMD_LEVEL(level);
  const int H = 2, D = 64, B = 16, N = 16 * 12 + 5, R = 6;
  quest_cache c(spec, H, D, B, N, 11);
  const paged_kv_view kview = c.k_view();
  const kv_format kf = kview.format;
  const bool int_key = kf.type == kv_type::int8 || kf.type == kv_type::int4 || kf.type == kv_type::int2;
  const bool folded = kf.scale_mode == kv_scale_mode::per_channel || kf.scale_mode == kv_scale_mode::static_scales;
  // AVX2 rounds the query of these keys too (int_kv::avx2_operand_error: int16,
  // or int8 for 4/2-bit keys with per-token or group scales; 0 for folded keys).
  const double e = !int_key ? 0.0
                   : level == simd_level::avx512
                       ? (kf.type != kv_type::int8 && !folded ? 1.0 / 254 : 1.0 / (127.0 * 508))
                   : level == simd_level::avx2 ? int_kv::avx2_operand_error(int_kv::layout_of(kf, kview.shape), kview.shape)
                                               : 0.0;
  int n_checked = 0;
  for (int h = 0; h < H; ++h)
    for (int b = 0; b < N / B; ++b) {
      auto sum = c.kv->key_summary_of(c.table[b], 0, h);
      ASSERT_TRUE(sum.has_value()) << spec << " block " << b;
      const void* tile = kview.tile(b, h);
      std::vector<float> keys(static_cast<std::size_t>(B) * D);
      kview.codec->decode(kview.format, kview.shape, kview.params(h), tile, 0, B, keys.data());
      auto q = random_queries(R, D, 100 * h + b, 1.5f);
      for (int r = 0; r < 3; ++r)  // rows 0..2 along the keys of tokens 0, 7 and 15
        std::copy_n(&keys[static_cast<std::size_t>(r * 7 + r / 2) * D], D, &q[static_cast<std::size_t>(r) * D]);
      std::vector<float> fast(static_cast<std::size_t>(R) * B), exact(fast.size());
      kview.codec->qk(kview.format, kview.shape, kview.params(h), &tile, B, q.data(), R, fast.data(), B);
      kview.codec->qk_ref(kview.format, kview.shape, kview.params(h), &tile, B, q.data(), R, exact.data(), B);
      double max_range = 0;
      for (int d = 0; d < D; ++d) max_range = std::max(max_range, static_cast<double>(sum->max[d]) - sum->min[d]);
      for (int r = 0; r < R; ++r) {
        const float* qr = q.data() + static_cast<std::size_t>(r) * D;
        float bound = 0, bound8 = 0;
        quest_bounds(qr, 1, D, std::span<const key_summary>(&*sum, 1), &bound);
        quest_query8 q8;
        quest_encode_query(qr, 1, D, q8);
        std::vector<std::int8_t> codes(2 * static_cast<std::size_t>(quest_padded_dim(D)));
        const quest_block8 b8 = quest_encode_block(*sum, D, codes.data());
        quest_bounds8(q8, codes.data(), &b8, 1, &bound8);
        // int4, with the channel scales of another block (codes outside them are still outward).
        float bound4 = 0;
        std::vector<float> scales(D);
        const key_summary other = *c.kv->key_summary_of(c.table[(b + 1) % (N / B)], 0, h);
        quest_channel_scales(std::span<const key_summary>(&other, 1), D, scales.data());
        quest_query4 q4;
        quest_encode_query4(qr, 1, D, scales.data(), q4);
        std::vector<std::uint8_t> codes4(quest4_padded_dim(D));
        const quest_block8 b4 = quest_encode_block4(*sum, D, scales.data(), codes4.data());
        quest_bounds4(q4, codes4.data(), &b4, 1, &bound4);
        double S = 0, qmax = 0, spread = 0;
        for (int d = 0; d < D; ++d) {
          S += std::fabs(qr[d]) * std::max(std::fabs(sum->min[d]), std::fabs(sum->max[d]));
          spread += std::fabs(qr[d]) * (static_cast<double>(sum->max[d]) - sum->min[d]);
          qmax = std::max(qmax, static_cast<double>(std::fabs(qr[d])));
        }
        const double tol = 1e-5 * S;
        for (int t = 0; t < B; ++t) {
          const float* kt = &keys[static_cast<std::size_t>(t) * D];
          double su = 0;  // sum_d s |u_d| bound for this token
          if (folded) {
            su = D * max_range;
          } else {
            const float kmin = *std::min_element(kt, kt + D);
            for (int d = 0; d < D; ++d) su += std::max(std::fabs(kt[d]), kt[d] - kmin);
          }
          const double tol_fast = tol + e * qmax * su;
          const std::size_t at = static_cast<std::size_t>(r) * B + t;
          ASSERT_LE(exact[at], bound + tol) << spec << " block " << b << " row " << r << " token " << t;
          ASSERT_LE(fast[at], bound + tol_fast) << spec << " block " << b << " row " << r << " token " << t;
          ASSERT_LE(exact[at], bound8 + tol) << spec << " int8 bound, block " << b << " row " << r << " token " << t;
          ASSERT_LE(fast[at], bound8 + tol_fast) << spec << " int8 bound, block " << b << " row " << r << " token " << t;
          ASSERT_LE(exact[at], bound4 + tol) << spec << " int4 bound, block " << b << " row " << r << " token " << t;
          ASSERT_LE(fast[at], bound4 + tol_fast) << spec << " int4 bound, block " << b << " row " << r << " token " << t;
          ASSERT_GE(exact[at], bound - spread - tol) << spec << " block " << b << " row " << r << " token " << t;
          ++n_checked;
        }
      }
    }
  EXPECT_EQ(n_checked, H * (N / B) * R * B);
}

// The partial selection agrees with std::nth_element for every k, on random
// values (the sampled threshold), monotone runs (where a stride sample sees
// only one side), many ties, and short inputs (the plain path).
TEST(quest_kth_largest_test, equals_nth_element) {
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> scratch;
  int n_cases = 0;
  for (int n : {1, 7, 511, 512, 2048, 3001})
    for (int kind = 0; kind < 4; ++kind) {
      std::vector<float> x(n);
      for (int i = 0; i < n; ++i)
        x[i] = kind == 0 ? nd(rng) : kind == 1 ? static_cast<float>(i) : kind == 2 ? static_cast<float>(-i)
                                                                                    : std::round(nd(rng) * 2);
      for (int k = 1; k <= n; k += std::max(1, n / 97)) {
        std::vector<float> want(x);
        std::nth_element(want.begin(), want.begin() + (k - 1), want.end(), std::greater<float>());
        ASSERT_EQ(quest_kth_largest(x, k, scratch), want[k - 1]) << "n " << n << " kind " << kind << " k " << k;
        ++n_cases;
      }
    }
  EXPECT_GT(n_cases, 1000);
}

// --- the selector -------------------------------------------------------------------

// A decode query over the whole cache, for KV head h: n_rows = n_tokens x n_rep rows.
kv_select_query make_query(const quest_cache& c, const paged_kv_view& k, int h, const std::vector<float>& q,
                           int n_rep, std::span<const std::int32_t> kv_pos, std::span<const std::int32_t> q_pos) {
  kv_select_query s;
  s.layer = 0;
  s.kv_head = h;
  s.k = &k;
  s.kv = c.kv.get();
  s.kv_pos = kv_pos;
  s.n_kv = c.n_ctx;
  s.q = q.data();
  s.n_rep = n_rep;
  s.n_rows = static_cast<int>(q_pos.size()) * n_rep;
  s.head_dim = c.head_dim;
  s.q_pos = q_pos;
  return s;
}

// The blocks that ranges cover, checking they are sorted, disjoint, non-empty,
// block-aligned at their start and end (or ending at n_kv).
std::vector<int> blocks_of(const std::vector<slot_range>& ranges, int bs, int n_kv) {
  std::vector<int> blocks;
  int end = -1;
  for (const slot_range& r : ranges) {
    EXPECT_GT(r.begin, end) << "ranges must be sorted, disjoint and merged";
    EXPECT_LT(r.begin, r.end);
    EXPECT_EQ(r.begin % bs, 0);
    EXPECT_TRUE(r.end % bs == 0 || r.end == n_kv) << r.end;
    EXPECT_LE(r.end, n_kv);
    for (int b = r.begin / bs; b * bs < r.end; ++b) blocks.push_back(b);
    end = r.end;
  }
  return blocks;
}

kv_policy_spec quest_spec(std::vector<std::pair<std::string, std::string>> params) {
  kv_policy_spec s;
  s.name = "quest";
  s.params = std::move(params);
  return s;
}

quest_params params_of(std::vector<std::pair<std::string, std::string>> kv) {
  auto p = parse_quest_params(quest_spec(std::move(kv)));
  EXPECT_TRUE(p.ok()) << p.error().message();
  return *p;
}

// A selector for one cache with these parameters and bounds=mode.
quest_selector selector_for(const quest_cache& c, std::vector<std::pair<std::string, std::string>> kv, const char* mode) {
  kv.emplace_back("bounds", mode);
  return quest_selector(params_of(std::move(kv)), 1, c.n_kv_heads, c.head_dim);
}

constexpr const char* k_modes[] = {"int8", "int4", "f32"};

// Known answer: small random keys, and in one block a key along q (for one
// query row of the GQA group): with room for one block beyond the sink block
// and the newest, that block is the one read.
TEST_P(quest_level, picks_the_block_holding_the_key_most_aligned_with_q) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int H = 2, D = 64, B = 16, N = 64 * B, R = 4;
  for (const char* mode : k_modes)
    for (int hot_row : {0, 2})
      for (int hot_block : {5, 37, 62}) {
        auto q = random_queries(R, D, 77 + hot_row);
        std::vector<float> keys(static_cast<std::size_t>(N) * H * D);
        std::mt19937 rng(9);
        std::normal_distribution<float> nd(0.0f, 0.3f);
        for (float& x : keys) x = nd(rng);
        const int hot_slot = hot_block * B + 5, h = 1;
        const float* qh = q.data() + static_cast<std::size_t>(hot_row) * D;
        double norm = 0;
        for (int d = 0; d < D; ++d) norm += qh[d] * qh[d];
        for (int d = 0; d < D; ++d) keys[(static_cast<std::size_t>(hot_slot) * H + h) * D + d] = 10.0f * qh[d] / std::sqrt(norm);
        quest_cache c("f32", H, D, B, N, 5, &keys);
        const paged_kv_view k = c.k_view();
        const std::int32_t q_pos = N;
        quest_selector sel = selector_for(c, {{"pages", "3"}, {"sinks", "16"}}, mode);
        std::vector<slot_range> out;
        ASSERT_TRUE(sel.select(make_query(c, k, h, q, R, c.pos, {&q_pos, 1}), out));
        EXPECT_EQ(blocks_of(out, B, N), (std::vector<int>{0, hot_block, 63})) << mode << " row " << hot_row;
      }
}

// Sinks (in tokens, rounded up to blocks), the unsealed last block and the
// newest block are always read; the budget's count is exact; and the blocks
// chosen beyond them are the top-k of bounds recomputed independently from
// the backend's summaries: int8 and int4 bounds exactly (the reference twins'
// integer sums; int4 with the channel scales of every ceil(n / 64)-th of
// the n blocks sealed, as the selector takes them when a row has doubled
// since its scales were made), f32 bounds in double up
// to float rounding of near ties. 63 blocks (the partial selection's plain
// path) and 1025 (its sampled threshold).
TEST_P(quest_level, reads_sinks_and_newest_and_the_exact_top_k) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int H = 2, D = 128, B = 16, R = 4;
  for (const int N : {1000, 1024 * B + 8}) {  // the last block holds 8 tokens
    const int n_blocks = (N + B - 1) / B, last = n_blocks - 1;
    const int n_read = (n_blocks + 7) / 8, k = n_read - 4;
    quest_cache c("int8", H, D, B, N, 21);
    const paged_kv_view kv = c.k_view();
    const std::int32_t q_pos = N;
    for (const char* mode : k_modes) {
      const std::string m = mode;
      quest_selector sel = selector_for(c, {{"budget", "12.5%"}, {"sinks", "40"}, {"min_context", "0"}}, mode);
      for (int h = 0; h < H; ++h) {
        const auto q = random_queries(R, D, 300 + h);
        std::vector<slot_range> out;
        // First a step over the first 20 blocks: int8 codes are then extended,
        // int4 ones remade with scales from the whole row (it has more than doubled).
        const int prefix = 20 * B + 3;
        const paged_kv_view kv_prefix = c.kv->k_view(0, c.table, prefix);
        kv_select_query early = make_query(c, kv_prefix, h, q, R, c.pos, {&q_pos, 1});
        early.n_kv = prefix;
        sel.select(early, out);
        ASSERT_TRUE(sel.select(make_query(c, kv, h, q, R, c.pos, {&q_pos, 1}), out));
        const auto blocks = blocks_of(out, B, N);
        ASSERT_EQ(static_cast<int>(blocks.size()), n_read);
        EXPECT_EQ(out.back().end, N);
        for (int b : {0, 1, 2, last}) EXPECT_TRUE(std::count(blocks.begin(), blocks.end(), b)) << "block " << b;
        // The other k: the top k of blocks 3..last-1 by bound.
        quest_query8 q8;
        quest_encode_query(q.data(), R, D, q8);
        std::vector<key_summary> sums;
        for (int b = 0; b < last; ++b) sums.push_back(*c.kv->key_summary_of(c.table[b], 0, h));
        std::vector<key_summary> sample;
        for (std::size_t i = 0; i < sums.size(); i += (sums.size() + 63) / 64) sample.push_back(sums[i]);
        std::vector<float> scales(D);
        quest_channel_scales(sample, D, scales.data());
        quest_query4 q4;
        quest_encode_query4(q.data(), R, D, scales.data(), q4);
        std::vector<std::int8_t> codes(2 * static_cast<std::size_t>(quest_padded_dim(D)));
        std::vector<std::uint8_t> codes4(quest4_padded_dim(D));
        std::vector<std::pair<float, int>> ranked;
        for (int b = 3; b < last; ++b) {
          float bound = 0;
          if (m == "int8") {
            const quest_block8 b8 = quest_encode_block(sums[b], D, codes.data());
            quest_bounds8_ref(q8, codes.data(), &b8, 1, &bound);
          } else if (m == "int4") {
            const quest_block8 b4 = quest_encode_block4(sums[b], D, scales.data(), codes4.data());
            quest_bounds4_ref(q4, codes4.data(), &b4, 1, &bound);
          } else {
            quest_bounds_ref(q.data(), R, D, std::span<const key_summary>(&sums[b], 1), &bound);
          }
          ranked.push_back({bound, -b});  // ties to the older block
        }
        std::sort(ranked.rbegin(), ranked.rend());
        std::vector<int> want = {0, 1, 2, last};
        for (int i = 0; i < k; ++i) want.push_back(-ranked[i].second);
        std::sort(want.begin(), want.end());
        if (m != "f32") {
          EXPECT_EQ(blocks, want) << m << " head " << h << " N " << N;
        } else {
          const float kth = ranked[k - 1].first;
          for (int b : blocks) {
            if (b <= 2 || b == last) continue;
            const auto it = std::find_if(ranked.begin(), ranked.end(), [&](auto& x) { return x.second == -b; });
            EXPECT_GE(it->first, kth - 1e-4f * std::fabs(kth)) << "block " << b << " is not among the top " << k;
          }
        }
      }
    }
  }
}

// Every block holds the same keys, so every candidate's bound is the same:
// the k chosen are the oldest candidates, and no more (the selection takes
// ties in block order, up to the budget). 300 and 1025 blocks: the partial
// selection's plain path and its sampled threshold; every SIMD level.
TEST_P(quest_level, tied_bounds_choose_the_oldest_candidates) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int H = 1, D = 64, B = 16, R = 4;
  for (const int n_blocks : {300, 1025}) {
    const int N = n_blocks * B;
    std::vector<float> keys(static_cast<std::size_t>(N) * H * D);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int t = 0; t < B; ++t)
      for (int d = 0; d < D; ++d) keys[static_cast<std::size_t>(t) * D + d] = nd(rng);
    for (std::size_t i = static_cast<std::size_t>(B) * D; i < keys.size(); ++i) keys[i] = keys[i % (B * D)];
    quest_cache c("f16", H, D, B, N, 8, &keys);
    const paged_kv_view kv = c.k_view();
    const std::int32_t q_pos = N;
    const auto q = random_queries(R, D, 9);
    const int n_read = (n_blocks + 7) / 8, k = n_read - 2;  // sink block 0 and the newest block besides
    for (const char* mode : k_modes) {
      quest_selector sel = selector_for(c, {{"budget", "12.5%"}, {"sinks", "16"}, {"min_context", "0"}}, mode);
      std::vector<slot_range> out;
      ASSERT_TRUE(sel.select(make_query(c, kv, 0, q, R, c.pos, {&q_pos, 1}), out));
      std::vector<int> want = {0};
      for (int b = 1; b <= k; ++b) want.push_back(b);
      want.push_back(n_blocks - 1);
      EXPECT_EQ(blocks_of(out, B, N), want) << mode << " " << n_blocks << " blocks";
    }
  }
}

// Dead slots lead a row (an evicting policy underneath): the sinks are the
// first live slots, and blocks holding only dead slots are not read.
TEST(quest_selector_test, sinks_are_the_first_live_slots) {
  const int H = 1, D = 32, B = 16, N = 640;
  quest_cache c("f16", H, D, B, N, 31);
  const paged_kv_view k = c.k_view();
  std::vector<std::int32_t> kv_pos = c.pos;
  for (int p = 0; p < 70; ++p) kv_pos[p] = -1;
  const std::int32_t q_pos = N;
  const auto q = random_queries(4, D, 8);
  for (const char* mode : k_modes) {
    quest_selector sel = selector_for(c, {{"pages", "6"}, {"sinks", "16"}, {"min_context", "0"}}, mode);
    std::vector<slot_range> out;
    ASSERT_TRUE(sel.select(make_query(c, k, 0, q, 4, kv_pos, {&q_pos, 1}), out));
    const auto blocks = blocks_of(out, B, N);
    EXPECT_EQ(blocks.size(), 6u);
    EXPECT_EQ(blocks[0], 4) << mode;  // slots 64..79: the first live slot is 70
    EXPECT_EQ(blocks[1], 5) << mode;  // 70 + 16 sink tokens end in block 5
    EXPECT_EQ(blocks.back(), N / B - 1);
  }
}

// Everything is read (select returns false) for prompt chunks, short
// contexts, budgets that cover every block, and without a backend.
TEST(quest_selector_test, reads_everything_where_selection_does_not_apply) {
  const int H = 1, D = 32, B = 16, N = 512;
  quest_cache c("f32", H, D, B, N, 2);
  const paged_kv_view k = c.k_view();
  const auto q = random_queries(4 * 9, D, 1);
  std::vector<std::int32_t> q_pos(9);
  std::iota(q_pos.begin(), q_pos.end(), N - 9);
  const auto decode = std::span<const std::int32_t>(q_pos).last(1);
  EXPECT_EQ(quest_params{}.min_context_tokens(B), (2 + 4) * 8 * B);
  for (const char* mode : k_modes) {
    std::vector<slot_range> out;
    quest_selector auto_min = selector_for(c, {}, mode);  // 0.125 of 32 blocks: below the automatic minimum
    EXPECT_FALSE(auto_min.select(make_query(c, k, 0, q, 4, c.pos, decode), out));
    quest_selector sel = selector_for(c, {{"budget", "0.25"}, {"min_context", "0"}}, mode);
    EXPECT_TRUE(sel.select(make_query(c, k, 0, q, 4, c.pos, decode), out));
    EXPECT_EQ(blocks_of(out, B, N).size(), 8u);
    EXPECT_TRUE(sel.select(make_query(c, k, 0, q, 4, c.pos, std::span<const std::int32_t>(q_pos).last(8)), out));
    EXPECT_FALSE(sel.select(make_query(c, k, 0, q, 4, c.pos, q_pos), out)) << "a 9-token chunk";
    kv_select_query no_backend = make_query(c, k, 0, q, 4, c.pos, decode);
    no_backend.kv = nullptr;
    EXPECT_FALSE(sel.select(no_backend, out));
    quest_selector all = selector_for(c, {{"pages", "32"}}, mode);
    EXPECT_FALSE(all.select(make_query(c, k, 0, q, 4, c.pos, decode), out));
    quest_selector whole = selector_for(c, {{"budget", "1"}, {"min_context", "0"}}, mode);
    EXPECT_FALSE(whole.select(make_query(c, k, 0, q, 4, c.pos, decode), out));
    quest_selector big_min = selector_for(c, {{"budget", "0.25"}, {"min_context", "513"}}, mode);
    EXPECT_FALSE(big_min.select(make_query(c, k, 0, q, 4, c.pos, decode), out));
  }
  // A layout without key summaries: no block has a bound, everything is read.
  kv_layout layout = kv_layout::uniform(1, H, D, B, kv_type::f16, kv_type::f16);
  auto bare = *kv_storage::create(layout, N / B);
  std::vector<block_id> table;
  for (int b = 0; b < N / B; ++b) table.push_back(block_id(b));
  bare->write(0, table, 0, N, c.k.data(), c.v.data());
  const paged_kv_view bare_k = bare->k_view(0, table, N);
  kv_select_query no_summaries = make_query(c, bare_k, 0, q, 4, c.pos, decode);
  no_summaries.kv = bare.get();
  std::vector<slot_range> out;
  EXPECT_FALSE(selector_for(c, {{"budget", "0.25"}, {"min_context", "0"}}, "int8").select(no_summaries, out));
}

// select() runs concurrently for the heads of a layer: two threads selecting
// the same heads over and over get what one thread gets.
TEST(quest_selector_test, concurrent_selects_agree_with_sequential_ones) {
  const int H = 8, D = 64, B = 16, N = 2048;
  quest_cache c("f16", H, D, B, N, 4);
  const paged_kv_view k = c.k_view();
  const std::int32_t q_pos = N;
  std::vector<std::vector<float>> qs;
  for (int h = 0; h < H; ++h) qs.push_back(random_queries(4, D, 50 + h));
  for (const char* mode : k_modes) {
    std::vector<std::vector<slot_range>> want(H);
    {
      quest_selector ref = selector_for(c, {{"budget", "0.1"}}, mode);
      for (int h = 0; h < H; ++h) ASSERT_TRUE(ref.select(make_query(c, k, h, qs[h], 4, c.pos, {&q_pos, 1}), want[h]));
    }
    quest_selector sel = selector_for(c, {{"budget", "0.1"}}, mode);  // fresh: the threads fill its codes
    std::vector<int> mismatches(2, 0);
    auto work = [&](int t) {
      std::vector<slot_range> out;
      for (int round = 0; round < 50; ++round)
        for (int h = t; h < H; h += 2) {
          sel.select(make_query(c, k, h, qs[h], 4, c.pos, {&q_pos, 1}), out);
          mismatches[t] += out != want[h];
        }
    };
    std::thread a(work, 0), b(work, 1);
    a.join();
    b.join();
    EXPECT_EQ(mismatches[0] + mismatches[1], 0) << mode;
  }
}

// The int8 codes a selector keeps follow the table: a block replaced in the
// table (copy-on-write, a new block id) is re-read at once, and after a
// rollback announced by on_slots_changed the rewritten blocks are re-read.
// Each time a key along q is planted and must be the block chosen.
TEST(quest_selector_test, int8_codes_follow_replaced_and_rewritten_blocks) {
  const int H = 1, D = 64, B = 16, N = 40 * B, R = 4;
  quest_cache c("f16", H, D, B, N, 12);
  const auto q = random_queries(R, D, 3);
  const std::int32_t q_pos = N;
  quest_selector sel = selector_for(c, {{"pages", "3"}, {"sinks", "16"}}, "int8");
  std::vector<slot_range> out;
  auto chosen = [&](const std::vector<block_id>& table) {
    const paged_kv_view k = c.kv->k_view(0, table, N);
    EXPECT_TRUE(sel.select(make_query(c, k, 0, q, R, c.pos, {&q_pos, 1}), out));
    const auto blocks = blocks_of(out, B, N);
    EXPECT_EQ(blocks.size(), 3u);
    return blocks.size() == 3 ? blocks[1] : -1;
  };
  const int first = chosen(c.table);
  EXPECT_GT(sel.memory_bytes(), static_cast<std::size_t>(N / B - 1) * 2 * quest_padded_dim(D));
  // A block of keys along row 0 of q, far above the others' bounds.
  std::vector<float> hot(static_cast<std::size_t>(B) * D), vals(hot.size(), 0.0f);
  double norm = 0;
  for (int d = 0; d < D; ++d) norm += q[d] * q[d];
  for (int t = 0; t < B; ++t)
    for (int d = 0; d < D; ++d) hot[static_cast<std::size_t>(t) * D + d] = 60.0f * q[d] / std::sqrt(norm);
  // Replace block 17 by a spare block (another id) holding the hot keys.
  std::vector<block_id> table = c.table;
  block_id spare(0);
  while (std::find(table.begin(), table.end(), spare) != table.end()) spare = block_id(spare.value + 1);
  std::vector<block_id> one = {spare};
  c.kv->write(0, one, 0, B, hot.data(), vals.data());
  table[17] = spare;
  EXPECT_EQ(chosen(table), 17) << "first choice was " << first;
  // A rollback to block 25 (announced), which is rewritten in place (same id) with hot keys.
  sel.on_slots_changed(25 * B, true);
  c.kv->truncate_block(table[25], 0);
  std::vector<block_id> head(table.begin(), table.begin() + 26);
  c.kv->write(0, head, 25 * B, B, hot.data(), vals.data());
  c.kv->truncate_block(table[17], 0);  // and make block 17 cold again
  std::vector<float> cold(hot.size(), 0.0f);
  std::vector<block_id> b17(table.begin(), table.begin() + 18);
  c.kv->write(0, b17, 17 * B, B, cold.data(), vals.data());
  sel.on_slots_changed(17 * B, true);
  EXPECT_EQ(chosen(table), 25);
  sel.on_slots_changed(0, false);
  EXPECT_GE(sel.memory_bytes(), static_cast<std::size_t>(N / B - 1) * 2 * quest_padded_dim(D))
      << "capacity is kept for reuse";
  EXPECT_EQ(chosen(table), 25);
}

// End to end with attention: when the attention mass sits in a few blocks
// (a key along each query row there, scores ~40 above the rest), attention
// over Quest's ranges equals full attention within 1e-5, while reading a
// quarter of the blocks.
TEST(quest_selector_test, attention_over_the_selection_matches_full_attention_when_mass_is_concentrated) {
  const int H = 1, R = 4, D = 64, B = 16, N = 64 * B;
  const auto q = random_queries(R, D, 5);
  std::vector<float> keys(static_cast<std::size_t>(N) * H * D);
  std::mt19937 rng(6);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  for (float& x : keys) x = nd(rng);
  // Each query row has a key of its own along it (score 40 |q_r| / sqrt(D), ~40).
  const int hot[R] = {100, 517, 900, 101};
  for (int r = 0; r < R; ++r) {
    const float* qr = q.data() + static_cast<std::size_t>(r) * D;
    double norm = 0;
    for (int d = 0; d < D; ++d) norm += qr[d] * qr[d];
    for (int d = 0; d < D; ++d) keys[static_cast<std::size_t>(hot[r]) * D + d] = 40.0f * qr[d] / std::sqrt(norm);
  }
  quest_cache c("f32", H, D, B, N, 8, &keys);
  const paged_kv_view k = c.k_view(), v = c.kv->v_view(0, c.table, N);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> scaled(q);
  for (float& x : scaled) x *= scale;
  const std::int32_t q_pos = N;
  for (const char* mode : k_modes) {
    quest_selector sel = selector_for(c, {{"budget", "0.25"}}, mode);
    std::vector<slot_range> ranges;
    ASSERT_TRUE(sel.select(make_query(c, k, 0, scaled, R, c.pos, {&q_pos, 1}), ranges));
    EXPECT_EQ(blocks_of(ranges, B, N).size(), 16u);
    std::vector<float> full(static_cast<std::size_t>(R) * D), sparse(full.size());
    attention_scratch scratch;
    for (bool with_ranges : {false, true}) {
      attention_task t;
      t.k = &k;
      t.v = &v;
      t.n_rep = R;
      t.head_dim = D;
      t.scale = scale;
      t.q = q.data();
      t.q_stride = static_cast<std::size_t>(R) * D;
      t.n_tokens = 1;
      t.q_pos = &q_pos;
      t.kv_pos = c.pos.data();
      t.n_kv = N;
      t.out = with_ranges ? sparse.data() : full.data();
      t.out_stride = t.q_stride;
      if (with_ranges) t.ranges = ranges;
      paged_attention(t, scratch);
    }
    for (std::size_t i = 0; i < full.size(); ++i) ASSERT_NEAR(sparse[i], full[i], 1e-5) << mode << " " << i;
  }
}

// --- parameters and the policy ----------------------------------------------------------

TEST(quest_params_test, parses_and_rejects) {
  const quest_params d = params_of({});
  EXPECT_DOUBLE_EQ(d.budget, 0.125);
  EXPECT_EQ(d.pages, 0);
  EXPECT_EQ(d.sinks, 16);
  EXPECT_EQ(d.blocks_read(2048), 256);
  EXPECT_EQ(d.blocks_read(63), 8);
  EXPECT_EQ(d.blocks_read(3), 1);
  EXPECT_DOUBLE_EQ(params_of({{"budget", "25%"}}).budget, 0.25);
  EXPECT_DOUBLE_EQ(params_of({{"budget", "0.5"}}).budget, 0.5);
  EXPECT_EQ(params_of({{"pages", "40"}}).blocks_read(2048), 40);
  EXPECT_EQ(params_of({{"pages", "40"}}).min_context_tokens(16), 0);
  EXPECT_EQ(params_of({{"sinks", "0"}, {"min_context", "100"}}).min_context_tokens(16), 100);
  EXPECT_EQ(params_of({{"budget", "1e-300"}}).min_context_tokens(16), INT32_MAX);  // no overflow
  for (auto [key, value, says] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"budget", "0", "(0, 1]"},
           {"budget", "1.5", "pages=N"},
           {"budget", "abc", "fraction"},
           {"budget", "", "fraction"},
           {"pages", "0", ">= 1"},
           {"sinks", "-1", ">= 0"},
           {"sinks", "4x", "whole number"},
           {"bounds", "f16", "int8, int4 or f32"},
           {"bounds", "int2", "int8, int4 or f32"},
           {"topk", "3", "unknown parameter 'topk'"}}) {
    auto p = parse_quest_params(quest_spec({{key, value}}));
    ASSERT_FALSE(p.ok()) << key << "=" << value;
    EXPECT_NE(p.error().message().find(says), std::string::npos) << p.error().message();
    EXPECT_FALSE(make_quest_policy(quest_spec({{key, value}})).ok());
  }
}

TEST(quest_params_test, the_policy_needs_summaries_evicts_nothing_and_makes_selectors) {
  auto p = make_quest_policy(quest_spec({{"budget", "0.25"}}));
  ASSERT_TRUE(p.ok()) << p.error().message();
  EXPECT_TRUE((*p)->needs().key_summaries);
  EXPECT_FALSE((*p)->needs().totals);
  EXPECT_FALSE((*p)->lossy());
  EXPECT_TRUE((*p)->evict(eviction_input{}).empty());
  EXPECT_EQ((*p)->spec().name, "quest");
  EXPECT_NE((*p)->make_selector(2, 8, 128), nullptr);
  EXPECT_EQ(params_of({{"bounds", "f32"}}).bounds, quest_bounds_kind::f32);
  EXPECT_EQ(params_of({{"bounds", "int4"}}).bounds, quest_bounds_kind::int4);
  EXPECT_EQ(params_of({}).bounds, quest_bounds_kind::int8);
}

INSTANTIATE_TEST_SUITE_P(codecs, quest_bound_property,
                         ::testing::Combine(::testing::Values("f32", "f16", "bf16", "fp8", "fp8_e5m2", "int8",
                                                              "int8/channel", "int4", "int4/token", "int4/g32", "int2",
                                                              "int2/token", "q8_0", "q4_0"),
                                            ::testing::ValuesIn(test::simd_levels_under_test())),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param);
                           for (char& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n + "_" + simd_level_name(std::get<1>(info.param));
                         });

INSTANTIATE_TEST_SUITE_P(levels, quest_level, ::testing::ValuesIn(test::simd_levels_under_test()),
                         test::level_param_name);

}  // namespace
}  // namespace pagoda
