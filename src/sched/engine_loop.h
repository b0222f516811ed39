// The engine on its own thread (DESIGN.md: one thread owns the engine, others
// talk to it through queues, as llama.cpp's server_queue / server_response).
//
// Client threads (HTTP handlers) submit requests and cancel them; each is a
// task the engine thread runs between two steps, so the engine itself needs no
// lock. The events of a submitted request arrive on the request_channel given
// at submission, until the event that says the request finished (also after a
// cancel: the engine answers "abort"). After every step the thread publishes a
// metrics snapshot that readers copy without waiting for the engine.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kv/kv_block_map.h"
#include "sched/engine_core.h"

namespace pagoda {

// A one-way queue of engine events from the engine thread to one client.
// Thread-safe; shared by both sides (shared_ptr), so neither outlives the other's use.
class request_channel {
 public:
  // Engine thread.
  void push(engine_event e);
  // Engine thread: the engine thread failed (an exception in its bookkeeping);
  // no more events come for these requests. A failed STEP is not this: its
  // requests end with "error" events.
  void fail(status st);

  // Client thread: appends what is queued to `out`; when nothing is, waits up
  // to `timeout` for something. Returns false when the channel has failed
  // (failure() says why) and nothing was left to return.
  bool wait(std::vector<engine_event>& out, std::chrono::milliseconds timeout);
  status failure() const;

  // For clients that do not block a thread on wait(): `fn` runs on the engine
  // thread after every push() and fail(), outside the channel's lock; it
  // should only schedule work (post to an event loop) and must not call into
  // the engine_loop. REQUIRES: set before the channel is submitted.
  void set_notify(std::function<void()> fn) { notify_ = std::move(fn); }

 private:
  void notify() const {
    if (notify_) notify_();
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<engine_event> queue_;
  status failure_;
  std::function<void()> notify_;  // set before submission, read by the engine thread only
};

// What the engine reports, copied on its thread between two steps: counts
// that belong together (blocks, requests, tokens) are consistent with each other.
struct engine_snapshot {
  kv_metrics kv;
  std::vector<std::string> kv_class_types;  // [kv.classes]: the type of each KV class (0: the default)
  std::int64_t n_steps = 0;
  std::int64_t n_prompt_tokens = 0;           // admitted prompt tokens
  std::int64_t n_computed_prompt_tokens = 0;  // prompt tokens run through the model
  std::int64_t n_policy_compactions = 0;      // KV policy compactions applied
  std::int64_t n_policy_evicted_slots = 0;    // KV slots they freed
  std::int64_t selector_bytes = 0;            // sparse-read selectors' memory (key bounds, ANN indexes)
  std::int64_t peak_selector_bytes = 0;       // the most of it at any step since start
  std::int64_t peak_side_blocks = 0;          // most pool blocks held for side memory at any step
  std::int64_t peak_running = 0;              // most sequences running at once
  std::int64_t n_generated_tokens = 0;
  std::map<std::string, spec_decode_stats> spec_decode;  // speculative decoding, by drafter
  std::map<std::string, kv_read_stats> kv_reads;         // attention's reads, by KV policy
  std::map<std::string, index_recall, std::less<>> recall_by_index;  // sparse-read indexes' sampled recall, by kind
  int n_running = 0;
  int n_waiting = 0;
  int max_num_seqs = 0;                     // sequences that may run at once (llama.cpp's slots)
  std::vector<running_sequence> sequences;  // those holding KV now (/slots)
  std::map<std::string, std::int64_t> n_finished_by_reason;  // finish reason of a request's last completion
  std::int64_t n_requests_active = 0;         // submitted, not finished yet
  histogram_snapshot ttft_seconds;
  histogram_snapshot itl_seconds;
  histogram_snapshot e2e_seconds;
  // What every block of the pool holds (a dashboard's grid), as of the
  // latest publish after want_block_map(); null until the first is taken.
  std::shared_ptr<const kv_block_map> block_map;
};

class engine_loop {
 public:
  // Starts the engine thread. max_waiting caps the requests queued in the
  // engine at once (submit() answers errc::resource_exhausted beyond it).
  engine_loop(std::unique_ptr<engine_core> eng, int max_waiting);
  ~engine_loop();  // stop()

  engine_loop(const engine_loop&) = delete;
  engine_loop& operator=(const engine_loop&) = delete;

