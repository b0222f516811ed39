// Retrieval attention (policy/retrieval.h): how well the ANN indexes find a
// query's top-k keys, what they cost to build and hold, and decode attention
// time against full attention.
//
// recall/...   one pass each (the figures are counters, not times):
//   recall@32, recall@128  |ANN top-k ∩ exact top-k| / k, averaged over queries;
//                          exact = brute-force q.k over the same keys;
//   build_ms_per_1K        index build time (adds, and training for ivfpq) per 1K keys;
//   index_KiB_per_1K       index memory (key_index::memory_bytes) per 1K keys;
//   search_us              one query's search (k = 128).
//   recall/stories260K/INDEX  real keys and queries of models/stories260K.gguf
//       over tests/data/tinystories_dev.txt: windows of 512 tokens, each run
//       through llama_context into an f32 KV cache and read back. The index
//       holds the keys of slots [0, 448) (28 sealed blocks of 16) of every
//       (window, layer, KV head); the queries are those of positions
//       [448, 512), every query head of the group. The forward pass does not
//       hand out queries, so they are rebuilt from the cache: the model has
//       2 x kv_dim == n_embd, so [Wk; Wv] is square and the normed input of
//       each token is solved from its (un-rotated) key and its value, then
//       q = RoPE(Wq x). Self-check: x / attn_norm must have unit RMS
//       (counter rms_err, the largest deviation).
//   recall/synthetic/KIND/INDEX  32768 keys of head_dim 128, 64 queries:
//       gaussian    keys and queries i.i.d. N(0, 1) (no structure: hardest);
//       clustered   RoPE-like: topics (64 centres ~ N(0, 1)) that change every
//                   ~256 tokens, key = centre + N(0, 0.5) with 8 outlier
//                   channels x4, rotated by RoPE (base 500000) at its
//                   position; a query = centre + N(0, 0.5), rotated at
//                   position 32768.
// decode/ctx:N  Llama-3-8B shapes (8 KV heads x 4 query heads, head_dim 128,
//       f16 KV, blocks of 16), clustered keys, 1 thread: one decode step of
//       one layer, full paged_attention against retrieval (select: sinks 4 +
//       recent 64 + the union of the 4 query rows' top-k, then
//       gather_attention), hnsw and ivfpq, ALTERNATED step by step in the same
//       loop, so the ratios come from the same seconds of this shared machine.
//       Counters: full_ms, hnsw_ms, ivfpq_ms (median wall time of a step),
//       the same as *_cpu_ms (median thread CPU time: on an oversubscribed
//       machine wall time includes waiting for a core), x_hnsw, x_ivfpq and
//       x_*_cpu (full / retrieval), read_frac (selected slots / context),
//       search_ms (the select() share of a hnsw step, wall), err_* (relative
//       L2 error of the step's outputs against full attention's).
//
//   build/release/bench/retrieval_bench --benchmark_filter=recall
//   build/release/bench/retrieval_bench --benchmark_filter=decode
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <utility>
#include <cmath>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "attention/gather_attention.h"
#include "attention/paged_attention.h"
#include "bench_kv.h"
#include "kv/kv_storage.h"
#include "model/llama.h"
#include "policy/retrieval.h"
#include "policy/retrieval_index.h"

namespace {

using namespace pagoda;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// --- index kinds as the bench runs them ------------------------------------

struct index_case {
  const char* name;
  retrieval_index_kind kind;
  hnsw_params hnsw;
  ivfpq_params ivfpq;
};

std::unique_ptr<key_index> make_index(const index_case& c, int head_dim) {
  switch (c.kind) {
    case retrieval_index_kind::hnsw: return make_hnsw_index(head_dim, c.hnsw);
    case retrieval_index_kind::auto_:
    case retrieval_index_kind::ivfpq: return make_ivfpq_index(head_dim, c.ivfpq);
    case retrieval_index_kind::exact: break;
  }
  return make_exact_index(head_dim);
}

// One recall measurement: keys [n][hd] and queries [n_q][hd].
struct recall_sum {
  double hits32 = 0, hits128 = 0;
  int n_queries = 0;
  double build_s = 0, search_s = 0;
  std::size_t keys = 0, bytes = 0;

