// Internals of the retrieval selector shared by retrieval_selector.cpp and
// retrieval_build.cpp: the per-(layer, KV head) state and the builder, the
// thread beside the forward pass that puts sealed blocks into the indexes.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "policy/retrieval.h"

namespace pagoda {

// The index p names (auto: IVF-PQ), empty.
std::unique_ptr<key_index> make_retrieval_index(const retrieval_params& p, int head_dim);
// The largest divisor of n that is at most m (1 at least).
int divisor_at_most(int n, int m);

struct retrieval_selector::head_state {
  // The token-major f16 copy of the keys of [0, sealed_end), in chunks of 256
  // rows (dead slots zero). chunks[c] is owned[c], or nullptr once released
  // (every slot of the chunk is in the IVF-PQ index). Changed on the forward
  // thread under copy_mu_; the builder reads rows under copy_mu_; select()
  // reads rows past indexed_end without it (it never runs beside a change).
  std::vector<std::unique_ptr<std::uint16_t[]>> owned;
  std::vector<const std::uint16_t*> chunks;
  int released_below = 0;  // chunks below this one were released
  bool copy_whole = true;  // no chunk was ever released (key_rows_of may hand the copy out)
  // The index and the end of what it holds: the builder publishes under mu,
  // select() searches under mu, removals take it.
  mutable std::mutex mu;
  std::unique_ptr<key_index> ix;
  int indexed_end = 0;
};

// Jobs are [b0, b1) block runs of a layer, taken in order. Each (layer, KV
// head) of a job: its unindexed keys are copied out of the selector's copy
// (under copy_mu_), then either added to the published index under the head's
// mutex, or, while nothing is published, put into a private index (trained on
// a sample first) that then replaces the empty one. cancel() makes the job in
// flight discard its result: a result is published only if the generation it
// started in is still current, checked under the head's mutex, and the
// canceller changes the copies and indexes only after bumping the generation
// and under the same mutexes. With background = false a job runs inline in push().
class retrieval_builder {
 public:
  retrieval_builder(retrieval_selector& sel, bool background);
  ~retrieval_builder();  // stops: waits for the job in flight (a training takes up to seconds)
  retrieval_builder(const retrieval_builder&) = delete;
  retrieval_builder& operator=(const retrieval_builder&) = delete;

  void push(int layer, int b0, int b1);
  // Drops the queued jobs; the one in flight publishes nothing more.
  void cancel();
  void wait_idle();
  // The builder's own buffers (a job's keys, a training sample).
  std::size_t memory_bytes() const;

 private:
  struct job {
    int layer, b0, b1;
    std::uint64_t gen;
  };
  void loop();
  void run(const job& j);
  void run_heads(const job& j);
  bool current(const job& j) const { return gen_.load(std::memory_order_acquire) == j.gen; }

  retrieval_selector& sel_;
  bool background_;
  mutable std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::deque<job> queue_;
  bool busy_ = false, stop_ = false;
  std::atomic<std::uint64_t> gen_{0};
  std::atomic<std::size_t> scratch_bytes_{0};
  std::vector<float> keys_, sample_;  // run()'s, on the builder's thread
  std::vector<std::int32_t> slots_;
  std::thread thread_;  // last: started once the rest exists
};

}  // namespace pagoda
