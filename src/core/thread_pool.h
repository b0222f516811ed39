// A fork-join pool for the forward pass. The calling thread is worker 0 and takes
// part in every job, so a pool of size 1 runs everything inline with no threads.
// Work is split statically, so which thread computes what never changes results.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

namespace pagoda {

class thread_pool {
 public:
  // n_threads <= 0 means every hardware thread.
  explicit thread_pool(int n_threads = 0);
  ~thread_pool();
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  int size() const { return n_threads_; }

  // Runs fn(ith, nth) once on each of the nth = size() threads and waits for all.
  // REQUIRES: not called from inside a job of this pool.
  void run(const std::function<void(int ith, int nth)>& fn);

  // Splits [0, n) into size() contiguous ranges (some possibly empty) and runs
  // fn(begin, end) for each in parallel. `grain` rounds range edges to multiples.
  void parallel_for(std::size_t n, const std::function<void(std::size_t begin, std::size_t end)>& fn,
                    std::size_t grain = 1);

  static int hardware_threads();

 private:
  void worker_loop(int ith);

  int n_threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* job_ = nullptr;
  alignas(64) std::atomic<std::uint64_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

// Thread range helper: [begin, end) of n items for thread ith of nth, edges on multiples of grain.
inline void split_range(std::size_t n, int ith, int nth, std::size_t grain, std::size_t& begin, std::size_t& end) {
  std::size_t units = (n + grain - 1) / grain;
  std::size_t per = units / nth, extra = units % nth;
  std::size_t ub = ith * per + (static_cast<std::size_t>(ith) < extra ? ith : extra);
  std::size_t ue = ub + per + (static_cast<std::size_t>(ith) < extra ? 1 : 0);
  begin = ub * grain < n ? ub * grain : n;
  end = ue * grain < n ? ue * grain : n;
}

}  // namespace pagoda
