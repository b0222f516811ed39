// The upper layer of a MiniCache pair (kv/kv_merge.h) reads the shared KV
// with per-slot ratios and retained rows: paged attention against its plain
// reference twin (which restores the rows first, then attends), at every
// SIMD level and per-token KV type, with GQA, prompt chunks, and sparse ranges.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <tuple>

#include "attention/attention_test_util.h"
#include "attention/paged_attention.h"
#include "core/simd_levels.h"
#include "kv/kv_storage.h"
#include "quant/kv_format_spec.h"

namespace pagoda {
namespace {

class kv_merge_attention : public ::testing::TestWithParam<std::tuple<const char*, simd_level>> {
 protected:
  test::simd_level_guard guard_;
};

// Tolerances: those of plain attention against its reference at the level
// (test::simd_tolerance); the ratios and retained rows add float rounding only.
TEST_P(kv_merge_attention, reader_matches_the_restoring_reference) {
  PAGODA_USE_SIMD_LEVEL(std::get<1>(GetParam()));
  const double tol = test::simd_tolerance(std::get<0>(GetParam()), std::get<1>(GetParam()));
  constexpr int H = 2, rep = 2, D = 32, B = 16, N = 70;
  const kv_pair_spec pair = *parse_kv_pair_spec(std::get<0>(GetParam()));
  kv_layout flat = kv_layout::uniform(2, H, D, B, kv_type::f32, kv_type::f32);
  for (int l = 0; l < 2; ++l) {
    flat.k_formats[static_cast<std::size_t>(l)] = pair.k.resolve(kv_role::key, false);
    flat.v_formats[static_cast<std::size_t>(l)] = pair.v.resolve(kv_role::value, false);
  }
  auto shared = share_kv_layers(flat, std::vector<int>{0, 0}, "minicache");
  ASSERT_TRUE(shared.ok()) << shared.error().message();
  auto layout = merge_kv_layers(*shared, std::vector<int>{1}, 0.6f, 3);
  ASSERT_TRUE(layout.ok()) << layout.error().message();
  auto kv = *kv_storage::create(*layout, 8);
  const std::vector<block_id> table = {block_id(6), block_id(2), block_id(4), block_id(1), block_id(7)};
  std::mt19937 rng(11);
  std::normal_distribution<float> g;
  const std::size_t row = static_cast<std::size_t>(H) * D;
  std::vector<float> ak(N * row), av(N * row), bk(N * row), bv(N * row);
  for (auto* x : {&ak, &av, &bk, &bv})
    for (float& f : *x) f = g(rng);
  for (std::size_t i = 0; i < bk.size(); ++i) {  // the upper layer's rows: near the lower's, some far
    bk[i] = 0.8f * ak[i] + 0.3f * bk[i];
    bv[i] = 0.7f * av[i] + 0.4f * bv[i];
  }
  for (int at = 0; at < N;) {  // a chunk of 37, then steps of one and two
    const int n = at == 0 ? 37 : std::min(N - at, 1 + at % 2);
    const std::size_t off = static_cast<std::size_t>(at) * row;
    kv->write(0, table, at, n, ak.data() + off, av.data() + off);
    kv->merge_write(0, table, at, n, bk.data() + off, bv.data() + off, ak.data() + off, av.data() + off);
    at += n;
  }
  std::vector<float> q(3 * static_cast<std::size_t>(H) * rep * D);
  for (float& f : q) f = g(rng);
  std::vector<std::int32_t> kv_pos(N), q_pos = {N - 3, N - 2, N - 1};
  for (int i = 0; i < N; ++i) kv_pos[static_cast<std::size_t>(i)] = i;
  for (const bool reader : {true, false})
    for (const bool sparse : {false, true}) {
      paged_kv_view k = kv->k_view(0, table, N), v = kv->v_view(0, table, N);
      if (reader) kv->attach_merge(0, k, v);
      ASSERT_EQ(k.merge != nullptr, reader);
      const std::vector<slot_range> ranges = {{0, 16}, {20, 21}, {40, 64}, {66, 70}};
      for (int h = 0; h < H; ++h) {
        std::vector<float> out(q.size(), NAN), want(q.size(), NAN);
        attention_task t;
        t.k = &k;
        t.v = &v;
        t.kv_head = h;
        t.n_rep = rep;
        t.head_dim = D;
        t.scale = 1.0f / std::sqrt(static_cast<float>(D));
        t.q = q.data();
        t.q_stride = static_cast<std::size_t>(H) * rep * D;
        t.n_tokens = 3;
        t.q_pos = q_pos.data();
        t.kv_pos = kv_pos.data();
        t.n_kv = N;
        t.out_stride = t.q_stride;
        if (sparse) t.ranges = ranges;
        t.out = out.data();
        attention_scratch sc;
        paged_attention(t, sc);
        t.out = want.data();
        paged_attention_ref(t);
        for (int i = 0; i < 3; ++i)
          for (int j = 0; j < rep; ++j)
            for (int d = 0; d < D; ++d) {
              const std::size_t at = static_cast<std::size_t>(i) * t.q_stride + static_cast<std::size_t>(h * rep + j) * D + d;
              EXPECT_NEAR(out[at], want[at], tol * (1 + std::abs(want[at])))
                  << "reader " << reader << " sparse " << sparse << " head " << h << " row " << i << "," << j;
            }
      }
    }
  // Something was retained and something merged in every block.
  for (int b = 0; b < 4; ++b) {
    const kv_merge_ref m = [&] {
      paged_kv_view k = kv->k_view(0, table, N), v = kv->v_view(0, table, N);
      kv->attach_merge(0, k, v);
      return k.merge_of(b, 0);
    }();
    int retained = 0, merged = 0;
    for (int e = 0; e < 3; ++e) retained += m.slot(e) >= 0;
    for (int s = 0; s < B; ++s) merged += m.ratio_k()[s] > 0;
    EXPECT_EQ(retained, 3) << b;
    EXPECT_EQ(merged, B - 3) << b;
  }
}

INSTANTIATE_TEST_SUITE_P(types, kv_merge_attention,
                         ::testing::Combine(::testing::Values("f32", "f16", "bf16", "int8", "fp8", "int4/token"),
                                            ::testing::ValuesIn(test::simd_levels_under_test())),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param);
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n + "_" + simd_level_name(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace pagoda
