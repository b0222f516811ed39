// What an eviction policy costs per call: the engine asks a sequence's policy
// after every step that computed its tokens, so the common call is the one
// that finds nothing worth evicting (the slack rule), and once per block of new
// tokens the policy decides. Reports; asserts nothing.
//   ./build/release/bench/policy_bench
// Shape: 8 layers x 8 KV heads (64 rows) over arg 0 slots; a budget of 25%.
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "policy/kv_policy.h"

namespace pagoda {
namespace {

constexpr int k_layers = 8;
constexpr int k_heads = 8;
constexpr int k_rows = k_layers * k_heads;
constexpr int k_block = 16;

// A sequence of n_slots tokens at positions 0.., random statistics.
struct bench_input {
  std::vector<std::int32_t> positions;
  std::vector<float> totals;
  attention_stats window;
  eviction_input in;

  explicit bench_input(int n_slots) {
    positions.resize(static_cast<std::size_t>(n_slots));
    std::iota(positions.begin(), positions.end(), 0);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(0, 1);
    totals.resize(static_cast<std::size_t>(n_slots) * k_rows);
    for (float& t : totals) t = u(rng);
    window.reset(k_layers, k_heads, n_slots, 16);
    for (float& w : window.window) w = u(rng);
    in.n_layers = k_layers;
    in.n_kv_heads = k_heads;
    in.block_size = k_block;
    in.n_slots = n_slots;
    in.n_seen = n_slots;
    in.n_prompt = n_slots;
    in.n_new = 1;
    in.positions = positions;
    in.totals = totals;
    in.window = &window;
  }
};

std::unique_ptr<kv_policy> policy(const std::string& text) {
  result<kv_policy_spec> spec = parse_kv_policy_spec(text);
  result<std::unique_ptr<kv_policy>> p = make_kv_policy(*spec);
  return std::move(p).value();
}

// The sequence after `d` was applied (kept slots compacted to the end of
// rows as wide as the widest, dead slots in front) and one more token computed.
void apply_and_step(bench_input& b, const eviction_decision& d) {
  const int width = d.width + 1;
  std::vector<std::int32_t> pos(static_cast<std::size_t>(width) * k_rows, -1);
  std::vector<float> totals(static_cast<std::size_t>(width) * k_rows, 0.0f);
  const std::size_t old_stride = b.in.row_stride;
  for (int r = 0; r < k_rows; ++r) {
    const std::span<const std::int32_t> row = d.row(r);
    int at = width - 1 - static_cast<int>(row.size());
    for (const std::int32_t s : row) {
      pos[static_cast<std::size_t>(r * width + at)] = b.positions[r * old_stride + static_cast<std::size_t>(s)];
      totals[static_cast<std::size_t>(at * k_rows + r)] = b.totals[static_cast<std::size_t>(s) * k_rows + r];
      ++at;
    }
    pos[static_cast<std::size_t>(r * width + width - 1)] = b.in.n_seen;  // the new token
  }
  b.positions = std::move(pos);
  b.totals = std::move(totals);
  b.window.reset(k_layers, k_heads, width, 1);
  b.in.n_slots = width;
  b.in.n_seen += 1;
  b.in.positions = b.positions;
  b.in.row_stride = static_cast<std::size_t>(width);
  b.in.totals = b.totals;
}

// The common call: the policy acted on the last block, one token came since,
// nothing is worth evicting (the slack rule).
void run_noop(benchmark::State& state, const std::unique_ptr<kv_policy>& p) {
  bench_input b(static_cast<int>(state.range(0)));
  apply_and_step(b, p->evict(b.in));
  for (auto _ : state) {
    eviction_decision d = p->evict(b.in);
    if (!d.empty()) state.SkipWithError("the step after a decision should not evict");
    benchmark::DoNotOptimize(d);
  }
  state.counters["slots"] = b.in.n_slots;
}

// The deciding call: the sequence holds its whole context, keeps 25%.
void run_decide(benchmark::State& state, const std::string& text) {
  bench_input b(static_cast<int>(state.range(0)));
  const std::unique_ptr<kv_policy> p = policy(text);
  for (auto _ : state) {
    eviction_decision d = p->evict(b.in);
    benchmark::DoNotOptimize(d);
  }
  state.SetItemsProcessed(state.iterations() * k_rows * state.range(0));  // slots considered
}

// Segments: the first quarter of the context kept whole, the second at 25%
// by a window, the rest by h2o.
void bm_noop_segmented(benchmark::State& state) {
  const auto quarter = static_cast<std::int32_t>(state.range(0) / 4);
  const std::vector<kv_segment> segments = {kv_segment{0, quarter, *parse_kv_policy_spec("none")},
                                            kv_segment{quarter, 2 * quarter, *parse_kv_policy_spec("window")}};
  run_noop(state, std::move(make_segmented_policy(*parse_kv_policy_spec("h2o"), segments)).value());
}

void bm_noop_h2o(benchmark::State& s) { run_noop(s, policy("h2o")); }
void bm_noop_pyramid(benchmark::State& s) { run_noop(s, policy("pyramid:base=h2o,ada=0")); }
void bm_noop_pyramid_ada(benchmark::State& s) { run_noop(s, policy("pyramid:base=h2o")); }
void bm_decide_window(benchmark::State& s) { run_decide(s, "window"); }
void bm_decide_h2o(benchmark::State& s) { run_decide(s, "h2o"); }
void bm_decide_snapkv(benchmark::State& s) { run_decide(s, "snapkv"); }
void bm_decide_cluster(benchmark::State& s) { run_decide(s, "cluster"); }
void bm_decide_pyramid(benchmark::State& s) { run_decide(s, "pyramid:base=h2o,ada=0"); }
void bm_decide_pyramid_ada(benchmark::State& s) { run_decide(s, "pyramid:base=h2o"); }

BENCHMARK(bm_noop_h2o)->Arg(4096)->Arg(32768);
BENCHMARK(bm_noop_pyramid)->Arg(4096)->Arg(32768);
BENCHMARK(bm_noop_pyramid_ada)->Arg(4096)->Arg(32768);
BENCHMARK(bm_noop_segmented)->Arg(4096)->Arg(32768);
BENCHMARK(bm_decide_window)->Arg(4096);
BENCHMARK(bm_decide_h2o)->Arg(4096);
BENCHMARK(bm_decide_snapkv)->Arg(4096);
BENCHMARK(bm_decide_cluster)->Arg(4096);
BENCHMARK(bm_decide_pyramid)->Arg(4096);
BENCHMARK(bm_decide_pyramid_ada)->Arg(4096);

}  // namespace
}  // namespace pagoda

BENCHMARK_MAIN();
