// The KV store's endpoints in process, with a step_gate holding the engine
// where a test needs it: /v1/kv/warm holds no HTTP worker while the engine
// computes, a client that hangs up cancels its warm, and DELETE /v1/kv is a
// barrier (the tenant's running request is aborted, nothing of it reaches
// the pool's cache or a tier afterwards).
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "server/server_util.h"
#include "store/block_store.h"
#include "store/store_key.h"

namespace pagoda::test {
namespace {

constexpr const char* k_admin = "sk-admin";
constexpr const char* k_story =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. One day, she "
    "saw a big red ball in the park. She ran to the ball and kicked it very high.";

httplib::Headers bearer(const std::string& key) { return {{"Authorization", "Bearer " + key}}; }

std::string http_post(const std::string& path, const std::string& body) {
  return fmt::format("POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
                     path, body.size(), body);
}

// Entries of `tenant` in the server's memory tier.
std::int64_t stored_blocks_of(test_server& s, const std::string& tenant) {
  std::int64_t n = 0;
  const std::uint64_t th = tenant_hash(tenant);
  EXPECT_TRUE(s.warehouse()->tiers()[0]->for_each([&](const store_key& k, std::span<const std::byte>) {
                 n += k.tenant == th;
                 return true;
               }).ok());
  return n;
}

// The tenant's cached blocks in the pool: dropping them finds none when it has none.
std::int32_t cached_blocks_of(test_server& s, const std::string& tenant) {
  std::int32_t n = -1;
  EXPECT_TRUE(s.loop().run_synced([&](engine_core& e) { n = e.kv().evict_cached_blocks(tenant); }).ok());
  return n;
}

// Warm calls wait for the engine on no thread: with one HTTP worker and the
// engine held mid-step, two warms are in flight and /tokenize still answers.
// (Before, each warm held a worker until its prompt was computed and the
// whole write-back queue flushed: /tokenize waited behind them.)
TEST(kv_endpoints, warm_calls_in_flight_hold_no_worker) {
  server_setup setup = default_setup();
  setup.kv_store = true;
  setup.http.n_workers = 1;
  setup.step_gate = true;
  test_server s(setup);
  s.gate().close();
  std::vector<http_reply> warms(2);
  thread_joiner j{&s.gate()};
  // A completion keeps the engine in a step, so the warms' submits wait in its queue.
  j.threads.emplace_back([&] { post_json(*s.client(), "/v1/completions", json{{"prompt", "Once"}, {"max_tokens", 4}}.dump()); });
  ASSERT_TRUE(poll_until([&] { return s.gate().n_held() == 1; }));
  for (int i = 0; i < 2; ++i)
    j.threads.emplace_back([&, i] {
      warms[i] = post_json(*s.client(), "/v1/kv/warm", json{{"prompt", fmt::format("{} {}", k_story, i)}}.dump());
    });
  ASSERT_TRUE(poll_until([&] { return s.loop().n_queued_tasks() == 2; })) << "both warms reached the engine's queue";
  auto c = s.client(/*timeout_s=*/10);
  const http_reply t = post_json(*c, "/tokenize", json{{"prompt", "Once upon a time"}}.dump());
  EXPECT_EQ(t.status, 200) << "the only worker is free while two warms run: " << t.body;
  s.gate().open();
  for (std::thread& th : j.threads) th.join();
  for (const http_reply& w : warms) {
    EXPECT_EQ(w.status, 200) << w.body;
    EXPECT_GE(w.json_body["blocks"].get<int>(), 2);
    EXPECT_EQ(w.json_body["stored_blocks"], w.json_body["blocks"]) << "answered once its blocks are stored";
  }
}

// A client that hangs up while its warm computes: the warm's engine requests
// are aborted at once (before, the prompt ran to its end and was stored).
TEST(kv_endpoints, a_hang_up_cancels_the_warm) {
  server_setup setup = default_setup();
  setup.kv_store = true;
  setup.step_gate = true;
  setup.engine.max_num_batched_tokens = 16;  // the prompt takes several steps
  test_server s(setup);
  s.gate().close();
  const int fd = raw_connect(s.port());
  ASSERT_GE(fd, 0);
  const std::string req = http_post("/v1/kv/warm", json{{"prompt", k_story}}.dump());
  ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  // Its first chunk is in a step: the request is admitted and holds blocks.
  ASSERT_TRUE(poll_until([&] { return s.gate().n_held() == 1; }));
  close(fd);
  ASSERT_TRUE(poll_until([&] { return s.loop().n_queued_tasks() == 1; })) << "the hang-up cancels the warm";
  s.gate().open();
  // Published once its request finished, whichever way.
  ASSERT_TRUE(poll_until([&] { return !s.snapshot().n_finished_by_reason.empty(); }));
  engine_snapshot snap = s.snapshot();
  EXPECT_EQ(snap.n_finished_by_reason["abort"], 1);
  EXPECT_EQ(snap.n_finished_by_reason["length"], 0);
  EXPECT_LT(snap.n_computed_prompt_tokens, snap.n_prompt_tokens) << "cut short";
  EXPECT_TRUE(wait_idle(s));
}

// DELETE /v1/kv?tenant=alice while alice's long request runs: the request
// ends with "abort", and no block of alice is in the pool's cache or the
// store afterwards, also once the engine ran on. (Before, the request kept
// running and wrote its blocks back after the erase.)
TEST(kv_endpoints, delete_is_a_barrier_for_the_tenants_running_requests) {
  server_setup setup = default_setup();
  setup.kv_store = true;
  setup.admin_key = k_admin;
  setup.step_gate = true;
  ASSERT_TRUE(setup.keys.add("sk-alice", "alice").ok());
  ASSERT_TRUE(setup.keys.add("sk-bob", "bob").ok());
  test_server s(setup);
  s.gate().close();
  http_reply alice, erased;
  thread_joiner j{&s.gate()};
  j.threads.emplace_back([&] {
    alice = post_json(*s.client(), "/v1/completions",
                      json{{"prompt", k_story}, {"max_tokens", 400}, {"ignore_eos", true}, {"temperature", 0}}.dump(),
                      bearer("sk-alice"));
  });
  // Her prompt, then her first decode step (whose ops hand the prompt's
  // blocks to the store); then she is held in the next step, mid-request.
  ASSERT_TRUE(poll_until([&] { return s.gate().n_held() == 1; }));
  const std::int64_t steps = s.snapshot().n_steps;
  s.gate().let_through(2);
  ASSERT_TRUE(poll_until([&] { return s.snapshot().n_steps >= steps + 2 && s.gate().n_held() == 1; }));
  ASSERT_TRUE(poll_until([&] { return stored_blocks_of(s, "alice") >= 2; }));
  j.threads.emplace_back([&] {
    auto res = s.client()->Delete("/v1/kv?tenant=alice", bearer(k_admin));
    if (!res) return;
    erased.status = res->status;
    erased.body = res->body;
  });
  ASSERT_TRUE(poll_until([&] { return s.loop().n_queued_tasks() == 1; })) << "the DELETE reached the engine's queue";
  s.gate().open();
  for (std::thread& th : j.threads) th.join();
  EXPECT_EQ(erased.status, 200) << erased.body;
  ASSERT_EQ(alice.status, 200) << alice.body;
  EXPECT_EQ(alice.json_body["choices"][0]["finish_reason"], "abort") << "her request was stopped first";
  EXPECT_EQ(stored_blocks_of(s, "alice"), 0);
  EXPECT_EQ(cached_blocks_of(s, "alice"), 0);
  // The engine runs on (bob's request): nothing of alice comes back.
  const http_reply bob = post_json(*s.client(), "/v1/completions",
                                   json{{"prompt", k_story}, {"max_tokens", 40}, {"temperature", 0}}.dump(), bearer("sk-bob"));
  EXPECT_EQ(bob.status, 200) << bob.body;
  EXPECT_TRUE(wait_idle(s));
  s.warehouse()->flush();
  EXPECT_EQ(stored_blocks_of(s, "alice"), 0);
  EXPECT_EQ(cached_blocks_of(s, "alice"), 0);
  EXPECT_GT(stored_blocks_of(s, "bob"), 0);
  // The erase is over: alice is served again.
  const http_reply again = post_json(*s.client(), "/v1/completions",
                                     json{{"prompt", "Once"}, {"max_tokens", 2}}.dump(), bearer("sk-alice"));
  EXPECT_EQ(again.status, 200) << again.body;
}

}  // namespace
}  // namespace pagoda::test
