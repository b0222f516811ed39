// `pagoda router` in front of three real `pagoda serve` replicas on loopback
// that share a Redis tier (docs/router.md): requests go to the replica that
// holds their prefix in memory, a replica killed mid-run is failed over,
// streams pass through as the replica sent them, tenants' keys pass through,
// and a router without replicas or with only dead ones says so and exits.
#include <atomic>
#include <fstream>
#include <regex>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "cli/serve_process.h"
#include "cli/store_client.h"
#include "store/redis_util.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

constexpr const char* k_admin = "sk-router-admin";
constexpr const char* k_alice = "sk-router-alice";

std::string write_tenants(const temp_dir& dir) {
  std::filesystem::create_directories(dir.path);
  const std::string path = (dir.path / "tenants.json").string();
  std::ofstream(path) << json{{"tenants", {{{"name", "alice"}, {"api_keys", {k_alice}}}}}}.dump();
  return path;
}

std::string url_of(int port) { return "http://127.0.0.1:" + std::to_string(port); }

// One series of the router's /metrics ("" when absent).
double metric(int router_port, const std::string& series) {
  httplib::Client c("127.0.0.1", router_port);
  auto res = c.Get("/metrics");
  if (!res) return -1;
  const std::size_t at = res->body.find(series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(res->body.substr(at + series.size() + 1));
}
std::string replica_series(const char* name, int replica_port, const char* route = nullptr) {
  std::string s = std::string(name) + "{replica=\"" + url_of(replica_port) + "\"";
  if (route) s += std::string(",route=\"") + route + "\"";
  return s + "}";
}

// Waits (bounded) until pred() holds; polling for readiness, not timing.
template <typename Pred>
bool eventually(Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// Two stories whose first blocks differ from the first token on.
std::string story_a(int i) {
  return "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. One day, "
         "she saw a big red ball in the park and ran to it. Question " + std::to_string(i) + ":";
}
std::string story_b(int i) {
  return "Tom had a small dog called Max. Every morning they walked to the river and looked at the fish. Max liked "
         "to bark at the ducks, and Tom laughed. Question " + std::to_string(i) + ":";
}

class RouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tenants_ = write_tenants(dir_);
    for (int i = 0; i < 3; ++i) {
      std::vector<std::string> args = store_test_args();
      args.insert(args.end(), {"--no-kv-store", "--kv-store-remote", redis_.url(), "--admin-key", k_admin, "--tenants",
                               tenants_});
      replicas_.push_back(std::make_unique<serve_process>(args));
    }
  }

  std::vector<std::string> router_args(int poll_ms) const {
    std::vector<std::string> a = {"-m", model_path(), "--admin-key", k_admin, "--tenants", tenants_, "--poll-ms",
                                  std::to_string(poll_ms), "--no-access-log"};
    for (const auto& r : replicas_) a.insert(a.end(), {"--replica", url_of(r->port())});
    return a;
  }

  json via(int router_port, const std::string& prompt, const std::string& key = k_alice) {
    return complete(router_port, prompt, 6, key);
  }

  temp_dir dir_{"router"};
  std::string tenants_;
  redis_server redis_;
  std::vector<std::unique_ptr<serve_process>> replicas_;
};

