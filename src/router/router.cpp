#include "router/router.h"

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/post.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/assert.h"
#include "router/router_internal.h"
#include "server/api_error.h"
#include "server/http_server.h"
#include "server/openai_response.h"
#include "server/server_log.h"

namespace pagoda::router {

namespace asio = boost::asio;
using server::server_logger;
using tcp = asio::ip::tcp;
using boost::system::error_code;
using nlohmann::json;
using server::http_exchange;

namespace {

constexpr const char* k_sse_heartbeat = ": keep-alive\n\n";

server::http_response router_error(int status, std::string message, const char* code) {
  server::api_error e;
  e.http_status = status;
  e.type = status == 404 ? "not_found_error" : "service_unavailable";
  e.code = code;
  e.message = std::move(message);
  return server::error_response(e);
}

// One client request on its way through a replica (or several, when one
// fails before a byte of its answer reached the client).
class proxy_call : public std::enable_shared_from_this<proxy_call> {
 public:
  proxy_call(router_server::impl& r, std::shared_ptr<http_exchange> ex, std::optional<server::api_kind> kind)
      : r_(r), ex_(std::move(ex)), kind_(kind), tried_(r.replicas.size(), false) {}

  // On the exchange's strand: tokenizes on a worker (when the request has a
  // prompt), then routes.
  void begin() {
    ex_->on_gone([self = shared_from_this()] {
      if (self->up_) self->up_->cancel();
    });
    if (!kind_) return next();
    asio::post(r_.workers, [self = shared_from_this()] {
      self->key_request();
      self->ex_->post([self] { self->next(); });
    });
  }

 private:
  // Worker: the request's keys at every block size a replica uses.
  void key_request() {
    const server::http_request& req = ex_->request();
    std::optional<prompt_info> p = r_.hasher.prompt_of(*kind_, req.body, req.field("Authorization"));
    if (!p) return;
    std::vector<int> sizes;
    {
      std::lock_guard lock(r_.mu);
      for (const replica_state& s : r_.replicas)
        if (s.prefix_usable && s.block_size > 0) sizes.push_back(s.block_size);
    }
    for (int bs : sizes)
      if (!keys_.contains(bs)) keys_[bs] = prompt_keys(*p, bs, p->prompt.size() / static_cast<std::size_t>(bs));
  }

  void next() {
    if (ex_->gone()) return;
    std::optional<route_decision> d;
    {
      std::lock_guard lock(r_.mu);
      std::vector<replica_view> views(r_.replicas.size());
      for (std::size_t i = 0; i < views.size(); ++i) {
        const replica_state& s = r_.replicas[i];
        views[i].up = s.up;
        views[i].excluded = tried_[i];
        views[i].load = s.load();
        const auto k = keys_.find(s.block_size);
        if (s.prefix_usable && k != keys_.end()) {
          views[i].blocks = &s.blocks;
          views[i].keys = k->second;
        }
      }
      d = choose_replica(views, r_.opts.route, r_.turn++);
      if (d) {
        replica_state& s = r_.replicas[d->replica];
        ++s.in_flight;
        ++s.routed[static_cast<int>(d->reason)];
        const auto k = keys_.find(s.block_size);
        if (k != keys_.end() && s.prefix_usable) {
          s.matched_blocks += d->matched_blocks;
          s.request_blocks += static_cast<std::int64_t>(k->second.size());
          s.blocks.add_pending(k->second, steady_ms());
        }
      } else if (n_attempts_ == 0) {
        ++r_.n_unroutable;
      }
    }
    if (!d) return give_up();
    ++n_attempts_;
    decision_ = *d;
    tried_[d->replica] = true;
    refused_ = false;
    status_ = 0;
    body_.clear();
    fields_.clear();
    content_type_.clear();
    const replica_address& to = r_.replicas[d->replica].address;  // fixed after start: read without the lock
    upstream_handlers h;
    auto self = shared_from_this();
    h.on_head = [self](int status, server::http_fields fields) {
      self->ex_->post([self, status, fields = std::move(fields)]() mutable { self->on_head(status, std::move(fields)); });
    };
    h.on_body = [self](std::string piece) {
      self->ex_->post([self, piece = std::move(piece)]() mutable { self->on_body(std::move(piece)); });
    };
    h.on_end = [self](const std::string& err, bool before_head) {
      self->ex_->post([self, err, before_head] { self->on_end(err, before_head); });
    };
    up_ = upstream_call::start(r_.ioc.get_executor(), to, upstream_request(ex_->request(), to), r_.opts.upstream,
                               std::move(h));
  }

