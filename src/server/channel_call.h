// What a call answered from the engine's events shares (generate_call.h for
// completions and chat, kv_calls.h for /v1/kv/warm): its requests are
// submitted without waiting (engine_loop::submit_async), every event the
// engine pushes posts one coalesced drain to the connection's strand, and a
// client that leaves has the requests cancelled at once.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "sched/engine_loop.h"
#include "server/api_error.h"
#include "server/http_connection.h"

namespace pagoda::server {

class channel_call : public std::enable_shared_from_this<channel_call> {
 public:
  virtual ~channel_call() = default;

 protected:
  channel_call(engine_loop& loop, std::shared_ptr<http_exchange> ex) : loop_(loop), ex_(std::move(ex)) {}

  // Worker thread: submits `reqs` (their ids already set) with a channel
  // whose events reach on_events() on the strand.
  void submit(std::vector<request> reqs);

  // Strand. on_accepted: the engine took the requests and the client is
  // still here (a stream begins). on_events: what the channel holds now.
  // on_channel_failed: the engine thread failed; no more events will come.
  virtual void on_accepted() {}
  virtual void on_events(std::vector<engine_event>& events) = 0;
  virtual void on_channel_failed(const api_error& e) { fail(e); }

  // Strand: answers with an error (unless the client left); nothing more to do.
  void fail(const api_error& e);
  // Strand: cancels the engine requests still running; nothing more to do.
  virtual void cancel();
  // The prompt index of a request id, or -1.
  int prompt_index(const std::string& id) const;
  // This call as its own type, for callbacks that outlive a handler.
  template <typename T>
  std::shared_ptr<T> self() {
    return std::static_pointer_cast<T>(shared_from_this());
  }

  engine_loop& loop_;
  std::shared_ptr<http_exchange> ex_;
  // Set by the worker before submitting, then the strand's.
  std::vector<std::string> ids_;  // [prompt index]
  std::shared_ptr<request_channel> channel_;
  // Strand only.
  bool submitted_ = false;
  bool complete_ = false;  // answered, failed or cancelled: nothing more to do

 private:
  void submitted(const status& st);
  void drain();

  std::atomic<bool> drain_posted_{false};  // a drain is posted and has not run yet
};

}  // namespace pagoda::server