TEST_F(RouterTest, SendsARequestToTheReplicaHoldingItsPrefix) {
  // Replica 1 holds story A, replica 2 story B (alice's: her key decides the keys).
  ASSERT_EQ(call(replicas_[1]->port(), "POST", "/v1/kv/warm", {{"prompt", story_a(0)}}, k_alice)["http_status"], 200);
  ASSERT_EQ(call(replicas_[2]->port(), "POST", "/v1/kv/warm", {{"prompt", story_b(0)}}, k_alice)["http_status"], 200);
  serve_process router("router", router_args(50));
  const int rp = router.port();
  ASSERT_TRUE(eventually([&] {
    return metric(rp, replica_series("pagoda_router:replica_cached_blocks", replicas_[1]->port())) > 0 &&
           metric(rp, replica_series("pagoda_router:replica_cached_blocks", replicas_[2]->port())) > 0;
  }));
  for (int i = 1; i <= 3; ++i) {
    for (const std::string& story : {story_a(i), story_b(i)}) {
      const json r = via(rp, story);
      ASSERT_EQ(r["http_status"], 200) << r;
      // From the holder's memory, not from the shared Redis tier another replica would load it from.
      EXPECT_GT(cached_from(r, "memory"), 0) << r;
      EXPECT_EQ(cached_from(r, "redis"), 0) << r;
    }
  }
  EXPECT_EQ(metric(rp, replica_series("pagoda_router:requests_total", replicas_[1]->port(), "prefix")), 3);
  EXPECT_EQ(metric(rp, replica_series("pagoda_router:requests_total", replicas_[2]->port(), "prefix")), 3);
  EXPECT_EQ(metric(rp, replica_series("pagoda_router:requests_total", replicas_[0]->port(), "prefix")), 0);
  // The API key passes through unchanged: without one the replicas' 401 comes back.
  EXPECT_EQ(call(rp, "POST", "/v1/completions", {{"prompt", story_a(9)}, {"max_tokens", 2}})["http_status"], 401);
}

