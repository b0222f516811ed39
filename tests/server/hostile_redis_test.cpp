// The hostile suite's Redis cases against real `pagoda serve`, `pagoda batch`
// and `pagoda kv` processes and a redis-server started here with a password:
// a URL Pagoda cannot use, or a server that refuses its password, stops the
// process at startup with a message naming the problem (before, such a server
// started silently without Redis); the right password, given in a file, stores
// the blocks of a completion in Redis.
#include <chrono>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "server/hostile_util.h"
#include "server/server_util.h"
#include "store/block_store.h"
#include "store/redis_util.h"

namespace pagoda::test {
namespace {

std::vector<std::string> serve_with(const std::string& url) {
  return {"serve", "-m", stories_path(), "--no-kv-store", "--port", "0", "--kv-store-remote", url};
}

void expect_startup_error(const std::vector<std::string>& args, const std::string& names) {
  const cli_outcome r = run_cli(args, 30000);
  EXPECT_NE(r.exit_code, 0) << args.back() << ": " << r.output;
  EXPECT_NE(r.output.find(names), std::string::npos) << args.back() << ": " << r.output;
  EXPECT_EQ(r.output.find("listening on"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("s3cret"), std::string::npos) << "the password leaked: " << r.output;
}

TEST(hostile_redis, a_url_pagoda_cannot_use_stops_serve_batch_and_kv) {
  key_files keys;
  const std::string in = keys.dir + "/batch.jsonl";
  std::ofstream(in) << R"({"id": "a", "prompt": "Once", "max_tokens": 2})" << "\n";
  for (const auto& [url, names] : std::vector<std::pair<std::string, std::string>>{
           {"redis://:s3cret@127.0.0.1:1:6379", "extra ':'"},
           {"redis://[::1", "'[' without ']'"},
           {"redis://127.0.0.1:6379?timeout=5", "unknown parameter 'timeout'"},
           {"http://127.0.0.1:6379", "scheme 'http://'"},
       }) {
    expect_startup_error(serve_with(url), names);
    expect_startup_error({"batch", "-m", stories_path(), "-i", in, "--kv-store-remote", url}, names);
    expect_startup_error({"kv", "ls", "--store", url}, names);
  }
}

TEST(hostile_redis, a_password_the_server_refuses_stops_serve) {
  redis_server redis({"--requirepass", "s3cret"}, /*tls=*/false);
  const std::string at = "127.0.0.1:" + std::to_string(redis.port());
  expect_startup_error(serve_with("redis://" + at), "NOAUTH");
  expect_startup_error(serve_with("redis://:wrong@" + at), "WRONGPASS");
  expect_startup_error({"kv", "ls", "--store", "redis://:wrong@" + at}, "WRONGPASS");
}

TEST(hostile_redis, the_right_password_from_a_file_stores_blocks_in_redis) {
  redis_server redis({"--requirepass", "s3cret"}, /*tls=*/false);
  key_files keys;
  const std::string pw_file = keys.dir + "/redis.pw";
  std::ofstream(pw_file) << "s3cret\n";
  const std::string url = "redis://127.0.0.1:" + std::to_string(redis.port()) + "?password_file=" + pw_file;
  serve_process server(hostile_server_args(keys, {"--kv-store-remote", url}));
  ASSERT_TRUE(server.running());
  std::string prompt;
  for (int i = 0; i < 12; ++i) prompt += "Once upon a time there was a little girl. ";
  const http_answer a = ask(server.port(), http_req("POST", "/v1/completions",
                                                    json{{"prompt", prompt}, {"max_tokens", 2}}.dump()));
  ASSERT_EQ(a.status, 200) << a.body;
  auto store = make_redis_store(*parse_redis_url(url));
  ASSERT_TRUE(store.ok()) << store.error().message();
  int n = 0;
  for (int i = 0; i < 200 && n == 0; ++i) {  // written back in the background
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    n = 0;
    ASSERT_TRUE((*store)->for_each([&](const store_key&, std::span<const std::byte>) { return ++n, true; }).ok());
  }
  EXPECT_GT(n, 0) << "no block reached Redis";
  // A client without the password cannot read them.
  auto open = make_redis_store(*parse_redis_url("redis://127.0.0.1:" + std::to_string(redis.port())));
  ASSERT_FALSE(open.ok());
}

}  // namespace
}  // namespace pagoda::test
