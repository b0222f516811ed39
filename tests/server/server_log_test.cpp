// The access line and the engine line, and the access lines a real server
// writes.
#include "server/server_log.h"

#include <sstream>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include "server/server_util.h"

namespace pagoda::server {
namespace {

TEST(server_log, access_line_fields_and_escapes) {
  access_entry a;
  a.remote = "127.0.0.1:5000";
  a.method = "POST";
  a.target = "/v1/completions";
  a.status = 200;
  a.tenant = "alice";
  a.prompt_tokens = 41;
  a.cached_tokens = 32;
  a.completion_tokens = 16;
  a.ttft_ms = 12.34;
  a.duration_ms = 210.5;
  EXPECT_EQ(format_access(a), "127.0.0.1:5000 \"POST /v1/completions HTTP/1.1\" 200 tenant=alice prompt=41 cached=32 "
                              "completion=16 ttft=12.3ms 210.5ms");
  access_entry bad;
  bad.target = "/x\r\nInjected: yes\"";
  bad.status = 400;
  bad.version = 10;
  EXPECT_EQ(format_access(bad), "- \"- /x\\x0d\\x0aInjected: yes\\x22 HTTP/1.0\" 400 0.0ms");
  bad.error = "too_many_tokens";  // why it was refused
  EXPECT_EQ(format_access(bad), "- \"- /x\\x0d\\x0aInjected: yes\\x22 HTTP/1.0\" 400 error=too_many_tokens 0.0ms");
}

TEST(server_log, a_generations_line_names_its_kv_type_and_policy) {
  access_entry a;
  a.status = 200;
  a.prompt_tokens = 5;
  a.cached_tokens = 0;
  a.completion_tokens = 2;
  a.kv_type = "int8/token+int8/token";
  a.kv_policy = "h2o:budget=0.25";
  EXPECT_EQ(format_access(a), "- \"- - HTTP/1.1\" 200 prompt=5 cached=0 completion=2 kv=int8/token+int8/token "
                              "policy=h2o:budget=0.25 0.0ms");
}

// What a server writes: a generation's line names the KV type and the policy
// in force (the request's own, or the server's default), a refused request's
// its error code.
TEST(server_log, a_servers_access_lines_carry_kv_and_errors) {
  std::ostringstream captured;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(captured);
  server_logger().sinks().push_back(sink);
  struct unhook {
    std::shared_ptr<spdlog::sinks::sink> s;
    ~unhook() { std::erase(server_logger().sinks(), s); }
  } guard{sink};
  test::server_setup setup = test::default_setup();
  setup.http.access_log = true;
  {
    test::test_server s(setup);
    auto c = s.client();
    auto ok = c->Post("/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 2, "kv_policy": "window:budget=64"})",
                      "application/json");
    ASSERT_TRUE(ok && ok->status == 200) << (ok ? ok->body : "");
    auto plain = c->Post("/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 2})", "application/json");
    ASSERT_TRUE(plain && plain->status == 200);
    auto bad = c->Post("/v1/completions", R"({"prompt": "x", "max_tokens": -3})", "application/json");
    ASSERT_TRUE(bad && bad->status == 400);
  }
  server_logger().flush();
  const std::string log = captured.str();
  EXPECT_NE(log.find("completion=2 kv=f32+f32 policy=window:budget=64"), std::string::npos) << log;
  EXPECT_NE(log.find("completion=2 kv=f32+f32 policy=none"), std::string::npos) << log;
  EXPECT_NE(log.find("400 error="), std::string::npos) << log;
}

TEST(server_log, an_error_replys_code_for_the_access_line) {
  EXPECT_EQ(access_error_code(R"({"error":{"message":"too long","type":"invalid_request_error","param":"prompt","code":"too_many_tokens"}})"),
            "too_many_tokens");
  EXPECT_EQ(access_error_code(R"({"error":{"message":"m","type":"invalid_request_error","param":null,"code":null}})"),
            "invalid_request_error");
  EXPECT_EQ(access_error_code("not json"), "");
}

TEST(server_log, engine_line_rates_over_the_interval) {
  stats_reporter r;
  engine_snapshot s;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(r.next(s, t0), "");  // the first call only primes
  EXPECT_EQ(r.next(s, t0 + std::chrono::seconds(10)), "");  // idle: nothing to say
  s.n_prompt_tokens = 1000;
  s.n_generated_tokens = 200;
  s.n_running = 3;
  s.kv.n_blocks_total = 100;
  s.kv.n_blocks_used = 25;
  s.kv.n_prefix_query_tokens = 1000;
  s.kv.n_prefix_hit_tokens = 600;
  EXPECT_EQ(r.next(s, t0 + std::chrono::seconds(20)),
            "engine: prompt 100.0 tok/s, generation 20.0 tok/s, running 3, waiting 0, KV 25.0% used, prefix hits 60.0% "
            "(interval), 60.0% (all)");
}

}  // namespace
}  // namespace pagoda::server
