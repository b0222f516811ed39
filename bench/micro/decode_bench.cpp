// End-to-end decode speed per KV codec at long context: one whole forward step
// (every layer's matmuls, KV write, attention over n_ctx cached tokens, logits)
// for one token of one sequence, on a synth model with Llama-3-8B attention
// shapes. The cache is filled with random K/V up to n_ctx (a 32K-token prefill
// per codec would take minutes and changes nothing about the decode step's
// work: the model's weights are random too), in a fresh pool's block order.
//
//   pagoda synth --preset llama3-8b --layers 2 --weight-type q8_0 --vocab 512 --ctx 65536
//     -o /tmp/llama3-8b-2l-q8.gguf
//   PAGODA_DECODE_MODEL=/tmp/llama3-8b-2l-q8.gguf build/bench/decode_bench
//   ... decode_bench --kv_huge_pages   (the pool in huge pages, faulted in: --kv-huge-pages)
//   ... decode_bench --no_mmap         (the weights read into memory, in huge pages: --no-mmap)
//
// "f16+quest": the same step with Quest reading 1/8 of the blocks of every
// layer (random keys choose scattered blocks: the worst case for locality).
//
// Counters: tokens/s (decode steps per second), KV_MiB (cache bytes the step
// reads: every layer's K and V of n_ctx tokens).
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "kv/kv_storage.h"
#include "model/llama.h"
#include "policy/quest.h"
#include "quant/kv_format_spec.h"
#include "bench_kv.h"

namespace {

using namespace pagoda;

bool g_no_mmap = false;  // --no_mmap

const llama_model* model() {
  static std::unique_ptr<llama_model> m = [] {
    const char* path = std::getenv("PAGODA_DECODE_MODEL");
    auto r = llama_model::load(path ? path : "/tmp/llama3-8b-2l-q8.gguf", {.use_mmap = !g_no_mmap});
    return r.ok() ? std::move(*r) : nullptr;
  }();
  return m.get();
}

// spec: a KV pair spec ("f16", "int4/token"), optionally "+quest": Quest
// reading 1/8 of the blocks (its selector on every layer, as --kv-policy quest:budget=0.125).
void bm_decode(benchmark::State& st, std::string spec) {
  const llama_model* m = model();
  if (!m) {
    st.SkipWithError("no model: set PAGODA_DECODE_MODEL to a GGUF from pagoda synth (see the file's header)");
    return;
  }
  const llama_hparams& hp = m->hparams();
  const int n_ctx = static_cast<int>(st.range(0));
  const int threads = static_cast<int>(st.range(1));
  const std::size_t plus = spec.find("+quest");
  const bool quest = plus != std::string::npos;
  kv_pair_spec pair = *parse_kv_pair_spec(spec.substr(0, plus));
  kv_layout layout = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, kv_type::f32, kv_type::f32);
  for (int l = 0; l < hp.n_layer; ++l) {
    layout.k_formats[l] = pair.k.resolve(kv_role::key, false);
    layout.v_formats[l] = pair.v.resolve(kv_role::value, false);
  }
  layout.key_summaries = quest;
  const int n_blocks = n_ctx / 16 + 2;
  auto storage = std::move(*kv_storage::create(layout, n_blocks, 1, {}, pagoda::bench::pool_memory()));
  std::vector<block_id> table;
  for (int b = 0; b < n_blocks; ++b) table.push_back(block_id(b));
  pagoda::bench::fill_random_kv(*storage, table, n_ctx);
  llama_context ctx(*m, *storage, threads);
  std::vector<float> logits;
  const std::vector<token_id> token{1};
  std::unique_ptr<quest_selector> selector;
  if (quest) {
    quest_params qp;
    qp.budget = 0.125;
    selector = std::make_unique<quest_selector>(qp, hp.n_layer, hp.n_head_kv, hp.head_dim);
  }
  bool sparse = false;
  auto step = [&] {
    forward_seq s = forward_seq::consecutive(token, n_ctx, table, false);
    s.selector = selector.get();
    s.sparse = &sparse;
    return ctx.forward({&s, 1}, logits);
  };
  // Untimed: the selector takes in the whole cache's blocks at its first step.
  if (auto r = step(); !r.ok() || (quest && !sparse)) {
    st.SkipWithError(r.ok() ? "quest read every block" : r.message().c_str());
    return;
  }
  for (auto _ : st) {
    if (auto r = step(); !r.ok()) {
      st.SkipWithError(r.message().c_str());
      return;
    }
    benchmark::DoNotOptimize(logits.data());
  }
  using benchmark::Counter;
  st.counters["tokens/s"] = Counter(1, Counter::kIsIterationInvariantRate);
  // K and V of every layer (summaries aside), even when quest reads 1/8 of it.
  kv_layout kv_only = layout;
  kv_only.key_summaries = false;
  st.counters["KV_MiB"] = static_cast<double>(n_ctx) * kv_only.bytes_per_token() / (1 << 20);
  st.SetLabel(layout.describe());
}

void register_all() {
  for (const char* spec : {"f16", "bf16", "fp8", "int8", "k8v4", "int4/token", "int4", "k4v2", "int2", "q8_0", "q4_0",
                           "f16+quest", "int8+quest"}) {
    auto* b = benchmark::RegisterBenchmark(fmt::format("decode_step/{}", spec).c_str(), bm_decode, std::string(spec));
    for (int ctx : {4096, 16384, 32768, 131072})
      for (int threads : {1, 2}) b->Args({ctx, threads});
    b->ArgNames({"ctx", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--no_mmap") g_no_mmap = true;
    else argv[out++] = argv[i];
  }
  argc = out;
  register_all();
  return pagoda::bench::run_benchmarks(argc, argv);
}
