// Shared by the retrieval tests: random data and one layer of KV written
// step by step with a selector told after each write.
#pragma once

#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "attention/kv_selector.h"
#include "kv/kv_storage.h"
#include "quant/kv_format_spec.h"

namespace pagoda {

inline std::vector<float> gaussian(std::size_t n, unsigned seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

inline std::vector<std::int32_t> iota_slots(int n, int first = 0) {
  std::vector<std::int32_t> s(n);
  std::iota(s.begin(), s.end(), first);
  return s;
}

// One layer of KV written step by step, with a selector told after each write.
struct sequence {
  int n_kv_heads = 2, n_rep = 2, head_dim = 16, block_size = 16;
  std::unique_ptr<kv_storage> kv;
  std::vector<block_id> table;
  std::vector<float> k, v;  // [n][n_kv_heads][head_dim] as written
  std::vector<std::int32_t> pos;
  int n = 0;

  explicit sequence(const std::string& kv_spec, int capacity) {
    kv_pair_spec pair = *parse_kv_pair_spec(kv_spec);
    kv_layout layout = kv_layout::uniform(1, n_kv_heads, head_dim, block_size, kv_type::f32, kv_type::f32);
    layout.k_formats[0] = pair.k.resolve(kv_role::key, false);
    layout.v_formats[0] = pair.v.resolve(kv_role::value, false);
    const int n_blocks = (capacity + block_size - 1) / block_size;
    kv = *kv_storage::create(layout, n_blocks);
    for (int i = 0; i < n_blocks; ++i) table.push_back(block_id(n_blocks - 1 - i));
    const std::size_t row = static_cast<std::size_t>(n_kv_heads) * head_dim;
    k = gaussian(capacity * row, 21);
    v = gaussian(capacity * row, 22);
    pos = iota_slots(capacity);
  }
  std::size_t row() const { return static_cast<std::size_t>(n_kv_heads) * head_dim; }
  paged_kv_view kview() const { return kv->k_view(0, table, n); }
  paged_kv_view vview() const { return kv->v_view(0, table, n); }
  void write(int m, kv_read_selector& sel) {
    kv->write(0, table, n, m, &k[n * row()], &v[n * row()]);
    n += m;
    sel.on_layer_written(0, kview(), std::span(pos).first(n), n);
  }
};

inline kv_select_query query(const sequence& s, const paged_kv_view& kv, int h, const std::vector<float>& q, int n_tok) {
  kv_select_query x;
  x.layer = 0;
  x.kv_head = h;
  x.k = &kv;
  x.kv_pos = std::span(s.pos).first(s.n);
  x.n_kv = s.n;
  x.q = q.data();
  x.n_rows = n_tok * s.n_rep;
  x.n_rep = s.n_rep;
  x.head_dim = s.head_dim;
  x.q_pos = std::span(s.pos).subspan(s.n - n_tok, n_tok);
  return x;
}

}  // namespace pagoda
