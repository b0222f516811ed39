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

  // Runs fn(ith, nth) on the calling thread (ith = 0) and on each worker that
  // picks the job up before the caller has finished its own call; returns when
  // the caller's call and every call that started have returned. A worker that
  // is late (descheduled on a shared machine) is skipped instead of waited for,
  // so fn must finish the whole job alone if need be: it takes its work from a
  // shared counter, not from a static split by ith. ith still names a distinct
  // thread (per-thread scratch).
  // REQUIRES: not called from inside a job of this pool.
  void run_shared(const std::function<void(int ith, int nth)>& fn);

  // Splits [0, n) into size() contiguous ranges (some possibly empty) and runs
  // fn(begin, end) for each in parallel. `grain` rounds range edges to multiples.
  void parallel_for(std::size_t n, const std::function<void(std::size_t begin, std::size_t end)>& fn,
                    std::size_t grain = 1);

  static int hardware_threads();

 private:
  void worker_loop(int ith);
  void start(const std::function<void(int, int)>& fn, bool shared);
  void run_job(const std::function<void(int, int)>& fn, bool shared);

  // entry_: the job a worker may join. Bits 32..63: the low 32 bits of the
  // job's generation (a worker joins only the job it was woken for); bit 31:
  // closed (the caller of a shared job is done, nobody joins any more); bit 30:
  // shared; bits 0..29: workers inside a shared job.
  static constexpr std::uint64_t k_closed = std::uint64_t{1} << 31;
  static constexpr std::uint64_t k_shared = std::uint64_t{1} << 30;
  static constexpr std::uint64_t k_inside_mask = k_shared - 1;

  int n_threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* job_ = nullptr;
  alignas(64) std::atomic<std::uint64_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  alignas(64) std::atomic<std::uint64_t> entry_{0};
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
