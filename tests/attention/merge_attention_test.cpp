// Merged KV entries keep attention mass: an entry standing for m tokens adds
// log m to its score (the per-slot bias kv_storage writes when a merge policy
// folds tokens), so the softmax gives it the weight of m copies.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "attention/paged_attention.h"
#include "kv/kv_storage.h"

namespace pagoda {
namespace {

constexpr int D = 8, H = 1, B = 4;

struct merged_case {
  std::unique_ptr<kv_storage> s = std::move(*kv_storage::create(kv_layout::uniform(1, H, D, B, kv_type::f32, kv_type::f32), 8));
  std::vector<float> q = std::vector<float>(D);
  std::vector<std::int32_t> q_pos{100};

  std::vector<float> attend(std::span<const block_id> table, int n, std::span<const std::int32_t> kv_pos, bool ref) {
    paged_kv_view k = s->k_view(0, table, n), v = s->v_view(0, table, n);
    std::vector<float> out(D, NAN);
    attention_task t;
    t.k = &k;
    t.v = &v;
    t.head_dim = D;
    t.scale = 1.0f / std::sqrt(static_cast<float>(D));
    t.q = q.data();
    t.q_stride = D;
    t.n_tokens = 1;
    t.q_pos = q_pos.data();
    t.kv_pos = kv_pos.data();
    t.n_kv = n;
    t.out = out.data();
    t.out_stride = D;
    attention_scratch sc;
    if (ref) paged_attention_ref(t);
    else paged_attention(t, sc);
    return out;
  }
};

// Tokens A, B, B', C where B' is an exact copy of B: folding B' into B (mass
// 2, bias log 2) gives the same attention output as the four tokens, at the
// reference and at the SIMD path.
TEST(merge_attention, a_merged_copy_keeps_its_attention_mass) {
  merged_case m;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> k(4 * D), v(4 * D);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  for (int d = 0; d < D; ++d) {
    k[2 * D + d] = k[1 * D + d];
    v[2 * D + d] = v[1 * D + d];
  }
  for (float& x : m.q) x = nd(rng) * 2;
  const std::vector<block_id> full_table{block_id(1)};
  m.s->write(0, full_table, 0, 4, k.data(), v.data());
  const std::int32_t pos4[] = {0, 1, 2, 3};
  const std::vector<float> full_ref = m.attend(full_table, 4, pos4, true);
  const std::vector<float> full = m.attend(full_table, 4, pos4, false);

  // The same tokens in another block, B' folded into B.
  const std::vector<block_id> table{block_id(5)};
  m.s->write(0, table, 0, 4, k.data(), v.data());
  kv_gather g;
  g.src_table = table;
  g.dst_table = table;
  g.first = 0;
  g.n = 3;
  g.sources = {0, 1, 3};
  g.fold = kv_fold::nearest;
  g.n_folded = 1;
  g.folded = {2};
  m.s->gather(g, nullptr);
  ASSERT_NE(m.s->bias_of(table[0], 0, 0), nullptr);
  EXPECT_FLOAT_EQ(m.s->bias_of(table[0], 0, 0)[1], std::log(2.0f));
  const std::int32_t pos3[] = {0, 1, 3};
  const std::vector<float> merged_ref = m.attend(table, 3, pos3, true);
  const std::vector<float> merged = m.attend(table, 3, pos3, false);
  for (int d = 0; d < D; ++d) {
    EXPECT_NEAR(merged_ref[d], full_ref[d], 1e-6) << d;
    EXPECT_NEAR(merged[d], full[d], 1e-5) << d;
  }
  // Without the bias the merged copy would count once: the output moves.
  const std::int32_t pos3b[] = {0, 1, 3};
  double moved = 0;
  std::vector<block_id> plain{block_id(6)};
  std::vector<float> kk = {k.begin(), k.begin() + 2 * D}, vv = {v.begin(), v.begin() + 2 * D};
  kk.insert(kk.end(), k.begin() + 3 * D, k.end());
  vv.insert(vv.end(), v.begin() + 3 * D, v.end());
  m.s->write(0, plain, 0, 3, kk.data(), vv.data());
  const std::vector<float> unbiased = m.attend(plain, 3, pos3b, true);
  for (int d = 0; d < D; ++d) moved += std::abs(unbiased[d] - full_ref[d]);
  EXPECT_GT(moved, 1e-3);
}

// Mass of a merged group: with near-identical keys, the merged entry receives
// the summed weight its members received (to first order in their spread).
TEST(merge_attention, a_merged_group_receives_its_members_weight) {
  merged_case m;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  constexpr int N = 8;
  std::vector<float> k(N * D), v(N * D);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  // Tokens 4..7 are small perturbations of token 3.
  for (int i = 4; i < N; ++i)
    for (int d = 0; d < D; ++d) {
      k[i * D + d] = k[3 * D + d] + 1e-3f * nd(rng);
      v[i * D + d] = v[3 * D + d] + 1e-3f * nd(rng);
    }
  for (float& x : m.q) x = nd(rng) * 2;
  const std::vector<block_id> table{block_id(2), block_id(3)};
  m.s->write(0, table, 0, N, k.data(), v.data());
  std::vector<std::int32_t> pos(N);
  std::iota(pos.begin(), pos.end(), 0);
  const std::vector<float> full = m.attend(table, N, pos, true);
  kv_gather g;
  g.src_table = table;
  g.dst_table = {table[0]};
  g.first = 0;
  g.n = 4;
  g.sources = {0, 1, 2, 3};
  g.fold = kv_fold::nearest;
  g.n_folded = 4;
  g.folded = {4, 5, 6, 7};
  m.s->gather(g, nullptr);
  EXPECT_NEAR(m.s->bias_of(table[0], 0, 0)[3], std::log(5.0f), 1e-5);
  const std::vector<float> merged = m.attend(g.dst_table, 4, std::span<const std::int32_t>(pos).first(4), true);
  for (int d = 0; d < D; ++d) EXPECT_NEAR(merged[d], full[d], 5e-3) << d;
}

}  // namespace
}  // namespace pagoda
