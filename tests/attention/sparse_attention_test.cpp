// Sparse reads (attention_task::ranges) and per-slot bias in paged_attention,
// against the double-precision reference twin (which spells the ranges and the
// bias out slot by slot), against full attention (ranges covering everything),
// and against attention over a table that holds only the selected blocks.
#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attention/attention_fixture.h"
#include "attention/paged_attention.h"
#include "core/simd_levels.h"
#include "kv/kv_storage.h"

namespace pagoda {
namespace {

using attention_test::fixture;
using attention_test::params;
using attention_test::simd_tolerance;
using attention_test::spec_test_name;

// One attention call over every KV head: n query tokens from query token
// `first` (positions q_pos), over the first n_kv slots of the views.
struct sparse_call {
  int first = 0, n = 1, n_kv = 0;
  const std::int32_t* q_pos = nullptr;
  const std::int32_t* kv_pos = nullptr;
  int window = 0;
  float softcap = 0.0f;
  std::span<const slot_range> ranges;
  std::vector<float>* acc = nullptr;  // [n_kv_heads][n_kv] statistics, or nullptr
  std::vector<float>* win = nullptr;  // [n_kv_heads][n_window][n_kv]
  int n_window = 0;
};

std::vector<float> run_call(fixture& f, const paged_kv_view& k, const paged_kv_view& v, const sparse_call& c,
                            bool reference) {
  std::vector<float> out(static_cast<std::size_t>(c.n) * f.q_stride(), NAN);
  attention_scratch scratch;
  for (int h = 0; h < f.n_kv_heads; ++h) {
    attention_task t = f.task(k, v, h, c.first, c.n, c.q_pos, c.kv_pos, c.n_kv, out.data());
    t.window = c.window;
    t.softcap = c.softcap;
    t.ranges = c.ranges;
    if (c.acc) t.stats.accumulated = c.acc->data() + static_cast<std::size_t>(h) * c.n_kv;
    if (c.win) {
      t.stats.window = c.win->data() + static_cast<std::size_t>(h) * c.n_window * c.n_kv;
      t.stats.n_window = c.n_window;
    }
    if (reference) paged_attention_ref(t);
    else paged_attention(t, scratch);
  }
  return out;
}

// The slots a selection marks, as sorted disjoint ranges.
std::vector<slot_range> to_ranges(const std::vector<bool>& selected) {
  std::vector<slot_range> out;
  for (int p = 0; p < static_cast<int>(selected.size()); ++p) {
    if (!selected[p]) continue;
    if (!out.empty() && out.back().end == p) ++out.back().end;
    else out.push_back({p, p + 1});
  }
  return out;
}

// Random ranges over n_kv slots: whole blocks (each with probability 0.35),
// or token-granular runs of 1 to 20 slots in and out. The last block is
// always in when `newest` (as every selector keeps it).
std::vector<slot_range> random_ranges(std::mt19937& rng, int n_kv, int bs, bool block_aligned, bool newest) {
  std::vector<bool> sel(n_kv, false);
  if (block_aligned) {
    for (int b = 0; b * bs < n_kv; ++b)
      if (rng() % 100 < 35)
        for (int p = b * bs; p < std::min(n_kv, (b + 1) * bs); ++p) sel[p] = true;
  } else {
    bool in = rng() % 2;
    for (int p = 0; p < n_kv;) {
      const int run = 1 + static_cast<int>(rng() % 20);
      for (int i = p; i < std::min(n_kv, p + run); ++i) sel[i] = in;
      p += run;
      in = !in;
    }
  }
  if (newest)
    for (int p = (n_kv - 1) / bs * bs; p < n_kv; ++p) sel[p] = true;
  if (std::none_of(sel.begin(), sel.end(), [](bool x) { return x; })) sel[rng() % n_kv] = true;  // empty = every slot
  return to_ranges(sel);
}

void expect_bitwise(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(a[i]), std::bit_cast<std::uint32_t>(b[i])) << what << " i=" << i;
}

class sparse_attention_p : public ::testing::TestWithParam<std::tuple<params, simd_level>> {
 protected:
  const params& p() const { return std::get<0>(GetParam()); }
  simd_level level() const { return std::get<1>(GetParam()); }
  fixture make(unsigned seed) const {
    return fixture(p().spec, p().n_kv_heads, p().n_rep, p().head_dim, p().block_size, p().n_ctx, seed);
  }
  test::simd_level_guard guard_;
};

// Ranges that cover every slot, whether as one range, block by block or in
// random token-granular pieces, give bitwise the output of no ranges: for a
// whole prefill, a mid-sequence chunk and a decode step, with and without a
// window.
TEST_P(sparse_attention_p, ranges_covering_everything_equal_full_attention_bitwise) {
  PAGODA_USE_SIMD_LEVEL(level());
  fixture f = make(31);
  const int N = f.n_ctx, bs = f.block_size;
  paged_kv_view k = f.kv->k_view(0, f.table, N), v = f.kv->v_view(0, f.table, N);
  std::vector<std::vector<slot_range>> covers = {{{0, N}}};
  covers.emplace_back();
  for (int b = 0; b * bs < N; ++b) covers.back().push_back({b * bs, std::min(N, (b + 1) * bs)});
  std::mt19937 rng(4);
  covers.emplace_back();
  for (int p = 0; p < N;) {
    const int e = std::min(N, p + 1 + static_cast<int>(rng() % 11));
    covers.back().push_back({p, e});
    p = e;
  }
  for (int window : {0, 21})
    for (auto [first, n] : {std::pair{0, N}, std::pair{N / 2, N - N / 2}, std::pair{N - 1, 1}}) {
      sparse_call c{.first = first, .n = n, .n_kv = N, .q_pos = f.pos.data() + first, .kv_pos = f.pos.data()};
      c.window = window;
      const auto full = run_call(f, k, v, c, false);
      for (const auto& cover : covers) {
        c.ranges = cover;
        expect_bitwise(run_call(f, k, v, c, false), full,
                       "window " + std::to_string(window) + " first " + std::to_string(first) + " pieces " +
                           std::to_string(cover.size()));
      }
    }
}

// Random ranges, block-aligned and token-granular, against the reference
// twin, with dead slots leading the row, sliding windows, soft-capping,
// prompt chunks and decode steps, and the statistics: the tolerance of
// matches_reference (paged_attention_test.cpp) on outputs, and on statistics
// that of paged_attention_stats (1e-5 absolute plus a relative term that
// follows the level's score error, plus 2e-6 relative for a float sum of up
// to n_tokens x n_rep weights); unread slots get exactly no weight. Rows that
// see only a few slots are more sensitive to score errors than full rows (the
// output error goes as the score error times sqrt(sum of squared weights)),
// so the 5e-2 of 4- and 2-bit keys with 8-bit queries is 8e-2 here.
TEST_P(sparse_attention_p, random_ranges_match_the_reference) {
  PAGODA_USE_SIMD_LEVEL(level());
  fixture f = make(7);
  const int N = f.n_ctx, bs = f.block_size, H = f.n_kv_heads;
  const double base_tol = simd_tolerance(p().spec, level());
  const double tol = base_tol == 5e-2 ? 8e-2 : base_tol;
  const double rel = (base_tol <= 2e-5 ? 0.0 : 2 * base_tol) + 2e-6;
  paged_kv_view k = f.kv->k_view(0, f.table, N), v = f.kv->v_view(0, f.table, N);
  std::mt19937 rng(100 + static_cast<unsigned>(level()));
  for (int trial = 0; trial < 12; ++trial) {
    const bool aligned = trial % 2 == 0;
    const auto ranges = random_ranges(rng, N, bs, aligned, trial % 3 != 2);
    std::vector<std::int32_t> kv_pos = f.pos;
    const int n_dead = trial % 4 == 1 ? 1 + static_cast<int>(rng() % (2 * bs)) : 0;
    for (int p = 0; p < n_dead; ++p) kv_pos[p] = -1;
    const bool decode = trial % 3 == 0;
    // Queries are newer than the dead slots (dead slots held evicted tokens).
    const int first = decode ? N - 1 : n_dead + static_cast<int>(rng() % (N / 2));
    const int n = N - first, W = std::min(n, 3);
    sparse_call c{.first = first, .n = n, .n_kv = N, .q_pos = f.pos.data() + first, .kv_pos = kv_pos.data()};
    c.window = trial % 4 == 2 ? 37 : 0;
    c.softcap = trial % 5 == 3 ? 2.0f : 0.0f;
    c.ranges = ranges;
    c.n_window = W;
    std::vector<float> acc_fast(static_cast<std::size_t>(H) * N, 0.0f), win_fast(static_cast<std::size_t>(H) * W * N, 0.0f);
    std::vector<float> acc_ref = acc_fast, win_ref = win_fast;
    c.acc = &acc_fast;
    c.win = &win_fast;
    const auto got = run_call(f, k, v, c, false);
    c.acc = &acc_ref;
    c.win = &win_ref;
    const auto ref = run_call(f, k, v, c, true);
    const std::string what = "trial " + std::to_string(trial) + (aligned ? " aligned" : " token-granular");
    for (std::size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], tol) << what << " i=" << i;
    std::vector<bool> read(N, false);
    for (const slot_range& r : ranges)
      for (int p = r.begin; p < r.end; ++p) read[p] = true;
    for (std::size_t i = 0; i < acc_ref.size(); ++i) {
      ASSERT_NEAR(acc_fast[i], acc_ref[i], 1e-5 + rel * acc_ref[i]) << what << " slot " << i % N;
      if (!read[i % N]) {
        ASSERT_EQ(acc_fast[i], 0.0f) << what << " unread slot " << i % N;
      }
    }
    for (std::size_t i = 0; i < win_ref.size(); ++i) {
      ASSERT_NEAR(win_fast[i], win_ref[i], 1e-5 + rel * win_ref[i]) << what << " window entry " << i;
      if (!read[i % N]) {
        ASSERT_EQ(win_fast[i], 0.0f) << what << " unread slot " << i % N;
      }
    }
  }
}

