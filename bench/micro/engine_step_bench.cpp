// Whole engine steps at long context: schedule, execute (forward pass and
// sampling), update and the output step, for n sequences decoding together
// after a shared prompt of n_ctx tokens (held once, through the prefix
// cache). What decode_bench measures (one forward pass) plus everything the
// engine does around it: the plan, the runner's per-sequence state, the
// commit and the events. Only engine_core's public calls, so the same file
// builds against older trees for A/B runs (bench/ab_engine.py).
//
//   build/release/bench/engine_step_bench            (stories260K)
//   PAGODA_STEP_MODEL=/tmp/model.gguf build/release/bench/engine_step_bench
//
// Counters: steps/s (whole engine steps of n sequences), tokens/s.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model/llama.h"
#include "sched/engine_core.h"

namespace {

using namespace pagoda;

const llama_model* model() {
  static std::unique_ptr<llama_model> m = [] {
    const char* path = std::getenv("PAGODA_STEP_MODEL");
    auto r = llama_model::load(path ? path : std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf");
    return r.ok() ? std::move(*r) : nullptr;
  }();
  return m.get();
}

void bm_engine_step(benchmark::State& st) {
  const llama_model* m = model();
  if (!m) {
    st.SkipWithError("no model: set PAGODA_STEP_MODEL to a GGUF");
    return;
  }
  const llama_hparams& hp = m->hparams();
  const int n_ctx = static_cast<int>(st.range(0));
  const int n_seqs = static_cast<int>(st.range(1));
  const int n_decode = 4096;  // tokens each sequence may generate: more than the benchmark runs
  engine_core_config c;
  c.n_threads = 1;
  c.max_model_len = n_ctx + n_decode + 16;
  c.max_num_seqs = n_seqs;
  c.max_num_batched_tokens = 4096;
  c.kv = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, kv_type::f16, kv_type::f16);
  c.n_blocks = (n_ctx + 16) / 16 + static_cast<std::int64_t>(n_seqs) * (n_decode / 16 + 2) + 16;
  auto e = engine_core::create(*m, c);
  if (!e.ok()) {
    st.SkipWithError(e.error().message().c_str());
    return;
  }
  engine_core& core = **e;
  std::mt19937 rng(5);
  std::uniform_int_distribution<token_id> tok(3, hp.n_vocab - 1);
  std::vector<token_id> prompt(static_cast<std::size_t>(n_ctx));
  for (token_id& t : prompt) t = tok(rng);
  for (int i = 0; i < n_seqs; ++i) {
    request r;
    r.id = std::to_string(i);
    r.prompt = prompt;
    r.prompt.back() = static_cast<token_id>(3 + i);  // the last token is each one's own
    r.max_tokens = n_decode;
    r.sampling = sampling_params::greedy();
    r.ignore_eos = true;
    if (!core.add_request(std::move(r)).ok()) {
      st.SkipWithError("request refused");
      return;
    }
  }
  std::vector<engine_event> events;
  // Prefill (the shared prompt once, then each sequence's last token) until every sequence decodes.
  for (int guard = 0; guard < 100000 && core.stats().n_generated_tokens < n_seqs; ++guard) {
    events.clear();
    core.step(events);
  }
  for (int i = 0; i < 4; ++i) core.step(events);  // warm up
  std::int64_t steps = 0;
  for (auto _ : st) {
    events.clear();
    core.step(events);
    benchmark::DoNotOptimize(events.data());
    ++steps;
  }
  st.counters["steps/s"] = benchmark::Counter(static_cast<double>(steps), benchmark::Counter::kIsRate);
  st.counters["tokens/s"] = benchmark::Counter(static_cast<double>(steps) * n_seqs, benchmark::Counter::kIsRate);
}

BENCHMARK(bm_engine_step)
    ->Name("engine_step")
    ->ArgNames({"ctx", "seqs"})
    ->Args({4096, 4})
    ->Args({32768, 4})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(200);

}  // namespace

BENCHMARK_MAIN();
