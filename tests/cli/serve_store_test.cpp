// The KV warehouse across real `pagoda serve` processes: two replicas share a
// redis-server started by the test; a restart keeps the disk tier's prefixes;
// a kill -9 during heavy write-back leaves a store that verifies clean and
// serves correct tokens; Redis dying mid-run does not fail requests.
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "cli/serve_process.h"
#include "cli/store_client.h"
#include "store/block_store.h"
#include "store/redis_util.h"

namespace pagoda::test {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

TEST(serve_store, two_servers_share_a_redis_tier) {
  redis_server redis;
  auto args = store_test_args();
  args.insert(args.end(), {"--no-kv-store", "--kv-store-remote", redis.url()});
  serve_process a(args), b(args);

  // The reference: a cold run with no store at all.
  auto cold_args = store_test_args();
  cold_args.push_back("--no-kv-store");
  serve_process cold(cold_args);
  const json ref = complete(cold.port(), story_prompt(1));
  ASSERT_EQ(ref["http_status"], 200) << ref;
  const int prompt_tokens = ref["usage"]["prompt_tokens"];
  const int full_blocks = (prompt_tokens - 1) / k_store_test_block;
  ASSERT_GE(full_blocks, 3);

  const json on_a = complete(a.port(), story_prompt(1));
  ASSERT_EQ(on_a["http_status"], 200) << on_a;
  EXPECT_EQ(cached(on_a), 0);
  EXPECT_EQ(text(on_a), text(ref));

  auto rs = make_redis_store(*parse_redis_url(redis.url()));
  ASSERT_TRUE(rs.ok());
  ASSERT_TRUE(wait_entries(**rs, full_blocks)) << count_entries(**rs);

  // B never saw the prompt: its prefix comes from Redis, and so do its tokens' KV.
  const json on_b = complete(b.port(), story_prompt(1));
  ASSERT_EQ(on_b["http_status"], 200) << on_b;
  EXPECT_EQ(cached(on_b), full_blocks * k_store_test_block) << on_b;
  EXPECT_EQ(cached_from(on_b, "redis"), full_blocks * k_store_test_block) << on_b;
  EXPECT_EQ(text(on_b), text(ref));

  // Redis dies: both replicas keep answering (from memory, or by computing).
  redis.stop(/*kill=*/true);
  const json after = complete(b.port(), story_prompt(3));
  EXPECT_EQ(after["http_status"], 200) << after;
  const json again = complete(a.port(), story_prompt(1));
  EXPECT_EQ(again["http_status"], 200) << again;
  EXPECT_EQ(text(again), text(ref));
}

TEST(serve_store, a_restart_keeps_the_disk_tier) {
  temp_dir dir("restart");
  auto args = store_test_args();
  args.insert(args.end(), {"--kv-store", (dir.path / "kv").string()});
  json first;
  {
    serve_process s(args);
    first = complete(s.port(), story_prompt(2));
    ASSERT_EQ(first["http_status"], 200) << first;
    EXPECT_EQ(cached(first), 0);
    s.stop(SIGTERM);  // graceful: the write-back queue drains
  }
  serve_process s(args);
  const json second = complete(s.port(), story_prompt(2));
  ASSERT_EQ(second["http_status"], 200) << second;
  const int full_blocks = (second["usage"]["prompt_tokens"].get<int>() - 1) / k_store_test_block;
  EXPECT_EQ(cached(second), full_blocks * k_store_test_block) << second;
  EXPECT_EQ(cached_from(second, "disk"), full_blocks * k_store_test_block) << second;
  EXPECT_EQ(text(second), text(first));
}

TEST(serve_store, kill_9_during_write_back_leaves_a_clean_store) {
  temp_dir dir("kill9");
  const std::string store = (dir.path / "kv").string();
  auto args = store_test_args();
  args.insert(args.end(), {"--kv-store", store});
  std::vector<std::string> refs;
  {
    serve_process s(args);
    // Many distinct prompts from several clients: a steady stream of blocks to write.
    std::vector<std::thread> clients;
    std::atomic<bool> stop{false};
    for (int c = 0; c < 4; ++c)
      clients.emplace_back([&, c] {
        for (int i = 0; !stop; ++i) (void)complete(s.port(), std::to_string(c * 1000 + i) + " " + story_prompt(i % 5), 4);
      });
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    s.stop(SIGKILL);
    stop = true;
    for (auto& t : clients) t.join();
  }
  auto verify = run_cli("kv verify --store " + store);
  EXPECT_EQ(verify.exit_code, 0) << verify.out << verify.err;

  // After the crash the server starts on the same store and serves correct tokens.
  auto cold_args = store_test_args();
  cold_args.push_back("--no-kv-store");
  serve_process cold(cold_args);
  serve_process s(args);
  for (int v = 0; v < 5; ++v) {
    const std::string p = std::to_string(v) + " " + story_prompt(v);
    const json ref = complete(cold.port(), p, 8);
    const json got = complete(s.port(), p, 8);
    ASSERT_EQ(got["http_status"], 200) << got;
    EXPECT_EQ(text(got), text(ref)) << v;
  }
}

}  // namespace
}  // namespace pagoda::test
