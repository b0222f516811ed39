// Quest against full attention: one decode step of one layer's attention at
// Llama-3-8B shapes (8 KV heads, 32 query heads, head_dim 128, blocks of 16
// tokens), 1 thread, over a context of ctx tokens: in a fresh pool
// (consecutive block ids, shuffled:0) or a fragmented one (a random
// permutation of the pool, shuffled:1; in this VM scattered 2-4 KiB tile
// reads run at about half the speed of sequential ones, bench/RESULTS.md). Full = paged_attention over every slot; quest = for every KV
// head, quest_selector::select (bounds, top-k, ranges), and then for every
// head paged_attention over its ranges. Selection is
// included in quest's time.
//
// The two run interleaved in one benchmark (full then quest, then quest then
// full, ...), each after a read that evicts the last-level cache (evict_bytes:
// 64 MiB, or twice a larger last-level cache): in a real decode step the
// other layers' KV passes through the cache between two steps of one layer,
// and quest's working set at 32K (a
// sixteenth of 128 MiB of f16 KV plus the summaries) would otherwise stay in
// it. Medians of each; speedup = full / quest from the same run.
//
// bounds: 1 for bounds=int8 (the default: int8 codes the selector keeps), 2
// for bounds=int4 (nibble codes, half the bytes), 0 for bounds=f32 (the
// backend's f32 summaries, read on every step).
//
// layers: the KV layout's layer count. Only layer 0 is written and read, but
// kv_storage keeps key summaries as [block][layer][head][min|max|mean], so
// the layer count sets the stride between one (layer, head)'s summaries of
// consecutive blocks (32 layers: 384 KiB), as in a real model.
//
// Counters (medians over the run's steps, microseconds):
//   full_us, quest_us   thread CPU time of one step (8 KV heads)
//   select_us           CPU time of quest's selection (its share of quest_us)
//   sparse_attn_us      CPU time of quest's attention over the ranges
//   select_of_read      select_us / sparse_attn_us: selection against the read it saves for
//   speedup             full_us / quest_us (CPU time)
//   speedup_wall        the same ratio of wall-clock medians
//   read                fraction of the blocks quest read (sinks and newest included)
//   stream_gbs          the sequential read that evicts the cache before each step (evict_bytes), GB/s by CPU time
//   full_of_stream      full attention's KV bytes / full_us, as a share of stream_gbs
//   sparse_of_stream    quest's KV bytes read / sparse_attn_us, as a share of stream_gbs
//
//   build/release/bench/quest_bench --benchmark_filter='quest/'            (the steps)
//   build/release/bench/quest_bench --benchmark_filter='quest/.*ctx:32768/' (32K only)
//   build/release/bench/quest_bench --benchmark_filter='^(select|bounds|kth|sparse_hot)'
//                                          (selection and sparse reads hot in cache)
//   build/release/bench/quest_bench --benchmark_filter='^quality'  (what each bound chooses)
//   build/release/bench/quest_bench --kv_huge_pages ...  (the steps' pools in huge pages, as the
//        engine's --kv-huge-pages, but faulted in as written: only layer 0 of the layout is used)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>

#include "attention/paged_attention.h"
#include "bench_kv.h"
#include "core/cpu.h"
#include "kv/kv_storage.h"
#include "policy/quest.h"
#include "read_bandwidth.h"
#include "quant/kv_format_spec.h"