  void add(const index_case& c, const float* keys_, int n, const float* queries, int n_q, int hd) {
    std::vector<std::int32_t> slots(n);
    std::iota(slots.begin(), slots.end(), 0);
    const auto t0 = clock_type::now();
    auto ix = make_index(c, hd);
    if (status s = ix->add(keys_, slots.data(), n); !s.ok()) fmt::print(stderr, "retrieval_bench: {}\n", s.message());
    build_s += seconds_since(t0);
    keys += static_cast<std::size_t>(n);
    bytes += ix->memory_bytes();
    for (int i = 0; i < n_q; ++i) {
      const float* q = queries + static_cast<std::size_t>(i) * hd;
      for (int k : {32, 128}) {
        std::vector<std::int32_t> got, want;
        const auto t1 = clock_type::now();
        ix->search(q, k, got);
        if (k == 128) search_s += seconds_since(t1);
        exact_top_k(q, keys_, slots.data(), n, hd, k, want);
        std::set<std::int32_t> w(want.begin(), want.end());
        double hit = 0;
        for (std::int32_t s : got) hit += static_cast<double>(w.count(s));
        (k == 32 ? hits32 : hits128) += hit / static_cast<double>(want.size());
      }
      ++n_queries;
    }
  }

  void report(benchmark::State& st) const {
    st.counters["recall@32"] = hits32 / n_queries;
    st.counters["recall@128"] = hits128 / n_queries;
    st.counters["build_ms_per_1K"] = build_s * 1e3 / (static_cast<double>(keys) / 1024.0);
    st.counters["index_KiB_per_1K"] = static_cast<double>(bytes) / 1024.0 / (static_cast<double>(keys) / 1024.0);
    st.counters["search_us"] = search_s * 1e6 / n_queries;
    st.counters["queries"] = n_queries;
  }
};

// --- RoPE (llama's adjacent pairs or NeoX halves), either direction ---------

void rotate(float* x, int head_dim, int rope_dim, bool neox, float base, float scale, int pos, float sign) {
  const int half = rope_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double angle = sign * pos * scale * std::pow(static_cast<double>(base), -2.0 * i / rope_dim);
    const double c = std::cos(angle), s = std::sin(angle);
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const double x0 = x[a], x1 = x[b];
    x[a] = static_cast<float>(x0 * c - x1 * s);
    x[b] = static_cast<float>(x0 * s + x1 * c);
  }
  (void)head_dim;
}

// --- stories260K: real keys, rebuilt queries --------------------------------

// Solves A x = b for many b: LU with partial pivoting of a square matrix, in double.
struct lu_solver {
  int n = 0;
  std::vector<double> a;  // [n][n], factored in place
  std::vector<int> piv;

  explicit lu_solver(std::vector<double> m, int n_) : n(n_), a(std::move(m)), piv(n_) {
    for (int c = 0; c < n; ++c) {
      int p = c;
      for (int r = c + 1; r < n; ++r)
        if (std::abs(a[r * n + c]) > std::abs(a[p * n + c])) p = r;
      piv[c] = p;
      if (p != c)
        for (int j = 0; j < n; ++j) std::swap(a[c * n + j], a[p * n + j]);
      for (int r = c + 1; r < n; ++r) {
        const double f = a[r * n + c] /= a[c * n + c];
        for (int j = c + 1; j < n; ++j) a[r * n + j] -= f * a[c * n + j];
      }
    }
  }
  // Row swaps moved whole rows (multipliers too), so they apply to b first.
  void solve(std::vector<double>& b) const {
    for (int c = 0; c < n; ++c) std::swap(b[c], b[piv[c]]);
    for (int c = 0; c < n; ++c)
      for (int r = c + 1; r < n; ++r) b[r] -= a[r * n + c] * b[c];
    for (int r = n - 1; r >= 0; --r) {
      for (int j = r + 1; j < n; ++j) b[r] -= a[r * n + j] * b[j];
      b[r] /= a[r * n + r];
    }
  }
};

std::vector<float> dequantized(const weight_view& w) {
  std::vector<float> m(static_cast<std::size_t>(w.n_out) * w.n_in);
  for (std::int64_t r = 0; r < w.n_out; ++r) dequantize_row(w, r, &m[static_cast<std::size_t>(r) * w.n_in]);
  return m;
}

// The keys and rebuilt queries of one window of tokens, per layer.
struct stories_window {
  std::vector<std::vector<float>> keys;     // [layer][kv head][token][hd]
  std::vector<std::vector<float>> queries;  // [layer][query head][token][hd]
};