// Rows stay batch invariant under ranges: a row computed inside a chunk equals
// it computed alone (same ranges), bit for bit.
TEST_P(sparse_attention_p, rows_are_batch_invariant_under_ranges) {
  PAGODA_USE_SIMD_LEVEL(level());
  fixture f = make(12);
  const int N = f.n_ctx, bs = f.block_size;
  paged_kv_view k = f.kv->k_view(0, f.table, N), v = f.kv->v_view(0, f.table, N);
  std::mt19937 rng(8);
  for (bool aligned : {true, false}) {
    const auto ranges = random_ranges(rng, N, bs, aligned, true);
    sparse_call c{.first = 0, .n = N, .n_kv = N, .q_pos = f.pos.data(), .kv_pos = f.pos.data()};
    c.ranges = ranges;
    const auto whole = run_call(f, k, v, c, false);
    for (int p = N / 3; p < N; p += 7) {
      sparse_call one = c;
      one.first = p;
      one.n = 1;
      one.q_pos = f.pos.data() + p;
      const auto got = run_call(f, k, v, one, false);
      const std::vector<float> want(whole.begin() + static_cast<std::ptrdiff_t>(p * f.q_stride()),
                                    whole.begin() + static_cast<std::ptrdiff_t>((p + 1) * f.q_stride()));
      expect_bitwise(got, want, "position " + std::to_string(p));
    }
  }
}

