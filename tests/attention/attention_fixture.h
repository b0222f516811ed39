// A KV cache of one layer filled with random K/V through kv_storage, and
// attention tasks over it: shared by the attention suites
// (paged_attention_test.cpp, sparse_attention_test.cpp).
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_test_util.h"
#include "attention/paged_attention.h"
#include "core/cpu.h"
#include "kv/kv_storage.h"
#include "quant/kv_format_spec.h"

namespace pagoda::attention_test {

// A shape and KV format for parameterised suites.
struct params {
  const char* spec;  // a K/V pair as the CLI spells it
  int n_kv_heads, n_rep, head_dim, block_size, n_ctx;
};

// A spec as a test name: "int4/g32" -> "int4_g32".
inline std::string spec_test_name(const char* spec) {
  std::string n = spec;
  for (char& c : n)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

struct fixture {
  int n_kv_heads, n_rep, head_dim, block_size, n_ctx;
  std::unique_ptr<kv_storage> kv;
  std::vector<block_id> table;
  std::vector<float> q;  // [n_ctx][n_kv_heads * n_rep * head_dim]
  std::vector<float> k, v;  // [n_ctx][n_kv_heads][head_dim], as written
  std::vector<std::int32_t> pos;  // [n_ctx]: slot i holds position i
  std::vector<float> sinks;       // [n_kv_heads * n_rep] attention sinks; empty: none

  // spec: a K/V pair as the CLI spells it ("f32", "k8v4", "int4/token+int2").
  fixture(const std::string& spec, int n_kv_heads_, int n_rep_, int head_dim_, int block_size_, int n_ctx_,
          unsigned seed)
      : n_kv_heads(n_kv_heads_), n_rep(n_rep_), head_dim(head_dim_), block_size(block_size_), n_ctx(n_ctx_) {
    kv_pair_spec pair = *parse_kv_pair_spec(spec);
    kv_layout layout = kv_layout::uniform(1, n_kv_heads, head_dim, block_size, kv_type::f32, kv_type::f32);
    layout.k_formats[0] = pair.k.resolve(kv_role::key, false);
    layout.v_formats[0] = pair.v.resolve(kv_role::value, false);
    int n_blocks = (n_ctx + block_size - 1) / block_size;
    kv = *kv_storage::create(layout, n_blocks + 7);
    // A scattered block table: attention must follow it, not assume contiguity.
    std::vector<int> ids(n_blocks + 7);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int i = 0; i < n_blocks; ++i) table.push_back(block_id(ids[i]));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    k.resize(static_cast<std::size_t>(n_ctx) * n_kv_heads * head_dim);
    v.resize(k.size());
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
    pos.resize(n_ctx);
    std::iota(pos.begin(), pos.end(), 0);
  }

  std::size_t q_stride() const { return static_cast<std::size_t>(n_kv_heads) * n_rep * head_dim; }

  // A task for KV head h: n query tokens from query token `first` at
  // positions q_pos, over n_kv slots at positions kv_pos.
  attention_task task(const paged_kv_view& k, const paged_kv_view& v, int h, int first, int n,
                      const std::int32_t* q_pos, const std::int32_t* kv_pos, int n_kv, float* out) const {
    attention_task t;
    t.k = &k;
    t.v = &v;
    t.kv_head = h;
    t.n_rep = n_rep;
    t.head_dim = head_dim;
    t.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    t.q = q.data() + static_cast<std::size_t>(first) * q_stride();
    t.q_stride = q_stride();
    t.n_tokens = n;
    t.q_pos = q_pos;
    t.kv_pos = kv_pos;
    t.n_kv = n_kv;
    t.out = out;
    t.out_stride = q_stride();
    t.sinks = sinks.empty() ? nullptr : sinks.data();
    return t;
  }

  // Attention for query tokens [first, first + n) over positions [0, first +
  // n), with a sliding window and soft-capping as given.
  std::vector<float> run(int first, int n, bool reference, int window = 0, float softcap = 0.0f) {
    return run_on(*kv, table, first, n, reference, window, softcap);
  }
  // The same over another backend's table that holds this fixture's K/V
  // (block classes), reading only `ranges` when there are any.
  std::vector<float> run_on(const kv_backend& backend, std::span<const block_id> blocks, int first, int n,
                            bool reference, int window = 0, float softcap = 0.0f,
                            std::span<const slot_range> ranges = {}) const {
    std::vector<float> out(static_cast<std::size_t>(n) * q_stride(), NAN);
    paged_kv_view kview = backend.k_view(0, blocks, first + n);
    paged_kv_view vview = backend.v_view(0, blocks, first + n);
    attention_scratch scratch;
    for (int h = 0; h < n_kv_heads; ++h) {
      attention_task t = task(kview, vview, h, first, n, pos.data() + first, pos.data(), first + n, out.data());
      t.window = window;
      t.softcap = softcap;
      t.ranges = ranges;
      if (reference) paged_attention_ref(t);
      else paged_attention(t, scratch);
    }
    return out;
  }
};

// Tolerance of a level's path against the double reference (see matches_reference).
using test::simd_tolerance;

}  // namespace pagoda::attention_test
