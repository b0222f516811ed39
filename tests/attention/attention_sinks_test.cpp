// Attention sinks (gpt-oss's learned per-head logits, attention_task::sinks)
// in every attention path: the softmax kernels at each SIMD level, paged
// attention over exact and quantized KV (with windows, sparse ranges and
// statistics), and gathered attention; each against its double-precision
// reference twin, which spells the sink out as one more softmax term.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "attention/attention_fixture.h"
#include "attention/gather_attention.h"
#include "attention/paged_attention.h"
#include "core/cpu.h"
#include "core/simd_levels.h"

namespace pagoda {
namespace {

using attention_test::fixture;
using attention_test::simd_tolerance;
using test::attention_shape;

class sink_softmax_level : public ::testing::TestWithParam<simd_level> {
 protected:
  test::simd_level_guard guard_;
};

// With a sink the max runs over the scores and the sink, and the sum gains
// exp(sink - max): sinks below, among and far above the scores.
TEST_P(sink_softmax_level, simd_matches_reference) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int n : {1, 7, 16, 17, 100}) {
    for (float sink : {-50.0f, -1.0f, 0.5f, 4.0f, 60.0f}) {
      std::vector<float> a(n), b;
      for (float& x : a) x = nd(rng);
      b = a;
      // The definition, in double: the sum of exp(x - m) and exp(sink - m), m the max of all.
      double m = sink, want = 0;
      for (float x : a) m = std::max(m, static_cast<double>(x));
      for (float x : a) want += std::exp(x - m);
      want += std::exp(sink - m);
      const float sa = softmax_unnormalized_ref(a.data(), n, sink);
      const float sb = softmax_unnormalized(b.data(), n, sink);
      EXPECT_NEAR(sa, want, 1e-5 * want) << n << " sink " << sink;
      EXPECT_NEAR(sb, sa, 1e-5 * sa) << n << " sink " << sink;
      for (int i = 0; i < n; ++i) ASSERT_NEAR(b[i], a[i], 5e-7 * a[i] + 1e-30) << n << " " << i;
      if (sink == 60.0f) {
        EXPECT_NEAR(sa, 1.0f, 1e-6);  // the sink holds all the mass
      }
    }
  }
}

TEST(sink_softmax, minus_infinity_is_no_sink_bitwise) {
  for (simd_level level : test::simd_levels_under_test()) {
    test::simd_level_guard guard;
    PAGODA_USE_SIMD_LEVEL(level);
    std::vector<float> a = {0.3f, -2.0f, 5.0f, 1.0f, 0.0f, 7.5f, -3.0f, 2.0f, 1.5f}, b = a;
    const float sa = softmax_unnormalized(a.data(), static_cast<int>(a.size()));
    const float sb = softmax_unnormalized(b.data(), static_cast<int>(b.size()), -INFINITY);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(sa), std::bit_cast<std::uint32_t>(sb));
    EXPECT_EQ(a, b);
  }
}

INSTANTIATE_TEST_SUITE_P(levels, sink_softmax_level, ::testing::ValuesIn(test::simd_levels_under_test()),
                         test::level_param_name);

// Per query head sink logits around the scores' range (scores here have a
// standard deviation of about 2), one far above (its head's outputs shrink
// towards 0) and one far below (no effect).
std::vector<float> some_sinks(int n_heads) {
  std::vector<float> s(static_cast<std::size_t>(n_heads));
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(1.0f, 2.0f);
  for (float& x : s) x = nd(rng);
  s[0] = 40.0f;
  if (n_heads > 1) s[1] = -40.0f;
  return s;
}

class sinks_p : public test::attention_shape_test {};

// Paged attention with sinks against the reference (the tolerances of
// paged_attention_test's matches_reference), batch invariant, and the sinks
// change the output: the +40 head's rows are all but zero, the -40 head's
// equal attention without sinks.
TEST_P(sinks_p, paged_matches_reference_and_is_batch_invariant) {
  PAGODA_USE_SIMD_LEVEL(level());
  const attention_shape& p = this->p();
  fixture f(p.spec, p.n_kv_heads, p.n_rep, p.head_dim, p.block_size, p.n_ctx, 31);
  const auto plain = f.run(0, p.n_ctx, false);
  f.sinks = some_sinks(p.n_kv_heads * p.n_rep);
  const auto ref = f.run(0, p.n_ctx, true);
  const auto got = f.run(0, p.n_ctx, false);
  const double tol = simd_tolerance(p.spec, level());
  for (std::size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], tol) << "i=" << i;
  const std::size_t stride = f.q_stride(), hd = static_cast<std::size_t>(p.head_dim);
  double moved = 0;
  for (int t = 0; t < p.n_ctx; ++t)
    for (std::size_t d = 0; d < hd; ++d) {
      const std::size_t h0 = t * stride + d, h1 = t * stride + hd + d;
      ASSERT_LT(std::fabs(got[h0]), 1e-9) << "head 0 (sink +40), token " << t;
      ASSERT_EQ(got[h1], plain[h1]) << "head 1 (sink -40), token " << t;
      for (std::size_t h = 2; h < stride / hd; ++h) moved = std::max(moved, static_cast<double>(std::fabs(got[t * stride + h * hd + d] - plain[t * stride + h * hd + d])));
    }
  EXPECT_GT(moved, 0.05);
  for (int pos : {0, p.n_ctx / 2, p.n_ctx - 1}) {
    const auto one = f.run(pos, 1, false);
    for (std::size_t i = 0; i < stride; ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(one[i]), std::bit_cast<std::uint32_t>(got[pos * stride + i]))
          << "position " << pos << " i " << i;
  }
}