// Block-aligned ranges read exactly the selected blocks: the output equals,
// bit for bit, attention over a table that holds only those blocks (positions
// kept), the way a dropped block would be absent.
TEST_P(sparse_attention_p, block_aligned_ranges_equal_a_table_of_the_selected_blocks) {
  PAGODA_USE_SIMD_LEVEL(level());
  fixture f = make(19);
  const int N = f.n_ctx, bs = f.block_size;
  paged_kv_view k = f.kv->k_view(0, f.table, N), v = f.kv->v_view(0, f.table, N);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 4; ++trial) {
    const auto ranges = random_ranges(rng, N, bs, true, true);
    std::vector<block_id> table;
    std::vector<std::int32_t> kv_pos;
    for (int b = 0; b * bs < N; ++b) {
      if (std::none_of(ranges.begin(), ranges.end(), [&](const slot_range& r) { return r.begin <= b * bs && b * bs < r.end; }))
        continue;
      table.push_back(f.table[b]);
      for (int p = b * bs; p < std::min(N, (b + 1) * bs); ++p) kv_pos.push_back(p);
    }
    const int n_sub = static_cast<int>(kv_pos.size());
    paged_kv_view ks = f.kv->k_view(0, table, n_sub), vs = f.kv->v_view(0, table, n_sub);
    // Query tokens whose positions are in the last block: they all see it.
    const int first = std::max(0, (N - 1) / bs * bs);
    sparse_call c{.first = first, .n = N - first, .n_kv = N, .q_pos = f.pos.data() + first, .kv_pos = f.pos.data()};
    c.ranges = ranges;
    sparse_call sub{.first = first, .n = N - first, .n_kv = n_sub, .q_pos = f.pos.data() + first, .kv_pos = kv_pos.data()};
    expect_bitwise(run_call(f, k, v, c, false), run_call(f, ks, vs, sub, false), "trial " + std::to_string(trial));
  }
}

