// MiniCache's row arithmetic and per-block retention (kv_merge.h), on
// hand-built rows.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <vector>

#include "kv/kv_merge.h"

namespace pagoda {
namespace {

double norm(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}

TEST(kv_merge, divergence_is_the_angle_over_pi) {
  const std::vector<float> x = {2, 0}, y = {0, 5}, z = {-1, 0}, w = {3, 3}, zero = {0, 0};
  EXPECT_FLOAT_EQ(kv_row_divergence(x.data(), x.data(), 2), 0.0f);
  EXPECT_FLOAT_EQ(kv_row_divergence(x.data(), y.data(), 2), 0.5f);
  EXPECT_FLOAT_EQ(kv_row_divergence(x.data(), z.data(), 2), 1.0f);
  EXPECT_NEAR(kv_row_divergence(x.data(), w.data(), 2), 0.25f, 1e-6);
  EXPECT_FLOAT_EQ(kv_row_divergence(x.data(), zero.data(), 2), 1.0f);
}

// Slerp of unit directions at 90 degrees: the merged direction is at t * 90
// degrees from a's, with a's magnitude; the ratio restores b's magnitude.
TEST(kv_merge, rows_interpolate_directions_and_keep_magnitudes) {
  const std::vector<float> a = {3, 0}, b = {0, 0.5f};
  std::vector<float> out(2);
  for (float t : {0.0f, 0.25f, 0.6f, 1.0f}) {
    const float ratio = kv_merge_rows(a.data(), b.data(), 2, t, out.data());
    EXPECT_FLOAT_EQ(ratio, 0.5f / 3.0f) << t;
    EXPECT_NEAR(norm(out), 3.0, 1e-6) << t;
    const double angle = std::atan2(out[1], out[0]);
    EXPECT_NEAR(angle, t * std::numbers::pi / 2, 1e-6) << t;
  }
  // Parallel rows: the direction is theirs, nothing lost.
  const std::vector<float> c = {1, 2, 2}, d = {2, 4, 4};
  std::vector<float> m(3);
  EXPECT_FLOAT_EQ(kv_merge_rows(c.data(), d.data(), 3, 0.6f, m.data()), 2.0f);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(m[i], c[i], 1e-6);
  // A zero row: nothing to scale (ratio 0), a stays when b is zero.
  const std::vector<float> zero = {0, 0, 0};
  EXPECT_EQ(kv_merge_rows(c.data(), zero.data(), 3, 0.6f, m.data()), 0.0f);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(m[i], c[i]);
  EXPECT_EQ(kv_merge_rows(zero.data(), c.data(), 3, 0.6f, m.data()), 0.0f);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(m[i], 0.0f);
}

// A block of 8 slots keeping 2 retained tokens: after every token, the
// retained ones are the 2 most divergent so far (the earliest of equals), the
// stored rows are a's for them and the merge for the others, and a displaced
// token is merged from its stored row and its retained own rows.
TEST(kv_merge, retention_keeps_the_most_divergent_tokens_of_a_block) {
  const int bs = 8, hd = 4;
  const kv_merge_shape shape{bs, hd, 2};
  std::vector<float> side(shape.head_floats(), 0.0f);
  const kv_merge_head h{side.data(), shape};
  std::mt19937 rng(7);
  std::normal_distribution<float> g;
  // The KV layer's rows of this head (what the caller stores), and each token's rows.
  std::vector<std::vector<float>> stored_k(bs), stored_v(bs), a_k(bs), a_v(bs), b_k(bs), b_v(bs);
  std::vector<float> divergence(bs);
  const float t = 0.6f;
  for (int s = 0; s < bs; ++s) {
    for (auto* r : {&a_k[s], &a_v[s], &b_k[s], &b_v[s]}) {
      r->resize(hd);
      for (float& x : *r) x = g(rng);
    }
    divergence[s] = 0.5f * (kv_row_divergence(a_k[s].data(), b_k[s].data(), hd) +
                            kv_row_divergence(a_v[s].data(), b_v[s].data(), hd));
    std::vector<float> sk(3 * hd), sv(3 * hd);
    kv_merge_write writes[2];
    int decoded = -1;
    kv_merge_token(h, s, {a_k[s].data(), a_v[s].data(), b_k[s].data(), b_v[s].data()}, t, sk.data(), sv.data(),
                   writes, [&](int slot, float* k, float* v) {
                     decoded = slot;
                     std::copy(stored_k[slot].begin(), stored_k[slot].end(), k);
                     std::copy(stored_v[slot].begin(), stored_v[slot].end(), v);
                   });
    for (const kv_merge_write& w : writes) {
      if (w.slot < 0) continue;
      stored_k[w.slot].assign(w.k, w.k + hd);
      stored_v[w.slot].assign(w.v, w.v + hd);
    }
    EXPECT_EQ(writes[0].slot, s);
    EXPECT_EQ(decoded, writes[1].slot) << "decode is asked for the displaced slot only";
    // The retained set is the top 2 by divergence of slots 0..s.
    std::vector<int> order;
    for (int j = 0; j <= s; ++j) order.push_back(j);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return divergence[x] > divergence[y]; });
    std::vector<int> want(order.begin(), order.begin() + std::min<std::size_t>(2, order.size()));
    std::vector<int> got;
    for (int e = 0; e < 2; ++e)
      if (h.slot(e) >= 0) got.push_back(h.slot(e));
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, want) << "after slot " << s;
  }
  // What the reader restores at each slot: its own rows where retained, else
  // the stored merged row times the ratio (b's magnitude, the slerp direction).
  for (int s = 0; s < bs; ++s) {
    const int e = h.find(s);
    if (e >= 0) {
      for (int i = 0; i < hd; ++i) {
        EXPECT_EQ(h.k(e)[i], b_k[s][i]);
        EXPECT_EQ(stored_k[s][i], a_k[s][i]);  // the producer reads its own
      }
      continue;
    }
    std::vector<float> mk(hd), mv(hd);
    const float rk = kv_merge_rows(a_k[s].data(), b_k[s].data(), hd, t, mk.data());
    const float rv = kv_merge_rows(a_v[s].data(), b_v[s].data(), hd, t, mv.data());
    EXPECT_FLOAT_EQ(h.ratio_k()[s], rk);
    EXPECT_FLOAT_EQ(h.ratio_v()[s], rv);
    for (int i = 0; i < hd; ++i) {
      EXPECT_NEAR(stored_k[s][i], mk[i], 1e-6);
      EXPECT_NEAR(stored_v[s][i], mv[i], 1e-6);
    }
    EXPECT_NEAR(norm(stored_k[s]) * h.ratio_k()[s], norm(b_k[s]), 1e-5);
  }
  // Truncation drops what lies past the kept tokens.
  h.drop_from(3);
  for (int e = 0; e < 2; ++e) EXPECT_LT(h.slot(e), 3);
}

TEST(kv_merge, nothing_retained_merges_every_token_and_all_retained_keeps_every_row) {
  const int bs = 4, hd = 3;
  for (int retain : {0, bs}) {
    const kv_merge_shape shape{bs, hd, retain};
    std::vector<float> side(shape.head_floats(), 0.0f);
    const kv_merge_head h{side.data(), shape};
    for (int s = 0; s < bs; ++s) {
      const std::vector<float> a = {1.0f + s, 2, 0}, b = {0, 1, 2.0f * s};
      std::vector<float> sk(3 * hd), sv(3 * hd);
      kv_merge_write writes[2];
      kv_merge_token(h, s, {a.data(), a.data(), b.data(), b.data()}, 0.5f, sk.data(), sv.data(), writes,
                     [](int, float*, float*) { FAIL() << "nothing is displaced"; });
      EXPECT_EQ(writes[1].slot, -1);
      EXPECT_EQ(h.find(s) >= 0, retain > 0);
      if (retain > 0)
        for (int i = 0; i < hd; ++i) EXPECT_EQ(writes[0].k[i], a[i]);
    }
  }
}

}  // namespace
}  // namespace pagoda
