// Decode attention over a paged KV cache, per KV codec, at a realistic shape:
// head_dim 128, 8 KV heads, 32 query heads (GQA 4), blocks of 16 tokens,
// contexts 1K to 32K, 1 and 2 threads. One decode step = one query token
// attending to n_ctx cached tokens of one layer. The block table is in a fresh
// pool's order (shuffled:0: consecutive block ids) or a random permutation of
// the pool (shuffled:1: a fragmented pool; in this VM scattered 4 KiB reads run
// at about half the speed of sequential ones).
//
// Counters:
//   KV_GB/s      bytes of K and V tiles read per second (every byte once per step);
//   of_stream    KV_GB/s divided by this machine's read bandwidth sampled
//                during the same benchmark (stream_GB/s: a STREAM-like read
//                pass over 1 GiB with the same thread count before every 50 ms
//                of decode steps; medians of both);
//   steps/s      decode steps per second (tokens/s of this layer's attention).
// KV_GB/s and steps/s come from the median step time. stream_read alone is the
// best of 5 passes, for reference.
// Decode attention reads every KV byte once, so its physical limit is memory
// bandwidth (DESIGN.md): of_stream is "achieved / available".
//
//   build/bench/attention_bench --benchmark_filter='ctx:32768'   (etc.)
//   build/bench/attention_bench --benchmark_filter='stream'      (bandwidth only)
//   build/bench/attention_bench --benchmark_filter='kernel/'     (q.k and a.v in cache, bm_kernel)
//   build/bench/attention_bench --kv_huge_pages ...             (pools in huge pages, faulted in:
//                                                                 the engine's --kv-huge-pages)
//
// Kernels run at the process's SIMD level (the CPU's best, lowered by
// PAGODA_SIMD=scalar|avx2). To compare levels in one run, name them:
//   build/bench/attention_bench --simd_levels=scalar,avx2,avx512 --benchmark_filter='decode/f16/'
// registers decode/SPEC/LEVEL for each, the levels of one (spec, ctx, threads,
// shuffled) next to each other on the same pool, so the ratios between them
// come from the same minute of this shared machine.
#include <benchmark/benchmark.h>
#include <sys/mman.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "attention/paged_attention.h"
#include "core/aligned_buffer.h"
#include "core/cpu.h"
#include "core/thread_pool.h"
#include "bench_kv.h"
#include "kv/kv_storage.h"
#include "quant/kv_codec.h"
#include "quant/kv_format_spec.h"
#include "read_bandwidth.h"

