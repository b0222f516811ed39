#include "server/generate_call.h"

#include <chrono>
#include <optional>

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "server/bounded_json.h"
#include "server/channel_call.h"
#include "server/image_input.h"
#include "server/openai_response.h"

namespace pagoda::server {

using nlohmann::json;

namespace {

std::int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// An SSE comment: clients ignore it; it is the stream's hang-up probe.
constexpr const char* k_sse_heartbeat = ": keep-alive\n\n";

class generate_call final : public channel_call {
 public:
  generate_call(generate_env& env, std::shared_ptr<http_exchange> ex, api_kind kind, std::string tenant)
      : channel_call(env.loop, std::move(ex)), env_(env), kind_(kind), tenant_(std::move(tenant)) {}

  // Worker thread.
  void parse_and_submit();
  // Worker thread, or the image thread for a body with images.
  void submit_parsed(const json& body);

 private:
  // Strand.
  void on_accepted() override;
  void on_events(std::vector<engine_event>& events) override;
  void on_channel_failed(const api_error& e) override;
  void cancel() override;
  void drain_stream(std::vector<engine_event>& events);
  void drain_whole(std::vector<engine_event>& events);
  void finish_stream();
  void note_first_token(const engine_event& e);
  void record_usage();

  generate_env& env_;
  const api_kind kind_;
  const std::string tenant_;

  // Set by the worker before submitting, then the strand's.
  std::optional<response_builder> builder_;
  bool stream_ = false;
  bool include_usage_ = false;
  std::string kv_policy_;  // set before submit, read on the strand (record_usage)

  // Strand only.
  std::size_t n_finished_ = 0;
  bool usage_counted_ = false;  // the image counters took this call's usage
};

void generate_call::parse_and_submit() {
  http_request& req = ex_->request();
  api_result<json> body = parse_bounded_json(req.body, env_.limits.json);
  req.drop_body();  // the budget's bytes go back as soon as the text is parsed
  if (!body.ok()) return ex_->post([self = self<generate_call>(), e = body.error] { self->fail(e); });
  if (kind_ == api_kind::chat && env_.image_thread && env_.ctx.images && has_image_parts(*body.value)) {
    // Encoding takes long: the image thread does it, so the workers go on parsing text requests.
    auto doc = std::make_shared<json>(std::move(*body.value));
    return boost::asio::post(*env_.image_thread, [self = self<generate_call>(), doc] { self->submit_parsed(*doc); });
  }
  submit_parsed(*body.value);
}

void generate_call::submit_parsed(const json& body) {
  api_result<api_call> parsed = parse_request(kind_, body, env_.ctx, tenant_);
  if (!parsed.ok()) return ex_->post([self = self<generate_call>(), e = parsed.error] { self->fail(e); });
  api_call& call = *parsed.value;

  const std::string id = fmt::format("{}-{:016x}{:08x}", kind_ == api_kind::chat ? "chatcmpl" : "cmpl", env_.id_salt,
                                     env_.next_id.fetch_add(1));
  for (std::size_t i = 0; i < call.requests.size(); ++i) call.requests[i].id = fmt::format("{}/{}", id, i);
  builder_.emplace(call, id, env_.ctx.model_names.front(), unix_seconds(), *env_.ctx.vocab);
  builder_->set_store_tiers(env_.ctx.store_tiers);
  stream_ = call.stream;
  include_usage_ = call.include_usage;
  // The policy in force, for the access line: the request's, else the server's default.
  kv_policy_ = call.requests.front().kv_policy.empty() ? env_.ctx.default_kv_policy : call.requests.front().kv_policy;
  if (kv_policy_.empty()) kv_policy_ = "none";
  submit(std::move(call.requests));
}

void generate_call::on_accepted() {
  if (!stream_) return;
  ex_->begin_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}},
                    k_sse_heartbeat);
  std::string out;
  for (const json& j : builder_->opening_chunks()) out += sse_event(j);
  ex_->write(std::move(out));
}

void generate_call::on_events(std::vector<engine_event>& events) {
  if (stream_) drain_stream(events);
  else drain_whole(events);
}

void generate_call::on_channel_failed(const api_error& e) {
  if (!stream_) return fail(e);
  ex_->write(sse_event(error_body(e)));
  finish_stream();
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

void generate_call::cancel() {
  channel_call::cancel();
  record_usage();
}

void generate_call::record_usage() {
  if (!builder_) return;
  const request_usage& u = builder_->usage();
  if (env_.ctx.images && !usage_counted_ && u.image_tokens > 0) {
    env_.ctx.images->count_usage(u.image_tokens, u.cached_image_tokens);
    usage_counted_ = true;
  }
  ex_->prompt_tokens = u.prompt_tokens;
  ex_->cached_tokens = u.cached_tokens;
  ex_->completion_tokens = u.completion_tokens;
  ex_->kv_policy = kv_policy_;
}

}  // namespace

void start_generate(generate_env& env, const std::shared_ptr<http_exchange>& ex, api_kind kind, std::string tenant) {
  auto call = std::make_shared<generate_call>(env, ex, kind, std::move(tenant));
  ex->keep(call);
  boost::asio::post(env.workers, [call] { call->parse_and_submit(); });
}

}  // namespace pagoda::server
