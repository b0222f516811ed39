// retrieval_side_memory (retrieval.h): the bound the scheduler charges
// against the KV pool is never below what a selector really holds
// (memory_bytes) as its sequence grows, for every index kind.
#include <random>

#include <gtest/gtest.h>

#include "kv/kv_storage.h"
#include "policy/retrieval.h"

namespace pagoda {
namespace {

void check_bound(const retrieval_params& p, int n_tokens) {
  constexpr int n_kv_heads = 2, head_dim = 16, block_size = 16;
  const kv_layout layout = kv_layout::uniform(1, n_kv_heads, head_dim, block_size, kv_type::f32, kv_type::f32);
  const int n_blocks = (n_tokens + block_size - 1) / block_size;
  auto kv = *kv_storage::create(layout, n_blocks);
  std::vector<block_id> table;
  for (int i = 0; i < n_blocks; ++i) table.push_back(block_id(i));
  std::mt19937 rng(7);
  std::normal_distribution<float> g;
  const std::size_t row = static_cast<std::size_t>(n_kv_heads) * head_dim;
  std::vector<float> k(static_cast<std::size_t>(n_tokens) * row), v(k.size());
  for (float& x : k) x = g(rng);
  for (float& x : v) x = g(rng);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(n_tokens));
  for (int i = 0; i < n_tokens; ++i) pos[static_cast<std::size_t>(i)] = i;

  retrieval_selector sel(p, 1, n_kv_heads, head_dim);
  const side_charge bound = retrieval_side_memory(p, 1, n_kv_heads, head_dim);
  std::size_t most = 0;
  for (int n = 0; n < n_tokens;) {
    const int m = std::min(block_size, n_tokens - n);
    kv->write(0, table, n, m, &k[static_cast<std::size_t>(n) * row], &v[static_cast<std::size_t>(n) * row]);
    n += m;
    sel.on_layer_written(0, kv->k_view(0, table, n), std::span(pos).first(static_cast<std::size_t>(n)), n);
    const std::size_t held = sel.memory_bytes();
    most = std::max(most, held);
    ASSERT_LE(static_cast<std::int64_t>(held), bound.bytes_for(n)) << "at " << n << " tokens";
  }
  EXPECT_TRUE(sel.error_status().ok()) << sel.error_status().message();
  EXPECT_GT(most, 0u);
  std::fprintf(stderr, "index %d: %zu bytes held at %d tokens, bound %lld\n", static_cast<int>(p.index), most,
               n_tokens, static_cast<long long>(bound.bytes_for(n_tokens)));
}

TEST(retrieval_side, the_charged_bound_covers_what_every_index_holds) {
  retrieval_params hnsw;
  hnsw.index = retrieval_index_kind::hnsw;
  hnsw.background = false;
  check_bound(hnsw, 3000);  // past hnsw's first capacity of 1024: one doubling
  retrieval_params ivfpq;
  ivfpq.index = retrieval_index_kind::ivfpq;
  ivfpq.ivfpq.nlist = 16;
  ivfpq.ivfpq.m = 4;
  ivfpq.ivfpq.nprobe = 4;
  ivfpq.background = false;
  check_bound(ivfpq, 12000);  // trains at 39 x 256 keys, then adds to the lists
  retrieval_params automatic = ivfpq;
  automatic.index = retrieval_index_kind::auto_;
  automatic.auto_min = 10240;
  check_bound(automatic, 12000);  // exact below 10240 slots, IVF-PQ (copies released) from there
  retrieval_params exact;
  exact.index = retrieval_index_kind::exact;
  exact.background = false;
  check_bound(exact, 2000);
}

TEST(retrieval_side, the_policy_reports_its_bound) {
  kv_policy_spec spec;
  spec.name = "retrieval";
  auto p = make_retrieval_policy(spec);
  ASSERT_TRUE(p.ok());
  const side_charge c = (*p)->side_memory(4, 2, 64);
  EXPECT_EQ(c.fixed_bytes, retrieval_side_memory(retrieval_params{}, 4, 2, 64).fixed_bytes);
  EXPECT_GT(c.bytes_per_token, 8 * 2 * 64);  // at least the key copy's f16 of 8 rows
}

}  // namespace
}  // namespace pagoda
