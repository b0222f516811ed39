// The KV store's endpoints and faults through real `pagoda serve` processes:
// /v1/kv/warm, /v1/kv/stats and DELETE /v1/kv with tenants kept apart in every
// tier (memory, disk, Redis; across a restart and across replicas), corrupted
// entries on disk and in Redis (never served: recomputed and counted), Redis
// going down and coming back, and a disk that fills up.
#include <fstream>
#include <sstream>
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

constexpr const char* k_admin = "sk-admin-test";
constexpr const char* k_alice = "sk-alice-test";
constexpr const char* k_bob = "sk-bob-test";

std::string write_tenants(const temp_dir& dir) {
  std::filesystem::create_directories(dir.path);
  const std::string path = (dir.path / "tenants.json").string();
  std::ofstream(path) << json{{"tenants",
                               {{{"name", "alice"}, {"api_keys", {k_alice}}}, {{"name", "bob"}, {"api_keys", {k_bob}}}}}}
                             .dump();
  return path;
}

json warm(int port, const std::string& prompt, const std::string& key, const json& extra = json::object()) {
  json body = {{"prompt", prompt}};
  body.update(extra);
  return call(port, "POST", "/v1/kv/warm", body, key);
}

std::unique_ptr<block_store> open_disk(const std::string& path) {
  auto s = make_disk_store({.path = path});
  EXPECT_TRUE(s.ok()) << s.error().message();
  return s.ok() ? std::move(*s) : nullptr;
}

std::unique_ptr<block_store> open_redis(const redis_server& r) {
  auto s = make_redis_store(*parse_redis_url(r.url()));
  EXPECT_TRUE(s.ok()) << s.error().message();
  return s.ok() ? std::move(*s) : nullptr;
}

// Flips one byte in the middle of every stored value of the tier.
int corrupt_every_entry(block_store& s) {
  std::vector<std::pair<store_key, std::vector<std::byte>>> all;
  EXPECT_TRUE(s.for_each([&](const store_key& k, std::span<const std::byte> v) {
                 all.emplace_back(k, std::vector<std::byte>(v.begin(), v.end()));
                 return true;
               }).ok());
  for (auto& [k, v] : all) {
    v[v.size() / 2] ^= std::byte{0x40};
    EXPECT_TRUE(s.erase(k).ok());
    EXPECT_TRUE(s.put(k, v).ok());
  }
  return static_cast<int>(all.size());
}

json tier_of(const json& stats, const std::string& name) {
  for (const json& t : stats["tiers"])
    if (t["tier"] == name) return t;
  return json();
}

// A sample of GET /metrics ("NAME{...LABEL...} VALUE"), -1 when absent.
double metric_sample(int port, const std::string& name, const std::string& label) {
  const json m = call(port, "GET", "/metrics");
  std::istringstream lines(m.value("body", std::string()));
  for (std::string line; std::getline(lines, line);)
    if (line.rfind(name + "{", 0) == 0 && line.find(label) != std::string::npos)
      return std::stod(line.substr(line.rfind(' ') + 1));
  return -1;
}

