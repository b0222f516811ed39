#include "server/http_server.h"

#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>

#include <httplib.h>

#include "core/assert.h"
#include "server/connection_probe.h"
#include "server/openai_response.h"

namespace pagoda::server {

using nlohmann::json;

namespace {

constexpr int k_listen_backlog = 1024;

std::int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void reply_error(httplib::Response& res, const api_error& e) {
  res.status = e.http_status;
  if (e.http_status == 429) res.set_header("Retry-After", "1");
  res.set_content(dump_json(error_body(e)), "application/json");
}

// The request's JSON body; std::nullopt (and a 400 in res) when it is not JSON.
std::optional<json> parse_body(const httplib::Request& req, httplib::Response& res) {
  try {
    return json::parse(req.body);
  } catch (const json::exception& e) {
    reply_error(res, bad_request("", fmt::format("The request body is not valid JSON: {}", e.what()), "invalid_json"));
    return std::nullopt;
  }
}

// The endpoint label of a path: fixed names only, so a scan of random paths
// cannot grow the metrics without bound.
std::string endpoint_label(const std::string& path) {
  for (const char* p : {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/v1/kv/warm",
                        "/v1/kv/stats", "/v1/kv"})
    if (path == p) return p;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "other";
}

// One call's engine requests: their ids and the prompt each belongs to.
struct call_ids {
  std::vector<std::string> ids;  // [prompt index]
  int prompt_index(const std::string& id) const {
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (ids[i] == id) return static_cast<int>(i);
    return -1;
  }
};

// What a streaming response needs after its handler returned.
struct stream_state {
  call_ids call;
  std::shared_ptr<request_channel> channel;
  response_builder builder;
  bool include_usage = false;
  connection_probe probe;
  std::size_t n_finished = 0;
  bool complete = false;  // [DONE] sent, or the engine answered every request
};

}  // namespace

struct http_server::impl {
  server_options opts;
  api_context ctx;
  key_store keys;
  engine_loop& loop;
  kv_admin* kv;
  httplib::Server svr;
  std::atomic<bool> bound{false};
  std::atomic<int> listen_fd{-1};

  mutable std::mutex counts_mu;
  http_counts counts;

  std::atomic<std::uint64_t> next_id{0};
  const std::uint64_t id_salt = (static_cast<std::uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
  const std::int64_t started_unix_s = unix_seconds();

  impl(server_options o, api_context c, key_store k, engine_loop& l, kv_admin* a)
      : opts(std::move(o)), ctx(std::move(c)), keys(std::move(k)), loop(l), kv(a) {}

  void setup();
  std::optional<std::string> authorize(const httplib::Request& req, httplib::Response& res) const;
  void handle_generate(const httplib::Request& req, httplib::Response& res, api_kind kind);
  void setup_kv_routes();
  bool presents_admin_key(const httplib::Request& req) const;
  bool pump(stream_state& s, httplib::DataSink& sink);
  json model_card(const std::string& name) const;
};

std::optional<std::string> http_server::impl::authorize(const httplib::Request& req, httplib::Response& res) const {
  if (!keys.enabled()) return std::string();
  std::string header = req.get_header_value("Authorization");
  std::optional<std::string_view> token = bearer_token(header);
  if (token)
    if (std::optional<std::string> tenant = keys.authenticate(*token)) return tenant;
  api_error e;
  e.http_status = 401;
  e.message = token ? "Incorrect API key provided." : "Missing API key: send the header 'Authorization: Bearer KEY'.";
  e.code = "invalid_api_key";
  res.set_header("WWW-Authenticate", "Bearer");
  reply_error(res, e);
  return std::nullopt;
}

json http_server::impl::model_card(const std::string& name) const {
  return {{"id", name},
          {"object", "model"},
          {"created", started_unix_s},
          {"owned_by", "pagoda"},
          {"root", name},
          {"parent", nullptr},
          {"max_model_len", ctx.limits.max_model_len}};
}

void http_server::impl::handle_generate(const httplib::Request& req, httplib::Response& res, api_kind kind) {
  std::optional<std::string> tenant = authorize(req, res);
  if (!tenant) return;
  std::optional<json> body = parse_body(req, res);
  if (!body) return;
  api_result<api_call> parsed = parse_request(kind, *body, ctx, *tenant);
  if (!parsed.ok()) {
    reply_error(res, parsed.error);
    return;
  }
  api_call& call = *parsed.value;

  const std::string id = fmt::format("{}-{:016x}{:08x}", kind == api_kind::chat ? "chatcmpl" : "cmpl", id_salt,
                                     next_id.fetch_add(1));
  call_ids ids;
  for (std::size_t i = 0; i < call.requests.size(); ++i) {
    call.requests[i].id = fmt::format("{}/{}", id, i);
    ids.ids.push_back(call.requests[i].id);
  }
  response_builder builder(call, id, ctx.model_names.front(), unix_seconds(), *ctx.vocab);
  builder.set_store_tiers(ctx.store_tiers);
  // Found before submitting: the descriptor is this handler's until it returns.
  connection_probe probe = connection_probe::find(req.local_addr, req.local_port, req.remote_addr, req.remote_port);
  auto channel = std::make_shared<request_channel>();
  if (status st = loop.submit(std::move(call.requests), channel); !st.ok()) {
    reply_error(res, from_status(st));
    return;
  }

  if (call.stream) {
    auto s = std::make_shared<stream_state>(
        stream_state{std::move(ids), channel, std::move(builder), call.include_usage, probe, 0, false});
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream", [this, s](std::size_t, httplib::DataSink& sink) { return pump(*s, sink); },
        [this, s](bool) {
          if (!s->complete) loop.cancel(s->call.ids);
        });
    return;
  }

