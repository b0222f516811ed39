#include "server/kv_calls.h"

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "server/bounded_json.h"
#include "server/channel_call.h"

namespace pagoda::server {

using nlohmann::json;

namespace {

class warm_call final : public channel_call {
 public:
  warm_call(kv_env& env, std::shared_ptr<http_exchange> ex, std::string tenant, bool admin)
      : channel_call(env.gen.loop, std::move(ex)), env_(env), tenant_(std::move(tenant)), admin_(admin) {}

  // Worker thread.
  void parse_and_submit();

 private:
  // Strand.
  void on_events(std::vector<engine_event>& events) override;
  void computed();
  void keyed(const status& st);

  kv_env& env_;
  const std::string tenant_;
  const bool admin_;

  // Set by the worker before submitting; then the strand's, the engine
  // thread's while it keys the prompts (between computed() and keyed()), and
  // the store thread's while it answers.
  warm_plan plan_;
  std::vector<warmed_prompt> out_;  // [prompt]

  // Strand only.
  bool aborted_ = false;  // a request ended with "abort" (its tenant's DELETE, or a stop)
  std::size_t n_finished_ = 0;
};

void warm_call::parse_and_submit() {
  http_request& req = ex_->request();
  api_result<json> body = parse_bounded_json(req.body, env_.gen.limits.json);
  req.drop_body();
  if (!body.ok()) return ex_->post([self = self<warm_call>(), e = body.error] { self->fail(e); });
  const std::string id = fmt::format("warm-{:016x}{:08x}", env_.gen.id_salt, env_.gen.next_id.fetch_add(1));
  api_result<warm_plan> plan = env_.admin.plan_warm(*body.value, env_.gen.ctx, tenant_, admin_, id);
  body.value.reset();
  if (!plan.ok()) return ex_->post([self = self<warm_call>(), e = plan.error] { self->fail(e); });
  plan_ = std::move(*plan.value);
  ex_->tenant = plan_.tenant;
  out_.resize(plan_.requests.size());
  submit(plan_.requests);  // a copy: the keys are computed from the plan's requests later
}

void warm_call::on_events(std::vector<engine_event>& events) {
  for (const engine_event& e : events) {
    if (e.finish_reason == "error") {
      cancel();
      return fail(from_status(error(errc::internal, "computing the prompt's KV failed: {}", e.error)));
    }
    if (!e.request_finished) continue;
    if (const int i = prompt_index(e.request_id); i >= 0) {
      out_[static_cast<std::size_t>(i)].prompt_tokens = e.usage.prompt_tokens;
      out_[static_cast<std::size_t>(i)].cached_tokens = e.usage.cached_tokens;
    }
    aborted_ = aborted_ || e.finish_reason == "abort";
    ++n_finished_;
  }
  if (n_finished_ == ids_.size()) computed();
}

// Every prompt is computed (or aborted).
void warm_call::computed() {
  complete_ = true;
  int prompt_tokens = 0, cached_tokens = 0;
  for (const warmed_prompt& w : out_) {
    prompt_tokens += w.prompt_tokens;
    cached_tokens += w.cached_tokens;
  }
  ex_->prompt_tokens = prompt_tokens;
  ex_->cached_tokens = cached_tokens;
  if (aborted_)
    return fail(from_status(error(errc::cancelled, "the warm was aborted before its prompts were computed (its "
                                                   "tenant's KV was erased, or the server is stopping); retry")));
  // The keys come from the engine's own KV manager, once the ops of the last
  // step are applied (so the commit hook has queued every block).
  env_.gen.loop.run_synced_async(
      [self = self<warm_call>()](engine_core& core) { kv_admin::key_prompts(core, self->plan_, self->out_); },
      [self = self<warm_call>()](status st) { self->ex_->post([self, st = std::move(st)] { self->keyed(st); }); });
}

void warm_call::keyed(const status& st) {
  if (!st.ok()) return fail(from_status(st));
  if (ex_->gone()) return;  // nobody to tell how much was stored
  boost::asio::post(env_.store_thread, [self = self<warm_call>()] {
    json answer = self->env_.admin.answer_warm(self->plan_, self->out_, self->env_.gen.ctx.model_names.front());
    self->ex_->post([self, answer = std::move(answer)] {
      if (!self->ex_->gone()) self->ex_->respond(json_response(200, answer));
    });
  });
}

}  // namespace

void start_warm(kv_env& env, const std::shared_ptr<http_exchange>& ex, std::string tenant, bool admin) {
  auto call = std::make_shared<warm_call>(env, ex, std::move(tenant), admin);
  ex->keep(call);
  boost::asio::post(env.gen.workers, [call] { call->parse_and_submit(); });
}

void start_erase(kv_env& env, const std::shared_ptr<http_exchange>& ex, const std::optional<std::string>& tenant_arg) {
  api_result<std::string> tenant = kv_admin::tenant_to_erase(tenant_arg);
  if (!tenant.ok()) return ex->respond(error_response(tenant.error));
  auto n_memory = std::make_shared<std::int32_t>(0);  // written on the engine thread, read on the store thread
  env.admin.loop().close_tenant_async(
      *tenant.value, [t = *tenant.value, n_memory](engine_core& core) { *n_memory = kv_admin::erase_in_pool(core, t); },
      [&env, ex, t = *tenant.value, n_memory](status st) {
        if (!st.ok()) {
          env.admin.loop().reopen_tenant(t);
          return ex->post([ex, e = from_status(st)] {
            if (!ex->gone()) ex->respond(error_response(e));
          });
        }
        boost::asio::post(env.store_thread, [&env, ex, t, n_memory] {
          api_result<json> r = env.admin.erase_in_store(t, *n_memory);
          env.admin.loop().reopen_tenant(t);
          ex->post([ex, r = std::move(r)] {
            if (!ex->gone()) ex->respond(r.ok() ? json_response(200, *r.value) : error_response(r.error));
          });
        });
      });
}

}  // namespace pagoda::server