TEST(serve_kv_admin, warm_stats_and_delete_keep_tenants_apart_in_every_tier) {
  temp_dir dir("kvadmin");
  redis_server redis;
  const std::string disk = (dir.path / "kv").string();
  auto args = store_test_args();
  args.insert(args.end(), {"--kv-store", disk, "--kv-store-remote", redis.url(), "--tenants", write_tenants(dir),
                           "--admin-key", k_admin});
  const std::string prompt = story_prompt(2);
  // Prompts only alice ever sends, for the checks after the restart: one
  // through the disk tier, one through Redis on a replica.
  const std::string only_alice = "Lily and Tom went to the lake. " + story_prompt(4);
  const std::string only_alice_2 = "Tom had a red kite. " + story_prompt(4);
  int blocks = 0;
  std::string alice_text;
  {
    serve_process s(args);
    // Admin endpoints need the admin key: no key, a tenant's key, a wrong one.
    EXPECT_EQ(call(s.port(), "GET", "/v1/kv/stats")["http_status"], 403);
    EXPECT_EQ(call(s.port(), "GET", "/v1/kv/stats", {}, k_alice)["http_status"], 403);
    EXPECT_EQ(call(s.port(), "DELETE", "/v1/kv?tenant=bob", {}, k_alice)["http_status"], 403);
    EXPECT_EQ(warm(s.port(), prompt, "")["http_status"], 401);  // tenants need keys
    EXPECT_EQ(warm(s.port(), prompt, k_alice, {{"tenant", "bob"}})["http_status"], 403);

    const json w = warm(s.port(), prompt, k_alice);
    ASSERT_EQ(w["http_status"], 200) << w;
    EXPECT_EQ(w["tenant"], "alice");
    blocks = w["blocks"];
    ASSERT_GE(blocks, 3);
    EXPECT_EQ(w["prompt_tokens"].get<int>() / k_store_test_block, blocks);
    EXPECT_EQ(w["stored_blocks"], blocks) << "warm answers once the blocks are stored";

    const json a = complete(s.port(), prompt, 8, k_alice);
    ASSERT_EQ(a["http_status"], 200) << a;
    EXPECT_GE(cached(a), (blocks - 1) * k_store_test_block);
    alice_text = text(a);
    const json b = complete(s.port(), prompt, 8, k_bob);
    ASSERT_EQ(b["http_status"], 200) << b;
    EXPECT_EQ(cached(b), 0) << "bob must not see alice's KV: " << b;
    EXPECT_EQ(text(b), alice_text);

    // A second prompt only alice ever sees, for the checks after the restart.
    const json w2 = warm(s.port(), only_alice, k_alice);
    ASSERT_EQ(w2["http_status"], 200) << w2;
    EXPECT_EQ(w2["stored_blocks"], w2["blocks"]);
    const json w3 = warm(s.port(), only_alice_2, k_alice);
    ASSERT_EQ(w3["http_status"], 200) << w3;

    const json st = call(s.port(), "GET", "/v1/kv/stats", {}, k_admin);
    ASSERT_EQ(st["http_status"], 200) << st;
    EXPECT_EQ(tier_of(st, "disk")["entries"].get<int>(), tier_of(st, "disk")["writes"].get<int>());
    EXPECT_GE(tier_of(st, "memory")["hits"].get<int>(), blocks - 1);
    EXPECT_EQ(st["write_back"]["dropped"], 0);
    s.stop(SIGTERM);
  }
  {
    auto d = open_disk(disk);
    auto r = open_redis(redis);
    const std::string alice = "alice";
    EXPECT_GE(count_entries(*d, &alice), blocks);
    EXPECT_GE(count_entries(*r, &alice), blocks);
  }
  // After a restart, and on a second replica that shares only Redis: alice
  // hits, bob misses.
  serve_process s(args);
  auto replica_args = store_test_args();
  replica_args.insert(replica_args.end(), {"--no-kv-store", "--kv-store-remote", redis.url(), "--tenants",
                                           write_tenants(dir), "--admin-key", k_admin});
  serve_process replica(replica_args);
  const json bob_after = complete(s.port(), only_alice, 8, k_bob);
  EXPECT_EQ(cached(bob_after), 0) << "alice's blocks on disk are not bob's: " << bob_after;
  const json bob_replica = complete(replica.port(), only_alice_2, 8, k_bob);
  EXPECT_EQ(cached(bob_replica), 0) << "alice's blocks in Redis are not bob's: " << bob_replica;
  const json alice_after = complete(s.port(), prompt, 8, k_alice);
  // Every full block but one ending at the last prompt token (always computed).
  const int reusable = (alice_after["usage"]["prompt_tokens"].get<int>() - 1) / k_store_test_block;
  EXPECT_EQ(cached_from(alice_after, "disk"), reusable * k_store_test_block) << alice_after;
  EXPECT_EQ(text(alice_after), alice_text);
  const json alice_replica = complete(replica.port(), only_alice_2, 8, k_alice);
  EXPECT_GT(cached_from(alice_replica, "redis"), 0) << alice_replica;
  EXPECT_EQ(text(alice_replica), text(bob_replica));

  // DELETE alice: nothing of hers is left in memory, on disk or in Redis;
  // bob's blocks stay.
  const json del = call(s.port(), "DELETE", "/v1/kv?tenant=alice", {}, k_admin);
  ASSERT_EQ(del["http_status"], 200) << del;
  const json del_replica = call(replica.port(), "DELETE", "/v1/kv?tenant=alice", {}, k_admin);
  ASSERT_EQ(del_replica["http_status"], 200) << del_replica;
  // The erase rewrote the disk tier's file (so none of her bytes remain in it).
  EXPECT_EQ(metric_sample(s.port(), "pagoda:kv_store_compactions_total", "tier=\"disk\""), 1);
  {
    auto r = open_redis(redis);
    const std::string alice = "alice", bob = "bob";
    EXPECT_EQ(count_entries(*r, &alice), 0);
    EXPECT_GT(count_entries(*r, &bob), 0);
  }
  const json alice_gone = complete(s.port(), prompt, 8, k_alice);
  EXPECT_EQ(cached(alice_gone), 0) << alice_gone;
  EXPECT_EQ(text(alice_gone), alice_text);
  s.stop(SIGTERM);
  auto ls = run_cli("kv ls --tenant alice --store " + disk);
  EXPECT_EQ(ls.exit_code, 0) << ls.err;
  // Only the blocks of alice_gone, a request after the DELETE.
  auto d = open_disk(disk);
  const std::string alice = "alice";
  EXPECT_EQ(count_entries(*d, &alice), blocks) << ls.out;
}

