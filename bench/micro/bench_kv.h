// Filling a KV cache for the decode benchmarks without a prefill: random K/V
// (a 32K-token prefill per variant would take minutes and changes nothing
// about a decode step's work; the models' weights are random too); the
// pools' pages (--kv_huge_pages) and the benchmarks' main.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <random>
#include <span>
#include <string_view>
#include <vector>

#include "kv/kv_arena.h"
#include "kv/kv_backend.h"

namespace pagoda::bench {

// How the benchmark's KV pools are mapped: base pages, or with
// --kv_huge_pages transparent huge pages (as the engine's --kv-huge-pages).
inline kv_pool_memory& pool_memory() {
  static kv_pool_memory m;
  return m;
}

// Google Benchmark's main for the benchmarks registered so far, after taking
// --kv_huge_pages out of argv into pool_memory() (fault_in as
// kv_pool_memory::fault_in).
inline int run_benchmarks(int argc, char** argv, bool fault_in = true) {
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--kv_huge_pages") pool_memory() = {.huge_pages = true, .fault_in = fault_in};
    else argv[out++] = argv[i];
  }
  argc = out;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

// Slots [0, n_ctx) of every KV layer of `kv` (its layout's, shared ones once)
// through `table`: a 512-token chunk of N(0, 1) values (seed 7), repeated.
inline void fill_random_kv(kv_backend& kv, std::span<const block_id> table, int n_ctx) {
  const kv_layout& l = kv.layout();
  constexpr int chunk = 512;
  std::vector<float> k(static_cast<std::size_t>(chunk) * l.n_kv_heads * l.head_dim), v(k.size());
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  for (int j = 0; j < l.n_layers; ++j)
    for (int pos = 0; pos < n_ctx; pos += chunk)
      kv.write(j, table, pos, std::min(chunk, n_ctx - pos), k.data(), v.data());
}

}  // namespace pagoda::bench
