#include "server/channel_call.h"

#include <chrono>

namespace pagoda::server {

void channel_call::submit(std::vector<request> reqs) {
  ids_.clear();
  for (const request& r : reqs) ids_.push_back(r.id);
  channel_ = std::make_shared<request_channel>();
  // Weak: the channel lives in the engine until its requests finish; the call
  // lives as long as its exchange. One posted drain takes everything queued.
  channel_->set_notify([weak = weak_from_this()] {
    auto self = weak.lock();
    if (!self || self->drain_posted_.exchange(true)) return;
    self->ex_->post([self] {
      self->drain_posted_ = false;
      self->drain();
    });
  });
  loop_.submit_async(std::move(reqs), channel_, [self = shared_from_this()](status st) {
    self->ex_->post([self, st = std::move(st)] { self->submitted(st); });
  });
}

void channel_call::submitted(const status& st) {
  if (!st.ok()) return fail(from_status(st));
  submitted_ = true;
  if (ex_->gone()) return cancel();  // the client left while the request was parsed
  ex_->on_gone([self = shared_from_this()] { self->cancel(); });
  on_accepted();
  drain();
}

void channel_call::drain() {
  if (!submitted_ || complete_) return;
  std::vector<engine_event> events;
  if (!channel_->wait(events, std::chrono::milliseconds(0))) return on_channel_failed(from_status(channel_->failure()));
  if (!events.empty()) on_events(events);
}

void channel_call::fail(const api_error& e) {
  complete_ = true;
  if (!ex_->gone()) ex_->respond(error_response(e));
}

void channel_call::cancel() {
  if (submitted_ && !complete_) loop_.cancel(ids_);
  complete_ = true;
}

int channel_call::prompt_index(const std::string& id) const {
  for (std::size_t i = 0; i < ids_.size(); ++i)
    if (ids_[i] == id) return static_cast<int>(i);
  return -1;
}

}  // namespace pagoda::server
