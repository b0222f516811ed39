// rms_norm and silu_mul at every SIMD level against their reference twins
// (model/vec_ops.h), on lengths with and without a partial last vector.
#include "model/vec_ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "model/simd_level_util.h"

namespace pagoda {
namespace {

class vec_ops_levels : public ::testing::TestWithParam<simd_level> {};

std::vector<float> random_floats(std::mt19937& rng, int n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& f : v) f = dist(rng);
  return v;
}

// Reports (the first five) where |got - ref| exceeds bound(i); the in-place
// run must give got's bits.
template <typename B>
void expect_within(const std::vector<float>& got, const std::vector<float>& ref, const std::vector<float>& in_place,
                   B&& bound) {
  int failures = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double b = bound(i);
    if (!(std::fabs(got[i] - ref[i]) <= b) && failures++ < 5)
      ADD_FAILURE() << "out[" << i << "] = " << got[i] << ", reference " << ref[i] << ", bound " << b;
    ASSERT_EQ(in_place[i], got[i]) << "in place, out[" << i << "]";
  }
}

// Lengths: shorter than one vector, whole vectors of 8 and 16, and partial
// last vectors (the masked tails).
constexpr int k_lengths[] = {1, 5, 8, 16, 23, 64, 100, 172, 256, 1000, 4096};

// fn(rng, n) for every length, one random stream.
template <typename F>
void for_each_length(unsigned seed, F&& fn) {
  std::mt19937 rng(seed);
  for (int n : k_lengths) {
    SCOPED_TRACE(testing::Message() << "n = " << n);
    fn(rng, n);
  }
}

// Bound, relative to |ref|, with u = 2^-24. The SIMD levels sum the squares in
// 8 (AVX2) or 16 (AVX-512) f32 lanes of ceil(n / lanes) fma each and a
// reduction tree of depth <= 4: all terms are positive, so the sum is within
// (ceil(n / 8) + 4) u of exact; the division by n, + eps, sqrt (which halves a
// relative error) and 1 / add 4 roundings, x * scale * w two more. The
// reference sums in double, rounds the scale once and multiplies twice in
// f32 (3 u). So |out - ref| <= ((ceil(n / 8) + 4) / 2 + 9) u |ref|; for
// n = 4096 that is 1.6e-5 relative. Leaving the tail out of the sum of squares
// (n = 100) moves the scale by about 2%, using n - 1 for n by 1 / (2n).
TEST_P(vec_ops_levels, rms_norm_matches_reference) {
  test::level_guard guard;
  PAGODA_USE_SIMD_LEVEL(GetParam());
  for_each_length(31, [](std::mt19937& rng, int n) {
    const std::vector<float> x = random_floats(rng, n, -3.0f, 3.0f), w = random_floats(rng, n, 0.5f, 1.5f);
    std::vector<float> got(x.size()), ref(x.size()), in_place = x;
    rms_norm(x.data(), w.data(), n, 1e-5f, got.data());
    rms_norm_ref(x.data(), w.data(), n, 1e-5f, ref.data());
    rms_norm(in_place.data(), w.data(), n, 1e-5f, in_place.data());  // out may alias x
    const double rel = ((std::ceil(n / 8.0) + 4) / 2 + 9) * std::ldexp(1.0, -24);
    expect_within(got, ref, in_place, [&](std::size_t i) { return rel * std::fabs(ref[i]); });
  });
}

// Bound: the polynomial exp is within 2^-21 relative of exp (its truncation
// error is below 2e-7, plus a few roundings), 1 + e, the division and the
// product with u add 3 roundings, and the reference's std::exp and its three
// operations 4 more: |out - ref| <= (2^-21 + 8 u) |ref| = 9.5e-7 |ref| for
// |g| <= 80, where neither exp overflows or underflows. Past that (|g| of 100
// and 1e4) exp saturates differently (the polynomial at exp(88.7), std::exp
// at inf), so the outputs agree only to within 1e-30 |u| absolute there; g
// itself so large gives silu(g) = g or 0. A wrong sign in exp's argument, a
// dropped tail or a missing factor moves outputs by their own size.
TEST_P(vec_ops_levels, silu_mul_matches_reference) {
  test::level_guard guard;
  PAGODA_USE_SIMD_LEVEL(GetParam());
  for_each_length(32, [](std::mt19937& rng, int n) {
    std::vector<float> g = random_floats(rng, n, -12.0f, 12.0f);
    const std::vector<float> u = random_floats(rng, n, -2.0f, 2.0f);
    const float extremes[] = {0.0f, -80.0f, 80.0f, -100.0f, 100.0f, -1e4f, 1e4f};
    for (int i = 0; i < n && i < 7; ++i) g[static_cast<std::size_t>(i * 13 % n)] = extremes[i];
    std::vector<float> got(g.size()), ref(g.size()), in_place = g;
    silu_mul(g.data(), u.data(), n, got.data());
    silu_mul_ref(g.data(), u.data(), n, ref.data());
    silu_mul(in_place.data(), u.data(), n, in_place.data());  // out may alias g
    const double rel = std::ldexp(1.0, -21) + 8 * std::ldexp(1.0, -24);
    expect_within(got, ref, in_place, [&](std::size_t i) {
      return std::fabs(g[i]) <= 80.0f ? rel * std::fabs(ref[i]) : 1e-30 * std::fabs(u[i]);
    });
  });
}

INSTANTIATE_TEST_SUITE_P(levels, vec_ops_levels, ::testing::ValuesIn(test::simd_levels_under_test()),
                         test::level_param_name);

}  // namespace
}  // namespace pagoda
