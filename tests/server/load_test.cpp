// Bounded load: 64 concurrent clients x 20 requests each, prompts sharing
// prefixes, over loopback. Every answer must be the one the prompt gets alone
// (greedy, f32 KV: batch-invariant), the metrics must add up, and the pool must
// end with no used block.
#include <gtest/gtest.h>

#include "server/server_util.h"

namespace pagoda::test {
namespace {

constexpr int k_clients = 64;
constexpr int k_requests_per_client = 20;
constexpr int k_max_tokens = 8;

std::vector<std::string> prompts() {
  // Two long shared prefixes, eight short suffixes: sixteen distinct prompts.
  const std::string prefixes[] = {
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine with her friends. ",
      "One day, a big brown dog came to the park. The dog was very happy and wanted to play with the ball all day. "};
  const char* suffixes[] = {"She saw", "He ran", "They went", "The cat", "Mom said", "It was", "A bird", "Then"};
  std::vector<std::string> out;
  for (const std::string& p : prefixes)
    for (const char* s : suffixes) out.push_back(p + s);
  return out;
}

struct answer {
  std::string text;
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = 0;
};

// Why the first failed requests failed (a failure must say more than "4 failed").
std::mutex g_why_mu;
std::vector<std::string> g_why;
void note_failure(std::string why) {
  std::lock_guard lock(g_why_mu);
  if (g_why.size() < 8) g_why.push_back(std::move(why));
}

std::optional<answer> complete(httplib::Client& c, const std::string& prompt, bool stream) {
  json body = {{"prompt", prompt}, {"max_tokens", k_max_tokens}, {"temperature", 0}, {"ignore_eos", true}};
  if (stream) {
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
  }
  auto res = c.Post("/v1/completions", body.dump(), "application/json");
  if (!res) {
    note_failure(fmt::format("stream={} transport error: {}", stream, httplib::to_string(res.error())));
    return std::nullopt;
  }
  if (res->status != 200) {
    note_failure(fmt::format("stream={} HTTP {}: {}", stream, res->status, res->body.substr(0, 300)));
    return std::nullopt;
  }
  answer a;
  const json* usage = nullptr;
  json last;
  if (stream) {
    std::vector<std::string> events = sse_data(res->body);
    if (events.size() < 2 || events.back() != "[DONE]") {
      note_failure(fmt::format("stream without [DONE]: {}", res->body.substr(0, 300)));
      return std::nullopt;
    }
    for (std::size_t i = 0; i + 1 < events.size(); ++i) {
      json j = json::parse(events[i], nullptr, false);
      if (j.is_discarded()) return std::nullopt;
      if (!j["choices"].empty()) a.text += j["choices"][0]["text"].get<std::string>();
      if (j.contains("usage") && !j["usage"].is_null()) last = j;
    }
    if (last.is_null()) return std::nullopt;
    usage = &last["usage"];
  } else {
    last = json::parse(res->body, nullptr, false);
    if (last.is_discarded()) return std::nullopt;
    a.text = last["choices"][0]["text"];
    usage = &last["usage"];
  }
  a.prompt_tokens = (*usage)["prompt_tokens"];
  a.completion_tokens = (*usage)["completion_tokens"];
  a.cached_tokens = (*usage)["prompt_tokens_details"]["cached_tokens"];
  return a;
}

TEST(load, clients_with_shared_prefixes) {
  server_setup setup = default_setup();
  setup.engine.n_blocks = 2048;  // room for every client at once: no preemption, so hits add up exactly
  setup.max_waiting = 256;
  test_server s(setup);
  const std::vector<std::string> ps = prompts();

  // References, one request at a time.
  std::vector<answer> expected;
  {
    auto c = s.client();
    for (const std::string& p : ps) {
      auto a = complete(*c, p, false);
      ASSERT_TRUE(a.has_value());
      expected.push_back(*a);
    }
  }
  // The server counts an HTTP answer once its last byte is written, which can
  // be just after the client has read it: wait for the count to reach n
  // (a count past n still fails the exact checks below).
  const std::string k_answered = "pagoda:http_requests_total{endpoint=\"/v1/completions\",code=\"200\"}";
  auto metrics_once_answered = [&](double n) {
    auto m = s.metrics();
    for (int i = 0; i < 500 && metric(m, k_answered) < n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      m = s.metrics();
    }
    return m;
  };
  const auto before = metrics_once_answered(static_cast<double>(ps.size()));

  std::atomic<int> n_ok{0}, n_wrong{0}, n_failed{0};
  std::atomic<long long> sum_prompt{0}, sum_completion{0}, sum_cached{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < k_clients; ++t)
    clients.emplace_back([&, t] {
      auto c = s.client(120);
      for (int i = 0; i < k_requests_per_client; ++i) {
        const std::size_t k = static_cast<std::size_t>(t * 7 + i * 3) % ps.size();
        auto a = complete(*c, ps[k], (t + i) % 2 == 0);
        if (!a) {
          ++n_failed;
          continue;
        }
        if (a->text == expected[k].text && a->prompt_tokens == expected[k].prompt_tokens &&
            a->completion_tokens == k_max_tokens)
          ++n_ok;
        else
          ++n_wrong;
        sum_prompt += a->prompt_tokens;
        sum_completion += a->completion_tokens;
        sum_cached += a->cached_tokens;
      }
    });
  for (auto& th : clients) th.join();
  const int total = k_clients * k_requests_per_client;
  EXPECT_EQ(n_failed, 0);
  for (const std::string& why : g_why) ADD_FAILURE() << why;
  EXPECT_EQ(n_wrong, 0);
  EXPECT_EQ(n_ok, total);

  ASSERT_TRUE(wait_idle(s, 10000));
  const auto after = metrics_once_answered(metric(before, k_answered) + total);
  auto delta = [&](const std::string& key) { return metric(after, key) - metric(before, key); };
  EXPECT_EQ(delta("pagoda:request_success_total{finished_reason=\"length\"}"), total);
  EXPECT_EQ(delta("pagoda:request_success_total{finished_reason=\"abort\"}"), 0);
  EXPECT_EQ(delta("pagoda:http_requests_total{endpoint=\"/v1/completions\",code=\"200\"}"), total);
  EXPECT_EQ(delta("pagoda:prompt_tokens_total"), sum_prompt.load());
  EXPECT_EQ(delta("pagoda:generation_tokens_total"), sum_completion.load());
  EXPECT_EQ(delta("pagoda:generation_tokens_total"), total * k_max_tokens);
  EXPECT_EQ(delta("pagoda:num_preemptions_total"), 0);
  // Each prompt is looked up once; what usage reported as cached is what the cache counted as hits.
  EXPECT_EQ(delta("pagoda:prefix_cache_hits_total"), sum_cached.load());
  EXPECT_GT(sum_cached.load(), sum_prompt.load() / 2);  // the shared prefixes were reused
  EXPECT_EQ(delta("pagoda:time_to_first_token_seconds_count"), total);
  EXPECT_EQ(delta("pagoda:e2e_request_latency_seconds_count"), total);
  EXPECT_EQ(metric(after, "pagoda:kv_cache_blocks{state=\"used\"}"), 0);
  EXPECT_EQ(metric(after, "pagoda:num_requests_running"), 0);
  EXPECT_EQ(metric(after, "pagoda:num_requests_waiting"), 0);
  EXPECT_EQ(metric(after, "pagoda:kv_cache_blocks{state=\"used\"}") +
                metric(after, "pagoda:kv_cache_blocks{state=\"cached\"}") +
                metric(after, "pagoda:kv_cache_blocks{state=\"free\"}"),
            2048);
}

}  // namespace
}  // namespace pagoda::test
