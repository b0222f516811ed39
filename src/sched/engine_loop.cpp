#include "sched/engine_loop.h"

#include <future>

#include "core/assert.h"

namespace pagoda {

// --- request_channel ------------------------------------------------------------

void request_channel::push(engine_event e) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(e));
  }
  cv_.notify_all();
  notify();
}

void request_channel::fail(status st) {
  PAGODA_ASSERT(!st.ok(), "a channel fails with an error");
  {
    std::lock_guard lock(mu_);
    failure_ = std::move(st);
  }
  cv_.notify_all();
  notify();
}

bool request_channel::wait(std::vector<engine_event>& out, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (queue_.empty() && failure_.ok()) cv_.wait_for(lock, timeout, [&] { return !queue_.empty() || !failure_.ok(); });
  if (queue_.empty()) return failure_.ok();
  for (engine_event& e : queue_) out.push_back(std::move(e));
  queue_.clear();
  return true;
}

status request_channel::failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

// --- engine_loop ----------------------------------------------------------------

engine_loop::engine_loop(std::unique_ptr<engine_core> eng, int max_waiting)
    : engine_(std::move(eng)), max_waiting_(max_waiting) {
  PAGODA_ASSERT(engine_ != nullptr, "engine_loop needs an engine");
  publish();
  thread_ = std::thread([this] { run(); });
}

engine_loop::~engine_loop() { stop(); }

status engine_loop::submit(std::vector<request> reqs, std::shared_ptr<request_channel> channel) {
  std::promise<status> done;
  std::future<status> answer = done.get_future();
  submit_async(std::move(reqs), std::move(channel), [&done](status st) { done.set_value(std::move(st)); });
  return answer.get();
}

