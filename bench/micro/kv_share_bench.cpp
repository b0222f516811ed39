// Cross-layer KV sharing at long context (issue 31): KV bytes per token and
// whole decode steps (llama_context::forward: every layer's matmuls, the KV
// write, attention over n_ctx cached tokens, logits; one token of one
// sequence) of synth models with Llama-3-8B shapes that declare sharing
// (pagoda.kv_source_layers: CLA 2, CLA 4, YOCO) against the same model
// without sharing, all in one run. Each model's KV layout is the one the
// engine builds (with_declared_kv_sharing); every KV layer is filled with
// random K/V up to n_ctx in a fresh pool's block order (as decode_bench:
// a 32K prefill per model would take minutes and change nothing about the
// step's work, the weights being random too).
//
//   P=build/release/pagoda; C="--preset llama3-8b --layers 4 --weight-type q8_0 --vocab 512 --ctx 65536"
//   $P synth $C -o /tmp/kvshare31/plain.gguf; $P synth $C --cla 2 -o /tmp/kvshare31/cla2.gguf
//   $P synth $C --cla 4 -o /tmp/kvshare31/cla4.gguf; $P synth $C --yoco -o /tmp/kvshare31/yoco.gguf
//   PAGODA_KV_SHARE_MODEL_DIR=/tmp/kvshare31 build/release/bench/kv_share_bench
//
// 4 layers, so that CLA 4 has a group (1 KV layer), CLA 2 and YOCO keep 2.
//
// Timing: the four models' steps and a STREAM-like read pass (read_bandwidth.h,
// same thread count) run interleaved, iteration i starting at variant i mod 5;
// figures are medians over the iterations. After the run, a table per
// benchmark: tokens/s (median wall clock), its ratio to the plain model's
// (ratio of medians, wall clock and process CPU time), KV bytes per token and
// their ratio, the bytes one step reads (weights as in the file, plus every
// model layer's attention over its KV layer's n_ctx tokens: a layer that reads
// a shared KV layer reads it again), and that over the step's median time
// against the median STREAM pass (achieved / limit).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kv/kv_storage.h"
#include "model/llama.h"
#include "quant/kv_format_spec.h"
#include "bench_kv.h"
#include "bench_stats.h"
#include "read_bandwidth.h"
#include "sched/engine_setup.h"

namespace {

using namespace pagoda;
using namespace pagoda::bench;

constexpr int k_block = 16;
const char* const k_models[] = {"plain", "cla2", "cla4", "yoco"};
constexpr int k_n_models = 4;

std::string model_path(const char* name) {
  const char* dir = std::getenv("PAGODA_KV_SHARE_MODEL_DIR");
  return fmt::format("{}/{}.gguf", dir ? dir : "/tmp/kvshare31", name);
}

const llama_model* model(int i) {
  static std::unique_ptr<llama_model> models[k_n_models];
  if (!models[i]) {
    auto r = llama_model::load(model_path(k_models[i]));
    if (!r.ok()) {
      fmt::print(stderr, "{}: {}\n", model_path(k_models[i]), r.error().message());
      return nullptr;
    }
    models[i] = std::move(*r);
  }
  return models[i].get();
}

// One model's cache at n_ctx tokens and its decode step.
struct model_case {
  const llama_model* m = nullptr;
  kv_layout layout;
  std::unique_ptr<kv_storage> kv;
  std::vector<block_id> table;
  std::unique_ptr<llama_context> ctx;
  std::vector<double> wall_s, cpu_s;
};

result<model_case> make_case(const llama_model& m, const kv_pair_spec& pair, int n_ctx, int threads) {
  const llama_hparams& hp = m.hparams();
  kv_layout per_layer = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, k_block, kv_type::f32, kv_type::f32);
  for (int l = 0; l < hp.n_layer; ++l) {
    per_layer.k_formats[l] = pair.k.resolve(kv_role::key, false);
    per_layer.v_formats[l] = pair.v.resolve(kv_role::value, false);
  }
  model_case c;
  c.m = &m;
  PAGODA_ASSIGN_OR_RETURN(c.layout, with_declared_kv_sharing(hp, per_layer));
  const int n_blocks = n_ctx / k_block + 2;
  PAGODA_ASSIGN_OR_RETURN(c.kv, kv_storage::create(c.layout, n_blocks, 1));
  for (int b = 0; b < n_blocks; ++b) c.table.push_back(block_id(b));
  pagoda::bench::fill_random_kv(*c.kv, c.table, n_ctx);
  c.ctx = std::make_unique<llama_context>(m, *c.kv, threads);
  return c;
}

