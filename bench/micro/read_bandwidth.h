// A STREAM-like read pass for benchmarks that set a step against the
// machine's memory bandwidth (achieved / available, bench/RESULTS.md): each
// thread of a pool sums its share of a 1 GiB buffer with 512-bit loads
// (256-bit without AVX-512; four accumulators, so the adds never limit).
// Header-only, for bench/micro/*_bench.cpp (one executable each).
#pragma once

#include <sys/mman.h>
#include <immintrin.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include <benchmark/benchmark.h>

#include "core/cpu.h"
#include "core/thread_pool.h"

namespace pagoda::bench {

inline constexpr std::size_t k_stream_bytes = std::size_t{1} << 30;

// Mapped like the KV pool (kv_storage.cpp: anonymous memory with huge pages
// where the kernel allows), so that both sides of the ratio read the same kind
// of memory. (With plain 4 KiB pages, every other interleaved pass in this VM
// ran at a tenth of the speed.)
inline const float* stream_buffer() {
  static const float* buf = [] {
    void* p = mmap(nullptr, k_stream_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    madvise(p, k_stream_bytes, MADV_HUGEPAGE);
    std::memset(p, 1, k_stream_bytes);  // touch every page
    return static_cast<const float*>(p);
  }();
  return buf;
}

__attribute__((target("avx512f"))) inline float read_sum_avx512(const float* p, std::size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  return std::accumulate(lanes, lanes + 16, 0.0f);
}

// The same pass with 256-bit loads, for CPUs without AVX-512 (the 512-bit one
// stopped the bench there with an illegal instruction).
__attribute__((target("avx"))) inline float read_sum_avx(const float* p, std::size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return std::accumulate(lanes, lanes + 8, 0.0f);
}

inline float read_sum(const float* p, std::size_t n) {
  static const bool avx512 = pagoda::detect_cpu().avx512f;
  return avx512 ? read_sum_avx512(p, n) : read_sum_avx(p, n);
}

// One pass over the buffer on every thread of the pool; GB/s.
inline double stream_pass(thread_pool& pool) {
  const float* p = stream_buffer();
  const std::size_t n = k_stream_bytes / sizeof(float);
  std::vector<float> sums(pool.size());
  auto t0 = std::chrono::steady_clock::now();
  pool.run([&](int ith, int nth) {
    std::size_t b, e;
    split_range(n, ith, nth, 1024, b, e);
    sums[ith] = read_sum(p + b, e - b);
  });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  benchmark::DoNotOptimize(sums.data());
  return static_cast<double>(k_stream_bytes) / s * 1e-9;
}

}  // namespace pagoda::bench
