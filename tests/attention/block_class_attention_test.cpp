// Attention over block tables that mix KV block classes (kv_backend.h): f16,
// int8 and KIVI int4 blocks in one sequence, the last block open (its int4
// keys staged in f16). The reference is attention in double precision over
// what each slot decodes to in a storage of its block's class alone, so it
// does not go through class-aware views.
#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "attention/attention_fixture.h"
#include "attention/gather_attention.h"
#include "core/simd_levels.h"
#include "kv/kv_storage.h"

namespace pagoda {
namespace {

using attention_test::fixture;

constexpr int H = 2, R = 4, D = 128, B = 16, N = 150;  // 10 blocks, 6 tokens in the last
constexpr int k_per_class = 12;
const char* const k_specs[3] = {"f16", "int8", "int4"};  // classes 0, 1, 2
// Each table block's class: runs of one, two and three blocks, the open last block int4.
const std::vector<int> k_mixed = {2, 2, 0, 1, 1, 1, 2, 0, 0, 2};

kv_layout layout_of(const char* spec) {
  const kv_pair_spec pair = *parse_kv_pair_spec(spec);
  kv_layout l = kv_layout::uniform(1, H, D, B, kv_type::f32, kv_type::f32);
  l.k_formats[0] = pair.k.resolve(kv_role::key, false);
  l.v_formats[0] = pair.v.resolve(kv_role::value, false);
  return l;
}

// f's K/V into table, in uneven chunks that depend only on seed.
void write_chunks(const fixture& f, kv_backend& kv, std::span<const block_id> table, unsigned seed) {
  std::mt19937 rng(seed);
  const std::size_t row = static_cast<std::size_t>(H) * D;
  for (int p = 0; p < N;) {
    const int n = std::min(N - p, 1 + static_cast<int>(rng() % 23));
    kv.write(0, table, p, n, &f.k[p * row], &f.v[p * row]);
    p += n;
  }
}

// f's K/V in a storage of the three classes (k_per_class blocks each), table
// block i of class classes[i], each class's ids in a scattered order.
struct mixed_cache {
  std::unique_ptr<kv_storage> kv;
  std::vector<block_id> table;

  mixed_cache(const fixture& f, std::span<const int> classes, unsigned seed) {
    const std::vector<kv_class_spec> extra{{layout_of(k_specs[1]), k_per_class}, {layout_of(k_specs[2]), k_per_class}};
    kv = std::move(*kv_storage::create(layout_of(k_specs[0]), k_per_class, 2, extra));
    std::mt19937 rng(seed);
    std::vector<std::vector<int>> ids(3, std::vector<int>(k_per_class));
    for (int c = 0; c < 3; ++c) {
      std::iota(ids[c].begin(), ids[c].end(), c * k_per_class);
      std::shuffle(ids[c].begin(), ids[c].end(), rng);
    }
    for (int c : classes) {
      table.push_back(block_id(ids[c].back()));
      ids[c].pop_back();
    }
    write_chunks(f, *kv, table, seed);
  }
};

// Overwrites f's f32 cache with what each slot decodes to in a storage of
// its block's class alone (written in the same chunks): attention over f's
// cache is then the reference for the mixed table.
void decode_into(fixture& f, std::span<const int> classes, unsigned seed) {
  const std::size_t row = static_cast<std::size_t>(H) * D;
  std::vector<float> dk(N * row), dv(N * row);
  for (int c = 0; c < 3; ++c) {
    auto single = *kv_storage::create(layout_of(k_specs[c]), f.kv->n_blocks(), 2);
    write_chunks(f, *single, f.table, seed);
    const paged_kv_view kv = single->k_view(0, f.table, N), vv = single->v_view(0, f.table, N);
    for (int p = 0; p < N; ++p)
      if (classes[p / B] == c)
        for (int h = 0; h < H; ++h) {
          decode_kv_rows(kv, h, p, 1, &dk[p * row + h * D]);
          decode_kv_rows(vv, h, p, 1, &dv[p * row + h * D]);
        }
  }
  f.kv->write(0, f.table, 0, N, dk.data(), dv.data());
}

// The tolerance of the classes' formats at a level (test::simd_tolerance).
double tolerance(simd_level level) {
  double tol = 0;
  for (const char* spec : k_specs) tol = std::max(tol, test::simd_tolerance(spec, level));
  return tol;
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tol) << "i=" << i;
}

void expect_bitwise(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i])) << "i=" << i;
}

// gather_attention of the last n query tokens over the listed slots of a view pair.
std::vector<float> gather_on(const fixture& f, const kv_backend& kv, std::span<const block_id> table,
                             std::span<const std::int32_t> slots, int n, bool reference) {
  std::vector<float> out(static_cast<std::size_t>(n) * f.q_stride(), NAN);
  const paged_kv_view kview = kv.k_view(0, table, N), vview = kv.v_view(0, table, N);
  gather_scratch sc;
  for (int h = 0; h < H; ++h) {
    const attention_task t = f.task(kview, vview, h, N - n, n, f.pos.data() + (N - n), f.pos.data(), N, out.data());
    if (reference) gather_attention_ref(t, slots);
    else gather_attention(t, slots, sc);
  }
  return out;
}

