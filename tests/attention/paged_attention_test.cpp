#include "attention/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "core/cpu.h"

namespace pagoda {
namespace {

struct fixture {
  int n_kv_heads, n_rep, head_dim, block_size, n_ctx;
  std::unique_ptr<kv_storage> kv;
  std::vector<block_id> table;
  std::vector<float> q;  // [n_ctx][n_kv_heads * n_rep * head_dim]

  fixture(kv_type type, int n_kv_heads_, int n_rep_, int head_dim_, int block_size_, int n_ctx_, unsigned seed)
      : n_kv_heads(n_kv_heads_), n_rep(n_rep_), head_dim(head_dim_), block_size(block_size_), n_ctx(n_ctx_) {
    auto layout = kv_layout::uniform(1, n_kv_heads, head_dim, block_size, type, type);
    int n_blocks = (n_ctx + block_size - 1) / block_size;
    kv = *kv_storage::create(layout, n_blocks + 7);
    // A scattered block table: attention must follow it, not assume contiguity.
    std::vector<int> ids(n_blocks + 7);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int i = 0; i < n_blocks; ++i) table.push_back(block_id(ids[i]));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> k(static_cast<std::size_t>(n_ctx) * n_kv_heads * head_dim), v(k.size());
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    // Written in uneven chunks, as prefill chunks and decode steps would.
    for (int pos = 0; pos < n_ctx;) {
      int n = std::min(n_ctx - pos, 1 + static_cast<int>(rng() % 23));
      kv->write(0, table, pos, n, &k[static_cast<std::size_t>(pos) * n_kv_heads * head_dim],
                &v[static_cast<std::size_t>(pos) * n_kv_heads * head_dim]);
      pos += n;
    }
    q.resize(static_cast<std::size_t>(n_ctx) * n_kv_heads * n_rep * head_dim);
    for (float& x : q) x = nd(rng) * 2.0f;
  }

  std::size_t q_stride() const { return static_cast<std::size_t>(n_kv_heads) * n_rep * head_dim; }

  // Attention for query tokens [first, first + n) over positions [0, first + n).
  std::vector<float> run(int first, int n, bool reference) {
    std::vector<float> out(static_cast<std::size_t>(n) * q_stride(), NAN);
    paged_kv_view kview = kv->k_view(0, table, first + n);
    paged_kv_view vview = kv->v_view(0, table, first + n);
    attention_scratch scratch;
    for (int h = 0; h < n_kv_heads; ++h) {
      attention_task t;
      t.k = &kview;
      t.v = &vview;
      t.kv_head = h;
      t.n_rep = n_rep;
      t.head_dim = head_dim;
      t.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
      t.q = q.data() + static_cast<std::size_t>(first) * q_stride();
      t.q_stride = q_stride();
      t.n_tokens = n;
      t.pos0 = first;
      t.out = out.data();
      t.out_stride = q_stride();
      if (reference) paged_attention_ref(t);
      else paged_attention(t, scratch);
    }
    return out;
  }
};

struct params {
  kv_type type;
  int n_kv_heads, n_rep, head_dim, block_size, n_ctx;
};

class paged_attention_p : public ::testing::TestWithParam<params> {};

// Against a double-precision reference on decoded K/V: the fast path rounds in
// float (scores, exp, sums over up to n_ctx terms), so we allow 2e-5 absolute on
// outputs whose magnitude is O(1) (values ~ N(0,1), weights summing to 1).
TEST_P(paged_attention_p, matches_reference) {
  const params& p = GetParam();
  for (simd_level level : {simd_level::scalar, simd_level::avx512}) {
    set_simd_level(level);
    fixture f(p.type, p.n_kv_heads, p.n_rep, p.head_dim, p.block_size, p.n_ctx, 11);
    auto ref = f.run(0, p.n_ctx, true);
    auto got = f.run(0, p.n_ctx, false);
    for (std::size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], 2e-5) << "i=" << i << " level " << simd_level_name(level);
  }
  set_simd_level(simd_level::avx512);
}

// The batch-invariance property: a query row computed inside a prefill chunk of
// any size equals, bit for bit, the same row computed alone as a decode step.
TEST_P(paged_attention_p, chunked_equals_token_by_token_bitwise) {
  const params& p = GetParam();
  fixture f(p.type, p.n_kv_heads, p.n_rep, p.head_dim, p.block_size, p.n_ctx, 5);
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
                         ::testing::Values(params{kv_type::f32, 4, 2, 8, 16, 70},      // stories260K-like
                                           params{kv_type::f16, 4, 2, 8, 16, 70},
                                           params{kv_type::f32, 2, 4, 128, 16, 150},   // llama3-like GQA
                                           params{kv_type::f16, 2, 4, 128, 16, 150},
                                           params{kv_type::f32, 1, 1, 64, 32, 100},    // MHA, other block size
                                           params{kv_type::f16, 3, 3, 40, 8, 33}));

TEST(softmax, simd_matches_reference) {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.0f, 5.0f);
  for (int n : {1, 3, 16, 17, 100, 1000}) {
    std::vector<float> a(n), b;
    for (float& x : a) x = nd(rng);
    b = a;
    float sa = softmax_unnormalized_ref(a.data(), n);
    set_simd_level(simd_level::avx512);
    float sb = softmax_unnormalized(b.data(), n);
    EXPECT_NEAR(sb, sa, 1e-5 * sa);
    // Each exp within 4 ulp-ish (relative 5e-7) of std::exp.
    for (int i = 0; i < n; ++i) ASSERT_NEAR(b[i], a[i], 5e-7 * a[i] + 1e-30) << n << " " << i;
  }
}

}  // namespace
}  // namespace pagoda
