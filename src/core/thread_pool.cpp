#include "core/thread_pool.h"

#include <immintrin.h>

#include "core/assert.h"

namespace pagoda {

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
    (*job_)(ith, n_threads_);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
}

void thread_pool::run(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
  pending_.store(n_threads_ - 1, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  fn(0, n_threads_);
  // Spin a little (the others are usually a few microseconds behind), then sleep:
  // on a loaded machine a descheduled worker must not cost a spinning core.
  int left = pending_.load(std::memory_order_acquire);
  for (int spin = 0; left != 0 && spin < 4000; ++spin) {
    _mm_pause();
    left = pending_.load(std::memory_order_acquire);
  }
  while (left != 0) {
    pending_.wait(left, std::memory_order_acquire);
    left = pending_.load(std::memory_order_acquire);
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