// An empty or malformed tenant in DELETE /v1/kv (or in a warm's "tenant") is
// a 400 that erases nothing: before, `?tenant=` (a client's empty variable)
// erased the global tenant's whole cache. Only '-' names the global tenant.
TEST(serve_kv_admin, an_empty_or_malformed_tenant_is_a_400_and_erases_nothing) {
  temp_dir dir("kvdelbad");
  const std::string disk = (dir.path / "kv").string();
  auto args = store_test_args();
  args.insert(args.end(), {"--kv-store", disk, "--admin-key", k_admin});
  serve_process s(args);
  const json w = warm(s.port(), story_prompt(2), k_admin);
  ASSERT_EQ(w["http_status"], 200) << w;
  const int blocks = w["stored_blocks"];
  ASSERT_GE(blocks, 2);
  for (const char* bad : {"/v1/kv?tenant=", "/v1/kv?tenant=%20", "/v1/kv?tenant=a%2Fb", "/v1/kv?tenant=..%2F..",
                          "/v1/kv?tenant=%00", "/v1/kv?tenant=al!ce"}) {
    const json del = call(s.port(), "DELETE", bad, {}, k_admin);
    EXPECT_EQ(del["http_status"], 400) << bad << ": " << del;
  }
  const std::string long_name(65, 'a');
  EXPECT_EQ(call(s.port(), "DELETE", "/v1/kv?tenant=" + long_name, {}, k_admin)["http_status"], 400);
  EXPECT_EQ(warm(s.port(), "Once", k_admin, {{"tenant", ""}})["http_status"], 400);
  const json st = call(s.port(), "GET", "/v1/kv/stats", {}, k_admin);
  ASSERT_EQ(st["http_status"], 200) << st;
  EXPECT_EQ(tier_of(st, "disk")["entries"].get<int>(), blocks) << "nothing was erased: " << st;
  // '-' is the global tenant, and erases it.
  const json del = call(s.port(), "DELETE", "/v1/kv?tenant=-", {}, k_admin);
  ASSERT_EQ(del["http_status"], 200) << del;
  EXPECT_EQ(tier_of(call(s.port(), "GET", "/v1/kv/stats", {}, k_admin), "disk")["entries"].get<int>(), 0);
}

// A store file truncated behind the server's back: `kv verify` reports the
// damage (exit 1), the server still starts (the file moved aside, the tier
// empty), serves, and counts it in /metrics and /v1/kv/stats.
TEST(serve_kv_admin, a_truncated_store_starts_the_server_quarantined_and_counted) {
  temp_dir dir("kvtrunc");
  const std::string disk = (dir.path / "kv").string();
  auto args = store_test_args();
  args.insert(args.end(), {"--kv-store", disk, "--admin-key", k_admin});
  const std::string prompt = story_prompt(3);
  std::string ref;
  {
    serve_process s(args);
    ASSERT_EQ(warm(s.port(), prompt, k_admin)["http_status"], 200);
    ref = text(complete(s.port(), prompt, 8));
    EXPECT_EQ(metric_sample(s.port(), "pagoda:kv_store_quarantined_total", "tier=\"disk\""), 0);
    s.stop(SIGTERM);
  }
  EXPECT_EQ(run_cli("kv verify --store " + disk).exit_code, 0);
  const std::filesystem::path data = std::filesystem::path(disk) / "data.mdb";
  std::filesystem::resize_file(data, std::filesystem::file_size(data) / 2);
  const cli_result v = run_cli("kv verify --store " + disk);
  EXPECT_EQ(v.exit_code, 1) << v.out << v.err;
  serve_process s(args);
  EXPECT_EQ(metric_sample(s.port(), "pagoda:kv_store_quarantined_total", "tier=\"disk\""), 1);
  const json st = call(s.port(), "GET", "/v1/kv/stats", {}, k_admin);
  EXPECT_EQ(tier_of(st, "disk")["quarantined"], 1) << st;
  EXPECT_EQ(tier_of(st, "disk")["entries"], 0) << st;
  const json again = complete(s.port(), prompt, 8);
  ASSERT_EQ(again["http_status"], 200) << again;
  EXPECT_EQ(text(again), ref);
  int n_aside = 0;
  for (const auto& e : std::filesystem::directory_iterator(disk))
    n_aside += e.path().filename().string().rfind("data.mdb.damaged-", 0) == 0;
  EXPECT_EQ(n_aside, 1);
}

