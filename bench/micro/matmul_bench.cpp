// Weight matmul throughput: Y[m][n_out] = X[m][n_in] · Wᵀ per weight type, at
// Llama-3-8B shapes (4096x4096 attention, 14336x4096 FFN up/gate), m = 1, 8, 32,
// 64 rows and 1-2 threads, plus stories260K shapes and the machine's read
// bandwidth measured in the same run. The formats/ group compares the
// K-quants, q8_0, q4_1, q5_0, q5_1, iq4_xs and iq3_s at AVX-512 and AVX2 on one
// layer's shapes; formats_huge/ and
// read_bandwidth_huge/ do the same decode calls and reads with the memory in
// 2 MiB pages (what `--no-mmap` gives the weights) instead of 4 KiB ones.
//
// Counters: weight_GB/s (bytes of W per second: decode is bound by it),
// GFLOP/s (2 m n_out n_in per call) and rows/s (rows of X per second; the ratio
// rows/s at m=32 over m=1 is how much batching buys). Weights are rotated among
// copies totalling >= 192 MiB so decode reads them from memory, not cache, as a
// real forward pass over many layers does.
//
//   build-mm/bench/matmul_bench --benchmark_filter='q8_0'   (etc.)
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "core/aligned_buffer.h"
#include "core/cpu.h"
#include "core/half.h"
#include "core/thread_pool.h"
#include "model/matmul.h"
#include "model/matmul_internal.h"

namespace {

using pagoda::gguf::tensor_type;

constexpr std::size_t k_rotation_bytes = std::size_t{192} << 20;

// Anonymous memory in 2 MiB pages where the kernel gives them (THP on
// madvise), never freed: the benchmark process keeps it.
std::byte* huge_alloc(std::size_t bytes) {
  constexpr std::size_t k_huge = std::size_t{2} << 20;
  bytes = (bytes + k_huge - 1) / k_huge * k_huge;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 1, bytes);
  return static_cast<std::byte*>(p);
}

struct weight_set {
  std::vector<pagoda::aligned_buffer> copies;
  std::vector<std::byte*> huge_copies;  // the same bytes in huge pages (formats_huge/)
  pagoda::weight_view view;
  std::size_t bytes = 0;
};

