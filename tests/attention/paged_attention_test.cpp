#include "attention/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "attention/attention_fixture.h"
#include "core/cpu.h"
#include "core/simd_levels.h"
#include "kv/kv_storage.h"
#include "quant/kv_format_spec.h"

namespace pagoda {
namespace {

using attention_test::fixture;
using attention_test::params;
using attention_test::simd_tolerance;
using attention_test::spec_test_name;

// One shape and KV format at one SIMD level (core/simd_levels.h).
class paged_attention_p : public ::testing::TestWithParam<std::tuple<params, simd_level>> {
 protected:
  const params& p() const { return std::get<0>(GetParam()); }
  simd_level level() const { return std::get<1>(GetParam()); }
  test::simd_level_guard guard_;
};

// Against a double-precision reference on decoded K/V: every level rounds in
// float (scores, exp, sums over up to n_ctx terms), so we allow 2e-5 absolute on
// outputs whose magnitude is O(1) (values ~ N(0,1), weights summing to 1). The
// AVX2 integer kernels apply scales and offsets after f32 code sums, which
// stays within that. The AVX-512 integer kernels also split q and the weights into two int8 halves (1.6e-5 of
// each row's largest element): scores move by up to ~1e-3 at head_dim 128, so
// there we allow 2e-3. For 4- and 2-bit keys with per-token or group scales q is
// rounded to 8 bits only (max|q|
// / 254 per element): with these peaked queries (q ~ N(0, 4)) scores move by
// ~0.013 standard deviation, a twelfth of what int4 codes themselves cost
// (~0.15); outputs move by up to ~0.03, so we allow 5e-2.
TEST_P(paged_attention_p, matches_reference) {
  PAGODA_USE_SIMD_LEVEL(level());
  const params& p = this->p();
  fixture f(p.spec, p.n_kv_heads, p.n_rep, p.head_dim, p.block_size, p.n_ctx, 11);
  auto ref = f.run(0, p.n_ctx, true);
  auto got = f.run(0, p.n_ctx, false);
  const double tol = simd_tolerance(p.spec, level());
  for (std::size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], tol) << "i=" << i;
}

// The batch-invariance property: a query row computed inside a prefill chunk of
// any size equals, bit for bit, the same row computed alone as a decode step,
// at every level.
TEST_P(paged_attention_p, chunked_equals_token_by_token_bitwise) {
  PAGODA_USE_SIMD_LEVEL(level());
  const params& p = this->p();
  fixture f(p.spec, p.n_kv_heads, p.n_rep, p.head_dim, p.block_size, p.n_ctx, 5);
  auto whole = f.run(0, p.n_ctx, false);
  std::size_t stride = f.q_stride();
  for (int pos = 0; pos < p.n_ctx; pos += 1 + pos / 3) {
    auto one = f.run(pos, 1, false);
    for (std::size_t i = 0; i < stride; ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(one[i]), std::bit_cast<std::uint32_t>(whole[pos * stride + i]))
          << "pos " << pos << " i " << i;
  }
  // And a chunk starting mid-sequence.
  int first = p.n_ctx / 2;
  auto tail = f.run(first, p.n_ctx - first, false);
  for (std::size_t i = 0; i < tail.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(tail[i]), std::bit_cast<std::uint32_t>(whole[first * stride + i]));
}

INSTANTIATE_TEST_SUITE_P(shapes, paged_attention_p,
                         ::testing::Combine(::testing::Values(params{"f32", 4, 2, 8, 16, 70},      // stories260K-like
                                           params{"f16", 4, 2, 8, 16, 70},
                                           params{"f32", 2, 4, 128, 16, 150},   // llama3-like GQA
                                           params{"f16", 2, 4, 128, 16, 150},
                                           params{"f32", 1, 1, 64, 32, 100},    // MHA, other block size
                                           params{"f16", 3, 3, 40, 8, 33},
                                           params{"bf16", 2, 4, 128, 16, 150},
                                           params{"fp8", 4, 2, 8, 16, 70},
                                           params{"fp8_e5m2", 2, 4, 128, 16, 150},
                                           params{"int8", 4, 2, 8, 16, 70},
                                           params{"int8", 2, 4, 128, 16, 150},
                                           params{"int8/channel", 2, 4, 128, 16, 150},
                                           params{"int4", 4, 2, 8, 16, 70},     // KIVI: K per channel, V per token
                                           params{"int4", 2, 4, 128, 16, 150},
                                           params{"int4/token", 2, 4, 128, 16, 150},
                                           params{"int4/g32", 2, 4, 128, 16, 150},
                                           params{"int2", 2, 4, 128, 16, 150},
                                           params{"int2", 3, 3, 40, 8, 33},
                                           params{"k8v4", 2, 4, 128, 32, 100},
                                           params{"int4+f16", 2, 4, 64, 16, 90},
                                           params{"q8_0", 4, 2, 8, 16, 70},     // head_dim zero-padded to 32
                                           params{"q4_0", 2, 4, 128, 16, 150}),
                                            ::testing::ValuesIn(test::simd_levels_under_test())),
                         [](const auto& info) {
                           const params& p = std::get<0>(info.param);
                           return spec_test_name(p.spec) + "_hd" + std::to_string(p.head_dim) + "_bs" + std::to_string(p.block_size) + "_" +
                                  simd_level_name(std::get<1>(info.param));
                         });

// Quantized attention against exact (f32 KV) attention on the same data, with a
// bound derived per query row from the stored errors: if every score moves by at
// most delta (delta = max_t |scale * q.(k^_t - k_t)|, from the decoded keys) the
// softmax weights move by at most e^(2 delta) - 1 in total, so
//   |out^ - out| <= max |v^ - v| + (e^(2 delta) - 1) * max |v|
// (plus 1e-3 for float rounding and the kernels' operand splitting). The test
// also checks the codecs are lossy at all (a bound that always holds trivially
// would prove nothing).
class quantized_vs_exact : public ::testing::TestWithParam<const char*> {};

TEST_P(quantized_vs_exact, within_the_stored_error_bound) {
  const int H = 2, R = 4, D = 64, B = 16, N = 120;
  fixture exact("f32", H, R, D, B, N, 21), quant(GetParam(), H, R, D, B, N, 21);
  ASSERT_EQ(exact.k, quant.k);
  auto ref = exact.run(0, N, false);
  auto got = quant.run(0, N, false);
  paged_kv_view kv = quant.kv->k_view(0, quant.table, N), vv = quant.kv->v_view(0, quant.table, N);
  auto decode = [&](const paged_kv_view& view, int p, int h) {
    std::vector<float> out(D);
    int b = p / B, slot = p % B;
    if (view.is_staged(b)) view.staged_codec->decode(view.staged_format, view.shape, nullptr, view.staged_tile(h), slot, 1, out.data());
    else view.codec->decode(view.format, view.shape, view.params(h), view.tile(b, h), slot, 1, out.data());
    return out;
  };
  double worst = 0, worst_bound = 0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int h = 0; h < H; ++h) {
    std::vector<std::vector<float>> kd(N), vd(N);
    for (int p = 0; p < N; ++p) {
      kd[p] = decode(kv, p, h);
      vd[p] = decode(vv, p, h);
    }
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < R; ++j) {
        const float* q = &quant.q[static_cast<std::size_t>(i) * quant.q_stride() + (h * R + j) * D];
        double delta = 0, ev = 0, vmax = 0;
        for (int p = 0; p <= i; ++p) {
          double ds = 0;
          for (int d = 0; d < D; ++d) {
            std::size_t x = (static_cast<std::size_t>(p) * H + h) * D + d;
            ds += q[d] * (static_cast<double>(kd[p][d]) - quant.k[x]);
            ev = std::max(ev, std::fabs(static_cast<double>(vd[p][d]) - quant.v[x]));
            vmax = std::max(vmax, std::fabs(static_cast<double>(quant.v[x])));
          }
          delta = std::max(delta, std::fabs(ds) * scale);
        }
        const double bound = ev + std::expm1(2 * delta) * vmax + 1e-3;
        for (int d = 0; d < D; ++d) {
          std::size_t o = static_cast<std::size_t>(i) * quant.q_stride() + (h * R + j) * D + d;
          double err = std::fabs(static_cast<double>(got[o]) - ref[o]);
          ASSERT_LE(err, bound) << GetParam() << " row " << i << " head " << h * R + j << " d " << d;
          worst = std::max(worst, err);
          worst_bound = std::max(worst_bound, bound);
        }
      }
  }
  EXPECT_GT(worst, 1e-6) << GetParam() << ": no error at all, is the codec quantizing?";
  ::testing::Test::RecordProperty("worst_error", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(codecs, quantized_vs_exact,
                         ::testing::Values("bf16", "fp8", "fp8_e5m2", "int8", "int8/channel", "int4", "int4/token",
                                           "int4/g16", "int2", "k8v4", "k4v2", "q8_0", "q4_0"),
                         [](const auto& info) {
                           return spec_test_name(info.param);
                         });

class softmax_level : public ::testing::TestWithParam<simd_level> {
 protected:
  test::simd_level_guard guard_;
};

// The dispatched softmax at each level (the reference itself at scalar).
TEST_P(softmax_level, simd_matches_reference) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.0f, 5.0f);
  for (int n : {1, 3, 7, 8, 9, 16, 17, 23, 100, 1000}) {
    std::vector<float> a(n), b;
    for (float& x : a) x = nd(rng);
    b = a;
    float sa = softmax_unnormalized_ref(a.data(), n);
    float sb = softmax_unnormalized(b.data(), n);
    EXPECT_NEAR(sb, sa, 1e-5 * sa);
    // Each exp within 4 ulp-ish (relative 5e-7) of std::exp.
    for (int i = 0; i < n; ++i) ASSERT_NEAR(b[i], a[i], 5e-7 * a[i] + 1e-30) << n << " " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(levels, softmax_level, ::testing::ValuesIn(test::simd_levels_under_test()),
                         test::level_param_name);

class softcap_level : public ::testing::TestWithParam<simd_level> {
 protected:
  test::simd_level_guard guard_;
};

// The dispatched soft-capping against cap * std::tanh(x / cap) at each level
// (the reference itself at scalar). The SIMD levels compute 1 - 2 / (exp(2x) +
// 1) in float: the exp is within 2e-7 relative and the subtraction from 1
// loses at most an ulp of 1, so within 1e-6 x cap; far out they saturate at
// exactly +-cap.
TEST_P(softcap_level, simd_matches_reference) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  std::mt19937 rng(3);
  for (float cap : {4.0f, 50.0f}) {
    std::normal_distribution<float> nd(0.0f, 2.0f * cap);
    for (int n : {1, 5, 8, 15, 16, 17, 33, 200}) {
      std::vector<float> a(n), b;
      for (float& x : a) x = nd(rng);
      a[0] = n > 1 ? 1e-6f : 0.0f;
      if (n > 2) a[1] = -1e4f;
      if (n > 3) a[2] = 1e4f;
      b = a;
      softcap_inplace_ref(a.data(), n, cap);
      softcap_inplace(b.data(), n, cap);
      for (int i = 0; i < n; ++i) {
        ASSERT_NEAR(b[i], a[i], 1e-6 * cap) << "cap " << cap << " n " << n << " i " << i;
        ASSERT_LE(std::fabs(b[i]), cap);
      }
    }
  }
}

