#include "attention/gather_attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "core/cpu.h"
#include "core/half.h"
#include "core/simd_levels.h"
#include "attention/attention_test_util.h"
#include "kv/kv_storage.h"
#include "quant/kv_format_spec.h"

namespace pagoda {
namespace {

// One layer of a KV cache filled with N(0, 1) keys and values, a scattered
// block table, and decode queries at the end.
struct cache {
  int n_kv_heads, n_rep, head_dim, block_size, n_ctx;
  std::unique_ptr<kv_storage> kv;
  std::vector<block_id> table;
  std::vector<float> q;            // [n_ctx][n_kv_heads * n_rep * head_dim]
  std::vector<std::int32_t> pos;   // [n_ctx]
  paged_kv_view kview, vview;

  cache(const std::string& spec, int n_kv_heads_, int n_rep_, int head_dim_, int block_size_, int n_ctx_, unsigned seed)
      : n_kv_heads(n_kv_heads_), n_rep(n_rep_), head_dim(head_dim_), block_size(block_size_), n_ctx(n_ctx_) {
    kv_pair_spec pair = *parse_kv_pair_spec(spec);
    kv_layout layout = kv_layout::uniform(1, n_kv_heads, head_dim, block_size, kv_type::f32, kv_type::f32);
    layout.k_formats[0] = pair.k.resolve(kv_role::key, false);
    layout.v_formats[0] = pair.v.resolve(kv_role::value, false);
    const int n_blocks = (n_ctx + block_size - 1) / block_size;
    kv = *kv_storage::create(layout, n_blocks + 5);
    std::vector<int> ids(n_blocks + 5);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int i = 0; i < n_blocks; ++i) table.push_back(block_id(ids[i]));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const std::size_t row = static_cast<std::size_t>(n_kv_heads) * head_dim;
    std::vector<float> k(n_ctx * row), v(n_ctx * row);
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    for (int p = 0; p < n_ctx;) {  // prefill chunks and decode steps
      const int n = std::min(n_ctx - p, 1 + static_cast<int>(rng() % 40));
      kv->write(0, table, p, n, &k[p * row], &v[p * row]);
      p += n;
    }
    q.resize(static_cast<std::size_t>(n_ctx) * q_stride());
    for (float& x : q) x = nd(rng) * 2.0f;
    pos.resize(n_ctx);
    std::iota(pos.begin(), pos.end(), 0);
    kview = kv->k_view(0, table, n_ctx);
    vview = kv->v_view(0, table, n_ctx);
  }

  std::size_t q_stride() const { return static_cast<std::size_t>(n_kv_heads) * n_rep * head_dim; }

  // The last n query tokens over every slot, for KV head h.
  attention_task task(int h, int n, float* out, int window = 0, float softcap = 0.0f) const {
    attention_task t;
    t.k = &kview;
    t.v = &vview;
    t.kv_head = h;
    t.n_rep = n_rep;
    t.head_dim = head_dim;
    t.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    t.q = q.data() + static_cast<std::size_t>(n_ctx - n) * q_stride();
    t.q_stride = q_stride();
    t.n_tokens = n;
    t.q_pos = pos.data() + (n_ctx - n);
    t.kv_pos = pos.data();
    t.n_kv = n_ctx;
    t.window = window;
    t.softcap = softcap;
    t.out = out;
    t.out_stride = q_stride();
    return t;
  }
};

enum class how { gather, gather_ref, full_ref };

std::vector<float> run(const cache& c, how h, std::span<const std::int32_t> slots, int n, int window = 0,
                       float softcap = 0.0f) {
  std::vector<float> out(static_cast<std::size_t>(n) * c.q_stride(), NAN);
  gather_scratch sc;
  for (int kh = 0; kh < c.n_kv_heads; ++kh) {
    attention_task t = c.task(kh, n, out.data(), window, softcap);
    if (h == how::gather) gather_attention(t, slots, sc);
    else if (h == how::gather_ref) gather_attention_ref(t, slots);
    else paged_attention_ref(t);
  }
  return out;
}

// A retrieval-like list: the first 4 slots, the last `recent`, and a random
// scatter between them (some blocks dense, most sparse).
std::vector<std::int32_t> scattered(int n_ctx, int recent, double density, unsigned seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution pick(density);
  std::vector<std::int32_t> s;
  for (int i = 0; i < n_ctx; ++i)
    if (i < 4 || i >= n_ctx - recent || pick(rng) || (i / 16 % 7 == 3 && i % 2 == 0)) s.push_back(i);
  return s;
}

using params = test::attention_shape;
using test::simd_tolerance;
using gather_attention_p = test::attention_shape_test;

void expect_near(const std::vector<float>& got, const std::vector<float>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tol) << "i=" << i;
}

