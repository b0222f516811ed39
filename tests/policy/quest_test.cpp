// Quest: its bound is a true upper bound of the scores attention computes
// (every KV codec, every SIMD level), its SIMD bound kernels match their
// reference twin, and the selector picks what the bound says (constructed
// keys with a known answer, the exact top-k of independently computed
// bounds, sinks, unsealed and newest blocks, dead slots, the budget).
#include "policy/quest.h"

#include <algorithm>
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
  const double e = level == simd_level::avx512 && int_key
                       ? (kf.type != kv_type::int8 && !folded ? 1.0 / 254 : 1.0 / (127.0 * 508))
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
        float bound = 0;
        quest_bounds(qr, 1, D, std::span<const key_summary>(&*sum, 1), &bound);
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
          ASSERT_GE(exact[at], bound - spread - tol) << spec << " block " << b << " row " << r << " token " << t;
          ++n_checked;
        }
      }
    }
  EXPECT_EQ(n_checked, H * (N / B) * R * B);
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

// Known answer: small random keys, and in one block a key along q (for one
// query row of the GQA group): with room for one block beyond the sink block
// and the newest, that block is the one read.
TEST_P(quest_level, picks_the_block_holding_the_key_most_aligned_with_q) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int H = 2, D = 64, B = 16, N = 64 * B, R = 4;
  for (int hot_row : {0, 2})
    for (int hot_block : {5, 37, 62}) {
      auto q = random_queries(R, D, 77 + hot_row);
      std::vector<float> keys(static_cast<std::size_t>(N) * H * D);
      std::mt19937 rng(9);
      std::normal_distribution<float> nd(0.0f, 0.3f);
      for (float& x : keys) x = nd(rng);
      const int hot_slot = hot_block * B + 5, h = 1;
      double norm = 0;
      for (int d = 0; d < D; ++d) norm += q[static_cast<std::size_t>(hot_row) * D + d] * q[static_cast<std::size_t>(hot_row) * D + d];
      for (int d = 0; d < D; ++d)
        keys[(static_cast<std::size_t>(hot_slot) * H + h) * D + d] = 10.0f * q[static_cast<std::size_t>(hot_row) * D + d] / std::sqrt(norm);
      quest_cache c("f32", H, D, B, N, 5, &keys);
      const paged_kv_view k = c.k_view();
      const std::int32_t q_pos = N;
      quest_selector sel(params_of({{"pages", "3"}, {"sinks", "16"}}));
      std::vector<slot_range> out;
      ASSERT_TRUE(sel.select(make_query(c, k, h, q, R, c.pos, {&q_pos, 1}), out));
      EXPECT_EQ(blocks_of(out, B, N), (std::vector<int>{0, hot_block, 63})) << "row " << hot_row;
    }
}