  void on_head(int status, server::http_fields fields) {
    status_ = status;
    // 503: the replica is stopping or full; another may take it (the answer
    // is passed on only if every replica refuses).
    refused_ = status == 503;
    for (auto& [name, value] : fields) {
      if (server::iequals(name, "Content-Type")) content_type_ = value;
      else if (!hop_by_hop(name) && !server::iequals(name, "Server")) fields_.emplace_back(std::move(name), std::move(value));
    }
    if (refused_ || ex_->gone() || content_type_.rfind("text/event-stream", 0) != 0) return;
    streaming_ = true;
    ex_->begin_stream(status, content_type_, fields_, k_sse_heartbeat);
  }

  void on_body(std::string piece) {
    if (!streaming_) {
      body_ += piece;
      return;
    }
    if (ex_->gone()) return;
    if (ex_->pending_bytes() > r_.opts.limits.max_pending_send_bytes) {
      // A client that does not read: stop its generation, as the server does.
      if (up_) up_->cancel();
      return ex_->abort();
    }
    ex_->write(std::move(piece));
  }

  void on_end(const std::string& err, bool before_head) {
    {
      std::lock_guard lock(r_.mu);
      --r_.replicas[decision_.replica].in_flight;
    }
    up_.reset();
    if (ex_->gone()) return log_line("client left");
    if (streaming_) {
      if (!err.empty()) {
        // Bytes already reached the client: no retry can be seamless.
        server_logger().error("replica {}: stream cut ({}); the client's stream is cut too",
                              r_.replicas[decision_.replica].address.url, err);
        log_line(err);
        return ex_->abort();
      }
      log_line("");
      return ex_->end_stream();
    }
    if (!err.empty() || refused_) {
      // Nothing reached the client yet: another replica gets it.
      if (!err.empty()) r_.call_failed(decision_.replica, err);
      last_error_ = err.empty() ? fmt::format("HTTP {}", status_) : err;
      (void)before_head;
      return next();
    }
    log_line("");
    server::http_response resp;
    resp.status = status_;
    resp.content_type = content_type_;
    resp.body = std::move(body_);
    resp.fields = std::move(fields_);
    ex_->respond(std::move(resp));
  }

  // No replica is left to try.
  void give_up() {
    if (refused_ && status_ > 0) {
      // Every replica refused: the client gets the last refusal as it was.
      server::http_response resp;
      resp.status = status_;
      resp.content_type = content_type_;
      resp.body = std::move(body_);
      resp.fields = std::move(fields_);
      return ex_->respond(std::move(resp));
    }
    const std::size_t n = tried_.size();
    std::string msg = n_attempts_ == 0
                          ? fmt::format("No replica is up ({} configured); see the router's log", n)
                          : fmt::format("Every replica tried failed before answering (last: {})", last_error_);
    server::http_response resp = router_error(503, std::move(msg), "no_replica");
    resp.fields.emplace_back("Retry-After", "1");
    ex_->respond(std::move(resp));
  }

  void log_line(const std::string& err) {
    if (!r_.opts.access_log) return;
    const server::http_request& req = ex_->request();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - req.started).count();
    server_logger().info("{} {} {} -> {} by {} ({} blocks matched) {} {:.1f} ms{}{}", req.remote, req.method,
                         req.target.substr(0, 200), r_.replicas[decision_.replica].address.url,
                         route_reason_name(decision_.reason), decision_.matched_blocks, status_, ms,
                         err.empty() ? "" : " ", err);
  }

  router_server::impl& r_;
  std::shared_ptr<http_exchange> ex_;
  std::optional<server::api_kind> kind_;
  std::unordered_map<int, std::vector<block_key>> keys_;  // block size -> the request's keys
  std::vector<bool> tried_;
  int n_attempts_ = 0;
  route_decision decision_;
  std::shared_ptr<upstream_call> up_;
  bool streaming_ = false, refused_ = false;
  int status_ = 0;
  std::string content_type_, body_, last_error_;
  server::http_fields fields_;
};

}  // namespace

router_server::impl::impl(router_options o, request_hasher h)
    : opts(std::move(o)),
      hasher(std::move(h)),
      budget(opts.limits.max_body_memory_bytes),
      ioc(std::max(1, opts.n_io_threads)),
      workers(static_cast<std::size_t>(std::max(1, opts.n_workers))),
      control(ioc.get_executor()),
      acceptor(control) {
  for (const replica_address& a : opts.replicas) {
    replica_state s;
    s.address = a;
    replicas.push_back(std::move(s));
    poll_timers.push_back(std::make_unique<asio::steady_timer>(control));
  }
  hooks.dispatch = [this](const std::shared_ptr<http_exchange>& ex) { route(ex); };
  hooks.finished = [](const http_exchange&) {};
  hooks.rejected = [](const server::http_request*, int) {};
  hooks.closed = [this](server::http_connection* c) {
    std::lock_guard lock(conns_mu);
    conns.erase(c);
    --n_connections;
  };
}