// rotate: enough copies to defeat the caches (large shapes); one copy otherwise.
weight_set& weights_for(tensor_type t, std::int64_t n_out, std::int64_t n_in, bool rotate, bool huge = false) {
  static std::map<std::tuple<int, std::int64_t, std::int64_t, bool, bool>, std::unique_ptr<weight_set>> cache;
  auto& slot = cache[{static_cast<int>(t), n_out, n_in, rotate, huge}];
  if (slot) return *slot;
  slot = std::make_unique<weight_set>();
  weight_set& ws = *slot;
  const std::size_t row = pagoda::row_size_bytes(t, n_in);
  ws.bytes = row * static_cast<std::size_t>(n_out);
  const std::size_t n_copies = rotate ? std::max<std::size_t>(1, (k_rotation_bytes + ws.bytes - 1) / ws.bytes) : 1;
  ws.copies.emplace_back(ws.bytes, false);
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> src(static_cast<std::size_t>(n_in));
  for (std::int64_t j = 0; j < n_out; ++j) {
    for (float& f : src) f = dist(rng);
    std::byte* dst = ws.copies[0].data() + row * static_cast<std::size_t>(j);
    for (std::int64_t k = 0; k < n_in; ++k) {
      if (t == tensor_type::f32) std::memcpy(dst + 4 * k, &src[k], 4);
      if (t == tensor_type::f16) {
        auto h = pagoda::f32_to_fp16(src[k]);
        std::memcpy(dst + 2 * k, &h, 2);
      }
      if (t == tensor_type::bf16) {
        auto h = pagoda::f32_to_bf16(src[k]);
        std::memcpy(dst + 2 * k, &h, 2);
      }
    }
    if (t == tensor_type::q8_0) pagoda::quantize_row_q8_0(src.data(), n_in, dst);
    if (t == tensor_type::q4_0) pagoda::quantize_row_q4_0(src.data(), n_in, dst);
    if (t == tensor_type::q4_k) pagoda::quantize_row_q4_k(src.data(), n_in, dst);
    if (t == tensor_type::q5_k) pagoda::quantize_row_q5_k(src.data(), n_in, dst);
    if (t == tensor_type::q6_k) pagoda::quantize_row_q6_k(src.data(), n_in, dst);
    if (t == tensor_type::mxfp4) pagoda::quantize_row_mxfp4(src.data(), n_in, dst);
    if (t == tensor_type::q2_k)  // no q2_K quantizer: random bits under d = dmin = 2^-7 (speed only)
      for (std::int64_t b = 0; b < n_in / 256; ++b) {
        auto* blk = reinterpret_cast<pagoda::block_q2_k*>(dst) + b;
        for (auto& q : blk->qs) q = static_cast<std::uint8_t>(rng());
        for (auto& q : blk->scales) q = static_cast<std::uint8_t>(rng());
        blk->d = blk->dmin = pagoda::f32_to_fp16(0.0078125f);
      }
    if (t == tensor_type::q3_k)  // no q3_K quantizer: random bits under d = 2^-7 (speed only)
      for (std::int64_t b = 0; b < n_in / 256; ++b) {
        auto* blk = reinterpret_cast<pagoda::block_q3_k*>(dst) + b;
        for (auto& q : blk->hmask) q = static_cast<std::uint8_t>(rng());
        for (auto& q : blk->qs) q = static_cast<std::uint8_t>(rng());
        for (auto& q : blk->scales) q = static_cast<std::uint8_t>(rng());
        blk->d = pagoda::f32_to_fp16(0.0078125f);
      }
    if (t == tensor_type::q4_1 || t == tensor_type::q5_0 || t == tensor_type::q5_1 || t == tensor_type::iq4_xs ||
        t == tensor_type::iq3_s) {  // no quantizer: random bits under d (and q4_1 / q5_1's m) = 2^-7 (speed only)
      const std::size_t bb = pagoda::row_size_bytes(t, pagoda::weight_block_elems(t));
      const bool with_m = t == tensor_type::q4_1 || t == tensor_type::q5_1;
      const auto h = pagoda::f32_to_fp16(0.0078125f);
      for (std::size_t k = 0; k < row; ++k) dst[k] = static_cast<std::byte>(rng());
      for (std::size_t o = 0; o < row; o += bb)
        for (std::size_t f = 0; f < (with_m ? 2u : 1u); ++f) std::memcpy(dst + o + 2 * f, &h, 2);
    }
    if (t == tensor_type::iq4_nl)  // no iq4_nl quantizer: random indices under d = 2^-7 (speed only)
      for (std::int64_t b = 0; b < n_in / 32; ++b) {
        auto* blk = reinterpret_cast<pagoda::block_iq4_nl*>(dst) + b;
        blk->d = pagoda::f32_to_fp16(0.0078125f);
        for (auto& q : blk->qs) q = static_cast<std::uint8_t>(rng());
      }
  }
  for (std::size_t c = 1; c < n_copies && !huge; ++c) {
    ws.copies.emplace_back(ws.bytes, false);
    std::memcpy(ws.copies.back().data(), ws.copies[0].data(), ws.bytes);
  }
  if (huge) {
    std::byte* region = huge_alloc(ws.bytes * n_copies);
    for (std::size_t c = 0; c < n_copies; ++c) {
      ws.huge_copies.push_back(region + ws.bytes * c);
      std::memcpy(ws.huge_copies.back(), ws.copies[0].data(), ws.bytes);
    }
  }
  ws.view = pagoda::weight_view{t, nullptr, n_in, n_out, row};
  return ws;
}