// Scattered slots, one and three decode tokens, plain, with a sliding window
// (it hides the sinks and part of the scatter) and soft-capped.
TEST_P(gather_attention_p, matches_reference) {
  PAGODA_USE_SIMD_LEVEL(level());
  const params& p = this->p();
  cache c(p.spec, p.n_kv_heads, p.n_rep, p.head_dim, p.block_size, p.n_ctx, 7);
  const double tol = simd_tolerance(p.spec, level());
  for (double density : {0.03, 0.3}) {
    const auto slots = scattered(p.n_ctx, 20, density, 3);
    for (int n : {1, 3}) {
      expect_near(run(c, how::gather, slots, n), run(c, how::gather_ref, slots, n), tol);
      expect_near(run(c, how::gather, slots, n, p.n_ctx / 2), run(c, how::gather_ref, slots, n, p.n_ctx / 2), tol);
      expect_near(run(c, how::gather, slots, n, 0, 5.0f), run(c, how::gather_ref, slots, n, 0, 5.0f),
                  tol + (level() == simd_level::scalar ? 0 : 1e-5));
    }
  }
}

// The list of every slot is full attention: against paged_attention's own
// reference twin.
TEST_P(gather_attention_p, every_slot_is_full_attention) {
  PAGODA_USE_SIMD_LEVEL(level());
  const params& p = this->p();
  cache c(p.spec, p.n_kv_heads, p.n_rep, p.head_dim, p.block_size, p.n_ctx, 9);
  std::vector<std::int32_t> all(p.n_ctx);
  std::iota(all.begin(), all.end(), 0);
  const double tol = simd_tolerance(p.spec, level());
  expect_near(run(c, how::gather, all, 2), run(c, how::full_ref, all, 2), tol);
  expect_near(run(c, how::gather, all, 1, 9), run(c, how::full_ref, all, 1, 9), tol);
}

// The token-major copy of a head's keys over slots [0, n_slots), as the
// retrieval selector keeps it; empty when a key is not an f16 exactly.
std::vector<std::uint16_t> key_copy(const cache& c, int h, int n_slots) {
  std::vector<std::uint16_t> rows(static_cast<std::size_t>(n_slots) * c.head_dim);
  std::vector<float> x(c.head_dim);
  for (int s = 0; s < n_slots; ++s) {
    decode_kv_rows(c.kview, h, s, 1, x.data());
    for (int d = 0; d < c.head_dim; ++d) {
      std::uint16_t& y = rows[static_cast<std::size_t>(s) * c.head_dim + d];
      y = f32_to_fp16(x[d]);
      if (fp16_to_f32(y) != x[d]) return {};
    }
  }
  return rows;
}