namespace {

using namespace pagoda;

constexpr int k_head_dim = 128, k_kv_heads = 8, k_rep = 4, k_block = 16;

struct pool {
  std::unique_ptr<kv_storage> kv;
  std::vector<block_id> table;
  std::vector<std::int32_t> pos;  // slot i at position i
  std::vector<float> q;           // [32][128]: one decode token
};

// One pool at a time (128K tokens of f16 are 512 MiB), filled once: K, V ~
// N(0, 1) with a few outlier key channels, written in chunks of 512.
pool& pool_for(const std::string& spec, int n_ctx, int n_layers, bool shuffled = false) {
  static std::map<std::tuple<std::string, int, int, bool>, std::unique_ptr<pool>> cache;
  const auto key = std::make_tuple(spec, n_ctx, n_layers, shuffled);
  if (auto it = cache.find(key); it != cache.end()) return *it->second;
  cache.clear();
  auto p = std::make_unique<pool>();
  kv_pair_spec pair = *parse_kv_pair_spec(spec);
  kv_layout layout = kv_layout::uniform(n_layers, k_kv_heads, k_head_dim, k_block, kv_type::f32, kv_type::f32);
  for (int l = 0; l < n_layers; ++l) {
    layout.k_formats[l] = pair.k.resolve(kv_role::key, false);
    layout.v_formats[l] = pair.v.resolve(kv_role::value, false);
  }
  layout.key_summaries = true;
  const int n_blocks = (n_ctx + k_block - 1) / k_block;
  p->kv = std::move(*kv_storage::create(layout, n_blocks, 1, {}, bench::pool_memory()));
  for (int i = 0; i < n_blocks; ++i) p->table.push_back(block_id(i));
  std::mt19937 rng(1);
  if (shuffled) std::shuffle(p->table.begin(), p->table.end(), rng);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int chunk = 512;
  std::vector<float> k(static_cast<std::size_t>(chunk) * k_kv_heads * k_head_dim), v(k.size());
  for (int at = 0; at < n_ctx; at += chunk) {
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = nd(rng) * (i % k_head_dim % 16 == 5 ? 8.0f : 1.0f);
      v[i] = nd(rng);
    }
    p->kv->write(0, p->table, at, std::min(chunk, n_ctx - at), k.data(), v.data());
  }
  p->pos.resize(n_ctx);
  std::iota(p->pos.begin(), p->pos.end(), 0);
  p->q.resize(static_cast<std::size_t>(k_kv_heads) * k_rep * k_head_dim);
  for (float& x : p->q) x = nd(rng);
  return *(cache[key] = std::move(p));
}

double thread_cpu_s();

// Bytes evict_cache reads: 64 MiB, or twice the last-level cache the
// machine reports when that is larger (an Intel Xeon VM here reported 260
// MiB, which holds a 32K context's whole KV layer).
std::size_t evict_bytes() {
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return std::max<std::size_t>(std::size_t{64} << 20, l3 > 0 ? 2 * static_cast<std::size_t>(l3) : 0);
}

// Reads evict_bytes() so that a step starts cold; a STREAM-like pass
// (read_bandwidth.h's loop), so its thread CPU time, in seconds (returned),
// gives the bandwidth of a sequential read in the same run.
double evict_cache() {
  static std::vector<float> junk(evict_bytes() / sizeof(float), 1.0f);
  const double t0 = thread_cpu_s();
  float s = bench::read_sum(junk.data(), junk.size());
  benchmark::DoNotOptimize(s);
  return thread_cpu_s() - t0;
}

quest_bounds_kind bounds_kind(int arg) {
  return arg == 0 ? quest_bounds_kind::f32 : arg == 1 ? quest_bounds_kind::int8 : quest_bounds_kind::int4;
}

double thread_cpu_s() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// One decode token of KV head h over the pool's first n_ctx slots.
attention_task decode_task(const pool& p, const paged_kv_view& k, const paged_kv_view& v, int n_ctx,
                           const std::int32_t& q_pos, int h, std::vector<float>& out) {
  attention_task t;
  t.k = &k;
  t.v = &v;
  t.kv_head = h;
  t.n_rep = k_rep;
  t.head_dim = k_head_dim;
  t.scale = 1.0f / std::sqrt(static_cast<float>(k_head_dim));
  t.q = p.q.data();
  t.q_stride = p.q.size();
  t.n_tokens = 1;
  t.q_pos = &q_pos;
  t.kv_pos = p.pos.data();
  t.n_kv = n_ctx;
  t.out = out.data();
  t.out_stride = out.size();
  return t;
}

