// GET /metrics of the router (Prometheus text, version 0.0.4):
//   pagoda_router:requests_total{replica, route="prefix|load|round_robin"}  counter
//   pagoda_router:replica_failures_total{replica}   calls that failed before the answer began (retried elsewhere)
//   pagoda_router:prefix_matched_blocks_total{replica}, pagoda_router:prefix_request_blocks_total{replica}
//                                                   the router's estimate of the prefix hit rate, in blocks
//   pagoda_router:replica_up{replica}               1 while its polls answer
//   pagoda_router:replica_prefix_usable{replica}    1 while its summary is of the router's model
//   pagoda_router:replica_load{replica}             running + waiting (the larger of its summary and the router's count)
//   pagoda_router:replica_cached_blocks{replica}    keys in its last summary
//   pagoda_router:unroutable_requests_total         answered 503: no replica up
#include <fmt/format.h>

#include "router/router_internal.h"
#include "server/prometheus.h"

namespace pagoda::router {

std::string router_server::impl::render_metrics() {
  std::string out;
  auto family = [&](const char* name, const char* type, const char* help) {
    fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  std::lock_guard lock(mu);
  auto per_replica = [&](const char* name, const char* type, const char* help, auto value) {
    family(name, type, help);
    for (const replica_state& r : replicas)
      fmt::format_to(std::back_inserter(out), "{}{{replica=\"{}\"}} {}\n", name, server::escape_label(r.address.url),
                     value(r));
  };
  family("pagoda_router:requests_total", "counter", "Requests routed, by replica and by what decided it.");
  for (const replica_state& r : replicas)
    for (route_reason why : {route_reason::prefix, route_reason::load, route_reason::round_robin})
      fmt::format_to(std::back_inserter(out), "pagoda_router:requests_total{{replica=\"{}\",route=\"{}\"}} {}\n",
                     server::escape_label(r.address.url), route_reason_name(why), r.routed[static_cast<int>(why)]);
  per_replica("pagoda_router:replica_failures_total", "counter",
              "Calls to the replica that failed before their answer began (retried on another replica).",
              [](const replica_state& r) { return r.failures; });
  per_replica("pagoda_router:prefix_matched_blocks_total", "counter",
              "Leading request blocks the replica was believed to hold when a request was routed there.",
              [](const replica_state& r) { return r.matched_blocks; });
  per_replica("pagoda_router:prefix_request_blocks_total", "counter", "Full blocks of the requests routed there.",
              [](const replica_state& r) { return r.request_blocks; });
  per_replica("pagoda_router:replica_up", "gauge", "1 while the replica answers its polls.",
              [](const replica_state& r) { return r.up ? 1 : 0; });
  per_replica("pagoda_router:replica_prefix_usable", "gauge", "1 while the replica's summary is of the router's model.",
              [](const replica_state& r) { return r.prefix_usable ? 1 : 0; });
  per_replica("pagoda_router:replica_load", "gauge", "Running plus waiting requests.",
              [](const replica_state& r) { return r.load(); });
  per_replica("pagoda_router:replica_cached_blocks", "gauge", "Blocks in the replica's last summary.",
              [](const replica_state& r) { return r.blocks.n_snapshot(); });
  family("pagoda_router:unroutable_requests_total", "counter", "Requests answered 503 because no replica was up.");
  fmt::format_to(std::back_inserter(out), "pagoda_router:unroutable_requests_total {}\n", n_unroutable);
  return out;
}

}  // namespace pagoda::router