void bm_matmul(benchmark::State& st, tensor_type t, std::int64_t n_out, std::int64_t n_in, std::int64_t m,
               int threads, bool rotate, bool huge) {
  if (pagoda::is_quantized_weight(t) && n_in % pagoda::weight_block_elems(t) != 0) {
    st.SkipWithError("n_in is not a multiple of the block size");
    return;
  }
  weight_set& ws = weights_for(t, n_out, n_in, rotate, huge);
  pagoda::thread_pool pool(threads);
  pagoda::matmul_scratch scratch;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> x(static_cast<std::size_t>(m * n_in)), y(static_cast<std::size_t>(m * n_out));
  for (float& f : x) f = dist(rng);
  std::size_t it = 0;
  for (auto _ : st) {
    pagoda::weight_view v = ws.view;
    v.data = huge ? ws.huge_copies[it++ % ws.huge_copies.size()] : ws.copies[it++ % ws.copies.size()].data();
    pagoda::matmul(v, x.data(), m, y.data(), pool, scratch);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  using benchmark::Counter;
  st.counters["weight_GB/s"] = Counter(static_cast<double>(ws.bytes) * 1e-9, Counter::kIsIterationInvariantRate);
  st.counters["GFLOP/s"] = Counter(2e-9 * static_cast<double>(m * n_out * n_in), Counter::kIsIterationInvariantRate);
  st.counters["rows/s"] = Counter(static_cast<double>(m), Counter::kIsIterationInvariantRate);
  st.SetLabel(pagoda::simd_level_name(pagoda::active_simd_level()));
}

// Read bandwidth of this machine, for "achieved / available": each thread sums
// its half of a 512 MiB buffer (in 4 KiB pages, or 2 MiB ones when huge).
void bm_read_bandwidth(benchmark::State& st, int threads, bool huge) {
  constexpr std::size_t k_bytes = std::size_t{512} << 20;
  static pagoda::aligned_buffer buf(k_bytes, true);
  static std::byte* huge_buf = huge_alloc(k_bytes);
  pagoda::thread_pool pool(threads);
  const std::size_t n = k_bytes / sizeof(std::uint64_t);
  const auto* p = huge ? reinterpret_cast<const std::uint64_t*>(huge_buf) : buf.as<std::uint64_t>();
  std::atomic<std::uint64_t> total{0};
  for (auto _ : st) {
    // One sequential stream per thread, prefetched into L1 as far ahead as the
    // decode tiles prefetch their weights (k_decode_prefetch_bytes): without
    // the prefetch the q8_0 decode kernel read more than this loop (110-122%
    // of it in bench/decode_speed.py's runs), so it was no limit; with it the
    // loop reads 1.1-1.2x more (bench/RESULTS.md, "The read-bandwidth limit").
    pool.parallel_for(n, [&](std::size_t b, std::size_t e) {
      constexpr std::size_t k_ahead = pagoda::matmul_detail::k_decode_prefetch_bytes / sizeof(std::uint64_t);
      std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (std::size_t i = b; i + 8 <= e; i += 8) {
        __builtin_prefetch(p + i + k_ahead, 0, 3);
        s0 += p[i] + p[i + 4];
        s1 += p[i + 1] + p[i + 5];
        s2 += p[i + 2] + p[i + 6];
        s3 += p[i + 3] + p[i + 7];
      }
      total.fetch_add(s0 + s1 + s2 + s3, std::memory_order_relaxed);
    }, 4096);
    benchmark::DoNotOptimize(total.load());
  }
  st.counters["GB/s"] = benchmark::Counter(static_cast<double>(k_bytes) * 1e-9,
                                           benchmark::Counter::kIsIterationInvariantRate);
}

// The same call at a forced SIMD level (the level is restored afterwards), so
// the AVX-512 and AVX2 kernels of a format are compared in one run.
void bm_matmul_at(benchmark::State& st, pagoda::simd_level level, tensor_type t, std::int64_t n_out,
                  std::int64_t n_in, std::int64_t m, int threads, bool rotate, bool huge) {
  const pagoda::simd_level saved = pagoda::active_simd_level();
  pagoda::set_simd_level(level);
  if (pagoda::active_simd_level() != level) {
    st.SkipWithError("this CPU lacks the level");
  } else {
    bm_matmul(st, t, n_out, n_in, m, threads, rotate, huge);
  }
  pagoda::set_simd_level(saved);
}

void register_all() {
  for (bool huge : {false, true})
    for (int threads : {1, 2})
      benchmark::RegisterBenchmark(fmt::format("read_bandwidth{}/threads:{}", huge ? "_huge" : "", threads).c_str(),
                                   bm_read_bandwidth, threads, huge)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
  const tensor_type types[] = {tensor_type::q8_0, tensor_type::q4_0, tensor_type::f16, tensor_type::bf16,
                               tensor_type::f32};
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{4096, 4096}, {14336, 4096}};
  for (tensor_type t : types)
    for (auto [n_out, n_in] : shapes)
      for (std::int64_t m : {1, 8, 32, 64})
        for (int threads : {1, 2})
          benchmark::RegisterBenchmark(
              fmt::format("matmul/{}/{}x{}/m:{}/threads:{}", pagoda::gguf::tensor_type_name(t), n_out, n_in, m, threads).c_str(),
              bm_matmul, t, n_out, n_in, m, threads, true, false)
              ->UseRealTime()
              ->Unit(benchmark::kMicrosecond);
  // Weight formats at one Llama-3-8B layer's shapes (q/o, gate/up, down), decode
  // and batched, AVX-512 against AVX2 in the same run: q2_K to q6_K (the types
  // of the K-quant files), q8_0, the legacy q4_1, q5_0, q5_1 and the i-quants
  // iq4_xs, iq3_s.
  const std::pair<std::int64_t, std::int64_t> layer[] = {{4096, 4096}, {14336, 4096}, {4096, 14336}};
  for (tensor_type t : {tensor_type::q2_k, tensor_type::q3_k, tensor_type::q4_k, tensor_type::q5_k, tensor_type::q6_k,
                        tensor_type::q8_0, tensor_type::q4_1, tensor_type::q5_0, tensor_type::q5_1, tensor_type::iq4_xs,
                        tensor_type::iq3_s})
    for (auto [n_out, n_in] : layer)
      for (std::int64_t m : {1, 8, 32})
        for (int threads : {1, 2})
          for (pagoda::simd_level level : {pagoda::simd_level::avx512, pagoda::simd_level::avx2})
            benchmark::RegisterBenchmark(fmt::format("formats/{}/{}x{}/m:{}/threads:{}/{}", pagoda::gguf::tensor_type_name(t),
                                                     n_out, n_in, m, threads, pagoda::simd_level_name(level))
                                             .c_str(),
                                         bm_matmul_at, level, t, n_out, n_in, m, threads, true, false)
                ->UseRealTime()
                ->Unit(benchmark::kMicrosecond);
  // The table formats: mxfp4 (gpt-oss's experts, n_embd = expert width 2880)
  // beside iq4_nl, whose kernels it shares, at both levels, and q8_0, whose
  // kernels theirs extend, at the same shapes.
  for (tensor_type t : {tensor_type::iq4_nl, tensor_type::mxfp4, tensor_type::q8_0})
    for (std::int64_t n : {2880, 4096})
      for (std::int64_t m : {1, 8, 32})
        for (pagoda::simd_level level : {pagoda::simd_level::avx512, pagoda::simd_level::avx2})
          benchmark::RegisterBenchmark(fmt::format("table_formats/{}/{}x{}/m:{}/threads:1/{}",
                                                   pagoda::gguf::tensor_type_name(t), n, n, m,
                                                   pagoda::simd_level_name(level))
                                           .c_str(),
                                       bm_matmul_at, level, t, n, n, m, 1, true, false)
              ->UseRealTime()
              ->Unit(benchmark::kMicrosecond);
  // Decode (m = 1) with the weights in huge pages, AVX-512.
  for (tensor_type t : {tensor_type::q4_k, tensor_type::q5_k, tensor_type::q6_k, tensor_type::q8_0})
    for (auto [n_out, n_in] : layer)
      for (int threads : {1, 2})
        benchmark::RegisterBenchmark(fmt::format("formats_huge/{}/{}x{}/m:1/threads:{}/avx512",
                                                 pagoda::gguf::tensor_type_name(t), n_out, n_in, threads)
                                         .c_str(),
                                     bm_matmul_at, pagoda::simd_level::avx512, t, n_out, n_in, 1, threads, true, true)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
  // The same kernels on 128 rows that stay in L2: their arithmetic alone.
  for (tensor_type t : {tensor_type::q4_k, tensor_type::q5_k, tensor_type::q6_k, tensor_type::q8_0})
    for (std::int64_t m : {1, 8, 32})
      for (pagoda::simd_level level : {pagoda::simd_level::avx512, pagoda::simd_level::avx2})
        benchmark::RegisterBenchmark(fmt::format("formats_in_l2/{}/128x4096/m:{}/threads:1/{}",
                                                 pagoda::gguf::tensor_type_name(t), m, pagoda::simd_level_name(level))
                                         .c_str(),
                                     bm_matmul_at, level, t, 128, 4096, m, 1, false, false)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
  // stories260K (dim 64, hidden 172, 512-token vocabulary, f32 weights): one
  // decode token's projections must cost little more than their arithmetic.
  const std::pair<std::int64_t, std::int64_t> tiny[] = {{64, 64}, {172, 64}, {64, 172}, {512, 64}};
  for (auto [n_out, n_in] : tiny)
    for (tensor_type t : {tensor_type::f32, tensor_type::q8_0})
      if (t == tensor_type::f32 || n_in % 32 == 0)
        benchmark::RegisterBenchmark(fmt::format("matmul_tiny/{}/{}x{}/m:1/threads:2", pagoda::gguf::tensor_type_name(t), n_out, n_in).c_str(),
                                     bm_matmul, t, n_out, n_in, 1, 2, false, false)
            ->UseRealTime()
            ->Unit(benchmark::kNanosecond);
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