class block_class_attention : public ::testing::TestWithParam<simd_level> {
 protected:
  test::simd_level_guard guard_;
};

// Prefill, a chunk and a decode step over the mixed table, plain, windowed
// and soft-capped; the class-aware reference twin agrees as well.
TEST_P(block_class_attention, paged_matches_the_decoded_reference) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  fixture f("f32", H, R, D, B, N, 31);
  const mixed_cache m(f, k_mixed, 5);
  ASSERT_TRUE(m.kv->k_view(0, m.table, N).is_staged(9));
  decode_into(f, k_mixed, 5);
  const double tol = tolerance(GetParam());
  for (auto [first, n] : {std::pair{0, N}, std::pair{N - 3, 3}, std::pair{N - 1, 1}}) {
    SCOPED_TRACE("first " + std::to_string(first) + " n " + std::to_string(n));
    const auto want = f.run(first, n, true);
    expect_near(f.run_on(*m.kv, m.table, first, n, false), want, tol);
    expect_near(f.run_on(*m.kv, m.table, first, n, true), want, 1e-6);
    expect_near(f.run_on(*m.kv, m.table, first, n, false, 40), f.run(first, n, true, 40), tol);
    expect_near(f.run_on(*m.kv, m.table, first, n, false, 0, 5.0f), f.run(first, n, true, 0, 5.0f), tol + 1e-5);
  }
}

// Batch invariance holds across classes: a row inside a prefill chunk equals
// the same row computed alone, bit for bit.
TEST_P(block_class_attention, chunked_equals_token_by_token_bitwise) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  fixture f("f32", H, R, D, B, N, 37);
  const mixed_cache m(f, k_mixed, 8);
  const auto whole = f.run_on(*m.kv, m.table, 0, N, false);
  const std::size_t stride = f.q_stride();
  for (int p = 0; p < N; p += 1 + p / 4) {
    const auto one = f.run_on(*m.kv, m.table, p, 1, false);
    expect_bitwise(one, std::vector<float>(whole.begin() + p * stride, whole.begin() + (p + 1) * stride));
  }
}

// Sparse reads: ranges that start and end inside blocks of every class.
TEST_P(block_class_attention, sparse_ranges_match_the_decoded_reference) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  fixture f("f32", H, R, D, B, N, 41);
  const mixed_cache m(f, k_mixed, 6);
  decode_into(f, k_mixed, 6);
  const std::vector<slot_range> ranges{{0, 4}, {20, 37}, {50, 52}, {70, 96}, {131, N}};
  for (auto [first, n] : {std::pair{N - 5, 5}, std::pair{N - 1, 1}})
    expect_near(f.run_on(*m.kv, m.table, first, n, false, 0, 0.0f, ranges),
                f.run_on(*f.kv, f.table, first, n, true, 0, 0.0f, ranges), tolerance(GetParam()));
}

// Scattered and dense listed slots across classes, the staged block included.
TEST_P(block_class_attention, gather_matches_the_decoded_reference) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  fixture f("f32", H, R, D, B, N, 43);
  const mixed_cache m(f, k_mixed, 7);
  decode_into(f, k_mixed, 7);
  std::vector<std::int32_t> slots;
  std::mt19937 rng(2);
  for (int p = 0; p < N; ++p)
    if (p < 4 || p >= N - 10 || (p / B) % 3 == 1 || rng() % 5 == 0) slots.push_back(p);  // some blocks dense
  for (int n : {1, 3})
    expect_near(gather_on(f, *m.kv, m.table, slots, n, false), gather_on(f, *f.kv, f.table, slots, n, true),
                tolerance(GetParam()));
}

// A table of one extra class reads through the same codec calls as a storage
// of that format alone: bit for bit the same outputs.
TEST_P(block_class_attention, one_extra_class_equals_its_single_class_storage_bitwise) {
  PAGODA_USE_SIMD_LEVEL(GetParam());
  for (int c : {1, 2}) {
    SCOPED_TRACE(k_specs[c]);
    fixture f(k_specs[c], H, R, D, B, N, 47);  // writes its K/V in its own chunks; codes do not depend on them
    const std::vector<int> classes(k_mixed.size(), c);
    const mixed_cache m(f, classes, 9);
    for (auto [first, n] : {std::pair{0, N}, std::pair{N - 1, 1}})
      expect_bitwise(f.run_on(*m.kv, m.table, first, n, false), f.run(first, n, false));
    std::vector<std::int32_t> slots;
    for (int p = 0; p < N; p += 1 + p % 5) slots.push_back(p);
    expect_bitwise(gather_on(f, *m.kv, m.table, slots, 2, false), gather_on(f, *f.kv, f.table, slots, 2, false));
  }
}

INSTANTIATE_TEST_SUITE_P(levels, block_class_attention, ::testing::ValuesIn(test::simd_levels_under_test()),
                         [](const auto& info) { return std::string(simd_level_name(info.param)); });

}  // namespace
}  // namespace pagoda