constexpr int k_window = 512, k_indexed = 448;

// Runs one window through the model and reads K and V back from the cache.
status run_window(const llama_model& m, std::span<const token_id> tokens, std::vector<std::vector<float>>& k,
                  std::vector<std::vector<float>>& v) {
  const llama_hparams& hp = m.hparams();
  const int n = static_cast<int>(tokens.size()), bs = 16;
  auto kv = kv_storage::create(kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, bs, kv_type::f32, kv_type::f32),
                               n / bs + 1);
  if (!kv.ok()) return kv.error();
  std::vector<block_id> table;
  for (int b = 0; b <= n / bs; ++b) table.push_back(block_id(b));
  llama_context ctx(m, **kv, 1);
  std::vector<float> logits;
  const forward_seq seq = forward_seq::consecutive(tokens, 0, table, false);
  if (status s = ctx.forward(std::span(&seq, 1), logits); !s.ok()) return s;
  k.assign(hp.n_layer, {});
  v.assign(hp.n_layer, {});
  for (int l = 0; l < hp.n_layer; ++l) {
    const paged_kv_view kview = (*kv)->k_view(l, table, n), vview = (*kv)->v_view(l, table, n);
    for (auto [view, out] : {std::pair{&kview, &k[l]}, std::pair{&vview, &v[l]}}) {
      out->resize(static_cast<std::size_t>(hp.n_head_kv) * n * hp.head_dim);
      for (int h = 0; h < hp.n_head_kv; ++h)
        for (int t = 0; t < n; ++t)
          decode_kv_rows(*view, h, t, 1, &(*out)[(static_cast<std::size_t>(h) * n + t) * hp.head_dim]);
    }
  }
  return {};
}

// q of every query head at every position from the key and value of that
// token (see the top); rms_err: the largest |RMS(x / attn_norm) - 1|.
void rebuild_queries(const llama_model& m, int layer, const std::vector<float>& k, const std::vector<float>& v, int n,
                     std::vector<float>& q, double& rms_err) {
  const llama_hparams& hp = m.hparams();
  const llama_layer& L = m.layers()[layer];
  const int E = hp.n_embd, KVD = hp.kv_dim(), HD = hp.head_dim;
  const auto wk = dequantized(L.wk), wv = dequantized(L.wv), wq = dequantized(L.wq);
  std::vector<double> a(static_cast<std::size_t>(E) * E);
  for (int r = 0; r < KVD; ++r)
    for (int c = 0; c < E; ++c) {
      a[static_cast<std::size_t>(r) * E + c] = wk[static_cast<std::size_t>(r) * E + c];
      a[static_cast<std::size_t>(r + KVD) * E + c] = wv[static_cast<std::size_t>(r) * E + c];
    }
  const lu_solver lu(std::move(a), E);
  q.assign(static_cast<std::size_t>(hp.n_head) * n * HD, 0.0f);
  std::vector<double> b(E);
  std::vector<float> kt(HD), qt(hp.q_dim());
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < hp.n_head_kv; ++h) {
      std::copy_n(&k[(static_cast<std::size_t>(h) * n + t) * HD], HD, kt.data());
      rotate(kt.data(), HD, hp.rope_dim, hp.rope_neox, hp.rope_base, hp.rope_freq_scale, t, -1.0f);
      for (int d = 0; d < HD; ++d) {
        b[h * HD + d] = kt[d];
        b[KVD + h * HD + d] = v[(static_cast<std::size_t>(h) * n + t) * HD + d];
      }
    }
    lu.solve(b);
    double ms = 0;
    for (int e = 0; e < E; ++e) ms += (b[e] / L.attn_norm[e]) * (b[e] / L.attn_norm[e]);
    rms_err = std::max(rms_err, std::abs(std::sqrt(ms / E) - 1.0));
    for (int o = 0; o < hp.q_dim(); ++o) {
      double s = 0;
      for (int e = 0; e < E; ++e) s += wq[static_cast<std::size_t>(o) * E + e] * b[e];
      qt[o] = static_cast<float>(s);
    }
    for (int h = 0; h < hp.n_head; ++h) {
      rotate(&qt[static_cast<std::size_t>(h) * HD], HD, hp.rope_dim, hp.rope_neox, hp.rope_base, hp.rope_freq_scale, t, 1.0f);
      std::copy_n(&qt[static_cast<std::size_t>(h) * HD], HD, &q[(static_cast<std::size_t>(h) * n + t) * HD]);
    }
  }
}

