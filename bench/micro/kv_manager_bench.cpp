// KV manager bookkeeping costs: what one scheduler step pays per sequence besides
// the forward pass. Reports; asserts nothing.
//   ./build/release/bench/kv_manager_bench
#include <numeric>
#include <vector>

#include <benchmark/benchmark.h>

#include "kv/kv_manager.h"

namespace pagoda {
namespace {

std::vector<token_id> make_tokens(int n, int first) {
  std::vector<token_id> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

// One request's whole life: add (prefix lookup), prefill, n decode steps, free.
// Arg 0: prompt tokens, arg 1: decode tokens. Every request shares the prompt's
// first half with the previous ones (prefix hits).
void bm_request_lifecycle(benchmark::State& state) {
  const int n_prompt = static_cast<int>(state.range(0));
  const int n_decode = static_cast<int>(state.range(1));
  kv_manager m(16, 4096);
  std::vector<token_id> prompt = make_tokens(n_prompt, 0);
  std::int64_t id = 0;
  for (auto _ : state) {
    // A fresh suffix each time: the shared half hits, the rest is computed.
    for (int i = n_prompt / 2; i < n_prompt; ++i) prompt[static_cast<std::size_t>(i)] = static_cast<token_id>(id + i);
    const seq_id s(++id);
    const std::int32_t cached = *m.add_sequence(s, prompt);
    (void)m.allocate(s, n_prompt - cached);
    (void)m.commit(s, std::span<const token_id>(prompt).subspan(static_cast<std::size_t>(cached)));
    for (int t = 0; t < n_decode; ++t) {
      (void)m.allocate(s, 1);
      const token_id one[] = {t};
      (void)m.commit(s, one);
    }
    (void)m.free_sequence(s);
  }
  state.SetItemsProcessed(state.iterations() * (n_prompt + n_decode));
  state.counters["hit_ratio"] = m.metrics().prefix_hit_ratio();
}
BENCHMARK(bm_request_lifecycle)->Args({512, 128})->Args({2048, 16});

// One decode step for a batch of running sequences: allocate(1) + commit(1) each.
void bm_decode_step(benchmark::State& state) {
  const int n_seqs = static_cast<int>(state.range(0));
  kv_manager m(16, 1 << 16);
  for (int i = 0; i < n_seqs; ++i) {
    const seq_id s(i);
    const auto prompt = make_tokens(100, i * 1000);
    (void)m.add_sequence(s, prompt);
    (void)m.allocate(s, 100);
    (void)m.commit(s, prompt);
  }
  token_id t = 0;
  for (auto _ : state) {
    for (int i = 0; i < n_seqs; ++i) {
      if (!m.allocate(seq_id(i), 1)) state.SkipWithError("pool exhausted");
      const token_id one[] = {t};
      (void)m.commit(seq_id(i), one);
    }
    ++t;
    if (t % 512 == 0) {  // keep tables bounded: restart every sequence
      state.PauseTiming();
      for (int i = 0; i < n_seqs; ++i) {
        (void)m.free_sequence(seq_id(i));
        const auto prompt = make_tokens(100, i * 1000);
        (void)m.add_sequence(seq_id(i), prompt);
        (void)m.allocate(seq_id(i), 100 - m.n_stored_tokens(seq_id(i)));
        (void)m.commit(seq_id(i), std::span<const token_id>(prompt).subspan(
                                      static_cast<std::size_t>(m.n_stored_tokens(seq_id(i)))));
      }
      state.ResumeTiming();
    }
  }
  state.SetItemsProcessed(state.iterations() * n_seqs);
}
BENCHMARK(bm_decode_step)->Arg(1)->Arg(32)->Arg(256);

// The chained hash of one full block of 16 tokens.
void bm_hash_block(benchmark::State& state) {
  const auto tokens = make_tokens(16, 7);
  block_key key = k_root_parent_key;
  for (auto _ : state) {
    key = hash_block(key, tokens, {});
    benchmark::DoNotOptimize(key);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(bm_hash_block);

}  // namespace
}  // namespace pagoda

BENCHMARK_MAIN();