// Keys scored from a token-major copy of the sealed part (the retrieval
// selector's) give what the tiles give: against the reference twin, which
// reads the view, for every format whose keys an f16 holds exactly.
TEST_P(gather_attention_p, copied_key_rows_match_reference) {
  PAGODA_USE_SIMD_LEVEL(level());
  const params& p = this->p();
  cache c(p.spec, p.n_kv_heads, p.n_rep, p.head_dim, p.block_size, p.n_ctx, 11);
  const int n_copied = (p.n_ctx - 30) / p.block_size * p.block_size;  // the tail stays in tiles
  std::vector<std::vector<std::uint16_t>> copies;
  for (int h = 0; h < p.n_kv_heads; ++h) copies.push_back(key_copy(c, h, n_copied));
  if (copies[0].empty()) GTEST_SKIP() << p.spec << " keys are not f16 values";
  std::vector<const std::uint16_t*> chunk;  // each head's copy as one chunk
  for (const auto& c : copies) chunk.push_back(c.data());
  const double tol = simd_tolerance(p.spec, level());
  for (double density : {0.03, 0.3}) {
    const auto slots = scattered(p.n_ctx, 20, density, 5);
    for (int n : {1, 3}) {
      std::vector<float> out(static_cast<std::size_t>(n) * c.q_stride(), NAN);
      gather_scratch sc;
      for (int kh = 0; kh < c.n_kv_heads; ++kh)
        gather_attention(c.task(kh, n, out.data()), slots, sc, key_rows{&chunk[kh], 24, n_copied});
      expect_near(out, run(c, how::gather_ref, slots, n), tol);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    shapes, gather_attention_p,
    ::testing::Combine(::testing::Values(params{"f32", 4, 2, 8, 16, 150}, params{"f16", 2, 4, 128, 16, 300},
                                         params{"bf16", 2, 4, 64, 16, 200}, params{"fp8", 4, 2, 8, 16, 150},
                                         params{"fp8_e5m2", 2, 4, 128, 16, 200}, params{"int8", 2, 4, 128, 16, 300},
                                         params{"int8/channel", 2, 4, 128, 16, 200},
                                         params{"int4", 2, 4, 128, 16, 301},  // KIVI keys: a staged last block
                                         params{"int4/token", 2, 4, 128, 16, 200},
                                         params{"int4/g32", 2, 4, 128, 16, 200}, params{"int2", 3, 3, 40, 8, 123},
                                         params{"k8v4", 2, 4, 128, 32, 300}, params{"int4+f16", 2, 4, 64, 16, 190},
                                         params{"q8_0", 4, 2, 8, 16, 150}, params{"q4_0", 2, 4, 128, 16, 200},
                                         params{"f16", 1, 1, 64, 32, 257}),
                       ::testing::ValuesIn(test::simd_levels_under_test())),
    [](const auto& info) { return test::attention_shape_name(std::get<0>(info.param), std::get<1>(info.param), true); });

// Dead slots (negative positions lead the row) are never seen even when listed.
TEST(gather_attention, dead_slots_are_not_seen) {
  cache c("f16", 2, 2, 32, 16, 100, 4);
  for (int i = 0; i < 20; ++i) c.pos[i] = -1;
  std::vector<std::int32_t> with_dead = scattered(100, 10, 0.2, 1);
  std::vector<std::int32_t> live;
  for (std::int32_t s : with_dead)
    if (s >= 20) live.push_back(s);
  const auto a = run(c, how::gather, with_dead, 1);
  expect_near(a, run(c, how::gather, live, 1), 0.0);
  expect_near(a, run(c, how::gather_ref, live, 1), 2e-5);
}

// A view's per-slot bias (merged entries) is added to the score: against the
// reference twin, and the output does move.
TEST(gather_attention, bias_is_added_to_scores) {
  cache c("f32", 1, 1, 16, 16, 64, 8);
  std::vector<float> bias(static_cast<std::size_t>(c.kv->n_blocks()) * 16, 0.0f);
  std::vector<std::uint8_t> has(c.kv->n_blocks(), 0);
  const int b = c.table[1].value;
  has[b] = 1;
  for (int i = 0; i < 16; ++i) bias[static_cast<std::size_t>(b) * 16 + i] = 0.1f * static_cast<float>(i);
  c.kview.bias = bias.data();
  c.kview.has_bias = has.data();
  c.kview.n_kv_heads = 1;
  const auto slots = scattered(64, 8, 0.5, 2);
  expect_near(run(c, how::gather, slots, 2), run(c, how::gather_ref, slots, 2), 2e-5);
  c.kview.bias = nullptr;
  const auto plain = run(c, how::gather, slots, 2);
  c.kview.bias = bias.data();
  EXPECT_NE(plain, run(c, how::gather, slots, 2));
}

// A row that sees none of the listed slots (a window that ends before them)
// gets zeros, not NaN.
TEST(gather_attention, unseen_list_gives_zeros) {
  cache c("f16", 1, 2, 16, 16, 64, 5);
  const std::vector<std::int32_t> early = {0, 1, 2, 17};
  for (float x : run(c, how::gather, early, 1, 8)) EXPECT_EQ(x, 0.0f);
  for (float x : run(c, how::gather, {}, 1)) EXPECT_EQ(x, 0.0f);
}

// The row kernels against their reference twins on random shapes, one SIMD
// level each (head_dim not a multiple of 8 takes the reference path).
class gather_kernels : public ::testing::TestWithParam<simd_level> {
  test::simd_level_guard guard_;  // the level is restored afterwards
};

TEST_P(gather_kernels, score_key_rows_matches_reference) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int hd : {8, 40, 64, 128, 36})
    for (int n_q : {1, 3, 4, 5, 8}) {
      const int n_rows = 300;
      std::vector<std::uint16_t> rows(static_cast<std::size_t>(n_rows) * hd);
      for (auto& x : rows) x = f32_to_fp16(nd(rng));
      std::vector<float> q(static_cast<std::size_t>(n_q) * hd);
      for (float& x : q) x = nd(rng);
      std::vector<std::int32_t> slots;
      for (int s = 0; s < n_rows; ++s)
        if (rng() % 3 == 0) slots.push_back(s);
      const std::size_t ld = slots.size() + 2;
      std::vector<float> got(n_q * ld, -1.0f), want(n_q * ld, -1.0f);
      // Chunks of 32 rows, as the retrieval selector holds them (of 256).
      std::vector<const std::uint16_t*> chunks;
      for (int c = 0; c < n_rows; c += 32) chunks.push_back(&rows[static_cast<std::size_t>(c) * hd]);
      const key_rows kr{chunks.data(), 5, n_rows};
      score_key_rows(q.data(), n_q, hd, kr, slots.data(), slots.size(), got.data(), ld);
      score_key_rows_ref(q.data(), n_q, hd, kr, slots.data(), slots.size(), want.data(), ld);
      // Sums of hd products of N(0, 1) values in another order: 4e-5 sqrt(hd).
      for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 4e-5 * std::sqrt(hd)) << "hd " << hd;
    }
}