  // Queues `reqs` all or none and waits until the engine thread took them.
  // Errors: errc::resource_exhausted when the waiting queue is full (and only
  // then: a request that can never fit the pool or a tenant's quota is
  // errc::out_of_range); the engine's own rejections (invalid_argument,
  // out_of_range); errc::cancelled after stop(). On success the requests'
  // events go to `channel` until each has had its request_finished event.
  status submit(std::vector<request> reqs, std::shared_ptr<request_channel> channel);
  // The same without waiting: `done` gets submit()'s answer, on the engine
  // thread (or on the calling thread when the loop is already stopping),
  // before any event of these requests reaches `channel`. It must not block.
  void submit_async(std::vector<request> reqs, std::shared_ptr<request_channel> channel,
                    std::function<void(status)> done);

  // Aborts the requests (unknown or finished ids are ignored). Returns at once;
  // the engine thread frees their blocks before its next step.
  void cancel(std::vector<std::string> ids);

  // Runs fn on the engine thread between two steps, once the block ops queued
  // before this call are applied (so the commit hook has seen every block
  // cached so far), and waits for it. fn may change the KV cache (the ops it
  // makes are applied by the next step). Errors: errc::cancelled after stop().
  status run_synced(std::function<void(engine_core&)> fn);
  // The same without waiting: `done` gets run_synced()'s answer right after
  // fn ran (or instead of it, when the loop stops first), on the engine
  // thread, or on the calling thread when the loop is already stopping.
  // Neither may block; done may call into the loop.
  void run_synced_async(std::function<void(engine_core&)> fn, std::function<void(status)> done);

  // The engine's half of erasing a tenant's KV (DELETE /v1/kv), a barrier:
  // on the engine thread, closes `tenant` (its submits are refused with
  // errc::cancelled until reopen_tenant), aborts every request of it this
  // loop admitted (their channels get "abort" finishes), then, once every
  // block op queued so far is applied (the commit hook has handed each block
  // the tenant cached to the store), runs fn and answers done as
  // run_synced_async does. Nothing of the tenant runs between the abort and
  // reopen_tenant, so what fn and the caller then erase stays erased.
  // Closures nest: a tenant closed twice opens at the second reopen_tenant.
  void close_tenant_async(std::string tenant, std::function<void(engine_core&)> fn, std::function<void(status)> done);
  // Ends one close_tenant_async; the tenant's submits queued after this are admitted again.
  void reopen_tenant(std::string tenant);

  // Tasks (submits, cancels, synced calls) posted and not yet taken by the
  // engine thread: what a test polls to know its call reached the loop.
  std::size_t n_queued_tasks();

  // A consistent copy of the engine's metrics as of the end of the latest step
  // (or task): never waits for a running step, so /metrics answers at once.
  // Events a client has received are already counted in it.
  engine_snapshot snapshot();
  // Asks for the pool's block map (engine_snapshot::block_map): the engine
  // thread takes it at its next publish (after the running step, or at once
  // when idle), so the map and the snapshot's counts are of the same moment.
  // A map costs O(blocks); it is taken only when asked for.
  void want_block_map();

  // Aborts every request, answers their channels and joins the thread. Idempotent.
  void stop();
  bool stopped() const { return stopping_.load(); }

 private:
  void run();
  // Posts a task for the engine thread; false (nothing posted) once stopping.
  bool post(std::function<void()> task);
  // Engine thread: adds a submit's requests all or none.
  status admit(std::vector<request>& reqs, const std::shared_ptr<request_channel>& channel);
  // Engine thread: runs fn and done once the ops queued so far are applied (run_synced_async).
  void when_synced(std::function<void(engine_core&)> fn, std::function<void(status)> done);
  void dispatch(std::vector<engine_event>& events);
  void publish();  // engine thread: refreshes snapshot_
  std::atomic<bool> block_map_wanted_{false};
  std::shared_ptr<const kv_block_map> block_map_;  // engine thread: the latest taken
  void fail_all(const status& st);

  std::unique_ptr<engine_core> engine_;
  const int max_waiting_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  std::mutex snapshot_mu_;
  engine_snapshot snapshot_;                  // guarded by snapshot_mu_
  std::atomic<bool> stopping_{false};
  std::thread thread_;

  // Engine thread only.
  struct admitted {
    std::shared_ptr<request_channel> channel;
    std::string tenant;
  };
  std::unordered_map<std::string, admitted> channels_;  // by request id, until its request_finished event
  std::map<std::string, int> closed_tenants_;            // tenant -> close_tenant_async calls not yet reopened
  std::map<std::string, std::int64_t> finished_by_reason_;
  bool flush_pending_ = false;  // a cancel produced events that only step() hands out
  struct synced_call {
    std::function<void(engine_core&)> fn;
    std::function<void(status)> done;
  };
  std::vector<synced_call> after_step_;  // synced calls waiting for the next step
};

}  // namespace pagoda
