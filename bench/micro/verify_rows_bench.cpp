// What a speculative verification step costs against one decode step: one
// forward of `rows` new tokens of one sequence (the last token and rows - 1
// drafts) after n_ctx stored tokens, logits for every row (as verification
// reads them), against rows = 1 with logits for its one row. The cache is
// filled with random K/V (the step's work does not depend on the values).
//
//   build/release/bench/verify_rows_bench                       (stories260K, models/)
//   PAGODA_VERIFY_MODEL=/tmp/llama3-8b-2l-q8.gguf build/release/bench/verify_rows_bench
//
// Counters: steps/s, and rows/s (the rows a step computes, per second). The
// ratio of a row count's time to rows = 1 is the verification cost of k = rows - 1.
// Times are the process's CPU time (one thread): on a shared machine other
// jobs' time slices would count in wall clock. PAGODA_VERIFY_CTX sets the
// cached tokens (default 160: a dev-text opening and half its continuation).
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kv/kv_storage.h"
#include "model/llama.h"
#include "bench_kv.h"

namespace {

using namespace pagoda;

const llama_model* model() {
  static std::unique_ptr<llama_model> m = [] {
    const char* path = std::getenv("PAGODA_VERIFY_MODEL");
    auto r = llama_model::load(path ? std::string(path) : std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf");
    return r.ok() ? std::move(*r) : nullptr;
  }();
  return m.get();
}

void bm_verify(benchmark::State& st) {
  const llama_model* m = model();
  if (!m) {
    st.SkipWithError("no model: set PAGODA_VERIFY_MODEL to a GGUF (see the file's header)");
    return;
  }
  const llama_hparams& hp = m->hparams();
  const int rows = static_cast<int>(st.range(0));
  const int n_ctx = static_cast<int>(st.range(1));
  const int threads = static_cast<int>(st.range(2));
  const kv_layout layout = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, kv_type::f32, kv_type::f32);
  const int n_blocks = (n_ctx + rows) / 16 + 2;
  auto storage = std::move(*kv_storage::create(layout, n_blocks, 1));
  std::vector<block_id> table;
  for (int b = 0; b < n_blocks; ++b) table.push_back(block_id(b));
  pagoda::bench::fill_random_kv(*storage, table, n_ctx);
  llama_context ctx(*m, *storage, threads);
  std::vector<float> logits;
  std::vector<token_id> tokens;
  for (int r = 0; r < rows; ++r) tokens.push_back(static_cast<token_id>(1 + r % (hp.n_vocab - 1)));
  for (auto _ : st) {
    forward_seq s = forward_seq::consecutive(tokens, n_ctx, table, rows > 1);
    if (auto r = ctx.forward({&s, 1}, logits); !r.ok()) {
      st.SkipWithError(r.message().c_str());
      return;
    }
    benchmark::DoNotOptimize(logits.data());
  }
  using benchmark::Counter;
  st.counters["steps/s"] = Counter(1, Counter::kIsIterationInvariantRate);
  st.counters["rows/s"] = Counter(rows, Counter::kIsIterationInvariantRate);
}

void register_all() {
  auto* b = benchmark::RegisterBenchmark("verify_step", bm_verify);
  const char* ctx_env = std::getenv("PAGODA_VERIFY_CTX");
  const int n_ctx = ctx_env ? std::atoi(ctx_env) : 160;
  for (int rows = 1; rows <= 9; ++rows) b->Args({rows, n_ctx, 1});
  b->ArgNames({"rows", "ctx", "threads"})->Unit(benchmark::kMicrosecond)->MinTime(0.3);
}

// Registered before main runs, so the stock benchmark main serves.
const bool registered = (register_all(), true);

}  // namespace

BENCHMARK_MAIN();