TEST_P(gather_kernels, add_weighted_row_matches_reference) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int hd : {8, 64, 128, 36})
    for (int n_q : {1, 4, 5}) {
      std::vector<float> row(hd), w(static_cast<std::size_t>(n_q) * 3), got(static_cast<std::size_t>(n_q) * hd);
      for (float& x : row) x = nd(rng);
      for (float& x : w) x = rng() % 4 == 0 ? 0.0f : nd(rng);
      for (float& x : got) x = nd(rng);
      std::vector<float> want = got;
      add_weighted_row(row.data(), hd, w.data(), 3, n_q, got.data());
      add_weighted_row_ref(row.data(), hd, w.data(), 3, n_q, want.data());
      // One FMA against a multiply and an add: an ulp or two of values ~N(0, 2).
      for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << "hd " << hd;
    }
}

INSTANTIATE_TEST_SUITE_P(levels, gather_kernels, ::testing::ValuesIn(test::simd_levels_under_test()),
                         [](const auto& info) { return std::string(simd_level_name(info.param)); });

TEST(gather_attention, slots_of_ranges) {
  std::vector<std::int32_t> out = {99};
  const std::vector<slot_range> r = {{0, 2}, {5, 6}, {9, 12}};
  append_slots_of_ranges(r, out);
  EXPECT_EQ(out, (std::vector<std::int32_t>{99, 0, 1, 5, 9, 10, 11}));
}

}  // namespace
}  // namespace pagoda