TEST(serve_kv_admin, corrupt_entries_on_disk_and_in_redis_are_recomputed_and_counted) {
  temp_dir dir("kvcorrupt");
  redis_server redis;
  const std::string disk = (dir.path / "kv").string();
  auto args = store_test_args();
  args.insert(args.end(), {"--kv-store", disk, "--kv-store-remote", redis.url(), "--admin-key", k_admin});
  const std::string prompt = story_prompt(3);
  std::string ref;
  int blocks = 0;
  {
    serve_process s(args);
    const json w = warm(s.port(), prompt, k_admin);
    ASSERT_EQ(w["http_status"], 200) << w;
    blocks = w["stored_blocks"];
    ASSERT_GE(blocks, 3);
    ref = text(complete(s.port(), prompt, 8));
    s.stop(SIGTERM);
  }
  // Disk copies damaged: Redis, the next tier, answers.
  ASSERT_EQ(corrupt_every_entry(*open_disk(disk)), blocks);
  {
    serve_process s(args);
    const json r = complete(s.port(), prompt, 8);
    ASSERT_EQ(r["http_status"], 200) << r;
    EXPECT_EQ(text(r), ref);
    EXPECT_EQ(cached_from(r, "disk"), 0) << r;
    EXPECT_GT(cached_from(r, "redis"), 0) << r;
    const json st = call(s.port(), "GET", "/v1/kv/stats", {}, k_admin);
    EXPECT_GE(st["loads"]["corrupt"].get<int>(), 1) << st;
    s.stop(SIGTERM);
  }
  // Both damaged (the disk copies were repaired from Redis above: damage them again).
  ASSERT_GT(corrupt_every_entry(*open_disk(disk)), 0);
  ASSERT_GT(corrupt_every_entry(*open_redis(redis)), 0);
  serve_process s(args);
  const json r = complete(s.port(), prompt, 8);
  ASSERT_EQ(r["http_status"], 200) << r;
  EXPECT_EQ(cached(r), 0) << "a block that fails its checksum is never served: " << r;
  EXPECT_EQ(text(r), ref);
  const json st = call(s.port(), "GET", "/v1/kv/stats", {}, k_admin);
  EXPECT_GE(st["loads"]["corrupt"].get<int>(), 1) << st;
  const std::string metrics = call(s.port(), "GET", "/metrics").value("body", "");
  EXPECT_NE(metrics.find("pagoda:kv_store_corrupt_total"), std::string::npos);
}

