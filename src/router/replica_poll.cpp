// Polling the replicas' summaries (server/kv_summary.h): what they hold, their
// load, and whether they answer at all (the health check).
#include <fmt/format.h>

#include "router/router_internal.h"
#include "server/kv_summary.h"
#include "server/server_log.h"

namespace pagoda::router {

namespace asio = boost::asio;
using server::server_logger;

std::uint64_t steady_ms() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

void router_server::impl::set_problem(replica_state& r, std::string problem) {
  if (problem == r.problem) return;
  if (problem.empty())
    server_logger().info("replica {}: up, its prefix cache is known ({} blocks of {} tokens)", r.address.url,
                         r.blocks.n_snapshot(), r.block_size);
  else
    server_logger().error("replica {}: {}", r.address.url, problem);
  r.problem = std::move(problem);
}

void router_server::impl::poll(std::size_t i) {
  std::string target = "/v1/kv/summary";
  replica_address address;
  {
    std::lock_guard lock(mu);
    const replica_state& r = replicas[i];
    if (!r.generation.empty()) target += "?since=" + r.generation;
    address = r.address;
  }
  struct answer {
    int status = 0;
    std::string body;
  };
  auto got = std::make_shared<answer>();
  upstream_limits limits = opts.upstream;
  // A summary is small and quick; a replica that cannot answer one within a
  // few intervals is busy enough to be treated as down.
  limits.head_timeout = limits.read_timeout = std::max(opts.poll_interval * 4, std::chrono::milliseconds(2000));
  upstream_handlers h;
  h.on_head = [got](int status, server::http_fields) { got->status = status; };
  h.on_body = [got](std::string piece) { got->body += piece; };
  h.on_end = [this, i, got](const std::string& err, bool) { polled(i, got->status, got->body, err); };
  upstream_call::start(ioc.get_executor(), address, upstream_get(target, address, opts.admin_key), limits, std::move(h));
}

void router_server::impl::polled(std::size_t i, int http_status, const std::string& body, const std::string& err) {
  result<server::kv_summary> parsed = http_status == 200 && err.empty()
                                          ? server::parse_kv_summary(body)
                                          : result<server::kv_summary>(error(errc::invalid_argument, "no summary"));
  {
    std::lock_guard lock(mu);
    replica_state& r = replicas[i];
    const bool answered = err.empty() && http_status > 0 && http_status < 500;
    r.polled = true;
    r.up = answered;
    if (!answered) {
      // A replica that went away forgets its memory: nothing of it is trusted again.
      r.prefix_usable = false;
      r.generation.clear();
      r.blocks.clear();
      r.polled_load = 0;
      set_problem(r, err.empty() ? fmt::format("answers /v1/kv/summary with HTTP {}; routed nothing until it recovers",
                                               http_status)
                                 : fmt::format("not answering ({}); routed nothing, retried every {} ms", err,
                                               opts.poll_interval.count()));
    } else if (http_status != 200) {
      r.prefix_usable = false;
      set_problem(r, http_status == 403 || http_status == 401
                         ? fmt::format("GET /v1/kv/summary refused (HTTP {}): start the replicas with --admin-key and "
                                       "give the router the same key (--admin-key or $PAGODA_ADMIN_KEY); routed by "
                                       "load only",
                                       http_status)
                         : fmt::format("GET /v1/kv/summary answered HTTP {} (a pagoda without it?); routed by load only",
                                       http_status));
    } else if (!parsed.ok()) {
      r.prefix_usable = false;
      set_problem(r, fmt::format("its summary is unreadable ({}); routed by load only", parsed.error().message()));
    } else {
      const server::kv_summary& s = *parsed;
      r.polled_load = s.n_running + s.n_waiting;
      r.block_size = s.block_size_tokens;
      if (!s.unchanged) {
        // Keys routed there longer ago than a few polls are in this summary if the replica kept them.
        const std::uint64_t ttl_ms = std::max<std::uint64_t>(2000, 4 * static_cast<std::uint64_t>(opts.poll_interval.count()));
        const std::uint64_t now = steady_ms();
        r.blocks.replace(s.keys, now > ttl_ms ? now - ttl_ms : 0);
        r.generation = s.generation;
      }
      r.prefix_usable = s.model_fingerprint == opts.model_fingerprint;
      set_problem(r, r.prefix_usable ? std::string()
                                     : fmt::format("serves another model (fingerprint {}; the router's --model is {}): "
                                                   "its block keys cannot match, so it is routed by load only",
                                                   s.model_fingerprint, opts.model_fingerprint));
    }
  }
  polled_cv.notify_all();
  schedule_poll(i);
}

void router_server::impl::schedule_poll(std::size_t i) {
  asio::post(control, [this, i] {
    if (stopping) return;
    asio::steady_timer& t = *poll_timers[i];
    t.expires_after(opts.poll_interval);
    t.async_wait([this, i](const boost::system::error_code& ec) {
      if (!ec && !stopping) poll(i);
    });
  });
}

void router_server::impl::call_failed(std::size_t i, const std::string& err) {
  std::lock_guard lock(mu);
  replica_state& r = replicas[i];
  ++r.failures;
  r.up = false;
  r.prefix_usable = false;
  r.generation.clear();
  r.blocks.clear();
  set_problem(r, fmt::format("a request failed before its answer began ({}); taken out until a poll answers", err));
}

}  // namespace pagoda::router
