// An in-process server on a free loopback port for the server tests, and the
// small HTTP helpers they share (httplib's client, a raw socket for hostile
// bytes, a /metrics parser).
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
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
#include "server/image_input.h"
#include "server/kv_admin.h"
#include "store/warehouse.h"

namespace pagoda::test {

using nlohmann::json;

// stories260K with tokenizer.chat_template set to `jinja` (a copy built in
// memory with the GGUF writer; the model keeps its bytes alive).
std::unique_ptr<llama_model> stories_with_chat_template(const std::string& jinja);

// Holds the engine thread at the start of its steps while closed: a test
// makes "the engine is in the middle of a step" a state it controls instead
// of a race. Wraps the engine's runner (server_setup::step_gate). A step is
// what the engine counts in n_steps: a plan with sequences or loads. Plans of
// block operations alone (the engine's flush after a request, at a time the
// test does not control) pass without a permit, so they neither take one
// nor show as held.
class step_gate {
 public:
  void close();
  void open();
  // While closed, lets the next n steps through.
  void let_through(int n_steps);
  // Steps waiting at the gate now (0 or 1: the engine has one thread).
  int n_held() const;
  void attach(engine_core& core);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  int n_permits_ = 0;
  int n_held_ = 0;
};

// Joins threads on every way out of a test (a failed ASSERT included), after
// opening the gate they may wait behind.
struct thread_joiner {
  step_gate* gate = nullptr;
  std::vector<std::thread> threads;
  ~thread_joiner() {
    if (gate) gate->open();
    for (std::thread& t : threads)
      if (t.joinable()) t.join();
  }
};

// Calls pred until it holds or timeout_ms passes (yielding in between, no
// sleep); returns its last answer. The timeout only bounds a failing test.
bool poll_until(const std::function<bool()>& pred, int timeout_ms = 20000);

struct server_setup {
  engine_core_config engine;        // from engine_config_for(); adjust before starting
  server::api_options api;     // model_path = stories_path()
  server::server_options http; // host 127.0.0.1, port 0
  server::key_store keys;
  int max_waiting = 64;
  // The KV store's endpoints (/v1/kv/*) over a warehouse of one memory tier;
  // without it they answer 404. admin_key: for stats and DELETE.
  bool kv_store = false;
  std::string admin_key;
  // Runs on the engine before its loop starts (a runner wrapper, hooks).
  std::function<void(engine_core&)> prepare_engine;
  // A step_gate in front of the runner (test_server::gate(); opened before
  // the server stops, so a failed test cannot leave the engine held).
  bool step_gate = false;
  // The vision tower (`serve --mmproj`), owned by the test; null: text only.
  server::image_input* images = nullptr;
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
  kv_warehouse* warehouse() { return warehouse_.get(); }
  step_gate& gate() { return *gate_; }
  // GET /metrics, parsed.
  std::map<std::string, double> metrics();

 private:
  std::shared_ptr<step_gate> gate_;
  std::unique_ptr<kv_warehouse> warehouse_;  // outlives the loop that writes to it
  std::unique_ptr<engine_loop> loop_;
  std::unique_ptr<server::kv_admin> kv_;
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
