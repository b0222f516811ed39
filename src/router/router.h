// pagoda router: an OpenAI-compatible proxy in front of N `pagoda serve`
// replicas that sends each request to the replica holding the longest prefix
// of it in memory, balanced against load (docs/router.md).
//
// What the router knows of each replica comes from polling its
// GET /v1/kv/summary (server/kv_summary.h) every poll interval: the keys of
// the blocks in its prefix cache, its load (running + waiting), its model
// fingerprint and block size. A snapshot is self-healing (a replica that
// restarted or a poll that was lost is corrected by the next one) and needs
// nothing but the replicas; KV events through Redis would need every message
// to arrive and a resync protocol after a gap. The poll doubles as the health
// check: a replica that does not answer is down (routed nothing) until a
// poll succeeds again.
//
// Requests: POST /v1/completions and /v1/chat/completions are tokenized with
// the server's own parser and the model's tokenizer and chat template
// (request_keys.h), keyed like the replicas' prefix caches, and routed by
// choose_replica (route_choice.h). Bodies, the Authorization header and every
// other end-to-end field pass unchanged; a streamed answer (SSE) is passed on
// piece by piece as it arrives. A replica that fails or answers 503 before a
// byte went to the client gets the request retried on another one (each
// replica once); after that, a failure cuts the client's stream.
// GET /v1/models, POST /tokenize and /detokenize go to any replica up.
// The router's own: GET /health (200 while a replica is up), GET /metrics.
//
// Threads: a few I/O threads run the client connections (the server's
// http_connection), the replica calls (upstream.h) and the polls; a small
// worker pool tokenizes request bodies. One mutex guards the replicas' state.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "pagoda/status.h"
#include "router/request_keys.h"
#include "router/route_choice.h"
#include "router/upstream.h"
#include "server/http_limits.h"

namespace pagoda::router {

struct router_options {
  std::string host = "127.0.0.1";
  int port = 8090;                      // 0: any free port (bind() returns it)
  std::vector<replica_address> replicas;
  route_params route;
  std::chrono::milliseconds poll_interval{250};
  std::string admin_key;                // the replicas' --admin-key: /v1/kv/summary needs it
  std::string model_fingerprint;        // of the router's --model (16 hex digits)
  server::http_limits limits;
  upstream_limits upstream;
  int n_io_threads = 2;
  int n_workers = 2;
  bool access_log = true;
  std::string version;
};

class router_server {
 public:
  router_server(router_options opts, request_hasher hasher);
  ~router_server();
  router_server(const router_server&) = delete;
  router_server& operator=(const router_server&) = delete;

  // Binds and listens; returns the port.
  result<int> bind();
  // Starts the I/O threads and polls every replica once, waiting for each
  // answer (at most the connect timeout). A replica that does not answer is
  // logged by URL and retried every poll interval; errc::io_error when
  // none answers (the router then does not serve). REQUIRES: bind() succeeded.
  status start();
  // Serves until stop(). REQUIRES: start() succeeded.
  void wait();
  // Any thread.
  void stop();

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace pagoda::router