// Attention with soft-capped scores, under a sliding window as on Gemma 2's
// local layers, against the double reference (same 2e-5 as matches_reference:
// f32 KV, O(1) outputs), batch invariant, and the cap changes the output.
TEST_P(softcap_level, attention_matches_reference_and_is_batch_invariant) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const int H = 2, R = 2, D = 64, B = 16, N = 80, W = 32;
  fixture f("f32", H, R, D, B, N, 13);
  auto run = [&](int first, int n, bool reference, float cap) { return f.run(first, n, reference, W, cap); };
  // Scores here have a standard deviation of about 2: a cap of 1.5 bites hard.
  const float cap = 1.5f;
  auto whole = run(0, N, false, cap);
  auto ref = run(0, N, true, cap);
  for (std::size_t i = 0; i < whole.size(); ++i) ASSERT_NEAR(whole[i], ref[i], 2e-5) << i;
  for (int p : {0, 31, 32, 79}) {
    auto one = run(p, 1, false, cap);
    for (std::size_t i = 0; i < one.size(); ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(one[i]), std::bit_cast<std::uint32_t>(whole[p * f.q_stride() + i]))
          << "position " << p;
  }
  auto uncapped = run(0, N, false, 0.0f);
  double diff = 0;
  for (std::size_t i = 0; i < whole.size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(whole[i] - uncapped[i])));
  EXPECT_GT(diff, 0.1);
}