TEST_F(RouterTest, FailsOverWhenTheReplicaIsKilledMidRun) {
  // Polls so rare that the router learns of the death from the failed call itself.
  serve_process router("router", router_args(60'000));
  const int rp = router.port();
  const json first = via(rp, story_a(1));
  ASSERT_EQ(first["http_status"], 200) << first;
  // The second request of the prefix goes where the first went (the router remembers what it routed).
  ASSERT_EQ(via(rp, story_a(1))["http_status"], 200);
  int holder = -1;
  for (int i = 0; i < 3; ++i)
    if (metric(rp, replica_series("pagoda_router:requests_total", replicas_[i]->port(), "prefix")) == 1) holder = i;
  ASSERT_GE(holder, 0);
  const int dead_port = replicas_[holder]->port();
  replicas_[holder]->stop(SIGKILL);
  // Routed to the dead holder first, refused before a byte came back, retried elsewhere.
  for (int i = 0; i < 4; ++i) {
    const json r = via(rp, story_a(1));
    ASSERT_EQ(r["http_status"], 200) << r;
    EXPECT_EQ(text(r), text(first));
  }
  EXPECT_EQ(metric(rp, replica_series("pagoda_router:replica_failures_total", dead_port)), 1);
  EXPECT_EQ(metric(rp, replica_series("pagoda_router:replica_up", dead_port)), 0);
  EXPECT_EQ(metric(rp, replica_series("pagoda_router:requests_total", dead_port, "prefix")), 2);  // 1 before, the failed try
}

TEST_F(RouterTest, TakesOutAReplicaThatStopsAnsweringAndHealthSaysSo) {
  serve_process router("router", router_args(50));
  const int rp = router.port();
  EXPECT_EQ(call(rp, "GET", "/health")["replicas_up"], 3);
  replicas_[0]->stop(SIGKILL);
  ASSERT_TRUE(eventually([&] { return call(rp, "GET", "/health")["replicas_up"] == 2; }));
  EXPECT_EQ(metric(rp, replica_series("pagoda_router:replica_up", replicas_[0]->port())), 0);
  for (int i = 0; i < 4; ++i) ASSERT_EQ(via(rp, story_b(i))["http_status"], 200);
  EXPECT_EQ(metric(rp, replica_series("pagoda_router:requests_total", replicas_[0]->port(), "load")), 0);
}

// A stream through the router is the replica's stream: the same events in
// the same framing (ids and timestamps aside), each arriving as sent.
TEST_F(RouterTest, PassesStreamingThrough) {
  serve_process router("router", router_args(50));
  auto stream = [](int port) {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);
    std::string body;
    int pieces = 0;
    const json req = {{"prompt", story_b(3)}, {"max_tokens", 12}, {"temperature", 0}, {"stream", true}};
    httplib::Request r;
    r.method = "POST";
    r.path = "/v1/completions";
    r.headers = {{"Authorization", std::string("Bearer ") + k_alice}};
    r.body = req.dump();
    r.set_header("Content-Type", "application/json");
    std::string content_type;
    r.response_handler = [&](const httplib::Response& res) {
      content_type = res.get_header_value("Content-Type");
      return true;
    };
    r.content_receiver = [&](const char* data, std::size_t n, std::uint64_t, std::uint64_t) {
      body.append(data, n);
      ++pieces;
      return true;
    };
    auto res = c.send(r);
    EXPECT_TRUE(res);
    EXPECT_EQ(content_type, "text/event-stream");
    // ids and timestamps differ between two calls; nothing else may.
    body = std::regex_replace(body, std::regex(R"("id":"[^"]*")"), R"("id":"")");
    body = std::regex_replace(body, std::regex(R"("created":[0-9]+)"), R"("created":0)");
    return std::pair{body, pieces};
  };
  const auto [direct, direct_pieces] = stream(replicas_[0]->port());
  const auto [routed, routed_pieces] = stream(router.port());
  EXPECT_EQ(routed, direct);
  EXPECT_NE(routed.find("data: [DONE]"), std::string::npos);
  EXPECT_GE(routed_pieces, 4);  // not one piece at the end: events arrive as the replica sends them
}

// What the router polls: the admin key only; the keys of what the replica
// cached; a few bytes when nothing changed since the caller's generation.
TEST_F(RouterTest, ReplicaSummaryListsTheCachedBlocks) {
  const int port = replicas_[0]->port();
  EXPECT_EQ(call(port, "GET", "/v1/kv/summary", {}, k_alice)["http_status"], 403);
  const json empty = call(port, "GET", "/v1/kv/summary", {}, k_admin);
  ASSERT_EQ(empty["http_status"], 200) << empty;
  EXPECT_EQ(empty["blocks"], 0);
  EXPECT_EQ(empty["block_size_tokens"], k_store_test_block);
  EXPECT_EQ(empty["model_fingerprint"].get<std::string>().size(), 16u);
  const json r = complete(port, story_a(1), 4, k_alice);
  ASSERT_EQ(r["http_status"], 200) << r;
  const json full = call(port, "GET", "/v1/kv/summary", {}, k_admin);
  const int n_blocks = r["usage"]["prompt_tokens"].get<int>() / k_store_test_block;
  EXPECT_GE(full["blocks"].get<int>(), n_blocks) << full;
  EXPECT_EQ(full["keys"].get<std::string>().size(), 16u * full["blocks"].get<std::size_t>());
  EXPECT_NE(full["generation"], empty["generation"]);
  const json same = call(port, "GET", "/v1/kv/summary?since=" + full["generation"].get<std::string>(), {}, k_admin);
  EXPECT_EQ(same["unchanged"], true) << same;
  EXPECT_FALSE(same.contains("keys"));
}

// A replica of another model: its keys can never match, so the router says
// so and sends it requests by load only.
TEST(RouterModels, AReplicaOfAnotherModelIsRoutedByLoadOnly) {
  temp_dir dir("router_models");
  std::filesystem::create_directories(dir.path);
  const std::string other = (dir.path / "tiny.gguf").string();
  ASSERT_EQ(run_cli("synth --preset tiny --layers 2 --weight-type f32 -o " + shell_quote(other)).exit_code, 0);
  std::vector<std::string> same_args = store_test_args();
  same_args.insert(same_args.end(), {"--no-kv-store", "--admin-key", k_admin});
  serve_process same(same_args);
  serve_process foreign({"-m", other, "--no-kv-store", "--admin-key", k_admin, "-t", "1"});
  serve_process router("router", {"-m", model_path(), "--admin-key", k_admin, "--replica", url_of(same.port()),
                                  "--replica", url_of(foreign.port()), "--poll-ms", "50"});
  EXPECT_EQ(metric(router.port(), replica_series("pagoda_router:replica_prefix_usable", same.port())), 1);
  EXPECT_EQ(metric(router.port(), replica_series("pagoda_router:replica_prefix_usable", foreign.port())), 0);
  EXPECT_EQ(metric(router.port(), replica_series("pagoda_router:replica_up", foreign.port())), 1);
}

// A replica that refuses every completion with 503 (as a stopping or full
// one does): the router tries another before answering; with none left the
// refusal comes back as the replica sent it.
class refusing_replica {
 public:
  refusing_replica() {
    srv_.Get("/v1/kv/summary", [](const httplib::Request&, httplib::Response& res) {
      res.status = 403;  // answers, so it is up; routed by load only
      res.set_content(R"({"error":{"message":"no"}})", "application/json");
    });
    srv_.Post("/v1/completions", [this](const httplib::Request&, httplib::Response& res) {
      ++n_refused_;
      res.status = 503;
      res.set_content(R"({"error":{"message":"stopping","code":"refused_here"}})", "application/json");
    });
    port_ = srv_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { srv_.listen_after_bind(); });
    // bind_to_any_port already listens: connections wait in the backlog until the thread accepts.
  }
  ~refusing_replica() {
    srv_.stop();
    thread_.join();
  }
  int port() const { return port_; }
  int n_refused() const { return n_refused_; }

 private:
  httplib::Server srv_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<int> n_refused_{0};
};

TEST(RouterRetry, A503IsRetriedOnAnotherReplicaAndPassedOnWhenAllRefuse) {
  refusing_replica refusing;
  {
    serve_process live(store_test_args());
    serve_process router("router", {"-m", model_path(), "--replica", url_of(refusing.port()), "--replica",
                                    url_of(live.port()), "--no-access-log"});
    for (int i = 0; i < 4; ++i) {
      const json r = complete(router.port(), story_a(i), 2);
      ASSERT_EQ(r["http_status"], 200) << r;
    }
    EXPECT_GE(refusing.n_refused(), 1);  // the rotation sent some there first
  }
  serve_process alone("router", {"-m", model_path(), "--replica", url_of(refusing.port()), "--no-access-log"});
  const json r = complete(alone.port(), story_a(1), 2);
  EXPECT_EQ(r["http_status"], 503);
  EXPECT_EQ(r["error"]["code"], "refused_here") << r;
}

TEST(RouterBadInput, NoReplicasIsAClearError) {
  const cli_result r = run_cli("router -m " + shell_quote(model_path()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("no replica given"), std::string::npos) << r.err;
  const cli_result bad = run_cli("router -m " + shell_quote(model_path()) + " --replica localhost:8080");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("replica 'localhost:8080': not an http:// URL"), std::string::npos) << bad.err;
}

TEST(RouterBadInput, ADeadReplicaIsNamedAndNoneAliveIsFatal) {
  const std::string dead = url_of(free_port());
  const cli_result r = run_cli("router -m " + shell_quote(model_path()) + " --port 0 --replica " + dead);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("replica " + dead + ": not answering"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("no replica answers"), std::string::npos) << r.err;
}

TEST(RouterBadInput, ADeadReplicaBesideALiveOneIsLoggedAndLeftOut) {
  serve_process live(store_test_args());
  const int dead_port = free_port();
  serve_process router("router", {"-m", model_path(), "--replica", url_of(live.port()), "--replica", url_of(dead_port)});
  EXPECT_EQ(call(router.port(), "GET", "/health")["replicas_up"], 1);
  EXPECT_EQ(metric(router.port(), replica_series("pagoda_router:replica_up", dead_port)), 0);
  // No admin key: the live replica refuses its summary, so it is routed by load.
  EXPECT_EQ(metric(router.port(), replica_series("pagoda_router:replica_prefix_usable", live.port())), 0);
  const json r = complete(router.port(), story_a(1), 4);
  EXPECT_EQ(r["http_status"], 200) << r;
  EXPECT_EQ(metric(router.port(), replica_series("pagoda_router:requests_total", live.port(), "load")), 1);
}

}  // namespace
}  // namespace pagoda::test
