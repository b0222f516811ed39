// The OpenAI-compatible HTTP server (cpp-httplib) in front of an engine_loop.
//
// Endpoints:
//   POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events)
//   GET  /v1/models, GET /v1/models/{id}
//   GET  /health                                      200 while the engine runs
//   GET  /metrics                                     Prometheus text (prometheus.h)
//   POST /v1/kv/warm, GET /v1/kv/stats, DELETE /v1/kv  the KV store (kv_admin.h)
// With API keys configured every /v1 call needs `Authorization: Bearer KEY`
// (401 otherwise); the key decides the request's tenant (auth.h). /health and
// /metrics stay open, as in vLLM.
//
// Each HTTP request runs on one of the server's threads, which submits to the
// engine loop and waits on the request's channel. A client that hangs up is
// noticed within one poll interval (connection_probe.h) or at the next failed
// write, and its requests are cancelled, freeing their blocks at once.
// Handlers never throw: every failure is an OpenAI error object.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "pagoda/status.h"
#include "sched/engine_loop.h"
#include "server/auth.h"
#include "server/kv_admin.h"
#include "server/openai_request.h"
#include "server/prometheus.h"

namespace pagoda::server {

struct server_options {
  std::string host = "127.0.0.1";
  int port = 8080;                              // 0: any free port (bind() returns it)
  std::size_t max_body_bytes = 4u << 20;        // larger bodies get 413
  int n_http_threads = 64;                      // connections served at once (keep-alive ones hold a thread)
  std::chrono::milliseconds poll_interval{20};  // how often a waiting handler checks for a hung-up client
};

class http_server {
 public:
  // REQUIRES: `loop`, `ctx.vocab` and `kv` outlive the server. Without kv the
  // /v1/kv endpoints answer 404.
  http_server(server_options opts, api_context ctx, key_store keys, engine_loop& loop, kv_admin* kv = nullptr);
  ~http_server();

  http_server(const http_server&) = delete;
  http_server& operator=(const http_server&) = delete;

  // Binds the listening socket; returns the port (the chosen one for port 0).
  result<int> bind();
  // Serves until stop(). REQUIRES: bind() succeeded.
  status serve();
  // Stops serving; safe from any thread. In-flight handlers finish.
  void stop();

  // Requests answered so far, by endpoint and status.
  http_counts counts() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace pagoda::server
