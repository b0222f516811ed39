// A remote crash, as any client could cause it: eight clients sending
// ordinary completions with a lossy KV policy (h2o, pyramid) and n = 4 to a
// `pagoda serve` whose pool is small enough to preempt (--kv-cache-size 8, 12 typed; 4 before
// the policies' statistics were paid for from the pool)
// used to bring it down within a round (a sequence admitted again after a
// refused first admission kept its policy's statistics: an assertion
// aborted the process); so did the same with a KV class (--kv-segment-dtype
// int4:0.5), typed parts, a mix of policies and clients hanging up early.
// Both run here for several rounds against the real binary: the server must
// stay up, and every request whose client stays must complete.
// ($PAGODA_TEST_BINARY=/path/to/an/older/pagoda runs them against another build.)
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <poll.h>

#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "cli/serve_process.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

constexpr int k_clients = 8;
constexpr int k_rounds = 4;
constexpr int k_n = 4;
constexpr int k_max_tokens = 200;  // 8 clients x 4 x ~260 tokens: well past the pool's ~3,300
constexpr const char* k_story =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. One day, she "
    "saw a big red ball in the park. ";

std::vector<std::string> serve_args(bool typed) {
  std::vector<std::string> a = {"-m", std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf", "-t", "1",
                                "--kv-cache-size", typed ? "12" : "8", "--no-kv-store"};
  // Class 0 (half the pool when typed) holds the policies' statistics too.
  if (typed) a.insert(a.end(), {"--kv-segment-dtype", "int4:0.5"});
  return a;
}

// Client c's request in round r. Prompts share their first blocks (a cached
// prefix, as in the crash); with `typed`, odd clients put their tail in an
// int4 part with a policy of its own, and the policies mix.
json request_of(int c, int r, bool typed) {
  const char* policies[] = {"h2o:budget=0.5", "pyramid:budget=0.5", "none"};
  const std::string policy = policies[(c + r) % (typed ? 3 : 2)];
  std::string tail;
  for (int i = 0; i <= c % 3; ++i) tail += "Then the dog ran after it and barked. ";
  json body = {{"n", k_n}, {"max_tokens", k_max_tokens}, {"ignore_eos", true}, {"temperature", 1.0},
               {"seed", 1000 * r + c}, {"kv_policy", policy}};
  if (typed && c % 2 == 1)
    body["prompt"] = json::array({{{"text", k_story}},
                                  {{"text", tail}, {"kv", {{"type", "int4"}, {"policy", policies[c % 2]}}}},
                                  {{"text", "The end."}}});
  else
    body["prompt"] = k_story + tail;
  return body;
}

// Sends a streamed request and hangs up once its first event arrived.
void hang_up_early(int port, json body) {
  body["stream"] = true;
  const std::string payload = body.dump();
  const std::string http = fmt::format(
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
      payload.size(), payload);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::send(fd, http.data(), http.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(http.size())) {
    std::string got;
    char buf[4096];
    // Bounded: a server that died closes the socket; one that runs sends its first event.
    while (got.find("data: ") == std::string::npos) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 60000) <= 0) break;
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      got.append(buf, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
}

// What a client that stays got: "" when it is a whole, valid answer.
std::string check_answer(const httplib::Result& res) {
  if (!res) return "no answer: " + httplib::to_string(res.error());
  if (res->status != 200) return fmt::format("HTTP {}: {}", res->status, res->body.substr(0, 300));
  const json j = json::parse(res->body, nullptr, false);
  if (!j.is_object() || !j["choices"].is_array() || j["choices"].size() != k_n) return "not n choices: " + res->body.substr(0, 300);
  for (const json& ch : j["choices"])
    if (ch["finish_reason"] != "length") return "finish_reason " + ch["finish_reason"].dump();
  if (j["usage"]["completion_tokens"] != k_n * k_max_tokens) return "usage " + j["usage"].dump();
  return "";
}

void run_rounds(bool typed) {
  serve_process s(serve_args(typed));
  ASSERT_GT(s.port(), 0);
  for (int r = 0; r < k_rounds; ++r) {
    std::vector<std::string> failures(k_clients);
    std::vector<std::thread> clients;
    for (int c = 0; c < k_clients; ++c)
      clients.emplace_back([&, c] {
        const json body = request_of(c, r, typed);
        if (typed && c % 4 == 3) return hang_up_early(s.port(), body);
        httplib::Client http("127.0.0.1", s.port());
        http.set_read_timeout(300, 0);
        failures[c] = check_answer(http.Post("/v1/completions", body.dump(), "application/json"));
      });
    for (std::thread& t : clients) t.join();
    ASSERT_FALSE(s.exited()) << "the server died in round " << r;
    for (int c = 0; c < k_clients; ++c) EXPECT_EQ(failures[c], "") << "round " << r << ", client " << c;
    httplib::Client http("127.0.0.1", s.port());
    const auto health = http.Get("/health");
    ASSERT_TRUE(health && health->status == 200) << "round " << r;
  }
  // The rounds did preempt (what the crash needed).
  httplib::Client http("127.0.0.1", s.port());
  const auto metrics = http.Get("/metrics");
  ASSERT_TRUE(metrics && metrics->status == 200);
  const std::size_t at = metrics->body.find("\npagoda:num_preemptions_total{");
  ASSERT_NE(at, std::string::npos);
  const std::size_t value = metrics->body.find("} ", at);
  EXPECT_GT(std::stod(metrics->body.substr(value + 2)), 0) << "no preemption: the pool was not short";
  s.stop(SIGTERM);
}

TEST(serve_stress, lossy_policies_with_n_under_preemption_keep_the_server_up) { run_rounds(false); }

TEST(serve_stress, kv_classes_typed_parts_and_hang_ups_keep_the_server_up) { run_rounds(true); }

}  // namespace
}  // namespace pagoda::test