  std::size_t n_finished = 0;
  std::vector<engine_event> events;
  while (n_finished < ids.ids.size()) {
    events.clear();
    if (!channel->wait(events, opts.poll_interval)) {
      reply_error(res, from_status(channel->failure()));
      return;
    }
    for (const engine_event& e : events) {
      if (e.finish_reason == "error") {  // the engine step failed: the whole call fails
        loop.cancel(ids.ids);
        reply_error(res, from_status(error(errc::internal, "{}", e.error)));
        return;
      }
      builder.add(ids.prompt_index(e.request_id), e);
      if (e.request_finished) ++n_finished;
    }
    if (n_finished < ids.ids.size() && probe.peer_gone()) {
      loop.cancel(ids.ids);  // nobody will read the answer: free the blocks now
      res.status = 499;      // nginx's "client closed request", for the log and metrics
      return;
    }
  }
  res.set_content(dump_json(builder.body()), "application/json");
}

bool http_server::impl::pump(stream_state& s, httplib::DataSink& sink) {
  std::string out;
  for (const json& j : s.builder.opening_chunks()) out += sse_event(j);
  std::vector<engine_event> events;
  std::vector<json> chunks;
  auto flush = [&] {
    if (out.empty()) return true;
    bool ok = sink.write(out.data(), out.size());
    out.clear();
    return ok;
  };
  while (s.n_finished < s.call.ids.size()) {
    events.clear();
    if (!s.channel->wait(events, opts.poll_interval)) {
      // The engine failed: say so in the stream, as vLLM does, and end it.
      out += sse_event(error_body(from_status(s.channel->failure())));
      s.n_finished = s.call.ids.size();
      break;
    }
    chunks.clear();
    bool failed = false;
    for (const engine_event& e : events) {
      if (e.finish_reason == "error") {  // the engine step failed: say so in the stream and end it
        out += sse_event(error_body(from_status(error(errc::internal, "{}", e.error))));
        failed = true;
        break;
      }
      const int p = s.call.prompt_index(e.request_id);
      s.builder.add(p, e);
      s.builder.chunks_for(p, e, chunks);
      if (e.request_finished) ++s.n_finished;
    }
    for (const json& j : chunks) out += sse_event(j);
    if (failed) {
      loop.cancel(s.call.ids);
      s.n_finished = s.call.ids.size();
      break;
    }
    if (!flush() || (s.n_finished < s.call.ids.size() && s.probe.peer_gone())) {
      loop.cancel(s.call.ids);
      s.complete = true;
      return false;
    }
  }
  s.complete = true;
  if (s.include_usage) out += sse_event(s.builder.usage_chunk());
  out += k_sse_done;
  if (!flush()) return false;
  sink.done();
  return true;
}

void http_server::impl::setup() {
  const int n_threads = std::max(1, opts.n_http_threads);
  svr.new_task_queue = [n_threads] { return new httplib::ThreadPool(static_cast<std::size_t>(n_threads)); };
  svr.set_payload_max_length(opts.max_body_bytes);
  svr.set_keep_alive_max_count(1000);
  // Debian's compiled httplib listens with a backlog of 5: a burst of clients
  // connecting at once overflows it and some see their connection dropped.
  // Remember the listening socket so bind() can raise its backlog.
  svr.set_socket_options([this](socket_t sock) {
    httplib::default_socket_options(sock);
    listen_fd.store(sock);
  });
  svr.set_tcp_nodelay(true);

  svr.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    std::lock_guard lock(counts_mu);
    ++counts[{endpoint_label(req.path), res.status}];
  });
  svr.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
    // Handlers write their own error bodies; 499 means nobody is listening.
    if (!res.body.empty() || res.content_provider_ || res.status == 499)
      return httplib::Server::HandlerResponse::Unhandled;
    api_error e;
    e.http_status = res.status;
    switch (res.status) {
      case 404: e.message = fmt::format("Not found: {} {}", req.method, req.path.substr(0, 200)); e.type = "not_found_error"; break;
      case 413: e.message = fmt::format("The request body is larger than this server's limit of {} bytes", opts.max_body_bytes); break;
      case 405: e.message = fmt::format("Method {} is not allowed here", req.method); break;
      default: e.message = fmt::format("HTTP {}", res.status); if (res.status >= 500) e.type = "internal_error"; break;
    }
    reply_error(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }));
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    api_error e;
    e.http_status = 500;
    e.type = "internal_error";
    e.message = fmt::format("internal error: {}", what);
    reply_error(res, e);
  });

  svr.Post("/v1/completions",
           [this](const httplib::Request& req, httplib::Response& res) { handle_generate(req, res, api_kind::completion); });
  svr.Post("/v1/chat/completions",
           [this](const httplib::Request& req, httplib::Response& res) { handle_generate(req, res, api_kind::chat); });
  svr.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
    if (!authorize(req, res)) return;
    json data = json::array();
    data.push_back(model_card(ctx.model_names.front()));
    res.set_content(dump_json({{"object", "list"}, {"data", data}}), "application/json");
  });
  svr.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    if (!authorize(req, res)) return;
    const std::string name = req.matches[1];
    if (std::find(ctx.model_names.begin(), ctx.model_names.end(), name) == ctx.model_names.end()) {
      api_error e = bad_request("model", fmt::format("The model '{}' does not exist", name.substr(0, 200)), "model_not_found");
      e.http_status = 404;
      e.type = "not_found_error";
      reply_error(res, e);
      return;
    }
    res.set_content(dump_json(model_card(ctx.model_names.front())), "application/json");
  });
  svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (loop.stopped()) {
      res.status = 503;
      res.set_content(R"({"status":"stopping"})", "application/json");
      return;
    }
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    engine_snapshot snap = loop.snapshot();
    http_counts c;
    {
      std::lock_guard lock(counts_mu);
      c = counts;
    }
    std::string text = render_metrics(snap, c, ctx.model_names.front());
    if (kv) text += kv->render_metrics(snap, ctx.model_names.front());
    res.set_content(text, "text/plain; version=0.0.4; charset=utf-8");
  });
  if (kv) setup_kv_routes();
}