void bm_quest(benchmark::State& st, std::string spec) {
  const int n_ctx = static_cast<int>(st.range(0));
  const int inv_budget = static_cast<int>(st.range(1));
  const int n_layers = static_cast<int>(st.range(2));
  const int bounds = static_cast<int>(st.range(3));
  const bool shuffled = st.range(4) != 0;
  pool& p = pool_for(spec, n_ctx, n_layers, shuffled);
  const paged_kv_view kview = p.kv->k_view(0, p.table, n_ctx), vview = p.kv->v_view(0, p.table, n_ctx);
  const float scale = 1.0f / std::sqrt(static_cast<float>(k_head_dim));
  std::vector<float> scaled(p.q);
  for (float& x : scaled) x *= scale;
  quest_params qp;
  qp.budget = 1.0 / inv_budget;
  qp.min_context = 0;
  qp.bounds = bounds_kind(bounds);
  quest_selector selector(qp, n_layers, k_kv_heads, k_head_dim);
  attention_scratch scratch;
  std::vector<float> out(p.q.size());
  const std::int32_t q_pos = n_ctx - 1;

  auto task = [&](int h) { return decode_task(p, kview, vview, n_ctx, q_pos, h, out); };
  auto full_step = [&] {
    for (int h = 0; h < k_kv_heads; ++h) paged_attention(task(h), scratch);
  };
  double read_slots = 0;
  // The 8 selections, then the 8 sparse reads: one CPU-clock reading around
  // the selections (a reading is a system call, 1.3-2.9 us in this VM: one
  // per head would add 10-25 us to the selection's figure).
  std::vector<std::vector<slot_range>> head_ranges(k_kv_heads);
  std::vector<char> head_sparse(k_kv_heads);
  auto quest_step = [&](double& select_s) {
    const double t0 = thread_cpu_s();
    for (int h = 0; h < k_kv_heads; ++h) {
      kv_select_query q;
      q.layer = 0;
      q.kv_head = h;
      q.k = &kview;
      q.kv = p.kv.get();
      q.kv_pos = p.pos;
      q.n_kv = n_ctx;
      q.q = scaled.data() + static_cast<std::size_t>(h) * k_rep * k_head_dim;
      q.n_rows = k_rep;
      q.n_rep = k_rep;
      q.head_dim = k_head_dim;
      q.q_pos = {&q_pos, 1};
      head_sparse[h] = selector.select(q, head_ranges[h]);
    }
    select_s += thread_cpu_s() - t0;
    for (int h = 0; h < k_kv_heads; ++h) {
      attention_task t = task(h);
      if (head_sparse[h]) t.ranges = head_ranges[h];
      for (const slot_range& r : t.ranges) read_slots += r.end - r.begin;
      if (!head_sparse[h]) read_slots += n_ctx;
      paged_attention(t, scratch);
    }
  };
  // Times in thread CPU time: this shared VM runs 4-5 runnable threads per
  // core at times, and a step that loses a 4 ms time slice says nothing about
  // attention. Memory stalls count as CPU time. Wall-clock medians too.
  struct sample {
    double cpu = 0, wall = 0;
  };
  auto timed = [](auto&& f) {
    const double c0 = thread_cpu_s();
    const auto w0 = std::chrono::steady_clock::now();
    f();
    const auto w1 = std::chrono::steady_clock::now();
    return sample{thread_cpu_s() - c0, std::chrono::duration<double>(w1 - w0).count()};
  };
  std::vector<double> full_s, quest_s, select_s, attn_s, full_wall, quest_wall, evict_s;
  full_step();  // first touch of the scratch buffers
  for (auto _ : st) {
    sample tf, tq, ts;
    const bool full_first = full_s.size() % 2 == 0;
    auto run_quest = [&] {
      double sel_cpu = 0;  // the selection's share
      tq = timed([&] { quest_step(sel_cpu); });
      ts.cpu = sel_cpu;
    };
    evict_s.push_back(evict_cache());
    if (full_first) tf = timed(full_step);
    else run_quest();
    evict_s.push_back(evict_cache());
    if (full_first) run_quest();
    else tf = timed(full_step);
    full_s.push_back(tf.cpu);
    quest_s.push_back(tq.cpu);
    select_s.push_back(ts.cpu);
    attn_s.push_back(tq.cpu - ts.cpu);
    full_wall.push_back(tf.wall);
    quest_wall.push_back(tq.wall);
    st.SetIterationTime(tf.wall + tq.wall);
  }
  st.counters["full_us"] = median(full_s) * 1e6;
  st.counters["quest_us"] = median(quest_s) * 1e6;
  st.counters["select_us"] = median(select_s) * 1e6;
  st.counters["sparse_attn_us"] = median(attn_s) * 1e6;
  st.counters["select_of_read"] = median(select_s) / median(attn_s);
  st.counters["speedup"] = median(full_s) / median(quest_s);
  st.counters["speedup_wall"] = median(full_wall) / median(quest_wall);
  const double read = read_slots / (static_cast<double>(quest_s.size()) * k_kv_heads * n_ctx);
  st.counters["read"] = read;
  // Bandwidths: the KV bytes each read (all 8 heads' K and V tiles of the
  // blocks read) over its CPU time, and the eviction pass; the two reads as
  // shares of that pass.
  const double kv_bytes = static_cast<double>(p.kv->layout().layer_tile_bytes_per_block(0)) * (n_ctx / k_block);
  const double stream = static_cast<double>(evict_bytes()) / median(evict_s) * 1e-9;
  st.counters["stream_gbs"] = stream;
  st.counters["full_of_stream"] = kv_bytes / median(full_s) * 1e-9 / stream;
  st.counters["sparse_of_stream"] = read * kv_bytes / median(attn_s) * 1e-9 / stream;
  st.SetLabel(p.kv->layout().describe() + " simd " + simd_level_name(active_simd_level()));
}

