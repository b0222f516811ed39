#include "server/generate_call.h"

#include <chrono>
#include <optional>

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "server/bounded_json.h"
#include "server/openai_response.h"

namespace pagoda::server {

using nlohmann::json;

namespace {

std::int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

http_response error_response(const api_error& e) {
  http_response r;
  r.status = e.http_status;
  r.body = dump_json(error_body(e));
  if (e.http_status == 429 || e.http_status == 503) r.fields.emplace_back("Retry-After", "1");
  return r;
}

// An SSE comment: clients ignore it; it is the stream's hang-up probe.
constexpr const char* k_sse_heartbeat = ": keep-alive\n\n";

class generate_call : public std::enable_shared_from_this<generate_call> {
 public:
  generate_call(generate_env& env, std::shared_ptr<http_exchange> ex, api_kind kind, std::string tenant)
      : env_(env), ex_(std::move(ex)), kind_(kind), tenant_(std::move(tenant)) {}

  // Worker thread.
  void parse_and_submit();

 private:
  // Strand.
  void submitted(const status& st);
  void schedule_drain();
  void drain();
  void drain_stream(std::vector<engine_event>& events);
  void drain_whole(std::vector<engine_event>& events);
  void fail(const api_error& e);
  void finish_stream();
  void cancel();
  void note_first_token(const engine_event& e);
  void record_usage();

  int prompt_index(const std::string& id) const {
    for (std::size_t i = 0; i < ids_.size(); ++i)
      if (ids_[i] == id) return static_cast<int>(i);
    return -1;
  }

  generate_env& env_;
  std::shared_ptr<http_exchange> ex_;
  const api_kind kind_;
  const std::string tenant_;

  // Set by the worker before submitting, then the strand's.
  std::vector<std::string> ids_;  // [prompt index]
  std::shared_ptr<request_channel> channel_;
  std::optional<response_builder> builder_;
  bool stream_ = false;
  bool include_usage_ = false;

  // Strand only.
  bool submitted_ = false;
  bool complete_ = false;  // answered, failed or cancelled: nothing more to do
  std::size_t n_finished_ = 0;
  std::atomic<bool> drain_posted_{false};
};

void generate_call::parse_and_submit() {
  http_request& req = ex_->request();
  api_result<json> body = parse_bounded_json(req.body, env_.limits.json);
  req.drop_body();  // the budget's bytes go back as soon as the text is parsed
  if (!body.ok()) return ex_->post([self = shared_from_this(), e = body.error] { self->fail(e); });
  api_result<api_call> parsed = parse_request(kind_, *body.value, env_.ctx, tenant_);
  body.value.reset();
  if (!parsed.ok()) return ex_->post([self = shared_from_this(), e = parsed.error] { self->fail(e); });
  api_call& call = *parsed.value;

  const std::string id = fmt::format("{}-{:016x}{:08x}", kind_ == api_kind::chat ? "chatcmpl" : "cmpl", env_.id_salt,
                                     env_.next_id.fetch_add(1));
  for (std::size_t i = 0; i < call.requests.size(); ++i) {
    call.requests[i].id = fmt::format("{}/{}", id, i);
    ids_.push_back(call.requests[i].id);
  }
  builder_.emplace(call, id, env_.ctx.model_names.front(), unix_seconds(), *env_.ctx.vocab);
  builder_->set_store_tiers(env_.ctx.store_tiers);
  stream_ = call.stream;
  include_usage_ = call.include_usage;
  channel_ = std::make_shared<request_channel>();
  // Weak: the channel lives in the engine until its requests finish; the call
  // lives as long as its exchange.
  channel_->set_notify([weak = weak_from_this()] {
    if (auto self = weak.lock()) self->schedule_drain();
  });
  env_.loop.submit_async(std::move(call.requests), channel_, [self = shared_from_this()](status st) {
    self->ex_->post([self, st = std::move(st)] { self->submitted(st); });
  });
}

void generate_call::submitted(const status& st) {
  if (!st.ok()) return fail(from_status(st));
  submitted_ = true;
  if (ex_->gone()) return cancel();  // the client left while the request was parsed
  ex_->on_gone([self = shared_from_this()] { self->cancel(); });
  if (stream_) {
    ex_->begin_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}},
                      k_sse_heartbeat);
    std::string out;
    for (const json& j : builder_->opening_chunks()) out += sse_event(j);
    ex_->write(std::move(out));
  }
  drain();
}

