// An in-process server on a free loopback port for the server tests, and the
// small HTTP helpers they share (httplib's client, a raw socket for hostile
// bytes, a /metrics parser).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "common/stories.h"
#include "model/llama.h"
#include "sched/engine_loop.h"
#include "server/api_setup.h"
#include "server/http_server.h"

namespace pagoda::test {

using nlohmann::json;

// stories260K with tokenizer.chat_template set to `jinja` (a copy built in
// memory with the GGUF writer; the model keeps its bytes alive).
std::unique_ptr<llama_model> stories_with_chat_template(const std::string& jinja);

struct server_setup {
  engine_core_config engine;        // from engine_config_for(); adjust before starting
  server::api_options api;     // model_path = stories_path()
  server::server_options http; // host 127.0.0.1, port 0
  server::key_store keys;
  int max_waiting = 64;
};

// f32 KV (batch-invariant greedy results), 1 thread, context 512.
engine_core_config engine_config_for(const llama_model& model, std::int64_t n_blocks = 1024, int max_seqs = 64);
server_setup default_setup();
// The request parser's context for stories260K at a 512-token context.
server::api_context stories_api_context();

class test_server {
 public:
  explicit test_server(server_setup setup, const llama_model& model = stories());
  ~test_server();

  int port() const { return port_; }
  std::unique_ptr<httplib::Client> client(int timeout_s = 60) const;
  engine_snapshot snapshot() { return loop_->snapshot(); }
  engine_loop& loop() { return *loop_; }
  // GET /metrics, parsed.
  std::map<std::string, double> metrics();

 private:
  std::unique_ptr<engine_loop> loop_;
  std::unique_ptr<server::http_server> http_;
  std::thread thread_;
  int port_ = -1;
};

// "name{labels}" -> value; labels as written, without model_name:
// pagoda:kv_cache_blocks{state="used"}.
std::map<std::string, double> parse_metrics(const std::string& text);
// The value of a series, or NaN when absent.
double metric(const std::map<std::string, double>& m, const std::string& key);

struct http_reply {
  int status = 0;  // 0: no answer (connection failed or closed first)
  std::string body;
  json json_body;  // discarded when the body is not JSON
};
http_reply post_json(httplib::Client& c, const std::string& path, const std::string& body,
                     const httplib::Headers& headers = {});

// A raw TCP exchange: sends `bytes` (optionally closing the write side), then
// reads until the server closes or `timeout_ms` passes. Returns what came back.
std::string raw_exchange(int port, const std::string& bytes, int timeout_ms, bool shutdown_write = false);
// Connects and returns the socket, or -1.
int raw_connect(int port);
// Reads until timeout_ms passes (appends to out); false on EOF/error.
bool raw_read(int fd, std::string& out, int timeout_ms);
// Waits up to timeout_ms for bytes and appends one read's worth; false on EOF/error/timeout.
bool raw_read_some(int fd, std::string& out, int timeout_ms);

// The payloads of a server-sent event stream ("data: X\n\n" -> X), in order.
std::vector<std::string> sse_data(const std::string& body);

// Polls until the pool holds no used block and no request runs (or timeout).
bool wait_idle(test_server& s, int timeout_ms = 5000);

}  // namespace pagoda::test