INSTANTIATE_TEST_SUITE_P(codecs, sparse_attention_p,
                         ::testing::Combine(::testing::Values(params{"f32", 2, 4, 64, 16, 150},
                                                              params{"f16", 3, 3, 40, 8, 97},
                                                              params{"bf16", 2, 4, 64, 16, 150},
                                                              params{"fp8", 2, 4, 64, 16, 150},
                                                              params{"fp8_e5m2", 2, 4, 64, 16, 150},
                                                              params{"int8", 2, 4, 128, 16, 150},
                                                              params{"int8/channel", 2, 4, 64, 16, 150},
                                                              params{"int4", 2, 4, 64, 16, 150},  // KIVI: staged last block
                                                              params{"int4/token", 2, 4, 64, 16, 150},
                                                              params{"int4/g32", 2, 4, 64, 16, 150},
                                                              params{"int2", 3, 3, 40, 8, 97},
                                                              params{"k8v4", 2, 4, 64, 32, 150},
                                                              params{"int4+f16", 2, 4, 64, 16, 150},
                                                              params{"q8_0", 2, 4, 64, 16, 150},
                                                              params{"q4_0", 2, 4, 64, 16, 150}),
                                            ::testing::ValuesIn(test::simd_levels_under_test())),
                         [](const auto& info) {
                           const params& p = std::get<0>(info.param);
                           return spec_test_name(p.spec) + "_" + simd_level_name(std::get<1>(info.param));
                         });

class sparse_level : public ::testing::TestWithParam<simd_level> {
 protected:
  test::simd_level_guard guard_;
};

// Slots of unselected blocks are never read: with NaN keys and values there,
// block-aligned ranges that skip them give finite outputs (a read with weight
// 0 would still turn the output into NaN through 0 x NaN).
TEST_P(sparse_level, unselected_blocks_are_not_read) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  for (const char* spec : {"f32", "f16"}) {
    const int H = 2, R = 2, D = 32, B = 16, N = 96;
    fixture f(spec, H, R, D, B, N, 23);
    const std::vector<float> nan_row(static_cast<std::size_t>(B) * H * D, NAN);
    for (int b : {1, 3, 4}) f.kv->write(0, f.table, b * B, B, nan_row.data(), nan_row.data());
    paged_kv_view k = f.kv->k_view(0, f.table, N), v = f.kv->v_view(0, f.table, N);
    const std::vector<slot_range> ranges = {{0, B}, {2 * B, 3 * B}, {5 * B, N}};
    sparse_call c{.first = 5 * B, .n = N - 5 * B, .n_kv = N, .q_pos = f.pos.data() + 5 * B, .kv_pos = f.pos.data()};
    c.ranges = ranges;
    const auto got = run_call(f, k, v, c, false);
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isfinite(got[i])) << spec << " i=" << i;
  }
}

