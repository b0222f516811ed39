// The server's logs, through spdlog on stderr (stdout keeps the one
// "listening on" line scripts wait for):
//
//   access, one line per request, as uvicorn and nginx print them, with what
//   vLLM's request logs add:
//     127.0.0.1:52734 "POST /v1/completions HTTP/1.1" 200 tenant=alice prompt=41 cached=32 completion=16 kv=int8/token+int8/token policy=h2o:budget=0.25 ttft=12.3ms 210.5ms
//   engine, every --log-stats-interval seconds while there is activity, as vLLM's:
//     engine: prompt 512.3 tok/s, generation 88.1 tok/s, running 4, waiting 0, KV 12.5% used, prefix hits 61.0%
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include <spdlog/logger.h>

#include "sched/engine_loop.h"

namespace pagoda::server {

// The "pagoda" logger (stderr), created on first use.
spdlog::logger& server_logger();

struct access_entry {
  std::string remote, method, target;
  int version = 11;
  int status = 0;
  std::string tenant;                               // "" = none or the global tenant
  int prompt_tokens = -1, cached_tokens = -1, completion_tokens = -1;  // -1: not a generation
  double ttft_ms = -1;                              // -1: no token
  std::string kv_type, kv_policy;                   // a generation's KV type and policy in force ("": not one)
  double duration_ms = 0;
  std::string error;  // an error reply's code ("too_many_tokens", "invalid_request_error"), or ""
};
std::string format_access(const access_entry& e);
// The code of an OpenAI-style error body ({"error": {..., "code": "x"}}), or
// its "type" when it has no code: the first such field, or "".
std::string access_error_code(std::string_view body);

// Turns consecutive snapshots into engine lines.
class stats_reporter {
 public:
  // The line for the interval since the previous call; "" when nothing ran or
  // waited in it (an idle server logs nothing).
  std::string next(const engine_snapshot& s, std::chrono::steady_clock::time_point now);

 private:
  bool primed_ = false;
  std::chrono::steady_clock::time_point last_time_;
  std::int64_t last_prompt_ = 0, last_generated_ = 0, last_queries_ = 0, last_hits_ = 0;
};

}  // namespace pagoda::server
