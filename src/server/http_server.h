// The OpenAI-compatible HTTP server in front of an engine_loop: event-driven
// (Boost.Asio, Boost.Beast's parser; http_connection.h), with hard limits on
// what a client may send and how long it may take (http_limits.h).
//
// Endpoints:
//   POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events)
//   GET  /v1/models, GET /v1/models/{id}
//   POST /tokenize, POST /detokenize                  (vLLM's and llama.cpp's shapes; tokenize_api.h)
//   GET  /health                                      200 while the engine runs
//   GET  /metrics                                     Prometheus text (prometheus.h)
//   GET  /version                                     {"version": "..."}
//   POST /v1/kv/warm, GET /v1/kv/stats, DELETE /v1/kv  the KV store (kv_admin.h; warm and DELETE: kv_calls.h)
//   GET  /v1/kv/summary                               the prefix cache's keys and the load, for the router (kv_summary.h)
//   GET  /props, GET /slots                           llama.cpp's server properties and running sequences (llama_api.h)
//   OPTIONS *                                         CORS preflight, with --cors-origin: 204 and what may be sent
// With API keys configured every /v1 call and /tokenize, /detokenize need
// `Authorization: Bearer KEY` (401 otherwise), the key compared exactly as
// sent; the key decides the request's tenant (auth.h). /health, /metrics and
// /version stay open, as in vLLM.
//
// Threads: a few I/O threads run every connection (no thread per
// connection); a small worker pool parses, validates and tokenizes request
// bodies; nothing waits for the engine (generate_call.h, kv_calls.h); one
// store thread does what waits on the KV store's tiers. Handlers never
// throw: every failure is an OpenAI error object.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/ip/tcp.hpp>

#include "pagoda/status.h"
#include "sched/engine_loop.h"
#include "server/auth.h"
#include "server/http_limits.h"
#include "server/kv_admin.h"
#include "server/openai_request.h"
#include "server/prometheus.h"

namespace pagoda::server {

struct server_options {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port (bind() returns it)
  http_limits limits;
  int n_io_threads = 2;  // connections are served by these, however many there are
  int n_workers = 2;     // body parsing, validation, tokenization
  bool access_log = true;
  std::chrono::milliseconds stats_interval{10'000};  // the engine line's period; 0: none
  std::string version;                               // what GET /version reports
  // --cors-origin: origins whose browser pages may call the API ("*": any).
  // Empty: no CORS headers and no preflight answers (OPTIONS is a 405).
  std::vector<std::string> cors_origins;
};

// Opens, binds and listens (backlog 4096) on host:port; returns the port
// (the chosen one for port 0). Errors name the address (a port in use says so).
result<int> listen_on(boost::asio::ip::tcp::acceptor& acceptor, const std::string& host, int port);

// Raises this process's soft limit on open files to its hard limit (every
// connection is a descriptor); returns the limit now in force.
int raise_open_file_limit();

class http_server {
 public:
  // REQUIRES: `loop`, `ctx.vocab` and `kv` outlive the server, and the loop
  // is stopped before the server is destroyed (its channels notify the
  // server). Without kv the /v1/kv endpoints answer 404.
  http_server(server_options opts, api_context ctx, key_store keys, engine_loop& loop, kv_admin* kv = nullptr);
  ~http_server();

  http_server(const http_server&) = delete;
  http_server& operator=(const http_server&) = delete;

  // Binds and listens; returns the port (the chosen one for port 0). A port
  // in use is an error (errc::io_error naming the address): no SO_REUSEPORT,
  // so two servers never share a port.
  result<int> bind();
  // Serves until stop(). REQUIRES: bind() succeeded.
  status serve();
  // Stops serving; safe from any thread. Responses in progress get up to two
  // seconds to finish (the engine's own stop ends its requests first).
  void stop();

  // Requests answered so far, by endpoint and status.
  http_counts counts() const;
  // Connections open now.
  int n_connections() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace pagoda::server