// With a sliding window (gpt-oss's local layers) and sparse ranges.
TEST_P(sinks_p, window_and_ranges_match_reference) {
  PAGODA_USE_SIMD_LEVEL(level());
  const attention_shape& p = this->p();
  fixture f(p.spec, p.n_kv_heads, p.n_rep, p.head_dim, p.block_size, p.n_ctx, 37);
  f.sinks = some_sinks(p.n_kv_heads * p.n_rep);
  const double tol = simd_tolerance(p.spec, level());
  const int window = p.block_size + 3;
  auto ref = f.run(0, p.n_ctx, true, window);
  auto got = f.run(0, p.n_ctx, false, window);
  for (std::size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], tol) << "window, i=" << i;
  // Ranges: the first block and a run in the middle, for the last quarter of the queries.
  const int first = p.n_ctx * 3 / 4, n = p.n_ctx - first;
  const std::vector<slot_range> ranges = {{0, p.block_size}, {p.n_ctx / 3, p.n_ctx / 3 + 9}, {first, p.n_ctx}};
  ref = f.run_on(*f.kv, f.table, first, n, true, 0, 0.0f, ranges);
  got = f.run_on(*f.kv, f.table, first, n, false, 0, 0.0f, ranges);
  for (std::size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], tol) << "ranges, i=" << i;
}

// Gathered attention (retrieval's path) with sinks against its reference,
// and over every slot equal to paged attention with sinks.
TEST_P(sinks_p, gathered_matches_reference) {
  PAGODA_USE_SIMD_LEVEL(level());
  const attention_shape& p = this->p();
  fixture f(p.spec, p.n_kv_heads, p.n_rep, p.head_dim, p.block_size, p.n_ctx, 41);
  f.sinks = some_sinks(p.n_kv_heads * p.n_rep);
  const double tol = simd_tolerance(p.spec, level());
  const int first = p.n_ctx - 4, n = 4;
  std::vector<std::int32_t> slots;
  for (int s = 0; s < p.n_ctx; s += 1 + s % 3) slots.push_back(s);
  std::vector<std::int32_t> every(static_cast<std::size_t>(p.n_ctx));
  std::iota(every.begin(), every.end(), 0);
  paged_kv_view kview = f.kv->k_view(0, f.table, p.n_ctx), vview = f.kv->v_view(0, f.table, p.n_ctx);
  const std::size_t size = static_cast<std::size_t>(n) * f.q_stride();
  std::vector<float> got(size), ref(size), all(size);
  gather_scratch scratch;
  auto task = [&](int h, std::vector<float>& out) {
    return f.task(kview, vview, h, first, n, f.pos.data() + first, f.pos.data(), p.n_ctx, out.data());
  };
  for (int h = 0; h < p.n_kv_heads; ++h) {
    gather_attention(task(h, got), slots, scratch);
    gather_attention_ref(task(h, ref), slots);
    gather_attention(task(h, all), every, scratch);
  }
  for (std::size_t i = 0; i < size; ++i) ASSERT_NEAR(got[i], ref[i], tol) << "i=" << i;
  const auto paged = f.run(first, n, false);
  for (std::size_t i = 0; i < size; ++i) ASSERT_NEAR(all[i], paged[i], tol) << "every slot, i=" << i;
}

INSTANTIATE_TEST_SUITE_P(formats, sinks_p,
                         ::testing::Combine(::testing::Values(attention_shape{"f32", 2, 4, 64, 16, 90},
                                                              attention_shape{"f16", 4, 2, 8, 16, 70},
                                                              attention_shape{"int8", 2, 4, 128, 16, 100},
                                                              attention_shape{"int4", 2, 4, 64, 16, 90},
                                                              attention_shape{"int4+f16", 2, 4, 64, 16, 90},
                                                              attention_shape{"q4_0", 2, 4, 128, 16, 100}),
                                            ::testing::ValuesIn(test::simd_levels_under_test())),
                         [](const auto& info) {
                           return test::attention_shape_name(std::get<0>(info.param), std::get<1>(info.param), false);
                         });

// The statistics eviction policies read are the slots' probabilities: with
// sinks they match the reference and each row's total is what the sink left.
TEST(sinks_stats, match_the_reference_and_sum_below_one) {
  const int H = 2, R = 2, D = 64, B = 16, N = 60;
  fixture f("f32", H, R, D, B, N, 43);
  f.sinks = {1.0f, 2.5f, -0.5f, 3.0f};
  paged_kv_view kview = f.kv->k_view(0, f.table, N), vview = f.kv->v_view(0, f.table, N);
  std::vector<float> out(static_cast<std::size_t>(N) * f.q_stride());
  attention_scratch scratch;
  for (int h = 0; h < H; ++h) {
    std::vector<float> fast(N, 0.0f), ref(N, 0.0f);
    for (bool reference : {false, true}) {
      attention_task t = f.task(kview, vview, h, 0, N, f.pos.data(), f.pos.data(), N, out.data());
      t.stats = attention_stats_out{reference ? ref.data() : fast.data(), nullptr, 0};
      if (reference) paged_attention_ref(t);
      else paged_attention(t, scratch);
    }
    double total = 0;
    for (int p = 0; p < N; ++p) {
      ASSERT_NEAR(fast[p], ref[p], 1e-5) << "slot " << p;
      total += fast[p];
    }
    // Every one of the N x R rows gives less than 1 to the slots (the sinks
    // are within a few units of the scores), the first row least of all.
    EXPECT_LT(total, N * R - 0.5);
    EXPECT_GT(total, 0.0);
  }
}

}  // namespace
}  // namespace pagoda