TEST(serve_kv_admin, redis_down_counts_errors_and_the_server_reconnects) {
  redis_server redis;
  auto args = store_test_args();
  args.insert(args.end(), {"--no-kv-store", "--kv-store-remote", redis.url(), "--admin-key", k_admin});
  serve_process s(args);
  const int port = redis.port();
  redis.stop(/*kill=*/true);
  for (int v = 0; v < 3; ++v) {
    const json r = complete(s.port(), story_prompt(v), 4);
    EXPECT_EQ(r["http_status"], 200) << r;
  }
  const json down = call(s.port(), "GET", "/v1/kv/stats", {}, k_admin);
  EXPECT_GT(tier_of(down, "redis")["errors"].get<int>(), 0) << down;
  // Redis comes back on the same port: new blocks reach it again.
  redis_server back(port);
  auto r = open_redis(back);
  bool stored = false;
  for (int attempt = 0; attempt < 40 && !stored; ++attempt) {
    // A new first block each time: every block of the prompt is new.
    const json w = warm(s.port(), "Attempt " + std::to_string(attempt) + ". " + story_prompt(4), k_admin);
    EXPECT_EQ(w["http_status"], 200) << w;
    stored = count_entries(*r) > 0;
    if (!stored) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(stored) << "the server did not reconnect to Redis";
}

TEST(serve_kv_admin, a_full_disk_stops_write_back_and_serving_continues) {
  temp_dir dir("kvfull");
  const std::string disk = (dir.path / "kv").string();
  auto args = store_test_args();
  args.insert(args.end(), {"--kv-store", disk, "--admin-key", k_admin});
  // The disk holds about 256 KiB: the store's files cannot grow past it.
  serve_process s(args, 256 * 1024);
  for (int v = 0; v < 24; ++v) {
    const json r = complete(s.port(), std::to_string(v) + " " + story_prompt(v % 6), 4);
    ASSERT_EQ(r["http_status"], 200) << r;
  }
  // The writer runs behind the requests (slowly under sanitizers): wait,
  // bounded, until it has met the full disk or drained its queue.
  json st;
  for (int attempt = 0; attempt < 600; ++attempt) {
    st = call(s.port(), "GET", "/v1/kv/stats", {}, k_admin);
    ASSERT_EQ(st["http_status"], 200) << st;
    const json& wb = st["write_back"];
    const int done = wb["written"].get<int>() + wb["errors"].get<int>() + wb["dropped"].get<int>() +
                     wb["already_stored"].get<int>();
    if (wb["errors"].get<int>() > 0 || done >= wb["queued"].get<int>()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GT(st["write_back"]["errors"].get<int>(), 0) << st;
  EXPECT_GT(tier_of(st, "disk")["errors"].get<int>(), 0) << st;
  EXPECT_EQ(call(s.port(), "GET", "/health")["http_status"], 200);
  s.stop(SIGTERM);
  auto verify = run_cli("kv verify --store " + disk);
  EXPECT_EQ(verify.exit_code, 0) << verify.out << verify.err;
}

}  // namespace
}  // namespace pagoda::test

namespace pagoda::test {
namespace {

// Two servers on one disk store would each evict what the other relies on:
// the second is refused at start, naming the first one's PID.
TEST(serve_kv_admin, a_second_server_on_one_disk_store_is_refused_naming_the_first) {
  temp_dir dir("kvlock");
  const std::string disk = (dir.path / "kv").string();
  auto args = store_test_args();
  args.insert(args.end(), {"--kv-store", disk + ",size=0.5"});
  serve_process first(args);
  ASSERT_TRUE(first.running());
  std::string second = "serve --port 0";
  for (const std::string& a : args) second += " " + shell_quote(a);
  const cli_result r = run_cli(second);
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("in use by process " + std::to_string(first.pid())), std::string::npos) << r.err;
  // And `pagoda kv stats` reads beside it, with the server's cap (0.5 GiB), not a tool's default (8 GiB).
  const cli_result stats = run_cli("kv stats --store " + shell_quote(disk));
  EXPECT_EQ(stats.exit_code, 0) << stats.err;
  EXPECT_NE(stats.out.find("capacity 512"), std::string::npos) << stats.out;
  first.stop(SIGTERM);
}

// /health names each store tier's state: Redis down (with why) while it is,
// up once it is back, down again after it goes; serving never stops.
TEST(serve_kv_admin, health_shows_the_redis_tier_going_down_and_up) {
  redis_server redis;
  redis.stop();
  auto args = store_test_args();
  args.insert(args.end(), {"--no-kv-store", "--kv-store-remote", redis.url()});
  serve_process s(args);
  ASSERT_TRUE(s.running());
  auto redis_state = [&] {
    const json h = call(s.port(), "GET", "/health");
    EXPECT_EQ(h["status"], "ok") << h;
    for (const json& t : h.value("kv_store", json::array()))
      if (t["tier"] == "redis") return t;
    ADD_FAILURE() << "no redis tier in /health: " << h;
    return json();
  };
  json down = redis_state();
  EXPECT_EQ(down["up"], false) << down;
  EXPECT_FALSE(down.value("reason", "").empty()) << down;
  redis.start();
  // The tier reconnects when it is next used (at most once a second): keep asking with requests.
  bool up = false;
  for (int i = 0; i < 100 && !up; ++i) {
    EXPECT_EQ(complete(s.port(), story_prompt(i), 2)["http_status"], 200);
    up = redis_state()["up"] == true;
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(up) << redis_state();
  redis.stop();
  bool again = false;
  for (int i = 0; i < 100 && !again; ++i) {
    EXPECT_EQ(complete(s.port(), story_prompt(100 + i), 2)["http_status"], 200);
    again = redis_state()["up"] == false;
  }
  EXPECT_TRUE(again) << redis_state();
}

}  // namespace
}  // namespace pagoda::test
