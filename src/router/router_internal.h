// The router's state, shared by its parts: router.cpp (accepting, routes,
// proxying), replica_poll.cpp (summaries and health), router_metrics.cpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>

#include "router/router.h"
#include "server/http_connection.h"

namespace pagoda::router {

// What the router knows of one replica. Guarded by router_server::impl::mu.
struct replica_state {
  replica_address address;
  bool up = false;
  bool polled = false;           // a poll has ended (the startup check waits for one each)
  bool prefix_usable = false;    // a summary of the router's model arrived: route to it by prefix
  std::string problem = "not polled yet";  // the last problem logged (each is logged when it changes)
  std::string generation;        // of the last summary
  int block_size = 0;
  int polled_load = 0;           // running + waiting at the last summary
  int in_flight = 0;             // requests the router has open there now
  replica_blocks blocks;
  std::int64_t routed[3] = {0, 0, 0};  // by route_reason
  std::int64_t failures = 0;     // calls that failed before any byte reached the client
  std::int64_t matched_blocks = 0, request_blocks = 0;  // of requests routed there

  int load() const { return std::max(polled_load, in_flight); }
};

struct router_server::impl {
  router_options opts;
  request_hasher hasher;
  std::mutex mu;
  std::condition_variable polled_cv;
  std::vector<replica_state> replicas;  // guarded by mu
  std::uint64_t turn = 0;               // guarded by mu
  std::int64_t n_unroutable = 0;        // guarded by mu: no replica up
  std::atomic<bool> stopping{false};
  std::atomic<int> n_connections{0};

  server::body_budget budget;
  server::connection_hooks hooks;
  std::mutex conns_mu;
  std::unordered_map<server::http_connection*, std::weak_ptr<server::http_connection>> conns;

  boost::asio::io_context ioc;
  boost::asio::thread_pool workers;
  boost::asio::strand<boost::asio::io_context::executor_type> control;
  boost::asio::ip::tcp::acceptor acceptor;
  std::vector<std::unique_ptr<boost::asio::steady_timer>> poll_timers;  // [replica], on control
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work;
  std::vector<std::thread> threads;

  impl(router_options o, request_hasher h);

  // replica_poll.cpp
  void poll(std::size_t i);
  void polled(std::size_t i, int http_status, const std::string& body, const std::string& err);
  void schedule_poll(std::size_t i);
  void set_problem(replica_state& r, std::string problem);  // REQUIRES: mu held
  // A call to replica i failed before any byte reached the client: it is down until a poll answers.
  void call_failed(std::size_t i, const std::string& err);

  // router.cpp
  void do_accept();
  void route(const std::shared_ptr<server::http_exchange>& ex);

  // router_metrics.cpp
  std::string render_metrics();
};

std::uint64_t steady_ms();

}  // namespace pagoda::router
