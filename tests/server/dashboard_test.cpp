// GET /dashboard (server/dashboard.h) in a real browser: Debian's chromium,
// headless, loads the page from an in-process server, runs its script (the
// polls of /metrics, /slots, /health and /dashboard/blocks) and dumps the
// DOM it built. The engine is held mid-generation with a step gate, so the
// page and /metrics read one moment of the pool: the grid and the figures
// must agree with /metrics exactly, and change as requests run and finish.
// Also: who may read the block map, and the Grafana dashboard in docs/,
// whose every metric must exist.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "server/server_util.h"

namespace pagoda::test {
namespace {

namespace fs = std::filesystem;

// What the page showed: each figure's raw value (data-value), the block
// counts, the first grid's states and the running table's rows.
struct dom_view {
  std::map<std::string, std::string> figures;
  std::map<std::string, std::int64_t> counts;
  std::string states;
  int n_running_rows = -1;
  int n_polls = 0;
  std::string html;
};

std::string chromium_binary() {
  for (const char* p : {"/usr/bin/chromium", "/usr/bin/chromium-browser"})
    if (::access(p, X_OK) == 0) return p;
  return "";
}

// Loads the dashboard headless and returns its DOM after a few polls.
dom_view load_dashboard(int port) {
  dom_view v;
  const std::string bin = chromium_binary();
  if (bin.empty()) {
    ADD_FAILURE() << "chromium is not installed (scripts/install-deps.sh installs Debian's chromium)";
    return v;
  }
  const fs::path profile = fs::temp_directory_path() / fmt::format("pagoda_chromium_{}", ::getpid());
  const std::string cmd = fmt::format(
      "{} --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run --user-data-dir={} "
      "--virtual-time-budget=3500 --dump-dom http://127.0.0.1:{}/dashboard 2>/dev/null",
      bin, profile.string(), port);
  FILE* f = ::popen(cmd.c_str(), "r");
  if (!f) {
    ADD_FAILURE() << "cannot run " << cmd;
    return v;
  }
  char buf[65536];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) v.html.append(buf, n);
  EXPECT_EQ(::pclose(f), 0) << cmd;
  fs::remove_all(profile);
  std::smatch m;
  const std::regex fig(R"re(id="fig-([a-z_]+)"[^>]*data-value="([^"]*)")re");
  for (auto it = std::sregex_iterator(v.html.begin(), v.html.end(), fig); it != std::sregex_iterator(); ++it)
    v.figures[(*it)[1]] = (*it)[2];
  const std::regex count(R"re(id="count-([a-z]+)">([0-9]+)<)re");
  for (auto it = std::sregex_iterator(v.html.begin(), v.html.end(), count); it != std::sregex_iterator(); ++it)
    v.counts[(*it)[1]] = std::stoll((*it)[2]);
  if (std::regex_search(v.html, m, std::regex(R"re(<canvas id="grid-0"[^>]*data-states="([^"]*)")re"))) v.states = m[1];
  if (std::regex_search(v.html, m, std::regex(R"re(data-polls="([0-9]+)")re"))) v.n_polls = std::stoi(m[1]);
  if (std::regex_search(v.html, m, std::regex(R"re(<table id="running">.*?<tbody>(.*?)</tbody>)re"))) {
    const std::string body = m[1];
    v.n_running_rows = 0;
    for (std::size_t at = 0; (at = body.find("<tr>", at)) != std::string::npos; ++at) ++v.n_running_rows;
  }
  return v;
}

double figure(const dom_view& v, const std::string& id) {
  const auto it = v.figures.find(id);
  if (it == v.figures.end() || it->second.empty()) {
    ADD_FAILURE() << "the page shows no value for " << id;
    return NAN;
  }
  return std::stod(it->second);
}

// A block count the page shows; -1 when it shows none.
std::int64_t count(const dom_view& v, const std::string& id) {
  const auto it = v.counts.find(id);
  if (it == v.counts.end()) ADD_FAILURE() << "the page shows no " << id << " count";
  return it == v.counts.end() ? -1 : it->second;
}

std::int64_t in_use(const std::string& states) {
  return std::count_if(states.begin(), states.end(), [](char c) { return c >= '1' && c <= '9'; });
}

// The page and /metrics read at one moment agree: the pool's counts, the grid, the figures.
void expect_agrees(const dom_view& v, std::map<std::string, double> m) {
  const double total = m["pagoda:kv_cache_num_blocks"];
  ASSERT_GT(total, 0);
  ASSERT_GE(v.n_polls, 1) << "the page never completed a poll:\n" << v.html.substr(0, 2000);
  EXPECT_EQ(figure(v, "blocks_total"), total);
  EXPECT_EQ(count(v, "total"), total);
  EXPECT_EQ(static_cast<double>(v.states.size()), total) << "one cell per block";
  EXPECT_EQ(count(v, "used"), m["pagoda:kv_cache_blocks{state=\"used\"}"]);
  EXPECT_EQ(count(v, "cached"), m["pagoda:kv_cache_blocks{state=\"cached\"}"]);
  EXPECT_EQ(count(v, "free"), m["pagoda:kv_cache_blocks{state=\"free\"}"]);
  EXPECT_EQ(in_use(v.states), count(v, "used"));
  EXPECT_EQ(std::count(v.states.begin(), v.states.end(), 'c'), count(v, "cached"));
  EXPECT_EQ(figure(v, "blocks_used"), m["pagoda:kv_cache_blocks{state=\"used\"}"]);
  EXPECT_EQ(figure(v, "blocks_cached"), m["pagoda:kv_cache_blocks{state=\"cached\"}"]);
  EXPECT_EQ(figure(v, "running"), m["pagoda:num_requests_running"]);
  EXPECT_EQ(figure(v, "waiting"), m["pagoda:num_requests_waiting"]);
  EXPECT_EQ(figure(v, "generated"), m["pagoda:generation_tokens_total"]);
  EXPECT_NEAR(figure(v, "usage"), m["pagoda:kv_cache_usage_perc"], 1e-9);
  EXPECT_NEAR(figure(v, "fragmentation"), m["pagoda:kv_cache_fragmentation_ratio"], 1e-9);
  EXPECT_EQ(v.n_running_rows, m["pagoda:num_requests_running"]) << "a row per running sequence (/slots)";
}

TEST(dashboard, the_page_in_chromium_shows_the_pool_and_agrees_with_metrics) {
  server_setup setup = default_setup();
  setup.step_gate = true;
  setup.engine = engine_config_for(stories(), 256, 8);
  test_server s(setup);

  // Idle, nothing run: every block free. The map is taken before the page
  // loads, so its first poll finds one (a fresh server answers "pending").
  auto c = s.client();
  ASSERT_TRUE(poll_until([&] { return c->Get("/dashboard/blocks") && s.snapshot().block_map != nullptr; }));
  const dom_view idle = load_dashboard(s.port());
  expect_agrees(idle, s.metrics());
  EXPECT_EQ(count(idle, "used") + count(idle, "cached"), 0);
  EXPECT_EQ(figure(idle, "generated"), 0);

  // Four requests held mid-generation: the gate lets the prompt step and a
  // few decode steps through, then one more step after the page's map was
  // asked for, so the map is of the moment /metrics shows.
  s.gate().close();
  thread_joiner j{&s.gate()};
  for (int i = 0; i < 4; ++i)
    j.threads.emplace_back([&s, i] {
      auto client = s.client();
      const json body = {{"prompt", fmt::format("Story {}: once upon a time there was a little fox who", i)},
                         {"max_tokens", 40},
                         {"temperature", 0},
                         {"ignore_eos", true}};
      auto r = client->Post("/v1/completions", body.dump(), "application/json");
      EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no reply");
    });
  // Each held step keeps the submits behind it queued: let steps through
  // one at a time until the engine took all four.
  std::int64_t released_after = -1;
  ASSERT_TRUE(poll_until([&] {
    const engine_snapshot now = s.snapshot();
    if (now.n_requests_active == 4) return true;
    if (s.gate().n_held() == 1 && now.n_steps != released_after) {
      released_after = now.n_steps;
      s.gate().let_through(1);
    }
    return false;
  }));
  const std::int64_t steps0 = s.snapshot().n_steps;
  s.gate().let_through(4);
  ASSERT_TRUE(poll_until([&] { return s.snapshot().n_steps >= steps0 + 4 && s.gate().n_held() == 1; }));
  ASSERT_TRUE(c->Get("/dashboard/blocks"));  // asks for the map: the next publish takes it
  const std::int64_t steps1 = s.snapshot().n_steps;
  s.gate().let_through(1);
  ASSERT_TRUE(poll_until([&] { return s.snapshot().n_steps > steps1 && s.gate().n_held() == 1; }));
  const engine_snapshot held = s.snapshot();
  ASSERT_TRUE(held.block_map);
  EXPECT_EQ(held.block_map->step, held.n_steps) << "the map is of the step the counts are";
  const dom_view busy = load_dashboard(s.port());
  const auto busy_metrics = s.metrics();
  expect_agrees(busy, busy_metrics);
  EXPECT_EQ(figure(busy, "running"), 4);
  EXPECT_GE(count(busy, "used"), 4) << "each running sequence holds blocks";
  EXPECT_GT(figure(busy, "generated"), 0);
  s.gate().open();
  for (std::thread& t : j.threads) t.join();
  j.threads.clear();

  // Done: the prompts' blocks wait in the prefix cache; the figures moved on.
  ASSERT_TRUE(poll_until([&] {
    if (!c->Get("/dashboard/blocks")) return false;  // asks again: the map follows the last step
    const engine_snapshot now = s.snapshot();
    return now.n_running == 0 && now.block_map && now.block_map->step == now.n_steps && now.kv.n_blocks_used == 0;
  }));
  const dom_view after = load_dashboard(s.port());
  const auto after_metrics = s.metrics();
  expect_agrees(after, after_metrics);
  EXPECT_EQ(count(after, "used"), 0);
  EXPECT_GT(count(after, "cached"), 0);
  EXPECT_EQ(figure(after, "generated"), 4 * 40);
  EXPECT_GT(figure(after, "generated"), figure(busy, "generated"));
}

// The page holds no data; the block map is the admin's when keys are set.
TEST(dashboard, the_block_map_needs_the_admin_key_when_keys_are_set) {
  server_setup setup = default_setup();
  setup.kv_store = true;
  setup.admin_key = "sk-admin";
  ASSERT_TRUE(setup.keys.add("sk-alice", "alice").ok());
  test_server s(setup);
  auto c = s.client();
  auto page = c->Get("/dashboard");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_NE(page->get_header_value("Content-Type").find("text/html"), std::string::npos);
  EXPECT_NE(page->body.find("/dashboard/blocks"), std::string::npos);
  for (const char* key : {"", "sk-alice"}) {
    httplib::Headers h;
    if (*key) h.emplace("Authorization", std::string("Bearer ") + key);
    auto r = c->Get("/dashboard/blocks", h);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 403) << key;
  }
  const httplib::Headers admin = {{"Authorization", "Bearer sk-admin"}};
  ASSERT_TRUE(poll_until([&] {
    auto r = c->Get("/dashboard/blocks", admin);
    return r && r->status == 200 && !json::parse(r->body).contains("pending");
  }));
  auto r = c->Get("/dashboard/blocks", admin);
  const json b = json::parse(r->body);
  EXPECT_EQ(b["object"], "kv.blocks");
  EXPECT_EQ(b["counts"]["free"], s.snapshot().kv.n_blocks_total);
  EXPECT_EQ(b["groups"][0]["states"].get<std::string>().size(), static_cast<std::size_t>(s.snapshot().kv.n_blocks_total));
  auto post = c->Post("/dashboard/blocks", "", "application/json");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
}

// docs/grafana-dashboard.json: every metric its queries name is one the
// server exports (a # TYPE line of /metrics, the store's families included).
TEST(dashboard, every_metric_of_the_grafana_dashboard_exists) {
  std::ifstream in(std::string(PAGODA_SOURCE_DIR) + "/docs/grafana-dashboard.json");
  ASSERT_TRUE(in) << "docs/grafana-dashboard.json is missing";
  const json dash = json::parse(in, nullptr, false);
  ASSERT_TRUE(dash.is_object()) << "docs/grafana-dashboard.json is not JSON";
  server_setup setup = default_setup();
  setup.kv_store = true;
  test_server s(setup);
  auto r = s.client()->Get("/metrics");
  ASSERT_TRUE(r && r->status == 200);
  std::set<std::string> families;
  const std::regex type_line(R"re(# TYPE (pagoda:[a-z0-9_]+) )re");
  for (auto it = std::sregex_iterator(r->body.begin(), r->body.end(), type_line); it != std::sregex_iterator(); ++it)
    families.insert((*it)[1]);
  ASSERT_GT(families.size(), 20u);
  std::set<std::string> named;
  int n_targets = 0;
  const std::regex metric(R"re(pagoda:[a-z0-9_]+)re");
  for (const json& panel : dash.at("panels"))
    for (const json& target : panel.value("targets", json::array())) {
      ++n_targets;
      const std::string expr = target.at("expr");
      for (auto it = std::sregex_iterator(expr.begin(), expr.end(), metric); it != std::sregex_iterator(); ++it) {
        std::string name = (*it)[0];
        for (const char* suffix : {"_bucket", "_sum", "_count"})  // a histogram's series
          if (name.ends_with(suffix) && !families.contains(name)) name.resize(name.size() - std::strlen(suffix));
        named.insert(name);
      }
    }
  EXPECT_GE(n_targets, 10);
  for (const std::string& name : named) EXPECT_TRUE(families.contains(name)) << name << " is not exported";
  for (const char* must : {"pagoda:kv_cache_usage_perc", "pagoda:kv_cache_fragmentation_ratio",
                           "pagoda:prefix_cache_hits_total", "pagoda:kv_store_hits_total", "pagoda:num_preemptions_total"})
    EXPECT_TRUE(named.contains(must)) << "the dashboard does not show " << must;
}

}  // namespace
}  // namespace pagoda::test