struct row {
  std::string bench, model;
  double tps, wall_ratio, cpu_ratio, kv_bytes_per_token, kv_ratio, read_mib, gbps, of_stream;
};
std::vector<row>& rows() {
  static std::vector<row> r;
  return r;
}

void bm_kv_share(benchmark::State& st, std::string spec) {
  const int n_ctx = static_cast<int>(st.range(0));
  const int threads = static_cast<int>(st.range(1));
  const kv_pair_spec pair = *parse_kv_pair_spec(spec);
  std::vector<model_case> cases;
  for (int i = 0; i < k_n_models; ++i) {
    const llama_model* m = model(i);
    if (!m) return st.SkipWithError("a model is missing: write the four synth files (see the file's header)");
    auto c = make_case(*m, pair, n_ctx, threads);
    if (!c.ok()) return st.SkipWithError(fmt::format("{}: {}", k_models[i], c.error().message()).c_str());
    cases.push_back(std::move(*c));
  }
  thread_pool stream_pool(threads);
  std::vector<double> stream_gbps;
  const std::vector<token_id> token{1};
  std::vector<float> logits;
  auto step = [&](model_case& c) {
    forward_seq s = forward_seq::consecutive(token, n_ctx, c.table, false);
    status r = c.ctx->forward({&s, 1}, logits);
    benchmark::DoNotOptimize(logits.data());
    return r;
  };
  for (model_case& c : cases)  // first touch, untimed
    if (status r = step(c); !r.ok()) return st.SkipWithError(r.message().c_str());
  std::size_t it = 0;
  for (auto _ : st) {
    double total = 0;
    for (int j = 0; j <= k_n_models; ++j) {
      const int v = static_cast<int>((it + static_cast<std::size_t>(j)) % (k_n_models + 1));
      const auto t0 = std::chrono::steady_clock::now();
      if (v == k_n_models) {
        stream_gbps.push_back(stream_pass(stream_pool));
      } else {
        const double c0 = process_cpu_s();
        if (status r = step(cases[v]); !r.ok()) return st.SkipWithError(r.message().c_str());
        cases[v].cpu_s.push_back(process_cpu_s() - c0);
        cases[v].wall_s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    st.SetIterationTime(total);
    ++it;
  }
  const double stream = median(stream_gbps);
  const double base_wall = median(cases[0].wall_s), base_cpu = median(cases[0].cpu_s);
  const double base_kv = cases[0].layout.bytes_per_token();
  for (int i = 0; i < k_n_models; ++i) {
    const model_case& c = cases[i];
    const double wall = median(c.wall_s);
    // Each model layer's attention reads its KV layer's n_ctx tokens.
    double kv_read = 0;
    for (int l = 0; l < c.layout.n_model_layers(); ++l) {
      const int j = c.layout.kv_layer_of(l);
      kv_read += static_cast<double>(c.layout.layer_tile_bytes_per_block(j)) / k_block * n_ctx;
    }
    const double read = static_cast<double>(std::filesystem::file_size(model_path(k_models[i]))) + kv_read;
    const double gbps = read / wall * 1e-9;
    rows().push_back({fmt::format("{}/threads:{}", spec, threads), k_models[i], 1 / wall, base_wall / wall,
                      base_cpu / median(c.cpu_s), c.layout.bytes_per_token(), c.layout.bytes_per_token() / base_kv,
                      read / (1 << 20), gbps, gbps / stream});
    st.counters[std::string(k_models[i]) + "_tok/s"] = 1 / wall;
  }
  st.counters["stream_GB/s"] = stream;
  st.SetLabel(fmt::format("{} KV, {} threads", spec, threads));
}

void register_all() {
  for (const char* spec : {"f16", "int8"}) {
    auto* b = benchmark::RegisterBenchmark(fmt::format("kv_share/{}", spec).c_str(), bm_kv_share, std::string(spec));
    for (int threads : {1, 2}) b->Args({32768, threads});
    b->ArgNames({"ctx", "threads"})->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(15);
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  fmt::print("\n| KV, threads | model | tok/s | / plain (wall) | / plain (CPU) | KV B/token | / plain | MiB read/step | GB/s | of STREAM |\n"
             "|---|---|---|---|---|---|---|---|---|---|\n");
  for (const row& r : rows())
    fmt::print("| {} | {} | {:.2f} | {:.3f} | {:.3f} | {:.0f} | {:.3f} | {:.0f} | {:.1f} | {:.2f} |\n", r.bench, r.model,
               r.tps, r.wall_ratio, r.cpu_ratio, r.kv_bytes_per_token, r.kv_ratio, r.read_mib, r.gbps, r.of_stream);
  benchmark::Shutdown();
  return 0;
}
