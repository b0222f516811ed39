// What carrying a sequence's KV state in the step plan costs at a decode
// step (step_plan.h): the deltas the scheduler sends (runner_sync.h: new
// table entries, no stored position) and the runner applies (runner_state.h),
// against owned copies of every block table and every stored position each
// step, and against the views the plan once held (the bookkeeping's floor). n sequences of n_ctx stored tokens each decode one token per
// iteration (the runner applying the deltas included) through a KV manager of two groups (full attention and a sliding
// window, as gemma2's), with no model: the bookkeeping alone.
//
//   build/release/bench/plan_sync_bench
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kv/kv_manager.h"
#include "sched/runner_state.h"
#include "sched/runner_sync.h"

namespace {

using namespace pagoda;

constexpr std::int32_t k_block = 16;

struct fixture {
  kv_manager kv;
  std::vector<seq_id> seqs;
  std::vector<runner_mirror> mirrors;
  runner_state state{runner_shape{1, 1, 8, k_block}, {}};
  std::int32_t pos = 0;

  fixture(int n_ctx, int n_seqs)
      : kv(k_block,
           std::vector<kv_group_config>{
               {kv_group_kind::full, 0, {static_cast<std::int32_t>(n_seqs * (n_ctx / k_block + 256))}},
               {kv_group_kind::sliding_window, 4096, {static_cast<std::int32_t>(n_seqs * (4096 / k_block + 256))}}},
           false) {
    std::vector<token_id> prompt(static_cast<std::size_t>(n_ctx));
    for (int i = 0; i < n_ctx; ++i) prompt[static_cast<std::size_t>(i)] = 3 + i % 500;
    for (int s = 0; s < n_seqs; ++s) {
      const seq_id id(s);
      (void)kv.add_sequence(id, prompt);
      for (int at = 0; at < n_ctx; at += 4096) {
        const int n = std::min(4096, n_ctx - at);
        (void)kv.allocate(id, n);
        (void)kv.commit(id, std::span(prompt).subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(n)));
        (void)kv.release_window(id, at + n);
      }
      seqs.push_back(id);
      mirrors.emplace_back();
    }
    pos = n_ctx;
  }

  // One decode step of every sequence; `mode` picks what the plan carries:
  // nothing of the KV state (views, as before), deltas, or copies.
  enum class mode { views, deltas, copies };
  void step(mode m, step_plan& plan) {
    const bool deltas = m == mode::deltas;
    plan.seqs.clear();
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const seq_id id = seqs[i];
      (void)kv.allocate(id, 1);
      scheduled_seq q;
      q.seq = id;
      q.tokens = {7};
      q.positions = {pos};
      q.n_stored = kv.n_stored_tokens(id);
      if (deltas) {
        if (!mirrors[i].known) {
          q.setup = seq_setup{};
          mirrors[i].known = true;
        }
        sync_kv_state(kv, id, 1, mirrors[i], q);
      } else if (m == mode::copies) {
        for (std::int32_t g = 0; g < kv.n_groups(); ++g) {
          const auto t = kv.block_table(id, g);
          q.tables.push_back({g, 0, 0, std::vector<block_id>(t.begin(), t.end())});
        }
        const auto p = kv.positions(id);
        q.stored_positions.assign(p.begin(), p.end());
      }
      plan.seqs.push_back(std::move(q));
    }
    if (deltas) {  // the runner's side of the deltas
      const status applied = state.apply(plan);
      if (!applied.ok()) {
        std::fprintf(stderr, "%s\n", applied.message().c_str());
        std::abort();
      }
    }
    benchmark::DoNotOptimize(plan.seqs.data());
    for (const seq_id id : seqs) {
      const token_id t = 7;
      (void)kv.commit(id, std::span(&t, 1));
      (void)kv.release_window(id, pos + 1);
    }
    ++pos;
  }
};

void bm_plan(benchmark::State& st, fixture::mode m) {
  fixture f(static_cast<int>(st.range(0)), static_cast<int>(st.range(1)));
  step_plan plan;
  f.step(m, plan);  // the first carries everything either way
  for (auto _ : st) f.step(m, plan);
}

void bm_plan_views(benchmark::State& st) { bm_plan(st, fixture::mode::views); }
void bm_plan_deltas(benchmark::State& st) { bm_plan(st, fixture::mode::deltas); }
void bm_plan_copies(benchmark::State& st) { bm_plan(st, fixture::mode::copies); }

// Fixed iterations: the pools hold each sequence's context plus 256 blocks.
BENCHMARK(bm_plan_views)->Name("plan/views")->ArgNames({"ctx", "seqs"})->Args({4096, 8})->Args({32768, 8})->Iterations(3000);
BENCHMARK(bm_plan_deltas)->Name("plan/deltas")->ArgNames({"ctx", "seqs"})->Args({4096, 8})->Args({32768, 8})->Iterations(3000);
BENCHMARK(bm_plan_copies)->Name("plan/copies")->ArgNames({"ctx", "seqs"})->Args({4096, 8})->Args({32768, 8})->Iterations(3000);

}  // namespace

BENCHMARK_MAIN();