struct stories_data {
  std::vector<stories_window> windows;
  int n_layer = 0, n_kv = 0, n_head = 0, head_dim = 0;
  double rms_err = 0;
  std::string error;
};

const stories_data& stories() {
  static const stories_data data = [] {
    stories_data d;
    auto model = llama_model::load(std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf");
    if (!model.ok()) return d.error = model.error().message(), d;
    const llama_model& m = **model;
    const llama_hparams& hp = m.hparams();
    if (2 * hp.kv_dim() != hp.n_embd || hp.arch != "llama" || !m.layers()[0].bq.empty())
      return d.error = "the query rebuild needs a llama model with 2 x kv_dim == n_embd", d;
    std::ifstream in(std::string(PAGODA_SOURCE_DIR) + "/tests/data/tinystories_dev.txt");
    std::stringstream text;
    text << in.rdbuf();
    const auto tokens = m.vocab().encode(text.str(), true);
    d.n_layer = hp.n_layer, d.n_kv = hp.n_head_kv, d.n_head = hp.n_head, d.head_dim = hp.head_dim;
    for (std::size_t at = 0; at + k_window <= tokens.size() && d.windows.size() < 8; at += k_window) {
      std::vector<std::vector<float>> k, v;
      if (status s = run_window(m, std::span(tokens).subspan(at, k_window), k, v); !s.ok()) return d.error = s.message(), d;
      stories_window w;
      w.keys = k;
      w.queries.resize(hp.n_layer);
      for (int l = 0; l < hp.n_layer; ++l) rebuild_queries(m, l, k[l], v[l], k_window, w.queries[l], d.rms_err);
      d.windows.push_back(std::move(w));
    }
    return d;
  }();
  return data;
}

void bm_recall_stories(benchmark::State& st, index_case c) {
  const stories_data& d = stories();
  if (!d.error.empty()) return st.SkipWithError(d.error.c_str());
  const int hd = d.head_dim, n_rep = d.n_head / d.n_kv, n_q_tok = k_window - k_indexed;
  recall_sum sum;
  for (auto _ : st) {
    for (const stories_window& w : d.windows)
      for (int l = 0; l < d.n_layer; ++l)
        for (int h = 0; h < d.n_kv; ++h) {
          std::vector<float> q;  // the group's query heads at positions [k_indexed, k_window)
          for (int j = 0; j < n_rep; ++j) {
            const float* src = &w.queries[l][(static_cast<std::size_t>(h * n_rep + j) * k_window + k_indexed) * hd];
            q.insert(q.end(), src, src + static_cast<std::size_t>(n_q_tok) * hd);
          }
          sum.add(c, &w.keys[l][static_cast<std::size_t>(h) * k_window * hd], k_indexed, q.data(), n_rep * n_q_tok, hd);
        }
  }
  sum.report(st);
  st.counters["rms_err"] = d.rms_err;
  st.SetLabel(fmt::format("{} windows x {} layers x {} KV heads, {} keys each, head_dim {}", d.windows.size(), d.n_layer,
                          d.n_kv, k_indexed, hd));
}

// --- synthetic keys ---------------------------------------------------------

constexpr int k_hd = 128;

// Clustered, RoPE-like vectors (see the top): one row from topic `topic`,
// rotated at position pos.
const std::vector<float>& centres() {
  static const std::vector<float> c = [] {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x(64 * k_hd);
    for (float& v : x) v = nd(rng);
    return x;
  }();
  return c;
}

void clustered_row(float* x, int topic, int pos, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int d = 0; d < k_hd; ++d) x[d] = (centres()[topic * k_hd + d] + 0.5f * nd(rng)) * (d % 16 == 5 ? 4.0f : 1.0f);
  rotate(x, k_hd, k_hd, false, 500000.0f, 1.0f, pos, 1.0f);
}

// Keys of positions [t0, t0 + n) (t0 a multiple of 256): each 256-token
// segment has its own topic and noise stream, so any range is reproducible.
std::vector<float> clustered_keys(int t0, int n, unsigned seed) {
  std::vector<float> out(static_cast<std::size_t>(n) * k_hd);
  for (int s = t0 / 256; s * 256 < t0 + n; ++s) {
    std::mt19937 rng(seed * 1000003u + static_cast<unsigned>(s));
    const int topic = static_cast<int>(rng() % 64);
    for (int t = s * 256; t < std::min((s + 1) * 256, t0 + n); ++t)
      clustered_row(&out[static_cast<std::size_t>(t - t0) * k_hd], topic, t, rng);
  }
  return out;
}