// A query row that sees none of the selected slots gets a zero output (and
// no statistics) in both twins, while the other rows of its chunk are as usual.
TEST_P(sparse_level, a_row_that_sees_no_selected_slot_gets_zero) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int H = 2, R = 2, D = 32, B = 8, N = 64;
  fixture f("f32", H, R, D, B, N, 29);
  paged_kv_view k = f.kv->k_view(0, f.table, N), v = f.kv->v_view(0, f.table, N);
  const std::vector<slot_range> ranges = {{20, 30}, {60, 64}};
  // Query tokens at positions 10..63: those below 20 see nothing selected.
  sparse_call c{.first = 10, .n = N - 10, .n_kv = N, .q_pos = f.pos.data() + 10, .kv_pos = f.pos.data()};
  c.ranges = ranges;
  std::vector<float> acc(static_cast<std::size_t>(H) * N, 0.0f), acc_ref = acc;
  c.acc = &acc;
  const auto got = run_call(f, k, v, c, false);
  c.acc = &acc_ref;
  const auto ref = run_call(f, k, v, c, true);
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], ref[i], 2e-5) << i;
    if (i < 10 * f.q_stride()) {
      ASSERT_EQ(got[i], 0.0f) << i;
    }
  }
  for (std::size_t i = 0; i < acc.size(); ++i) ASSERT_NEAR(acc[i], acc_ref[i], 1e-5) << i;
  double total = 0;
  for (float x : acc) total += x;
  EXPECT_NEAR(total, static_cast<double>(N - 20) * R * H, 1e-3);  // rows at positions 20..63 have weight 1 each
}

// Per-slot bias (merged entries) on a hand-built key view: random biases on
// about half the pool's blocks, against the reference twin, with ranges,
// soft-capping, a window and a staged last block (int4 KIVI keys), at the
// tolerance of matches_reference; and the bias matters.
TEST_P(sparse_level, bias_matches_the_reference) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  for (const char* spec : {"f32", "f16", "int8", "int4"}) {
    const int H = 2, R = 4, D = 64, B = 16, N = 150;
    fixture f(spec, H, R, D, B, N, 37);
    const double tol = simd_tolerance(spec, GetParam());
    paged_kv_view k = f.kv->k_view(0, f.table, N), v = f.kv->v_view(0, f.table, N);
    const auto n_pool = static_cast<std::size_t>(f.kv->n_blocks());
    std::vector<float> bias(n_pool * H * B);
    std::vector<std::uint8_t> has_bias(n_pool);
    std::mt19937 rng(41);
    std::uniform_real_distribution<float> ud(0.0f, std::log(8.0f));
    for (float& x : bias) x = ud(rng);
    for (auto& x : has_bias) x = rng() % 2;
    paged_kv_view kb = k;
    kb.bias = bias.data();
    kb.has_bias = has_bias.data();
    kb.n_kv_heads = H;
    std::vector<slot_range> ranges = random_ranges(rng, N, B, false, true);
    for (int variant = 0; variant < 3; ++variant) {
      sparse_call c{.first = 40, .n = N - 40, .n_kv = N, .q_pos = f.pos.data() + 40, .kv_pos = f.pos.data()};
      if (variant == 1) c.ranges = ranges;
      if (variant == 2) {
        c.softcap = 2.0f;
        c.window = 50;
      }
      const auto got = run_call(f, kb, v, c, false);
      const auto ref = run_call(f, kb, v, c, true);
      const auto unbiased = run_call(f, k, v, c, false);
      double moved = 0;
      for (std::size_t i = 0; i < ref.size(); ++i) {
        ASSERT_NEAR(got[i], ref[i], tol) << spec << " variant " << variant << " i=" << i;
        moved = std::max(moved, static_cast<double>(std::fabs(got[i] - unbiased[i])));
      }
      EXPECT_GT(moved, 0.05) << spec << " variant " << variant << ": the bias changed nothing";
    }
  }
}

