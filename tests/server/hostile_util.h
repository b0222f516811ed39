// Helpers of the hostile-client suite (hostile_test.cpp): a real `pagoda
// serve` process with the suite's keys and short deadlines, a /health
// watcher that times it all along, RSS readings, raw HTTP bytes in and parsed
// responses out.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/serve_process.h"

namespace pagoda::test {

using nlohmann::json;

inline constexpr const char* k_alice_key = "sk-alice";    // a tenants-file key (tenant alice)
inline constexpr const char* k_global_key = "sk-global";  // from --api-key-file

// Deadlines of the suite's server (short, so the slow-client cases take seconds).
inline constexpr int k_header_timeout_ms = 1000;
inline constexpr int k_body_timeout_ms = 1500;
inline constexpr int k_idle_timeout_ms = 2000;

// A scratch directory holding the suite's tenants and key files.
class key_files {
 public:
  key_files();
  ~key_files();
  std::string dir, tenants, key_file, empty_tenants;
};

// The server's flags: stories260K, hermetic (--no-kv-store), keys required,
// the short deadlines above; `extra` appended.
std::vector<std::string> hostile_server_args(const key_files& keys, std::vector<std::string> extra = {});

// GETs /health on a fresh connection every few milliseconds and keeps the
// slowest answer; a missing or wrong answer counts as a failure.
class health_watch {
 public:
  explicit health_watch(int port);
  ~health_watch();  // stops
  void stop();
  // Starts a new measuring window (the slowest answer so far is forgotten).
  void reset_max() { max_us_ = 0; max_at_us_ = 0; }
  double max_ms() const { return max_us_.load() / 1000.0; }
  double max_at_ms() const { return max_at_us_.load() / 1000.0; }  // when the slowest check started
  int n_checks() const { return n_.load(); }
  int n_failures() const { return n_failed_.load(); }

 private:
  int port_;
  std::atomic<bool> stop_{false};
  std::atomic<long> max_us_{0}, max_at_us_{0};
  std::atomic<int> n_{0}, n_failed_{0};
  std::thread thread_;
};

// VmRSS of a process, in bytes (-1 when unreadable).
long rss_bytes(pid_t pid);

// Samples a process's RSS every few milliseconds while alive; keeps the peak.
class rss_watch {
 public:
  explicit rss_watch(pid_t pid);
  ~rss_watch();
  long peak() { stop(); return peak_.load(); }

 private:
  void stop();
  pid_t pid_;
  std::atomic<bool> stop_{false};
  std::atomic<long> peak_{0};
  std::thread thread_;
};

struct http_answer {
  int status = 0;  // 0: none (closed or timed out first)
  std::string headers;
  std::string body;
  json json_body;  // discarded when the body is not JSON
  int n_informational = 0;  // 1xx answers before it
};
// Every response in `raw`, in order (Content-Length, chunked or to-close bodies).
std::vector<http_answer> parse_answers(const std::string& raw);
// The first final response in `raw` (status 0 when there is none).
http_answer first_answer(const std::string& raw);

// A request with Host, Connection: close, and an Authorization header with
// `key` when it is not empty.
std::string http_req(const std::string& method, const std::string& path, const std::string& body = "",
                     const std::string& key = k_alice_key, const std::string& extra_headers = "");

// Sends `bytes` (ignoring a close by the server partway), optionally
// half-closes, and reads until the server closes or timeout_ms.
http_answer ask(int port, const std::string& bytes, int timeout_ms = 10000, bool shutdown_write = false);

// A connection to 127.0.0.1:port from another loopback address (`from`, such
// as "127.0.0.2": all of 127/8 is loopback on Linux), so the server sees
// another client address. -1 on failure.
int raw_connect_from(int port, const char* from);

// Raises this process's open-file limit to its hard limit; returns it.
int raise_fd_limit();

// (Not cli_result: cli/cli_util.h's cli_result, another struct, is in the
// same test binary through scoring_test.cpp; one name for both breaks the ODR.)
struct cli_outcome {
  int exit_code = -1;  // -1: killed at the deadline
  std::string output;  // stderr and stdout
};
// Runs `pagoda ARGS...` to its end (killed after timeout_ms).
cli_outcome run_cli(const std::vector<std::string>& args, int timeout_ms);

// GET /metrics, parsed ("name{labels}" without model_name -> value).
json metrics_of(int port);
double metric_value(int port, const std::string& key);

}  // namespace pagoda::test