std::vector<float> clustered_queries(int n_q, int q_pos, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<float> out(static_cast<std::size_t>(n_q) * k_hd);
  for (int i = 0; i < n_q; ++i) clustered_row(&out[static_cast<std::size_t>(i) * k_hd], static_cast<int>(rng() % 64), q_pos, rng);
  return out;
}

std::vector<float> gaussian(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

void bm_recall_synthetic(benchmark::State& st, std::string kind, index_case c) {
  const int n = 32768, n_q = 64;
  const bool gauss = kind == "gaussian";
  const auto keys = gauss ? gaussian(static_cast<std::size_t>(n) * k_hd, 1) : clustered_keys(0, n, 1);
  const auto queries = gauss ? gaussian(static_cast<std::size_t>(n_q) * k_hd, 2) : clustered_queries(n_q, n, 2);
  recall_sum sum;
  for (auto _ : st) sum.add(c, keys.data(), n, queries.data(), n_q, k_hd);
  sum.report(st);
  st.SetLabel(fmt::format("{} keys of head_dim {}, {} queries", n, k_hd, n_q));
}

// --- decode speed -----------------------------------------------------------

constexpr int k_kv_heads = 8, k_rep = 4, k_block = 16;

struct decode_setup {
  std::unique_ptr<kv_storage> kv;
  std::vector<block_id> table;
  std::vector<std::int32_t> pos;
  std::vector<float> q;  // [32][128]: one decode token, every query head
  // [0] exact top-k (index=exact), [1] IVF-PQ (index=ivfpq); index=auto is
  // [0] below auto_min and [1] from it.
  std::unique_ptr<retrieval_selector> sel[2];
  double build_s[2] = {0, 0};    // on_layer_written of the whole context (IVF-PQ: built inline)
};

constexpr const char* k_variants[2] = {"exact", "ivfpq"};

// keys: clustered (RoPE-rotated topics, as above) or Gaussian (i.i.d.
// N(0, 1) keys and queries: the case of a random-weight model such as
// bench/policy_speed.py's synth file, the hardest for an ANN index).
decode_setup& decode_for(int n_ctx, bool gaussian_keys) {
  static std::unique_ptr<decode_setup> s;
  static int built_for = 0;
  static bool built_gaussian = false;
  if (s && built_for == n_ctx && built_gaussian == gaussian_keys) return *s;
  s.reset();  // one context at a time: 128K is 512 MiB of KV and as much of HNSW
  s = std::make_unique<decode_setup>();
  built_for = n_ctx;
  built_gaussian = gaussian_keys;
  kv_layout layout = kv_layout::uniform(1, k_kv_heads, k_hd, k_block, kv_type::f16, kv_type::f16);
  const int n_blocks = (n_ctx + k_block - 1) / k_block;
  s->kv = std::move(*kv_storage::create(layout, n_blocks, 1));
  for (int b = 0; b < n_blocks; ++b) s->table.push_back(block_id(b));
  const int chunk = 4096;
  for (int p = 0; p < n_ctx; p += chunk) {
    const int m = std::min(chunk, n_ctx - p);
    std::vector<float> k(static_cast<std::size_t>(m) * k_kv_heads * k_hd), v = gaussian(k.size(), 100 + p);
    if (gaussian_keys) k = gaussian(k.size(), 200 + p);
    for (int h = 0; h < k_kv_heads && !gaussian_keys; ++h) {  // each head its own topics' order
      const auto kh = clustered_keys(p, m, 10 + h);
      for (int t = 0; t < m; ++t)
        std::copy_n(&kh[static_cast<std::size_t>(t) * k_hd], k_hd, &k[(static_cast<std::size_t>(t) * k_kv_heads + h) * k_hd]);
    }
    s->kv->write(0, s->table, p, m, k.data(), v.data());
  }
  s->pos.resize(n_ctx);
  std::iota(s->pos.begin(), s->pos.end(), 0);
  // Each group's 4 query heads ask about one topic (a query token's heads
  // are correlated), with their own noise.
  s->q.clear();
  for (int h = 0; h < k_kv_heads; ++h) {
    std::mt19937 rng(300 + h);
    const int topic = static_cast<int>(rng() % 64);
    std::vector<float> row(k_hd);
    for (int j = 0; j < k_rep; ++j) {
      if (gaussian_keys) row = gaussian(k_hd, 400 + h * k_rep + j);
      else clustered_row(row.data(), topic, n_ctx - 1, rng);
      s->q.insert(s->q.end(), row.begin(), row.end());
    }
  }
  const paged_kv_view kview = s->kv->k_view(0, s->table, n_ctx);
  retrieval_params p;
  p.k_tokens = 128;
  p.background = false;  // the index whole before the steps
  p.recall_every = 64;   // one sampled search in 8 steps (8 heads a step): the medians skip it
  for (int i = 0; i < 2; ++i) {
    p.index = i == 0 ? retrieval_index_kind::exact : retrieval_index_kind::ivfpq;
    const auto t0 = clock_type::now();
    s->sel[i] = std::make_unique<retrieval_selector>(p, 1, k_kv_heads, k_hd);
    // The copy grows a few blocks per call (the steps of a decode): call
    // until every sealed key is copied and indexed.
    while (s->sel[i]->sealed_end(0) < n_ctx / k_block * k_block) s->sel[i]->on_layer_written(0, kview, s->pos, n_ctx);
    s->build_s[i] = seconds_since(t0);
  }
  return *s;
}

attention_task decode_task(const decode_setup& s, const paged_kv_view& k, const paged_kv_view& v, int h, float* out) {
  attention_task t;
  t.k = &k;
  t.v = &v;
  t.kv_head = h;
  t.n_rep = k_rep;
  t.head_dim = k_hd;
  t.scale = 1.0f / std::sqrt(static_cast<float>(k_hd));
  t.q = s.q.data();
  t.q_stride = s.q.size();
  t.n_tokens = 1;
  t.q_pos = &s.pos.back();
  t.kv_pos = s.pos.data();
  t.n_kv = static_cast<int>(s.pos.size());
  t.out = out;
  t.out_stride = s.q.size();
  return t;
}

double thread_cpu_seconds();

// One retrieval step over every KV head; returns the thread CPU seconds spent
// in select (search) and in gather_attention.
std::pair<double, double> retrieval_step(decode_setup& s, retrieval_selector& sel, const paged_kv_view& k,
                                         const paged_kv_view& v, float* out, gather_scratch& sc, std::size_t& n_read) {
  std::vector<slot_range> ranges;
  std::vector<std::int32_t> slots;
  std::vector<float> qs(static_cast<std::size_t>(k_rep) * k_hd);
  double select_s = 0, gather_s = 0;
  n_read = 0;
  for (int h = 0; h < k_kv_heads; ++h) {
    const attention_task t = decode_task(s, k, v, h, out);
    const double t0 = thread_cpu_seconds();
    for (std::size_t i = 0; i < qs.size(); ++i) qs[i] = s.q[h * qs.size() + i] * t.scale;
    kv_select_query q;
    q.kv_head = h;
    q.k = &k;
    q.kv_pos = s.pos;
    q.n_kv = t.n_kv;
    q.q = qs.data();
    q.n_rows = k_rep;
    q.n_rep = k_rep;
    q.head_dim = k_hd;
    q.q_pos = std::span(&s.pos.back(), 1);
    slots.clear();
    if (sel.select(q, ranges)) append_slots_of_ranges(ranges, slots);
    const double t1 = thread_cpu_seconds();
    select_s += t1 - t0;
    n_read += slots.size();
    gather_attention(t, slots, sc, sel.key_rows_of(0, h));
    gather_s += thread_cpu_seconds() - t1;
  }
  return {select_s, gather_s};
}

// This thread's CPU time: on a shared, oversubscribed machine the wall time
// of a step includes the time the thread waited for a core.
double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Wall and CPU seconds of f().
template <class F>
std::pair<double, double> timed(F&& f) {
  const auto t0 = clock_type::now();
  const double c0 = thread_cpu_seconds();
  f();
  return {seconds_since(t0), thread_cpu_seconds() - c0};
}

// |a - b| / |b| over every output value.
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

void bm_decode(benchmark::State& st) {
  const int n_ctx = static_cast<int>(st.range(0));
  const bool gaussian_keys = st.range(1) != 0;
  decode_setup& s = decode_for(n_ctx, gaussian_keys);
  const paged_kv_view k = s.kv->k_view(0, s.table, n_ctx), v = s.kv->v_view(0, s.table, n_ctx);
  std::vector<float> out_full(s.q.size()), out[2] = {out_full, out_full};
  attention_scratch asc;
  gather_scratch gsc;
  // [0] full, [1] exact, [2] ivfpq: wall and CPU seconds per step.
  std::vector<double> wall[3], cpu[3], search_s[2], gather_s[2];
  std::size_t read[2] = {0, 0};
  auto keep = [&](int i, std::pair<double, double> t) {
    wall[i].push_back(t.first);
    cpu[i].push_back(t.second);
  };
  for (auto _ : st) {  // the three, alternated
    keep(0, timed([&] {
           for (int h = 0; h < k_kv_heads; ++h) paged_attention(decode_task(s, k, v, h, out_full.data()), asc);
         }));
    for (int i = 0; i < 2; ++i)
      keep(i + 1, timed([&] {
             const auto sg = retrieval_step(s, *s.sel[i], k, v, out[i].data(), gsc, read[i]);
             search_s[i].push_back(sg.first);
             gather_s[i].push_back(sg.second);
           }));
    benchmark::DoNotOptimize(out_full.data());
  }
  const double kv_bytes = static_cast<double>(n_ctx) * k_kv_heads * k_hd * 2 * 2;
  st.counters["full_ms"] = median(wall[0]) * 1e3;
  st.counters["full_cpu_ms"] = median(cpu[0]) * 1e3;
  for (int i = 0; i < 2; ++i) {
    const std::string n = k_variants[i];
    st.counters[n + "_ms"] = median(wall[i + 1]) * 1e3;
    st.counters[n + "_cpu_ms"] = median(cpu[i + 1]) * 1e3;
    st.counters["x_" + n] = median(wall[0]) / median(wall[i + 1]);
    st.counters["x_" + n + "_cpu"] = median(cpu[0]) / median(cpu[i + 1]);
    // Thread CPU time of select (the top-k) and of gather_attention, per step.
    st.counters["select_cpu_ms_" + n] = median(search_s[i]) * 1e3;
    st.counters["gather_cpu_ms_" + n] = median(gather_s[i]) * 1e3;
    st.counters["err_" + n] = relative_error(out[i], out_full);
    st.counters["read_frac_" + n] = static_cast<double>(read[i]) / (static_cast<double>(n_ctx) * k_kv_heads);
    st.counters["mem_per_kv_" + n] = static_cast<double>(s.sel[i]->memory_bytes()) / kv_bytes;
    st.counters["build_s_" + n] = s.build_s[i];
  }
  const retrieval_recall r = s.sel[1]->recall();
  st.counters["recall_ivfpq"] = r.wanted ? static_cast<double>(r.found) / static_cast<double>(r.wanted) : 0.0;
  st.counters["kv_MiB"] = kv_bytes / (1 << 20);
  st.SetLabel(fmt::format("{} keys, 1 layer, 8 KV heads x 4, head_dim 128, f16 KV, k=128, sinks 4, recent 64, 1 thread",
                          gaussian_keys ? "Gaussian" : "clustered"));
}

// --- the first token after a cached prompt ---------------------------------

// A synth model with Llama-3-8B shapes (see the top), or nullptr.
const llama_model* first_token_model() {
  static std::unique_ptr<llama_model> m = [] {
    const char* path = std::getenv("PAGODA_RETRIEVAL_MODEL");
    auto r = llama_model::load(path ? path : "/tmp/llama3-8b-2l-q8.gguf");
    return r.ok() ? std::move(*r) : nullptr;
  }();
  return m.get();
}

// One whole forward step of one token after n_ctx cached tokens (random f16
// K/V, as the prefix cache would hand them: no prefill), 1 thread: full
// attention against `--kv-policy retrieval` with its defaults (index=auto,
// background build), a fresh selector each round, so its first step sees the
// whole prompt at once (on_layer_written copies every sealed key; from
// auto_min the IVF-PQ build starts on the builder's thread). Then a second
// step with the same selector (the steady state while the index builds).
// Alternated round by round.
void bm_first_token(benchmark::State& st) {
  const llama_model* m = first_token_model();
  if (!m) return st.SkipWithError("no model: set PAGODA_RETRIEVAL_MODEL to a GGUF from pagoda synth (see the top)");
  const llama_hparams& hp = m->hparams();
  const int n_ctx = static_cast<int>(st.range(0));
  const kv_layout layout = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, k_block, kv_type::f16, kv_type::f16);
  const int n_blocks = n_ctx / k_block + 2;
  auto storage = std::move(*kv_storage::create(layout, n_blocks, 1));
  std::vector<block_id> table;
  for (int b = 0; b < n_blocks; ++b) table.push_back(block_id(b));
  pagoda::bench::fill_random_kv(*storage, table, n_ctx);
  llama_context ctx(*m, *storage, 1);
  std::vector<float> logits;
  const std::vector<token_id> token{1};
  kv_policy_spec spec;
  spec.name = "retrieval";
  auto policy = make_retrieval_policy(spec);
  std::vector<double> wall[3], cpu[3];  // [0] full, [1] retrieval's first step, [2] its second
  auto step = [&](kv_read_selector* sel, int i) {
    forward_seq s = forward_seq::consecutive(token, n_ctx, table, false);
    s.selector = sel;
    status r;
    const auto t = timed([&] { r = ctx.forward({&s, 1}, logits); });
    if (!r.ok()) fmt::print(stderr, "retrieval_bench: {}\n", r.message());
    wall[i].push_back(t.first);
    cpu[i].push_back(t.second);
  };
  for (auto _ : st) {
    step(nullptr, 0);
    auto sel = (*policy)->make_selector(hp.n_layer, hp.n_head_kv, hp.head_dim);
    step(sel.get(), 1);
    step(sel.get(), 2);
    st.PauseTiming();
    sel.reset();  // waits for a build in flight
    st.ResumeTiming();
  }
  st.counters["full_ms"] = median(wall[0]) * 1e3;
  st.counters["full_cpu_ms"] = median(cpu[0]) * 1e3;
  st.counters["first_ms"] = median(wall[1]) * 1e3;
  st.counters["first_cpu_ms"] = median(cpu[1]) * 1e3;
  st.counters["second_cpu_ms"] = median(cpu[2]) * 1e3;
  st.counters["first_over_full"] = median(wall[1]) / median(wall[0]);
  st.counters["first_over_full_cpu"] = median(cpu[1]) / median(cpu[0]);
  st.counters["second_over_full_cpu"] = median(cpu[2]) / median(cpu[0]);
  st.SetLabel(fmt::format("{} layers, f16 KV, 1 thread, retrieval defaults", hp.n_layer));
}