INSTANTIATE_TEST_SUITE_P(levels, softcap_level, ::testing::ValuesIn(test::simd_levels_under_test()),
                         test::level_param_name);

// Masking follows stored positions, not slot numbers. With blocks dropped from
// the middle (the table skips them; the kept slots keep their positions) and
// gaps in the query positions, the fast path must match the reference, which
// spells the mask out slot by slot from the positions; and a query sees
// exactly the slots at or before its position: moving the query past more
// slots changes its output, while a query at a position before a slot never
// reads that slot (its output equals the one computed without it).
TEST(paged_attention_positions, masks_by_stored_positions_after_a_drop) {
  const int H = 2, R = 2, D = 16, B = 4, N = 40;
  fixture f("f32", H, R, D, B, N, 3);
  // Drop blocks 2 and 5 (slots 8..11 and 20..23): a shorter table, positions kept.
  std::vector<block_id> table;
  std::vector<std::int32_t> kv_pos;
  for (int b = 0; b < N / B; ++b) {
    if (b == 2 || b == 5) continue;
    table.push_back(f.table[b]);
    for (int i = 0; i < B; ++i) kv_pos.push_back(b * B + i);
  }
  const int n_kv = static_cast<int>(kv_pos.size());
  // Queries at positions that fall before, inside and after the holes.
  const std::vector<std::int32_t> q_pos = {3, 9, 10, 21, 30, 39};
  const int n = static_cast<int>(q_pos.size());
  paged_kv_view kview = f.kv->k_view(0, table, n_kv), vview = f.kv->v_view(0, table, n_kv);
  std::vector<float> fast(static_cast<std::size_t>(n) * f.q_stride()), ref(fast.size());
  attention_scratch scratch;
  for (int h = 0; h < H; ++h)
    for (bool reference : {false, true}) {
      attention_task t = f.task(kview, vview, h, 0, n, q_pos.data(), kv_pos.data(), n_kv,
                                reference ? ref.data() : fast.data());
      if (reference) paged_attention_ref(t);
      else paged_attention(t, scratch);
    }
  for (std::size_t i = 0; i < fast.size(); ++i) ASSERT_NEAR(fast[i], ref[i], 2e-5) << i;
  // The query at position 9 sees slots of positions 0..7 only (8 and 9 were
  // dropped), exactly as the query at position 7 would on the full table.
  int lo = -1, hi = -1;
  visible_slots(kv_pos.data(), n_kv, 9, 0, lo, hi);
  EXPECT_EQ(lo, 0);
  EXPECT_EQ(hi, 8);
  visible_slots(kv_pos.data(), n_kv, 30, 8, lo, hi);  // a window of 8 positions: 23..30
  EXPECT_EQ(kv_pos[lo], 24);  // 23 was dropped
  EXPECT_EQ(kv_pos[hi - 1], 30);
}