void generate_call::schedule_drain() {
  if (drain_posted_.exchange(true)) return;  // one pending drain takes everything queued
  ex_->post([self = shared_from_this()] {
    self->drain_posted_ = false;
    self->drain();
  });
}

void generate_call::drain() {
  if (!submitted_ || complete_) return;
  std::vector<engine_event> events;
  if (!channel_->wait(events, std::chrono::milliseconds(0))) {
    // The engine thread failed: no more events will come.
    const api_error e = from_status(channel_->failure());
    if (!stream_) return fail(e);
    ex_->write(sse_event(error_body(e)));
    return finish_stream();
  }
  if (events.empty()) return;
  if (stream_) drain_stream(events);
  else drain_whole(events);
}

void generate_call::note_first_token(const engine_event& e) {
  if (ex_->ttft_ms >= 0 || e.tokens.empty()) return;
  ex_->ttft_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - ex_->request().started).count();
}

void generate_call::drain_whole(std::vector<engine_event>& events) {
  for (const engine_event& e : events) {
    if (e.finish_reason == "error") {  // the engine step failed: the whole call fails
      cancel();
      return fail(from_status(error(errc::internal, "{}", e.error)));
    }
    note_first_token(e);
    builder_->add(prompt_index(e.request_id), e);
    if (e.request_finished) ++n_finished_;
  }
  if (n_finished_ < ids_.size()) return;
  complete_ = true;
  record_usage();
  http_response r;
  r.body = dump_json(builder_->body());
  ex_->respond(std::move(r));
}

void generate_call::drain_stream(std::vector<engine_event>& events) {
  std::string out;
  std::vector<json> chunks;
  for (const engine_event& e : events) {
    if (e.finish_reason == "error") {  // the engine step failed: say so in the stream and end it
      for (const json& j : chunks) out += sse_event(j);
      out += sse_event(error_body(from_status(error(errc::internal, "{}", e.error))));
      ex_->write(std::move(out));
      cancel();
      return finish_stream();
    }
    note_first_token(e);
    const int p = prompt_index(e.request_id);
    builder_->add(p, e);
    builder_->chunks_for(p, e, chunks);
    if (e.request_finished) ++n_finished_;
  }
  for (const json& j : chunks) out += sse_event(j);
  ex_->write(std::move(out));
  if (n_finished_ >= ids_.size()) {
    if (include_usage_) ex_->write(sse_event(builder_->usage_chunk()));
    return finish_stream();
  }
  if (ex_->pending_bytes() > env_.limits.max_pending_send_bytes) {
    // The client does not read: it must not hold the engine's blocks.
    cancel();
    complete_ = true;
    ex_->abort();
  }
}

void generate_call::finish_stream() {
  complete_ = true;
  record_usage();
  ex_->write(k_sse_done);
  ex_->end_stream();
}

void generate_call::fail(const api_error& e) {
  complete_ = true;
  if (!ex_->gone()) ex_->respond(error_response(e));
}

void generate_call::cancel() {
  if (submitted_ && !complete_) env_.loop.cancel(ids_);
  complete_ = true;
  record_usage();
}

void generate_call::record_usage() {
  if (!builder_) return;
  const request_usage& u = builder_->usage();
  ex_->prompt_tokens = u.prompt_tokens;
  ex_->cached_tokens = u.cached_tokens;
  ex_->completion_tokens = u.completion_tokens;
}

}  // namespace

void start_generate(generate_env& env, const std::shared_ptr<http_exchange>& ex, api_kind kind, std::string tenant) {
  auto call = std::make_shared<generate_call>(env, ex, kind, std::move(tenant));
  ex->keep(call);
  boost::asio::post(env.workers, [call] { call->parse_and_submit(); });
}

}  // namespace pagoda::server