void register_all() {
  const index_case hnsw{"hnsw", retrieval_index_kind::hnsw, {}, {}};
  const index_case ivfpq{"ivfpq", retrieval_index_kind::ivfpq, {}, {}};
  // head_dim 8: 4 sub-quantizers of 2 dimensions, 16 centroids each; the
  // window's 448 keys train it (below faiss's 39 per centroid: it warns).
  const index_case ivfpq_small{"ivfpq", retrieval_index_kind::ivfpq, {}, ivfpq_params{16, 4, 4, 4, k_indexed}};
  for (const index_case& c : {hnsw, ivfpq_small})
    benchmark::RegisterBenchmark(fmt::format("recall/stories260K/{}", c.name).c_str(), bm_recall_stories, c)
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  // IVF-PQ's search cost against its recall: fewer lists visited (the
  // default is 16 of 256).
  ivfpq_params probe8, probe4;
  probe8.nprobe = 8;
  probe4.nprobe = 4;
  const index_case ivfpq8{"ivfpq_nprobe8", retrieval_index_kind::ivfpq, {}, probe8};
  const index_case ivfpq4{"ivfpq_nprobe4", retrieval_index_kind::ivfpq, {}, probe4};
  for (const char* kind : {"gaussian", "clustered"})
    for (const index_case& c : {hnsw, ivfpq, ivfpq8, ivfpq4})
      benchmark::RegisterBenchmark(fmt::format("recall/synthetic/{}/{}", kind, c.name).c_str(), bm_recall_synthetic,
                                   std::string(kind), c)
          ->Iterations(1)
          ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("decode", bm_decode)
      ->ArgNames({"ctx", "gaussian"})
      ->ArgsProduct({{4096, 8192, 16384, 32768, 65536, 131072}, {0, 1}})
      ->Iterations(20)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("first_token", bm_first_token)
      ->ArgNames({"ctx"})
      ->Args({16384})
      ->Args({32768})
      ->Iterations(15)
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