bool engine_loop::post(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    // Checked under the lock the thread takes before its final drain, so a task
    // posted here always runs.
    if (stopping_) return false;
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

std::size_t engine_loop::n_queued_tasks() {
  std::lock_guard lock(mu_);
  return tasks_.size();
}

void engine_loop::submit_async(std::vector<request> reqs, std::shared_ptr<request_channel> channel,
                               std::function<void(status)> done) {
  PAGODA_ASSERT(channel != nullptr, "submit needs a channel");
  if (reqs.empty()) return done(error(errc::invalid_argument, "no request to submit"));
  const bool posted = post([this, reqs = std::move(reqs), channel = std::move(channel), done]() mutable {
    done(admit(reqs, channel));
  });
  // Outside the lock: `done` may post work that calls back into the loop.
  if (!posted) done(error(errc::cancelled, "the server is shutting down"));
}

status engine_loop::admit(std::vector<request>& reqs, const std::shared_ptr<request_channel>& channel) {
  if (stopping_) return error(errc::cancelled, "the server is shutting down");
  for (const request& r : reqs)
    if (closed_tenants_.contains(r.tenant))
      return error(errc::cancelled, "tenant '{}': its KV cache is being erased (DELETE /v1/kv); retry in a moment",
                   r.tenant);
  const int waiting = engine_->stats().n_waiting;
  if (waiting + static_cast<std::int64_t>(reqs.size()) > max_waiting_)
    return error(errc::resource_exhausted, "the server's queue is full ({} requests waiting); retry later", waiting);
  std::vector<std::pair<std::string, admitted>> added;  // by request id
  for (request& r : reqs) {
    std::pair<std::string, admitted> a{r.id, {channel, r.tenant}};
    status st = engine_->add_request(std::move(r));
    if (!st.ok()) {
      for (const auto& [id, ignored] : added) engine_->abort_request(id);
      flush_pending_ = !added.empty();
      // The queue was checked above, so exhaustion here means the pool or a
      // quota is too small for this request, whatever the load.
      if (st.code() == errc::resource_exhausted) st = status(errc::out_of_range, st.message());
      return st;
    }
    added.push_back(std::move(a));
  }
  for (auto& a : added) channels_.insert(std::move(a));
  return {};
}

void engine_loop::cancel(std::vector<std::string> ids) {
  // stop() aborts everything anyway, so a cancel that finds the loop stopping is dropped.
  post([this, ids = std::move(ids)] {
    for (const std::string& id : ids)
      if (channels_.contains(id) && engine_->abort_request(id)) flush_pending_ = true;
  });
}

status engine_loop::run_synced(std::function<void(engine_core&)> fn) {
  std::promise<status> done;
  std::future<status> answer = done.get_future();
  run_synced_async(std::move(fn), [&done](status st) { done.set_value(std::move(st)); });
  return answer.get();
}

void engine_loop::run_synced_async(std::function<void(engine_core&)> fn, std::function<void(status)> done) {
  if (!post([this, fn, done]() mutable { when_synced(std::move(fn), std::move(done)); }))
    done(error(errc::cancelled, "the server is shutting down"));
}

void engine_loop::when_synced(std::function<void(engine_core&)> fn, std::function<void(status)> done) {
  if (stopping_) return done(error(errc::cancelled, "the server is shutting down"));
  if (engine_->has_pending_ops() && !engine_->has_work()) {
    std::vector<engine_event> events;
    engine_->flush(events);
    dispatch(events);
  }
  if (engine_->has_pending_ops()) {
    after_step_.push_back({std::move(fn), std::move(done)});  // the next step applies them first
    return;
  }
  fn(*engine_);
  done(status{});
}

void engine_loop::close_tenant_async(std::string tenant, std::function<void(engine_core&)> fn,
                                     std::function<void(status)> done) {
  const bool posted = post([this, tenant, fn, done]() mutable {
    if (stopping_) return done(error(errc::cancelled, "the server is shutting down"));
    ++closed_tenants_[tenant];
    for (const auto& [id, a] : channels_)
      if (a.tenant == tenant && engine_->abort_request(id)) flush_pending_ = true;
    // The aborts may leave ops (blocks released) beside those of the last step.
    when_synced(std::move(fn), std::move(done));
  });
  if (!posted) done(error(errc::cancelled, "the server is shutting down"));
}

void engine_loop::reopen_tenant(std::string tenant) {
  post([this, tenant = std::move(tenant)] {
    auto it = closed_tenants_.find(tenant);
    if (it != closed_tenants_.end() && --it->second == 0) closed_tenants_.erase(it);
  });
}

engine_snapshot engine_loop::snapshot() {
  std::lock_guard lock(snapshot_mu_);
  return snapshot_;
}

void engine_loop::want_block_map() {
  block_map_wanted_ = true;
  post([] {});  // an idle engine publishes after its tasks; a busy one after its step
}

void engine_loop::publish() {
  const engine_stats& st = engine_->stats();
  engine_snapshot s;
  s.kv = engine_->kv_stats();
  if (!s.kv.classes.empty()) {
    s.kv_class_types.push_back(engine_->config().kv.describe());
    for (const kv_segment_class& k : engine_->config().kv_classes) s.kv_class_types.push_back(k.name);
  }
  s.n_steps = st.n_steps;
  s.n_prompt_tokens = st.n_prompt_tokens;
  s.n_computed_prompt_tokens = st.n_computed_prompt_tokens;
  s.n_policy_compactions = st.n_policy_compactions;
  s.n_policy_evicted_slots = st.n_policy_evicted_slots;
  s.selector_bytes = st.selector_bytes;
  s.peak_selector_bytes = st.peak_selector_bytes;
  s.peak_side_blocks = st.peak_side_blocks;
  s.peak_running = st.peak_running;
  s.n_generated_tokens = st.n_generated_tokens;
  s.spec_decode = st.spec_decode;
  s.kv_reads = st.kv_reads;
  s.recall_by_index = st.recall_by_index;
  s.n_running = st.n_running;
  s.n_waiting = st.n_waiting;
  // engine_stats' counts are refreshed by step(); when aborts emptied the
  // engine, no step ran since to refresh them.
  if (!engine_->has_work()) s.n_running = s.n_waiting = 0;
  s.max_num_seqs = engine_->config().max_num_seqs;
  s.sequences = engine_->sched().running_sequences();
  s.n_finished_by_reason = finished_by_reason_;
  s.n_requests_active = static_cast<std::int64_t>(channels_.size());
  s.ttft_seconds = st.ttft_seconds.snapshot();
  s.itl_seconds = st.itl_seconds.snapshot();
  s.e2e_seconds = st.e2e_seconds.snapshot();
  if (block_map_wanted_.exchange(false))
    block_map_ = std::make_shared<const kv_block_map>(make_kv_block_map(engine_->kv(), st.n_steps));
  s.block_map = block_map_;
  std::lock_guard lock(snapshot_mu_);
  snapshot_ = std::move(s);
}

void engine_loop::dispatch(std::vector<engine_event>& events) {
  // Account first, publish, then hand out: a client that sees its request's
  // last event already finds it counted in snapshot().
  std::vector<std::pair<std::shared_ptr<request_channel>, engine_event*>> out;
  out.reserve(events.size());
  for (engine_event& e : events) {
    auto it = channels_.find(e.request_id);
    if (it == channels_.end()) continue;  // rejected half of a batch, or the channel failed
    out.emplace_back(it->second.channel, &e);
    if (e.request_finished) {
      ++finished_by_reason_[e.finish_reason];
      channels_.erase(it);
    }
  }
  publish();
  for (auto& [ch, e] : out) ch->push(std::move(*e));
}

void engine_loop::fail_all(const status& st) {
  for (auto& [id, a] : channels_) {
    a.channel->fail(st);
    engine_->abort_request(id);
  }
  channels_.clear();
  flush_pending_ = true;
}

void engine_loop::run() {
  std::vector<engine_event> events;
  std::deque<std::function<void()>> batch;
  for (;;) {
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] {
        return !tasks_.empty() || stopping_ || engine_->has_work() || engine_->has_pending_ops() || flush_pending_;
      });
      batch.swap(tasks_);
    }
    for (auto& task : batch) task();
    batch.clear();
    if (stopping_) break;
    if (!engine_->has_work() && !engine_->has_pending_ops() && !flush_pending_) {
      publish();  // the tasks may have changed what the engine holds
      continue;
    }
    flush_pending_ = false;
    events.clear();
    bool computed = false;
    status failed;
    try {
      computed = engine_->step(events);
    } catch (const std::exception& e) {
      // The bookkeeping itself failed (std::bad_alloc outside the runner, whose
      // failures only end the step's own requests): end every request in
      // flight with an error and keep serving new ones.
      failed = error(errc::internal, "engine step: {}", e.what());
    }
    dispatch(events);
    if (!failed.ok()) fail_all(failed);
    // Every step starts by applying the ops queued before it.
    std::vector<synced_call> synced;
    synced.swap(after_step_);
    for (synced_call& c : synced) {
      c.fn(*engine_);
      c.done(status{});
    }
    if (!computed && engine_->has_work()) {
      // Nothing could run (every waiting request waits on something): do not spin.
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(5), [&] { return !tasks_.empty() || stopping_; });
    }
  }
  // Shutting down: abort what is left, hand out the abort events, then answer
  // every task posted before stop() took the lock (submits see stopping_).
  std::vector<std::string> ids;
  for (const auto& [id, ch] : channels_) ids.push_back(id);
  for (const std::string& id : ids) engine_->abort_request(id);
  events.clear();
  engine_->step(events);  // with nothing running, only flushes the aborts
  dispatch(events);
  for (auto& [id, a] : channels_) a.channel->fail(error(errc::cancelled, "the server is shutting down"));
  channels_.clear();
  std::vector<synced_call> synced;
  synced.swap(after_step_);
  for (synced_call& c : synced) c.done(error(errc::cancelled, "the server is shutting down"));
  publish();
  // Outside the lock, as every task runs: a task's callback may call into the
  // loop (cancel, submit_async), which takes mu_. Nothing is posted once
  // stopping_ is set (every poster checks it under mu_), so this ends.
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (tasks_.empty()) break;
      batch.swap(tasks_);
    }
    for (auto& task : batch) task();
    batch.clear();
  }
}

void engine_loop::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

}  // namespace pagoda