// The bound kernels alone, hot in cache: 2048 blocks (32K tokens), 4 rows
// (one decode token of a GQA-4 group), head_dim 128; blocks/s by CPU time.
void bm_bounds(benchmark::State& st) {
  const quest_bounds_kind kind = bounds_kind(static_cast<int>(st.range(0)));
  const int n = 2048, rows = k_rep, hd = k_head_dim;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> lo(static_cast<std::size_t>(n) * hd), hi(lo.size()), q(static_cast<std::size_t>(rows) * hd);
  for (std::size_t i = 0; i < lo.size(); ++i) {
    const float a = nd(rng), b = nd(rng);
    lo[i] = std::min(a, b);
    hi[i] = std::max(a, b);
  }
  for (float& x : q) x = nd(rng);
  std::vector<key_summary> sums(n);
  const std::size_t per8 = 2 * static_cast<std::size_t>(quest_padded_dim(hd)), per4 = quest4_padded_dim(hd);
  std::vector<std::int8_t> codes(n * per8);
  std::vector<std::uint8_t> codes4(n * per4);
  std::vector<quest_block8> blocks(n), blocks4(n);
  std::vector<float> scales(hd);
  for (int i = 0; i < n; ++i) sums[i] = {&lo[static_cast<std::size_t>(i) * hd], &hi[static_cast<std::size_t>(i) * hd], nullptr};
  quest_channel_scales(sums, hd, scales.data());
  for (int i = 0; i < n; ++i) {
    blocks[i] = quest_encode_block(sums[i], hd, codes.data() + i * per8);
    blocks4[i] = quest_encode_block4(sums[i], hd, scales.data(), codes4.data() + i * per4);
  }
  quest_query8 q8;
  quest_query4 q4;
  std::vector<float> out(n);
  for (auto _ : st) {
    if (kind == quest_bounds_kind::int8) {
      quest_encode_query(q.data(), rows, hd, q8);
      quest_bounds8(q8, codes.data(), blocks.data(), n, out.data());
    } else if (kind == quest_bounds_kind::int4) {
      quest_encode_query4(q.data(), rows, hd, scales.data(), q4);
      quest_bounds4(q4, codes4.data(), blocks4.data(), n, out.data());
    } else {
      quest_bounds(q.data(), rows, hd, sums, out.data());
    }
    benchmark::DoNotOptimize(out.data());
  }
  st.counters["blocks/s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(simd_level_name(active_simd_level()));
}

// Making the codes of 2048 sealed blocks (one (layer, KV head) row at 32K):
// what a row pays once per block as blocks seal, and what the first step
// after a long prompt pays per row. bounds:1 int8, bounds:2 int4.
void bm_encode(benchmark::State& st) {
  const bool int4 = st.range(0) == 2;
  const int n = 2048, hd = k_head_dim;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> lo(static_cast<std::size_t>(n) * hd), hi(lo.size());
  for (std::size_t i = 0; i < lo.size(); ++i) {
    const float a = nd(rng), b = nd(rng);
    lo[i] = std::min(a, b);
    hi[i] = std::max(a, b);
  }
  std::vector<key_summary> sums(n);
  for (int i = 0; i < n; ++i) sums[i] = {&lo[static_cast<std::size_t>(i) * hd], &hi[static_cast<std::size_t>(i) * hd], nullptr};
  std::vector<float> scales(hd);
  quest_channel_scales(sums, hd, scales.data());
  const std::size_t per = int4 ? quest4_padded_dim(hd) : 2 * static_cast<std::size_t>(quest_padded_dim(hd));
  std::vector<std::uint8_t> codes(n * per);
  std::vector<quest_block8> blocks(n);
  for (auto _ : st) {
    for (int i = 0; i < n; ++i)
      blocks[i] = int4 ? quest_encode_block4(sums[i], hd, scales.data(), codes.data() + i * per)
                       : quest_encode_block(sums[i], hd, reinterpret_cast<std::int8_t*>(codes.data() + i * per));
    benchmark::DoNotOptimize(blocks.data());
  }
  st.counters["s_per_block"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate |
                                                                                benchmark::Counter::kInvert);
}

// The k-th largest of 2046 random bounds (k = 254: a 32K-token step's
// candidates at 1/8), quest_kth_largest (kth:1) against std::nth_element
// over a copy (kth:0), on 64 arrays in turn.
void bm_kth(benchmark::State& st) {
  const bool ours = st.range(0) != 0;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(100.0f, 5.0f);
  std::vector<std::vector<float>> xs(64, std::vector<float>(2046));  // the branch predictor must not learn one
  for (auto& x : xs)
    for (float& v : x) v = nd(rng);
  std::vector<float> scratch;
  std::size_t at = 0;
  for (auto _ : st) {
    const std::vector<float>& x = xs[at++ % xs.size()];
    float kth = 0;
    if (ours) {
      kth = quest_kth_largest(x, 254, scratch);
    } else {
      scratch.assign(x.begin(), x.end());
      std::nth_element(scratch.begin(), scratch.begin() + 253, scratch.end(), std::greater<float>());
      kth = scratch[253];
    }
    benchmark::DoNotOptimize(kth);
  }
}

// quest_selector::select alone, hot in cache, one KV head of a 32K-token
// f16 pool (2048 blocks): bounds, top-k and ranges; selects/s by CPU time.
void bm_select(benchmark::State& st) {
  const int n_ctx = 32768;
  pool& p = pool_for("f16", n_ctx, 1);
  const paged_kv_view kview = p.kv->k_view(0, p.table, n_ctx);
  std::vector<float> scaled(p.q);
  for (float& x : scaled) x /= std::sqrt(static_cast<float>(k_head_dim));
  quest_params qp;
  qp.bounds = bounds_kind(static_cast<int>(st.range(0)));
  quest_selector selector(qp, 1, k_kv_heads, k_head_dim);
  const std::int32_t q_pos = n_ctx - 1;
  kv_select_query q;
  q.k = &kview;
  q.kv = p.kv.get();
  q.kv_pos = p.pos;
  q.n_kv = n_ctx;
  q.q = scaled.data();
  q.n_rows = q.n_rep = k_rep;
  q.head_dim = k_head_dim;
  q.q_pos = {&q_pos, 1};
  std::vector<slot_range> ranges;
  for (auto _ : st) benchmark::DoNotOptimize(selector.select(q, ranges));
  st.counters["selects/s"] = benchmark::Counter(1, benchmark::Counter::kIsIterationInvariantRate);
}

// Attention over 1/8 of the blocks of an 8K-token pool (int8: 17 MiB of K and
// V, within the 32 MiB last-level cache; f16's 32 MiB only partly), every
// eighth block (scattered:1) or the first eighth (scattered:0): what
// scattering costs the kernels themselves, apart from memory. All 8 KV heads.
void bm_sparse_hot(benchmark::State& st, std::string spec) {
  const int n_ctx = 8192, n_blocks = n_ctx / k_block;
  const bool scattered = st.range(0) != 0;
  pool& p = pool_for(spec, n_ctx, 1);
  const paged_kv_view kview = p.kv->k_view(0, p.table, n_ctx), vview = p.kv->v_view(0, p.table, n_ctx);
  std::vector<slot_range> ranges;
  if (scattered)
    for (int b = 0; b < n_blocks; b += 8) ranges.push_back({b * k_block, (b + 1) * k_block});
  else
    ranges.push_back({0, n_blocks / 8 * k_block});
  attention_scratch scratch;
  std::vector<float> out(p.q.size());
  const std::int32_t q_pos = n_ctx - 1;
  for (auto _ : st)
    for (int h = 0; h < k_kv_heads; ++h) {
      attention_task t = decode_task(p, kview, vview, n_ctx, q_pos, h, out);
      t.ranges = ranges;
      paged_attention(t, scratch);
    }
}

// What each bound chooses, not how fast: one decode step at 32K tokens
// (8 KV heads x 4 query rows, head_dim 128, f32 KV so the summaries are of
// the keys themselves), budget 1/8. Keys as in the steps above (N(0, 1),
// every 16th channel 8x); planted:1 adds to 1% of the tokens (random ones)
// 0.5 sqrt(head_dim) along one query row's direction (about 5.7 more score
// there: attention mass concentrated in few tokens, as real heads have it).
// Per KV head: mass(S) = mean over its rows of the softmax mass (over all
// tokens, scores scaled by 1/sqrt(head_dim)) in the blocks S reads; the
// oracle reads the n_read blocks of the largest mass. Counters, means over
// heads: mass_<bounds> = mass(Quest's selection) / mass(oracle's);
// same_<bounds> = the share of the f32 bound's chosen blocks that int8 /
// int4 choose too.
void bm_quality(benchmark::State& st) {
  const bool planted = st.range(0) != 0;
  const int n_ctx = 32768, n_blocks = n_ctx / k_block, rows = k_rep;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(k_kv_heads) * rows * k_head_dim);
  for (float& x : q) x = nd(rng) / std::sqrt(static_cast<float>(k_head_dim));  // pre-scaled
  std::vector<float> k(static_cast<std::size_t>(n_ctx) * k_kv_heads * k_head_dim), v(k.size(), 0.0f);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) * (i % k_head_dim % 16 == 5 ? 8.0f : 1.0f);
  if (planted)
    for (int t = 0; t < n_ctx; ++t)
      for (int h = 0; h < k_kv_heads; ++h) {
        if (rng() % 100 != 0) continue;
        const float* qr = &q[(static_cast<std::size_t>(h) * rows + rng() % rows) * k_head_dim];
        double norm = 0;
        for (int d = 0; d < k_head_dim; ++d) norm += qr[d] * qr[d];
        float* kt = &k[(static_cast<std::size_t>(t) * k_kv_heads + h) * k_head_dim];
        for (int d = 0; d < k_head_dim; ++d) kt[d] += static_cast<float>(0.5 * std::sqrt(k_head_dim) * qr[d] / std::sqrt(norm));
      }
  kv_layout layout = kv_layout::uniform(1, k_kv_heads, k_head_dim, k_block, kv_type::f32, kv_type::f32);
  layout.key_summaries = true;
  auto kv = std::move(*kv_storage::create(layout, n_blocks));
  std::vector<block_id> table;
  for (int b = 0; b < n_blocks; ++b) table.push_back(block_id(b));
  kv->write(0, table, 0, n_ctx, k.data(), v.data());
  const paged_kv_view kview = kv->k_view(0, table, n_ctx);
  std::vector<std::int32_t> pos(n_ctx);
  std::iota(pos.begin(), pos.end(), 0);
  const std::int32_t q_pos = n_ctx - 1;
  const quest_bounds_kind kinds[3] = {quest_bounds_kind::f32, quest_bounds_kind::int8, quest_bounds_kind::int4};
  double mass_sum[3] = {0, 0, 0}, same_sum[3] = {0, 0, 0};
  for (auto _ : st) {
    for (int h = 0; h < k_kv_heads; ++h) {
      // Each row's softmax mass per block.
      std::vector<double> block_mass(static_cast<std::size_t>(rows) * n_blocks, 0.0);
      for (int r = 0; r < rows; ++r) {
        const float* qr = &q[(static_cast<std::size_t>(h) * rows + r) * k_head_dim];
        std::vector<double> s(n_ctx);
        double mx = -INFINITY, z = 0;
        for (int t = 0; t < n_ctx; ++t) {
          const float* kt = &k[(static_cast<std::size_t>(t) * k_kv_heads + h) * k_head_dim];
          double dot = 0;
          for (int d = 0; d < k_head_dim; ++d) dot += static_cast<double>(qr[d]) * kt[d];
          s[t] = dot;
          mx = std::max(mx, dot);
        }
        for (int t = 0; t < n_ctx; ++t) z += std::exp(s[t] - mx);
        for (int t = 0; t < n_ctx; ++t) block_mass[static_cast<std::size_t>(r) * n_blocks + t / k_block] += std::exp(s[t] - mx) / z;
      }
      auto mass_of = [&](const std::vector<int>& blocks) {
        double m = 0;
        for (int b : blocks)
          for (int r = 0; r < rows; ++r) m += block_mass[static_cast<std::size_t>(r) * n_blocks + b];
        return m / rows;
      };
      quest_params qp;
      const int n_read = qp.blocks_read(n_blocks);
      std::vector<int> order(n_blocks);
      std::iota(order.begin(), order.end(), 0);
      std::vector<double> total(n_blocks, 0.0);
      for (int b = 0; b < n_blocks; ++b)
        for (int r = 0; r < rows; ++r) total[b] += block_mass[static_cast<std::size_t>(r) * n_blocks + b];
      std::partial_sort(order.begin(), order.begin() + n_read, order.end(), [&](int a, int b) { return total[a] > total[b]; });
      const double oracle = mass_of(std::vector<int>(order.begin(), order.begin() + n_read));
      std::vector<int> chosen[3];
      for (int m = 0; m < 3; ++m) {
        qp.bounds = kinds[m];
        quest_selector sel(qp, 1, k_kv_heads, k_head_dim);
        kv_select_query sq;
        sq.layer = 0;
        sq.kv_head = h;
        sq.k = &kview;
        sq.kv = kv.get();
        sq.kv_pos = pos;
        sq.n_kv = n_ctx;
        sq.q = &q[static_cast<std::size_t>(h) * rows * k_head_dim];
        sq.n_rows = sq.n_rep = rows;
        sq.head_dim = k_head_dim;
        sq.q_pos = {&q_pos, 1};
        std::vector<slot_range> ranges;
        sel.select(sq, ranges);
        for (const slot_range& rg : ranges)
          for (int b = rg.begin / k_block; b * k_block < rg.end; ++b) chosen[m].push_back(b);
        mass_sum[m] += mass_of(chosen[m]) / oracle;
      }
      for (int m = 1; m < 3; ++m) {
        int same = 0;
        for (int b : chosen[m]) same += std::binary_search(chosen[0].begin(), chosen[0].end(), b);
        same_sum[m] += static_cast<double>(same) / static_cast<double>(chosen[0].size());
      }
    }
  }
  const double n = static_cast<double>(st.iterations()) * k_kv_heads;
  st.counters["mass_f32"] = mass_sum[0] / n;
  st.counters["mass_int8"] = mass_sum[1] / n;
  st.counters["mass_int4"] = mass_sum[2] / n;
  st.counters["same_int8"] = same_sum[1] / n;
  st.counters["same_int4"] = same_sum[2] / n;
}