namespace {

using namespace pagoda;
using namespace pagoda::bench;

constexpr int k_head_dim = 128, k_kv_heads = 8, k_rep = 4, k_block = 16;

void bm_stream(benchmark::State& st) {
  const int threads = static_cast<int>(st.range(0));
  thread_pool pool(threads);
  double best = 0;
  for (auto _ : st) best = std::max(best, stream_pass(pool));
  st.counters["GB/s"] = best;
}

// --- attention -------------------------------------------------------------

struct setup {
  std::unique_ptr<kv_storage> kv;
  std::vector<block_id> table;
  std::vector<float> q;  // [32][128]: one decode token
  std::vector<std::int32_t> pos;  // [n_ctx]: slot i at position i
  std::size_t kv_bytes = 0;
};

// One pool per (codec, context), filled once: K, V ~ N(0, 1) with a few
// outlier key channels, written in prompt chunks of 512 as a prefill would.
setup& setup_for(const std::string& spec, int n_ctx, bool shuffled) {
  static std::map<std::tuple<std::string, int, bool>, std::unique_ptr<setup>> cache;
  auto& slot = cache[{spec, n_ctx, shuffled}];
  if (slot) return *slot;
  // Keep one pool alive at a time: 32K f32 pools are 256 MiB each.
  cache.clear();
  auto& s = cache[{spec, n_ctx, shuffled}];
  s = std::make_unique<setup>();
  kv_pair_spec pair = *parse_kv_pair_spec(spec);
  kv_layout layout = kv_layout::uniform(1, k_kv_heads, k_head_dim, k_block, kv_type::f32, kv_type::f32);
  layout.k_formats[0] = pair.k.resolve(kv_role::key, false);
  layout.v_formats[0] = pair.v.resolve(kv_role::value, false);
  const int n_blocks = (n_ctx + k_block - 1) / k_block;
  s->kv = std::move(*kv_storage::create(layout, n_blocks + 64, 1, {}, pool_memory()));
  std::vector<int> ids(n_blocks + 64);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(1);
  if (shuffled) std::shuffle(ids.begin(), ids.end(), rng);
  for (int i = 0; i < n_blocks; ++i) s->table.push_back(block_id(ids[i]));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int chunk = 512;
  std::vector<float> k(static_cast<std::size_t>(chunk) * k_kv_heads * k_head_dim), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = nd(rng) * (i % k_head_dim % 16 == 5 ? 8.0f : 1.0f);
    v[i] = nd(rng);
  }
  for (int pos = 0; pos < n_ctx; pos += chunk) s->kv->write(0, s->table, pos, std::min(chunk, n_ctx - pos), k.data(), v.data());
  s->pos.resize(n_ctx);
  for (int i = 0; i < n_ctx; ++i) s->pos[i] = i;
  s->q.resize(static_cast<std::size_t>(k_kv_heads) * k_rep * k_head_dim);
  for (float& x : s->q) x = nd(rng);
  const std::size_t full = static_cast<std::size_t>(n_ctx / k_block) * layout.bytes_per_block();
  const std::size_t tail = n_ctx % k_block ? layout.bytes_per_block() : 0;  // upper bound for a partial block
  s->kv_bytes = full + tail;
  return *s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// level: the SIMD level to run at, or nullopt for the process's level.
void bm_decode(benchmark::State& st, std::string spec, std::optional<simd_level> level) {
  if (level) {
    set_simd_level(*level);
    if (active_simd_level() != *level) {
      st.SkipWithError(fmt::format("this CPU has no {} level", simd_level_name(*level)).c_str());
      return;
    }
  }
  const int n_ctx = static_cast<int>(st.range(0));
  const int threads = static_cast<int>(st.range(1));
  const bool shuffled = st.range(2) != 0;
  setup& s = setup_for(spec, n_ctx, shuffled);
  thread_pool pool(threads);
  std::vector<attention_scratch> scratch(threads);
  std::vector<float> out(s.q.size());
  paged_kv_view kview = s.kv->k_view(0, s.table, n_ctx), vview = s.kv->v_view(0, s.table, n_ctx);
  const float scale = 1.0f / std::sqrt(static_cast<float>(k_head_dim));
  auto step = [&] {
    pool.run([&](int ith, int nth) {
      std::size_t b, e;
      split_range(k_kv_heads, ith, nth, 1, b, e);
      for (std::size_t h = b; h < e; ++h) {
        attention_task t;
        t.k = &kview;
        t.v = &vview;
        t.kv_head = static_cast<int>(h);
        t.n_rep = k_rep;
        t.head_dim = k_head_dim;
        t.scale = scale;
        t.q = s.q.data();
        t.q_stride = s.q.size();
        t.n_tokens = 1;
        t.q_pos = s.pos.data() + n_ctx - 1;
        t.kv_pos = s.pos.data();
        t.n_kv = n_ctx;
        t.out = out.data();
        t.out_stride = out.size();
        paged_attention(t, scratch[ith]);
      }
    });
    benchmark::DoNotOptimize(out.data());
  };
  // The bandwidth this step competes with is sampled while it runs: a STREAM
  // pass (1 GiB, same threads) before every 50 ms of decode steps. On this
  // shared VM the read bandwidth moves by 20-40% from second to second with
  // the neighbours' load, so a best-of STREAM taken once, set against the mean
  // of later steps, compared a quiet moment with an average one. Both sides
  // are now medians over the same stretch of time.
  using clock = std::chrono::steady_clock;
  std::vector<double> step_s, stream_gbps;
  auto last_stream = clock::time_point{};
  step();  // first touch of the scratch buffers
  for (auto _ : st) {
    if (clock::now() - last_stream > std::chrono::milliseconds(50)) {
      stream_gbps.push_back(stream_pass(pool));
      last_stream = clock::now();
    }
    const auto t0 = clock::now();
    step();
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    st.SetIterationTime(dt);
    step_s.push_back(dt);
  }
  const double kv_gbps = static_cast<double>(s.kv_bytes) / median(step_s) * 1e-9;
  const double stream = median(stream_gbps);
  st.counters["KV_GB/s"] = kv_gbps;
  st.counters["of_stream"] = kv_gbps / stream;
  st.counters["steps/s"] = 1.0 / median(step_s);
  st.counters["stream_GB/s"] = stream;
  st.counters["KV_MiB"] = static_cast<double>(s.kv_bytes) / (1 << 20);
  st.SetLabel(s.kv->layout().describe() + " simd " + simd_level_name(active_simd_level()));
}

// --- q.k and a.v apart, over the decode pool ----------------------------------
//
// split/SPEC: decode/SPEC's pool and block table (1 thread, shuffled:0), but
// each KV head's q.k and a.v timed apart (GQA 4 rows, weights exp(N(0,1) - 2)
// instead of a softmax): qk_us and av_us per step (medians), and GB/s of the
// K and V tiles through each. At 32K the pool is past the L3, at 2K in it: the
// two say how much of a step is arithmetic and how much memory.
void bm_split(benchmark::State& st, std::string spec) {
  const int n_ctx = static_cast<int>(st.range(0));
  setup& s = setup_for(spec, n_ctx, false);
  paged_kv_view kview = s.kv->k_view(0, s.table, n_ctx), vview = s.kv->v_view(0, s.table, n_ctx);
  const int n_blocks = (n_ctx + k_block - 1) / k_block;
  std::vector<std::vector<const void*>> kt(k_kv_heads), vt(k_kv_heads);
  for (int h = 0; h < k_kv_heads; ++h)
    for (int b = 0; b < n_blocks; ++b) {
      kt[h].push_back(kview.tile(b, h));
      vt[h].push_back(vview.tile(b, h));
    }
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> scores(static_cast<std::size_t>(k_rep) * n_ctx), w(scores.size()), acc(k_rep * k_head_dim);
  for (float& v : w) v = std::exp(nd(rng) - 2.0f);
  using clock = std::chrono::steady_clock;
  std::vector<double> qk_s, av_s;
  for (auto _ : st) {
    double qk = 0, av = 0;
    for (int h = 0; h < k_kv_heads; ++h) {
      const float* q = s.q.data() + static_cast<std::size_t>(h) * k_rep * k_head_dim;
      auto t0 = clock::now();
      kview.codec_of(0)->qk(kview.format_of(0), kview.shape, kview.params_of(0, h), kt[h].data(), n_ctx, q, k_rep,
                            scores.data(), n_ctx);
      auto t1 = clock::now();
      vview.codec_of(0)->av(vview.format_of(0), vview.shape, vview.params_of(0, h), vt[h].data(), n_ctx, w.data(),
                            n_ctx, k_rep, acc.data());
      auto t2 = clock::now();
      qk += std::chrono::duration<double>(t1 - t0).count();
      av += std::chrono::duration<double>(t2 - t1).count();
    }
    benchmark::DoNotOptimize(acc.data());
    qk_s.push_back(qk);
    av_s.push_back(av);
  }
  const double kb = static_cast<double>(kview.codec_of(0)->tile_bytes(kview.format_of(0), kview.shape)) * n_blocks * k_kv_heads;
  const double vb = static_cast<double>(vview.codec_of(0)->tile_bytes(vview.format_of(0), vview.shape)) * n_blocks * k_kv_heads;
  const double qk = median(qk_s), av = median(av_s);
  st.counters["qk_us"] = qk * 1e6;
  st.counters["av_us"] = av * 1e6;
  st.counters["qk_GB/s"] = kb / qk * 1e-9;
  st.counters["av_GB/s"] = vb / av * 1e-9;
  st.counters["KV_GB/s"] = (kb + vb) / (qk + av) * 1e-9;
  st.SetLabel(s.kv->layout().describe());
}

// --- the codec kernels alone, in cache ---------------------------------------
//
// kernel/SPEC: one KV head's q.k and a.v (4 query rows, head_dim 128) over 64
// tiles of 16 tokens (1K tokens, L2-resident), each timed alone; the counters
// are from the FASTEST of the iterations (qk_us, av_us per call, and GB/s of
// the K and V tiles through both), the speed of the arithmetic when memory is
// not in the way. On this shared VM a slice of another process lands in many
// iterations; the fastest is the one that had the core to itself. Set against
// decode/SPEC's stream_GB/s, it bounds what of_stream can reach.
void bm_kernel(benchmark::State& st, std::string spec) {
  constexpr int k_tiles = 64, k_rows = 4;
  const kv_tile_shape shape{k_block, k_head_dim};
  const kv_pair_spec pair = *parse_kv_pair_spec(spec);
  const kv_format kf = pair.k.resolve(kv_role::key, false), vf = pair.v.resolve(kv_role::value, false);
  const kv_codec* kc = get_kv_codec(kf.type);
  const kv_codec* vc = get_kv_codec(vf.type);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<aligned_buffer> kt, vt;
  std::vector<const void*> kp, vp;
  std::vector<float> x(static_cast<std::size_t>(k_block) * k_head_dim);
  for (int i = 0; i < k_tiles; ++i) {
    for (std::size_t j = 0; j < x.size(); ++j) x[j] = nd(rng) * (j % k_head_dim % 16 == 5 ? 8.0f : 1.0f);
    kt.emplace_back(kc->tile_bytes(kf, shape));
    kc->encode(kf, shape, nullptr, x.data(), 0, k_block, kt.back().data());
    kp.push_back(kt.back().data());
    for (float& v : x) v = nd(rng);
    vt.emplace_back(vc->tile_bytes(vf, shape));
    vc->encode(vf, shape, nullptr, x.data(), 0, k_block, vt.back().data());
    vp.push_back(vt.back().data());
  }
  const int n = k_tiles * k_block;
  std::vector<float> q(static_cast<std::size_t>(k_rows) * k_head_dim), scores(static_cast<std::size_t>(k_rows) * n),
      w(scores.size()), acc(q.size());
  for (float& v : q) v = nd(rng);
  for (float& v : w) v = std::exp(nd(rng) - 2.0f);
  using clock = std::chrono::steady_clock;
  double qk_s = 1e9, av_s = 1e9;
  for (auto _ : st) {
    auto t0 = clock::now();
    kc->qk(kf, shape, nullptr, kp.data(), n, q.data(), k_rows, scores.data(), n);
    auto t1 = clock::now();
    vc->av(vf, shape, nullptr, vp.data(), n, w.data(), n, k_rows, acc.data());
    auto t2 = clock::now();
    qk_s = std::min(qk_s, std::chrono::duration<double>(t1 - t0).count());
    av_s = std::min(av_s, std::chrono::duration<double>(t2 - t1).count());
    benchmark::DoNotOptimize(acc.data());
  }
  const double kb = static_cast<double>(kc->tile_bytes(kf, shape)) * k_tiles;
  const double vb = static_cast<double>(vc->tile_bytes(vf, shape)) * k_tiles;
  st.counters["qk_us"] = qk_s * 1e6;
  st.counters["av_us"] = av_s * 1e6;
  st.counters["qk_GB/s"] = kb / qk_s * 1e-9;
  st.counters["av_GB/s"] = vb / av_s * 1e-9;
  st.counters["KV_GB/s"] = (kb + vb) / (qk_s + av_s) * 1e-9;
  st.SetLabel(kv_format_name(kf) + "+" + kv_format_name(vf));
}

void register_all(const std::vector<simd_level>& levels) {
  for (int threads : {1, 2})
    benchmark::RegisterBenchmark("stream_read", bm_stream)->Arg(threads)->Iterations(5)->UseRealTime()->Unit(benchmark::kMillisecond);
  // int2/token: the per-token 2-bit layout, beside KIVI's int2 (per-channel keys).
  const char* specs[] = {"f32",  "f16",        "bf16", "fp8",  "fp8_e5m2",   "int8", "int8/channel", "k8v4",
                         "int4/token", "int4", "k4v2", "int2/token", "int2", "q8_0", "q4_0"};
  for (const char* spec : specs)
    benchmark::RegisterBenchmark(fmt::format("kernel/{}", spec).c_str(), bm_kernel, std::string(spec))->Iterations(3000);
  for (const char* spec : specs)
    benchmark::RegisterBenchmark(fmt::format("split/{}", spec).c_str(), bm_split, std::string(spec))
        ->ArgName("ctx")
        ->Arg(2048)
        ->Arg(32768)
        ->Unit(benchmark::kMicrosecond);
  for (const char* spec : specs) {
    if (levels.empty()) {
      auto* b = benchmark::RegisterBenchmark(fmt::format("decode/{}", spec).c_str(), bm_decode, std::string(spec),
                                             std::nullopt);
      for (int shuffled : {0, 1})
        for (int ctx : {1024, 4096, 16384, 32768})
          for (int threads : {1, 2}) b->Args({ctx, threads, shuffled});
      b->ArgNames({"ctx", "threads", "shuffled"})->UseManualTime()->Unit(benchmark::kMicrosecond);
      continue;
    }
    for (int shuffled : {0, 1})
      for (int ctx : {1024, 4096, 16384, 32768})
        for (int threads : {1, 2})
          for (simd_level level : levels)
            benchmark::RegisterBenchmark(fmt::format("decode/{}/{}", spec, simd_level_name(level)).c_str(), bm_decode,
                                         std::string(spec), std::optional<simd_level>(level))
                ->Args({ctx, threads, shuffled})
                ->ArgNames({"ctx", "threads", "shuffled"})
                ->UseManualTime()
                ->Unit(benchmark::kMicrosecond);
  }
}

// --simd_levels=a,b,c (removed from argv before Google Benchmark reads it).
std::vector<simd_level> take_simd_levels(int& argc, char** argv) {
  std::vector<simd_level> levels;
  const std::string_view flag = "--simd_levels=";
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a.substr(0, flag.size()) != flag) {
      argv[out++] = argv[i];
      continue;
    }
    a.remove_prefix(flag.size());
    while (!a.empty()) {
      const std::string_view name = a.substr(0, a.find(','));
      a.remove_prefix(std::min(a.size(), name.size() + 1));
      if (auto l = parse_simd_level(name)) levels.push_back(*l);
      else fmt::print(stderr, "attention_bench: unknown SIMD level '{}' (scalar, avx2, avx512)\n", name);
    }
  }
  argc = out;
  return levels;
}

}  // namespace

int main(int argc, char** argv) {
  register_all(take_simd_levels(argc, argv));
  return run_benchmarks(argc, argv);
}