// The known answer for a merged entry: a slot with bias log m weighs as m
// copies of it. Attention with bias log 2 on one slot and log 3 on another
// equals attention without bias over a cache where the first slot appears
// twice and the second three times (f32 KV; both sides round in float: 2e-5).
TEST_P(sparse_level, bias_log_m_weighs_as_m_copies) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int H = 2, R = 2, D = 32, B = 8, N = 40;
  const int twice = 5, thrice = 27;
  fixture f("f32", H, R, D, B, N, 43);
  // The cache with copies: slot order does not matter to attention, so the
  // copies go at the end, at later positions all queries see.
  const std::size_t row = static_cast<std::size_t>(H) * D;
  std::vector<float> k2(f.k), v2(f.v);
  for (int src : {twice, thrice, thrice}) {
    k2.insert(k2.end(), f.k.begin() + static_cast<std::ptrdiff_t>(src * row), f.k.begin() + static_cast<std::ptrdiff_t>((src + 1) * row));
    v2.insert(v2.end(), f.v.begin() + static_cast<std::ptrdiff_t>(src * row), f.v.begin() + static_cast<std::ptrdiff_t>((src + 1) * row));
  }
  const int N2 = N + 3;
  kv_layout layout = kv_layout::uniform(1, H, D, B, kv_type::f32, kv_type::f32);
  auto kv2 = *kv_storage::create(layout, (N2 + B - 1) / B);
  std::vector<block_id> table2;
  for (int b = 0; b < (N2 + B - 1) / B; ++b) table2.push_back(block_id(b));
  kv2->write(0, table2, 0, N2, k2.data(), v2.data());
  std::vector<std::int32_t> pos2(N2);
  std::iota(pos2.begin(), pos2.end(), 0);

  paged_kv_view k = f.kv->k_view(0, f.table, N), v = f.kv->v_view(0, f.table, N);
  const auto n_pool = static_cast<std::size_t>(f.kv->n_blocks());
  std::vector<float> bias(n_pool * H * B, 0.0f);
  std::vector<std::uint8_t> has_bias(n_pool, 0);
  for (int slot : {twice, thrice}) {
    const auto b = static_cast<std::size_t>(f.table[slot / B].value);
    has_bias[b] = 1;
    for (int h = 0; h < H; ++h) bias[(b * H + h) * B + slot % B] = std::log(slot == twice ? 2.0f : 3.0f);
  }
  k.bias = bias.data();
  k.has_bias = has_bias.data();
  k.n_kv_heads = H;
  // One decode query at a position past every slot of both caches.
  const std::int32_t q_pos = N2;
  sparse_call c{.first = N - 1, .n = 1, .n_kv = N, .q_pos = &q_pos, .kv_pos = f.pos.data()};
  const auto biased = run_call(f, k, v, c, false);
  paged_kv_view k2v = kv2->k_view(0, table2, N2), v2v = kv2->v_view(0, table2, N2);
  sparse_call c2{.first = N - 1, .n = 1, .n_kv = N2, .q_pos = &q_pos, .kv_pos = pos2.data()};
  const auto copies = run_call(f, k2v, v2v, c2, false);
  const auto plain = run_call(f, f.kv->k_view(0, f.table, N), v, c, false);
  double moved = 0;
  for (std::size_t i = 0; i < copies.size(); ++i) {
    ASSERT_NEAR(biased[i], copies[i], 2e-5) << i;
    moved = std::max(moved, static_cast<double>(std::fabs(plain[i] - copies[i])));
  }
  EXPECT_GT(moved, 1e-3) << "the copies changed nothing: the test proves nothing";
}

INSTANTIATE_TEST_SUITE_P(levels, sparse_level, ::testing::ValuesIn(test::simd_levels_under_test()),
                         test::level_param_name);

}  // namespace
}  // namespace pagoda