// A sliding window (position p sees p - w + 1 .. p) against the reference, and
// batch invariance under it: a chunk's rows equal the same rows computed alone.
TEST(paged_attention_positions, sliding_window_matches_reference_and_is_batch_invariant) {
  const int H = 2, R = 4, D = 32, B = 16, N = 100, W = 21;
  fixture f("f16", H, R, D, B, N, 9);
  auto run = [&](int first, int n, bool reference) { return f.run(first, n, reference, W); };
  auto whole = run(0, N, false);
  auto ref = run(0, N, true);
  for (std::size_t i = 0; i < whole.size(); ++i) ASSERT_NEAR(whole[i], ref[i], 2e-5) << i;
  for (int p : {0, 20, 21, 50, 99}) {
    auto one = run(p, 1, false);
    for (std::size_t i = 0; i < one.size(); ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(one[i]), std::bit_cast<std::uint32_t>(whole[p * f.q_stride() + i]))
          << "position " << p;
  }
  // The window matters: without it the last row differs.
  fixture g("f16", H, R, D, B, N, 9);
  auto full = g.run(0, N, false);
  double diff = 0;
  for (std::size_t i = (N - 1) * f.q_stride(); i < whole.size(); ++i) diff += std::fabs(whole[i] - full[i]);
  EXPECT_GT(diff, 1e-3);
}