// Sinks (in tokens, rounded up to blocks), the unsealed last block and the
// newest block are always read; the budget's count is exact; and the blocks
// chosen beyond them are the top-k of bounds recomputed independently in
// double from the summaries (quest_bounds_ref), up to float rounding of near ties.
TEST_P(quest_level, reads_sinks_and_newest_and_the_exact_top_k) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int H = 2, D = 128, B = 16, N = 1000, R = 4;  // 63 blocks, the last holds 8 tokens
  quest_cache c("int8", H, D, B, N, 21);
  const paged_kv_view k = c.k_view();
  const std::int32_t q_pos = N;
  quest_selector sel(params_of({{"budget", "12.5%"}, {"sinks", "40"}, {"min_context", "0"}}));
  for (int h = 0; h < H; ++h) {
    const auto q = random_queries(R, D, 300 + h);
    std::vector<slot_range> out;
    ASSERT_TRUE(sel.select(make_query(c, k, h, q, R, c.pos, {&q_pos, 1}), out));
    const auto blocks = blocks_of(out, B, N);
    ASSERT_EQ(blocks.size(), 8u);  // ceil(0.125 x 63)
    EXPECT_EQ(out.back().end, N);
    for (int b : {0, 1, 2, 62}) EXPECT_TRUE(std::count(blocks.begin(), blocks.end(), b)) << "block " << b;
    // The other four: the top 4 of blocks 3..61 by bound.
    std::vector<std::pair<float, int>> ranked;
    for (int b = 3; b < 62; ++b) {
      const key_summary s = *c.kv->key_summary_of(c.table[b], 0, h);
      float bound = 0;
      quest_bounds_ref(q.data(), R, D, std::span<const key_summary>(&s, 1), &bound);
      ranked.push_back({bound, b});
    }
    std::sort(ranked.rbegin(), ranked.rend());
    const float kth = ranked[3].first;
    for (int b : blocks) {
      if (b <= 2 || b == 62) continue;
      const auto it = std::find_if(ranked.begin(), ranked.end(), [&](auto& x) { return x.second == b; });
      EXPECT_GE(it->first, kth - 1e-4f * std::fabs(kth)) << "block " << b << " is not among the top 4";
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
  quest_selector sel(params_of({{"pages", "6"}, {"sinks", "16"}, {"min_context", "0"}}));
  std::vector<slot_range> out;
  ASSERT_TRUE(sel.select(make_query(c, k, 0, q, 4, kv_pos, {&q_pos, 1}), out));
  const auto blocks = blocks_of(out, B, N);
  EXPECT_EQ(blocks.size(), 6u);
  EXPECT_EQ(blocks[0], 4);  // slots 64..79: the first live slot is 70
  EXPECT_EQ(blocks[1], 5);  // 70 + 16 sink tokens end in block 5
  EXPECT_EQ(blocks.back(), N / B - 1);
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
  std::vector<slot_range> out;
  const auto decode = std::span<const std::int32_t>(q_pos).last(1);
  quest_selector auto_min(params_of({}));  // 0.125 of 32 blocks: below the automatic minimum context
  EXPECT_EQ(quest_params{}.min_context_tokens(B), (2 + 4) * 8 * B);
  EXPECT_FALSE(auto_min.select(make_query(c, k, 0, q, 4, c.pos, decode), out));
  quest_selector sel(params_of({{"budget", "0.25"}, {"min_context", "0"}}));
  EXPECT_TRUE(sel.select(make_query(c, k, 0, q, 4, c.pos, decode), out));
  EXPECT_EQ(blocks_of(out, B, N).size(), 8u);
  EXPECT_TRUE(sel.select(make_query(c, k, 0, q, 4, c.pos, std::span<const std::int32_t>(q_pos).last(8)), out));
  EXPECT_FALSE(sel.select(make_query(c, k, 0, q, 4, c.pos, q_pos), out)) << "a 9-token chunk";
  kv_select_query no_backend = make_query(c, k, 0, q, 4, c.pos, decode);
  no_backend.kv = nullptr;
  EXPECT_FALSE(sel.select(no_backend, out));
  quest_selector all(params_of({{"pages", "32"}}));
  EXPECT_FALSE(all.select(make_query(c, k, 0, q, 4, c.pos, decode), out));
  quest_selector whole(params_of({{"budget", "1"}, {"min_context", "0"}}));
  EXPECT_FALSE(whole.select(make_query(c, k, 0, q, 4, c.pos, decode), out));
  quest_selector big_min(params_of({{"budget", "0.25"}, {"min_context", "513"}}));
  EXPECT_FALSE(big_min.select(make_query(c, k, 0, q, 4, c.pos, decode), out));
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
  quest_selector sel(params_of({{"budget", "0.1"}}));
  std::vector<std::vector<slot_range>> want(H);
  for (int h = 0; h < H; ++h) ASSERT_TRUE(sel.select(make_query(c, k, h, qs[h], 4, c.pos, {&q_pos, 1}), want[h]));
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
  EXPECT_EQ(mismatches[0] + mismatches[1], 0);
}

// End to end with attention: when the attention mass sits in a few blocks
// (a key along each query row there, scores ~40 above the rest), attention over Quest's
// ranges equals full attention within 1e-5, while reading a quarter of the blocks.
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
  quest_selector sel(params_of({{"budget", "0.25"}}));
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
  for (std::size_t i = 0; i < full.size(); ++i) ASSERT_NEAR(sparse[i], full[i], 1e-5) << i;
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
  for (auto [key, value, says] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"budget", "0", "(0, 1]"},
           {"budget", "1.5", "pages=N"},
           {"budget", "abc", "fraction"},
           {"budget", "", "fraction"},
           {"pages", "0", ">= 1"},
           {"sinks", "-1", ">= 0"},
           {"sinks", "4x", "whole number"},
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
