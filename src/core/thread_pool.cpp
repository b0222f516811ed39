#include "core/thread_pool.h"

#include <immintrin.h>

#include "core/assert.h"

namespace pagoda {
namespace {

// Spins a little (the others are usually a few microseconds behind), then
// sleeps until done(a): on a loaded machine a descheduled worker must not
// cost a spinning core.
template <typename T, typename Done>
void wait_until(std::atomic<T>& a, Done done) {
  T v = a.load(std::memory_order_acquire);
  for (int spin = 0; !done(v) && spin < 4000; ++spin) {
    _mm_pause();
    v = a.load(std::memory_order_acquire);
  }
  while (!done(v)) {
    a.wait(v, std::memory_order_acquire);
    v = a.load(std::memory_order_acquire);
  }
}

}  // namespace

int thread_pool::hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

thread_pool::thread_pool(int n_threads) : n_threads_(n_threads <= 0 ? hardware_threads() : n_threads) {
  workers_.reserve(n_threads_ - 1);
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

thread_pool::~thread_pool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  for (auto& t : workers_) t.join();
}

void thread_pool::worker_loop(int ith) {
  std::uint64_t seen = 0;
  for (;;) {
    // Spin briefly (jobs in a forward pass follow each other within microseconds),
    // then sleep on the generation counter.
    std::uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spin = 0; gen == seen && spin < 4000; ++spin) {
      _mm_pause();
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      continue;
    }
    seen = gen;
    if (stop_.load(std::memory_order_acquire)) return;
    // Join job `gen` if it is still open. The caller of a shared job may have
    // finished it (closed), or finished it and started others (another
    // generation): then there is nothing to do here. A job that waits for
    // every worker is never closed before this worker has run it.
    const std::uint64_t tag = (gen & 0xffffffffu) << 32;
    std::uint64_t e = entry_.load(std::memory_order_acquire);
    bool joined = false;
    while ((e & ~(k_closed | k_shared | k_inside_mask)) == tag && !(e & k_closed)) {
      if (entry_.compare_exchange_weak(e, e + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        joined = true;
        break;
      }
    }
    if (!joined) continue;
    (*job_)(ith, n_threads_);
    if (e & k_shared) {
      const std::uint64_t prev = entry_.fetch_sub(1, std::memory_order_acq_rel);
      if ((prev & k_closed) && (prev & k_inside_mask) == 1) entry_.notify_one();
    } else if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      pending_.notify_one();
    }
  }
}

void thread_pool::start(const std::function<void(int, int)>& fn, bool shared) {
  job_ = &fn;
  const std::uint64_t gen = generation_.load(std::memory_order_relaxed) + 1;  // only this thread writes it
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  entry_.store(((gen & 0xffffffffu) << 32) | (shared ? k_shared : 0), std::memory_order_relaxed);
  generation_.store(gen, std::memory_order_release);
  generation_.notify_all();
}

void thread_pool::run(const std::function<void(int, int)>& fn) { run_job(fn, false); }

void thread_pool::run_shared(const std::function<void(int, int)>& fn) { run_job(fn, true); }

void thread_pool::run_job(const std::function<void(int, int)>& fn, bool shared) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  start(fn, shared);
  fn(0, n_threads_);
  if (shared) {
    // Close the job: workers that have not joined yet never will; wait for those inside.
    entry_.fetch_or(k_closed, std::memory_order_acq_rel);
    wait_until(entry_, [](std::uint64_t e) { return (e & k_inside_mask) == 0; });
  } else {
    wait_until(pending_, [](int left) { return left == 0; });
  }
  job_ = nullptr;
}

void thread_pool::parallel_for(std::size_t n, const std::function<void(std::size_t, std::size_t)>& fn,
                               std::size_t grain) {
  if (n == 0) return;
  if (grain == 0) grain = 1;
  if (n_threads_ == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  run([&](int ith, int nth) {
    std::size_t b, e;
    split_range(n, ith, nth, grain, b, e);
    if (b < e) fn(b, e);
  });
}

}  // namespace pagoda