// Bidirectional rows (attention_task::q_see, a Gemma 3 image span): a row at
// position p that sees up to P reads what a causal row at P reads (without
// a window: bit for bit the same output for the same q), at every level; with
// a window the lower bound still counts back from p, as the reference twin
// spells out slot by slot.
TEST(paged_attention_positions, bidirectional_rows_see_up_to_their_bound) {
  const int H = 2, R = 2, D = 32, B = 16, N = 40, first = 20, n = 12, W = 9;
  for (const simd_level level : test::simd_levels_under_test()) {
    test::simd_level_guard guard;
    PAGODA_USE_SIMD_LEVEL(level);
    fixture f("f32", H, R, D, B, N, 3);
    const paged_kv_view kv_k = f.kv->k_view(0, f.table, first + n);
    const paged_kv_view kv_v = f.kv->v_view(0, f.table, first + n);
    const std::vector<std::int32_t> see(static_cast<std::size_t>(n), first + n - 1);
    const std::vector<std::int32_t> at_last(static_cast<std::size_t>(n), first + n - 1);
    for (const int window : {0, W}) {
      std::vector<float> bidir(static_cast<std::size_t>(n) * f.q_stride()), causal_last(bidir.size()),
          ref(bidir.size());
      attention_scratch sc;
      for (int h = 0; h < H; ++h) {
        attention_task t = f.task(kv_k, kv_v, h, first, n, f.pos.data() + first, f.pos.data(), first + n, bidir.data());
        t.window = window;
        t.q_see = see.data();
        paged_attention(t, sc);
        t.out = ref.data();
        paged_attention_ref(t);
        attention_task c = f.task(kv_k, kv_v, h, first, n, at_last.data(), f.pos.data(), first + n, causal_last.data());
        paged_attention(c, sc);
      }
      for (std::size_t i = 0; i < bidir.size(); ++i) ASSERT_NEAR(bidir[i], ref[i], 2e-5) << i;
      if (window == 0) {
        EXPECT_TRUE(bidir == causal_last) << "a row sees up to its bound, as a causal row there does";
      } else {
        double d = 0;  // the window counts back from each row's own position: not the last row's reads
        for (std::size_t i = 0; i < bidir.size(); ++i) d += std::fabs(bidir[i] - causal_last[i]);
        EXPECT_GT(d, 1e-3);
      }
    }
    // The first row's output differs from its causal one (it sees 11 later slots).
    std::vector<float> causal = f.run(first, n, false);
    std::vector<float> bidir(causal.size());
    attention_scratch sc;
    for (int h = 0; h < H; ++h) {
      attention_task t = f.task(kv_k, kv_v, h, first, n, f.pos.data() + first, f.pos.data(), first + n, bidir.data());
      t.q_see = see.data();
      paged_attention(t, sc);
    }
    EXPECT_NE(bidir[0], causal[0]);
  }
}

// The statistics sink against its reference twin: per KV slot, the softmax
// weights summed over every query row of the task (each row's weights sum to
// 1, so the total is n_tokens x n_rep), and one row per token of the last
// n_window. Bound: with f32 KV each weight is a float ratio of float
// exponentials (relative error ~1e-6) and a slot sums at most n_tokens x n_rep
// of them, so 1e-5 absolute. The integer kernels move scores by up to about
// 1e-3 (int8) and 1.3e-2 (int4 with 8-bit queries; see simd_tolerance), which
// moves a weight by that much relatively (d w / w = d s - sum w d s), so there
// the bound is 1e-5 + rel x reference with rel = 4e-3 and 6e-2.
TEST(paged_attention_stats, match_the_reference_twin) {
  for (const char* spec : {"f32", "int8", "int4"}) {
    const double rel = std::string(spec) == "f32" ? 0.0 : std::string(spec) == "int8" ? 4e-3 : 6e-2;
    const int H = 2, R = 4, D = 64, B = 16, N = 90, first = 30, W = 8;
    fixture f(spec, H, R, D, B, N, 17);
    const int n = N - first;
    paged_kv_view kview = f.kv->k_view(0, f.table, N), vview = f.kv->v_view(0, f.table, N);
    std::vector<float> out(static_cast<std::size_t>(n) * f.q_stride());
    attention_scratch scratch;
    for (int h = 0; h < H; ++h) {
      std::vector<float> acc_fast(N, 0.0f), win_fast(static_cast<std::size_t>(W) * N, 0.0f);
      std::vector<float> acc_ref = acc_fast, win_ref = win_fast;
      for (bool reference : {false, true}) {
        attention_task t = f.task(kview, vview, h, first, n, f.pos.data() + first, f.pos.data(), N, out.data());
        t.stats = reference ? attention_stats_out{acc_ref.data(), win_ref.data(), W}
                            : attention_stats_out{acc_fast.data(), win_fast.data(), W};
        if (reference) paged_attention_ref(t);
        else paged_attention(t, scratch);
      }
      double total = 0;
      for (int p = 0; p < N; ++p) {
        ASSERT_NEAR(acc_fast[p], acc_ref[p], 1e-5 + rel * acc_ref[p]) << spec << " slot " << p;
        total += acc_fast[p];
      }
      EXPECT_NEAR(total, static_cast<double>(n) * R, 1e-3) << spec;
      for (int r = 0; r < W; ++r) {
        double row_total = 0;
        for (int p = 0; p < N; ++p) {
          const std::size_t at = static_cast<std::size_t>(r) * N + p;
          ASSERT_NEAR(win_fast[at], win_ref[at], 1e-5 + rel * win_ref[at]) << spec << " window row " << r << " slot " << p;
          row_total += win_fast[at];
          // Causal: window row r is query position first + n - W + r.
          if (p > first + n - W + r) {
            EXPECT_EQ(win_fast[at], 0.0f);
          }
        }
        EXPECT_NEAR(row_total, R, 1e-4) << spec;
      }
    }
  }
}

}  // namespace
}  // namespace pagoda