bool http_server::impl::presents_admin_key(const httplib::Request& req) const {
  const std::string header = req.get_header_value("Authorization");
  const std::optional<std::string_view> token = bearer_token(header);
  return token && kv->is_admin(*token);
}

void http_server::impl::setup_kv_routes() {
  svr.Post("/v1/kv/warm", [this](const httplib::Request& req, httplib::Response& res) {
    const bool admin = presents_admin_key(req);
    std::string tenant;
    if (!admin) {
      std::optional<std::string> t = authorize(req, res);
      if (!t) return;
      tenant = std::move(*t);
    }
    std::optional<json> body = parse_body(req, res);
    if (!body) return;
    const std::string id = fmt::format("warm-{:016x}{:08x}", id_salt, next_id.fetch_add(1));
    api_result<json> r = kv->warm(*body, ctx, tenant, admin, id);
    if (!r.ok()) return reply_error(res, r.error);
    res.set_content(dump_json(*r.value), "application/json");
  });
  svr.Get("/v1/kv/stats", [this](const httplib::Request& req, httplib::Response& res) {
    if (!presents_admin_key(req)) return reply_error(res, kv_admin::forbidden("GET /v1/kv/stats"));
    res.set_content(dump_json(kv->stats()), "application/json");
  });
  svr.Delete("/v1/kv", [this](const httplib::Request& req, httplib::Response& res) {
    if (!presents_admin_key(req)) return reply_error(res, kv_admin::forbidden("DELETE /v1/kv"));
    std::optional<std::string> tenant;
    if (req.has_param("tenant")) tenant = req.get_param_value("tenant");
    api_result<json> r = kv->erase_tenant(tenant);
    if (!r.ok()) return reply_error(res, r.error);
    res.set_content(dump_json(*r.value), "application/json");
  });
}

http_server::http_server(server_options opts, api_context ctx, key_store keys, engine_loop& loop, kv_admin* kv)
    : impl_(std::make_unique<impl>(std::move(opts), std::move(ctx), std::move(keys), loop, kv)) {
  PAGODA_ASSERT(impl_->ctx.vocab != nullptr && !impl_->ctx.model_names.empty(), "the server needs a vocabulary and a model name");
  impl_->setup();
}

http_server::~http_server() { stop(); }

result<int> http_server::bind() {
  int port = impl_->opts.port;
  if (port == 0) {
    port = impl_->svr.bind_to_any_port(impl_->opts.host);
    if (port < 0) return error(errc::io_error, "cannot bind to {} on any port", impl_->opts.host);
  } else if (!impl_->svr.bind_to_port(impl_->opts.host, port)) {
    return error(errc::io_error, "cannot bind to {}:{} (in use, or not an address of this machine)", impl_->opts.host, port);
  }
  // listen() again on a listening socket only changes its backlog (Linux).
  if (int fd = impl_->listen_fd.load(); fd >= 0 && ::listen(fd, k_listen_backlog) != 0)
    return error(errc::io_error, "cannot set the listen backlog of {}:{}: {}", impl_->opts.host, port, std::strerror(errno));
  impl_->bound = true;
  return port;
}

status http_server::serve() {
  PAGODA_ASSERT(impl_->bound, "serve() before bind()");
  if (!impl_->svr.listen_after_bind()) return error(errc::io_error, "the HTTP server stopped with an error");
  return {};
}

void http_server::stop() {
  if (impl_) impl_->svr.stop();
}

http_counts http_server::counts() const {
  std::lock_guard lock(impl_->counts_mu);
  return impl_->counts;
}

}  // namespace pagoda::server
