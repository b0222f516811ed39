// copy_kv_slots (spec/kv_mirror.h): what fills a KV mirror.
#include "spec/kv_mirror.h"

#include <random>

#include <gtest/gtest.h>

#include "attention/gather_attention.h"
#include "kv/kv_storage.h"

namespace pagoda {
namespace {

constexpr int k_layers = 2, k_heads = 2, k_dim = 32, k_block = 16;

std::unique_ptr<kv_storage> storage(kv_type type, std::int64_t n_blocks) {
  return std::move(*kv_storage::create(kv_layout::uniform(k_layers, k_heads, k_dim, k_block, type, type), n_blocks, 4));
}

// One head's slots [0, n) of a view, decoded.
std::vector<float> decoded(const paged_kv_view& v, int head, int n) {
  std::vector<float> out(static_cast<std::size_t>(n) * k_dim);
  for (int at = 0; at < n; at += k_block)
    decode_kv_rows(v, head, at, std::min(k_block, n - at), out.data() + static_cast<std::size_t>(at) * k_dim);
  return out;
}

// Slots copied in pieces as a runner copies them (a prompt, then a step at a
// time, across block boundaries) hold what the source reads: exactly into a
// mirror of the same type, within the mirror's quantization otherwise (the
// worst errors measured on these N(0, 1) values: int8 0.011, int4 0.18).
TEST(copy_kv_slots, copies_what_the_source_reads_into_the_mirrors_type) {
  const int n = 45;  // three blocks, the last open
  auto src = storage(kv_type::f32, 3);
  const std::vector<block_id> table{block_id(0), block_id(1), block_id(2)};
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<std::size_t>(n) * k_heads * k_dim), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = nd(rng), v[i] = nd(rng);
  for (int l = 0; l < k_layers; ++l) src->write(l, table, 0, n, k.data(), v.data());
  const std::span<const block_id> tables[] = {table};
  for (const auto& [type, tolerance] : {std::pair{kv_type::f32, 0.0f}, std::pair{kv_type::int8, 0.03f}, std::pair{kv_type::int4, 0.4f}}) {
    auto dst = storage(type, 3);
    kv_copy_scratch scratch;
    for (const auto& [from, end] : {std::pair{0, 20}, std::pair{20, 21}, std::pair{21, 33}, std::pair{33, 45}})
      copy_kv_slots(*src, tables, *dst, table, from, end, scratch);
    for (int l = 0; l < k_layers; ++l)
      for (int h = 0; h < k_heads; ++h) {
        const auto want_k = decoded(src->k_view(l, table, n), h, n), got_k = decoded(dst->k_view(l, table, n), h, n);
        const auto want_v = decoded(src->v_view(l, table, n), h, n), got_v = decoded(dst->v_view(l, table, n), h, n);
        float worst = 0;
        for (std::size_t i = 0; i < want_k.size(); ++i)
          worst = std::max({worst, std::abs(want_k[i] - got_k[i]), std::abs(want_v[i] - got_v[i])});
        EXPECT_LE(worst, tolerance) << kv_type_name(type) << " layer " << l << " head " << h;
        if (type == kv_type::f32) EXPECT_EQ(worst, 0.0f);
      }
  }
}

}  // namespace
}  // namespace pagoda