void register_all() {
  benchmark::RegisterBenchmark("quality", bm_quality)->Arg(0)->Arg(1)->ArgName("planted")->Iterations(1)->Unit(benchmark::kMillisecond);
  for (const char* spec : {"f16", "int8"})
    benchmark::RegisterBenchmark(fmt::format("sparse_hot/{}", spec).c_str(), bm_sparse_hot, std::string(spec))
        ->Arg(0)
        ->Arg(1)
        ->ArgName("scattered")
        ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("select", bm_select)->Arg(2)->Arg(1)->Arg(0)->ArgName("bounds")->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("encode", bm_encode)->Arg(2)->Arg(1)->ArgName("bounds")->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("kth", bm_kth)->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("bounds", bm_bounds)->Arg(2)->Arg(1)->Arg(0)->ArgName("bounds")->Unit(benchmark::kMicrosecond);
  for (const char* spec : {"f16", "int8"}) {
    auto* b = benchmark::RegisterBenchmark(fmt::format("quest/{}", spec).c_str(), bm_quest, std::string(spec));
    for (int ctx : {16384, 32768, 131072})
      for (int layers : {1, 32})
        for (int shuffled : {0, 1})  // (a pool per (ctx, layers, shuffled): bounds innermost)
          for (int bounds : {2, 1, 0}) b->Args({ctx, 8, layers, bounds, shuffled});
    b->ArgNames({"ctx", "inv_budget", "layers", "bounds", "shuffled"})->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(2.0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  // Not faulted in: a 32 layers' layout maps every layer's tiles (16 GiB of
  // f16 at 128K) and the steps use layer 0's.
  return pagoda::bench::run_benchmarks(argc, argv, false);
}
