// What constrained decoding (structured output, docs/serving.md) costs.
//   ./build/release/bench/grammar_bench
// BM_request/<vocab>/<mode>: one greedy request of 64 generated tokens
//   through the engine, on a synth "tiny" model (2 layers, embd 128) with a
//   vocabulary of <vocab> tokens (512: stories260K's size; 128256: Llama 3's),
//   one thread. mode 0: unconstrained; mode 1: under a JSON Schema, warm (the
//   same request ran once before, so every grammar state's mask is cached, as
//   for any later request with that schema); mode 2: under a schema no
//   request used before (every mask computed in the request: what the first
//   request with a schema pays). Counter us_per_token (CPU time): the
//   request's wall time over its tokens; the ratio of mode 1 to mode 0 is the
//   mask's cost per decode step. A tiny model's step is far cheaper than a
//   real one's, so the ratio is an upper bound for real models.
// BM_first_compile/<vocab>: the first request with a schema: parsing its
//   grammar and computing the mask of every state along a 40-token JSON
//   output (what a fresh grammar cache pays, once per schema).
// Reports; asserts nothing.
#include <unistd.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include "grammar/convert.h"
#include "grammar/token_mask.h"
#include "model/gguf.h"
#include "model/synth.h"
#include "model/tokenizer.h"
#include "pagoda/engine.h"
#include "sched/runner_state.h"

namespace pagoda {
namespace {

const char* k_schema = R"({"type": "object", "properties": {"title": {"type": "string", "maxLength": 400},
  "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8}},
  "required": ["title", "year", "tags"]})";

const std::string& grammar_text() {
  static const std::string g = *grammar::json_schema_to_gbnf(nlohmann::json::parse(k_schema));
  return g;
}

// The schema with another title length: a grammar no cache has seen.
std::string fresh_grammar_text(int i) {
  nlohmann::json s = nlohmann::json::parse(k_schema);
  s["properties"]["title"]["maxLength"] = 1000 + i;
  return *grammar::json_schema_to_gbnf(s);
}

// The synth model with n_vocab tokens, written once per process.
const std::string& model_path(int n_vocab) {
  static std::map<int, std::string> paths;
  auto it = paths.find(n_vocab);
  if (it != paths.end()) return it->second;
  synth_options o;
  o.preset = "tiny";
  o.weight_type = gguf::tensor_type::f32;
  o.n_threads = 1;
  o.n_vocab = n_vocab;
  const std::string path = "/tmp/pagoda_grammar_bench_" + std::to_string(getpid()) + "_" + std::to_string(n_vocab) + ".gguf";
  if (status st = write_synth_model(o, path); !st.ok()) std::fprintf(stderr, "synth: %s\n", st.message().c_str());
  std::atexit([] {
    for (const auto& [n, p] : paths) std::remove(p.c_str());
  });
  return paths.emplace(n_vocab, path).first->second;
}

int run_request(engine& eng, const std::string& id, const std::string& grammar) {
  request r;
  r.id = id;
  r.prompt = eng.tokenize("Once upon a time");
  r.max_tokens = 64;
  r.ignore_eos = false;
  r.sampling.grammar = grammar;
  if (status st = eng.add_request(std::move(r)); !st.ok()) std::fprintf(stderr, "%s\n", st.message().c_str());
  std::vector<engine_event> events;
  int n = 0;
  while (eng.has_work()) {
    events.clear();
    eng.step(events);
    for (const engine_event& e : events) n += static_cast<int>(e.tokens.size());
  }
  return n;
}

void BM_request(benchmark::State& state) {
  const int n_vocab = static_cast<int>(state.range(0));
  const int mode = static_cast<int>(state.range(1));
  engine_config c;
  c.model_path = model_path(n_vocab);
  c.n_threads = 1;
  c.n_ctx = 512;
  c.max_num_seqs = 4;
  auto eng = engine::create(c);
  if (!eng.ok()) {
    state.SkipWithError(eng.error().message().c_str());
    return;
  }
  run_request(**eng, "warm", mode == 1 ? grammar_text() : "");  // fills the mask cache (and the prefix cache)
  int i = 0, tokens = 0;
  for (auto _ : state) {
    const std::string g = mode == 0 ? "" : mode == 1 ? grammar_text() : fresh_grammar_text(i);
    tokens += run_request(**eng, "r" + std::to_string(i++), g);
  }
  state.counters["tokens_per_request"] = static_cast<double>(tokens) / static_cast<double>(std::max(i, 1));
  state.counters["us_per_token"] =
      benchmark::Counter(static_cast<double>(tokens) * 1e-6, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_request)->ArgsProduct({{512, 128256}, {0, 1, 2}})->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_first_compile(benchmark::State& state) {
  const int n_vocab = static_cast<int>(state.range(0));
  auto file = gguf::file::open(model_path(n_vocab));
  auto vocab = tokenizer::from_gguf(**file);
  const auto v = grammar_vocabulary(**vocab);
  const std::vector<token_id> output =
      (*vocab)->encode(R"({"title": "The little red hen", "year": 1942, "tags": ["farm", "story"]})", false);
  for (auto _ : state) {
    grammar::grammar_cache cache(v);
    auto g = cache.get(grammar_text());
    grammar::token_matcher m(*g);
    for (const token_id t : output) {
      benchmark::DoNotOptimize(m.mask().n_allowed);
      if (!m.accept(t)) break;
    }
    state.counters["exact_masks"] = static_cast<double>((*g)->n_computed_masks());
  }
}
BENCHMARK(BM_first_compile)->Arg(512)->Arg(128256)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace pagoda

BENCHMARK_MAIN();
