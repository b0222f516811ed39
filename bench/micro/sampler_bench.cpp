// What one sampling step costs at a large vocabulary: sampler::sample() on a
// fixed row of logits, once per iteration (the RNG moves on, the logits do
// not), for each way of truncating, at 32K and 128K tokens (Llama 3's
// vocabulary is 128,256). Reports; asserts nothing.
//   ./build/release/bench/sampler_bench
// The logits come in two spreads:
//   peaked: what most decode steps look like: a bulk of N(0, 2.5) logits and
//           20 leading tokens at 20, 19, ..., 1 above the bulk's mean (the
//           top-p 0.95 set holds a few tokens);
//   flat:   a Zipf law with exponent 1.1 over the whole vocabulary (logit of
//           the token of rank r: -1.1 ln r, ranks shuffled over the ids), a
//           high-entropy step where the top-p 0.95 set holds ~1/3 of them.
// Uses only the sampler's public interface, so the same file builds against an
// older sampler.cpp for a before/after comparison (bench/RESULTS.md).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "model/sampler.h"

namespace pagoda {
namespace {

enum spread { k_peaked = 0, k_flat = 1 };

// A uniform double in [0, 1) from the top 53 bits (the same on every standard library).
double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

std::vector<float> make_logits(int n_vocab, spread s) {
  std::mt19937_64 rng(2024);
  std::vector<float> l(static_cast<std::size_t>(n_vocab));
  std::vector<int> ids(l.size());
  std::iota(ids.begin(), ids.end(), 0);
  for (std::size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[rng() % i]);  // Fisher-Yates
  if (s == k_flat) {
    for (std::size_t r = 0; r < ids.size(); ++r) l[ids[r]] = static_cast<float>(-1.1 * std::log(r + 1.0));
    return l;
  }
  for (float& x : l) {  // Box-Muller
    const double u1 = 1.0 - uniform01(rng), u2 = uniform01(rng);
    x = static_cast<float>(2.5 * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  for (int r = 0; r < 20; ++r) l[ids[r]] = static_cast<float>(20 - r);
  return l;
}

struct mode {
  const char* name;
  sampling_params params;
};

const std::vector<mode>& modes() {
  static const std::vector<mode> m = {
      {"greedy", sampling_params::greedy()},
      {"temperature", {1.0f, 0, 1.0f, 0.0f, 1}},
      {"top_k_40", {1.0f, 40, 1.0f, 0.0f, 1}},
      {"top_p_0.95", {1.0f, 0, 0.95f, 0.0f, 1}},
      {"min_p_0.05", {1.0f, 0, 1.0f, 0.05f, 1}},
      {"top_k_40+top_p_0.95", {1.0f, 40, 0.95f, 0.0f, 1}},
      // sampling_params' defaults: T 0.8, top-k 40, top-p 0.95, min-p 0.05.
      {"defaults", sampling_params{}},
  };
  return m;
}

void bm_sample(benchmark::State& state, sampling_params params) {
  const auto logits = make_logits(static_cast<int>(state.range(0)), static_cast<spread>(state.range(1)));
  sampler s(params);
  for (auto _ : state) benchmark::DoNotOptimize(s.sample(logits));
  state.SetItemsProcessed(state.iterations());
}

void bm_top_log_probs(benchmark::State& state) {
  const auto logits = make_logits(static_cast<int>(state.range(0)), static_cast<spread>(state.range(1)));
  for (auto _ : state) benchmark::DoNotOptimize(sampler::top_log_probs(logits, 5));
}

void register_all() {
  for (const mode& m : modes()) {
    auto* b = benchmark::RegisterBenchmark((std::string("sample/") + m.name).c_str(), bm_sample, m.params);
    b->ArgNames({"vocab", "flat"})->Unit(benchmark::kMicrosecond);
    for (int flat : {0, 1})
      for (int n_vocab : {32768, 131072}) b->Args({n_vocab, flat});
  }
  auto* b = benchmark::RegisterBenchmark("top_log_probs/k:5", bm_top_log_probs);
  b->ArgNames({"vocab", "flat"})->Unit(benchmark::kMicrosecond);
  for (int flat : {0, 1})
    for (int n_vocab : {32768, 131072}) b->Args({n_vocab, flat});
}

}  // namespace
}  // namespace pagoda

int main(int argc, char** argv) {
  pagoda::register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