void router_server::impl::do_accept() {
  acceptor.async_accept(asio::make_strand(ioc), asio::bind_executor(control, [this](const error_code& ec, tcp::socket s) {
    if (stopping || !acceptor.is_open()) return;
    if (!ec && n_connections.load() < opts.limits.max_connections) {
      ++n_connections;
      auto conn = std::make_shared<server::http_connection>(std::move(s), opts.limits, budget, hooks);
      {
        std::lock_guard lock(conns_mu);
        conns.emplace(conn.get(), conn);
      }
      conn->start();
    }
    do_accept();  // a failed accept (or one over the cap, closed here) does not stop the others
  }));
}

void router_server::impl::route(const std::shared_ptr<http_exchange>& ex) {
  const server::http_request& req = ex->request();
  const std::string_view path = req.path();
  const bool is_get = req.method == "GET" || req.method == "HEAD";
  if (path == "/health" && is_get) {
    int n_up = 0;
    {
      std::lock_guard lock(mu);
      for (const replica_state& r : replicas) n_up += r.up ? 1 : 0;
    }
    return ex->respond(server::json_response(n_up > 0 ? 200 : 503, {{"status", n_up > 0 ? "ok" : "no replica up"},
                                                                     {"replicas_up", n_up},
                                                                     {"replicas", replicas.size()}}));
  }
  if (path == "/metrics" && is_get) {
    server::http_response r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    r.body = render_metrics();
    return ex->respond(std::move(r));
  }
  if (path == "/version" && is_get) return ex->respond(server::json_response(200, {{"version", opts.version}}));
  if (path == "/v1/kv" || path.rfind("/v1/kv/", 0) == 0)
    return ex->respond(router_error(404,
                                    "The router does not proxy the KV store's endpoints: each replica has its own "
                                    "cache, call them directly",
                                    "not_proxied"));
  std::optional<server::api_kind> kind;
  if (req.method == "POST" && path == "/v1/completions") kind = server::api_kind::completion;
  if (req.method == "POST" && path == "/v1/chat/completions") kind = server::api_kind::chat;
  // Everything else (models, tokenize, wrong methods) is any replica's to answer.
  std::make_shared<proxy_call>(*this, ex, kind)->begin();
}

router_server::router_server(router_options opts, request_hasher hasher)
    : impl_(std::make_unique<impl>(std::move(opts), std::move(hasher))) {}

router_server::~router_server() {
  stop();
  wait();
  impl_->workers.join();
}

result<int> router_server::bind() { return server::listen_on(impl_->acceptor, impl_->opts.host, impl_->opts.port); }

status router_server::start() {
  impl& s = *impl_;
  PAGODA_ASSERT(s.threads.empty(), "start() twice");
  s.work.emplace(s.ioc.get_executor());
  for (int i = 0; i < std::max(1, s.opts.n_io_threads); ++i) s.threads.emplace_back([&s] { s.ioc.run(); });
  for (std::size_t i = 0; i < s.replicas.size(); ++i) s.poll(i);
  {
    // Each first poll ends within its connect timeout (or the head timeout of an accepted connection).
    std::unique_lock lock(s.mu);
    s.polled_cv.wait(lock, [&s] {
      for (const replica_state& r : s.replicas)
        if (!r.polled) return false;
      return true;
    });
    std::size_t n_up = 0;
    for (const replica_state& r : s.replicas) n_up += r.up ? 1 : 0;
    if (n_up == 0) {
      lock.unlock();
      stop();
      wait();
      std::string urls;
      for (const replica_state& r : s.replicas) urls += (urls.empty() ? "" : ", ") + r.address.url;
      return error(errc::io_error, "no replica answers ({}); start them first (see the errors above)", urls);
    }
  }
  asio::post(s.control, [&s] { s.do_accept(); });
  return ok_status();
}

void router_server::wait() {
  for (std::thread& t : impl_->threads)
    if (t.joinable()) t.join();
  impl_->threads.clear();
}

void router_server::stop() {
  impl& s = *impl_;
  if (s.stopping.exchange(true)) return;
  asio::post(s.control, [&s] {
    error_code ec;
    s.acceptor.close(ec);
    for (auto& t : s.poll_timers) t->cancel();
    std::vector<std::shared_ptr<server::http_connection>> live;
    {
      std::lock_guard lock(s.conns_mu);
      for (auto& [p, w] : s.conns)
        if (auto c = w.lock()) live.push_back(std::move(c));
    }
    for (auto& c : live) c->stop();
    s.work.reset();
    if (live.empty()) return s.ioc.stop();
    // Streams in progress get a moment; then everything ends.
    auto grace = std::make_shared<asio::steady_timer>(s.control, std::chrono::seconds(2));
    grace->async_wait([&s, grace](const error_code&) { s.ioc.stop(); });
  });
}

}  // namespace pagoda::router
