// The /metrics text: names, labels, histogram shape, escaping.
#include "server/prometheus.h"

#include <gtest/gtest.h>

#include "server/server_util.h"

namespace pagoda::server {
namespace {

TEST(prometheus, renders_every_series) {
  engine_snapshot s;
  s.kv.n_blocks_total = 10;
  s.kv.n_blocks_used = 3;
  s.kv.n_blocks_cached = 2;
  s.kv.n_blocks_free = 5;
  s.kv.block_size_tokens = 16;
  s.kv.n_stored_tokens = 40;  // 3 blocks hold 48 slots
  s.kv.n_prefix_query_tokens = 100;
  s.kv.n_prefix_hit_tokens = 64;
  s.kv.tenants = {{"", 1, 2, std::nullopt}, {"alice", 2, 0, 8}};
  s.n_running = 2;
  s.n_waiting = 1;
  s.n_prompt_tokens = 100;
  s.n_generated_tokens = 7;
  s.n_finished_by_reason = {{"length", 4}};
  s.ttft_seconds = {{0.1, 1.0}, {1, 3}, 4, 5.5};
  http_counts http = {{{"/v1/completions", 200}, 4}};
  const std::string text = render_metrics(s, http, "my \"model\"");
  auto m = test::parse_metrics(text);

  EXPECT_EQ(test::metric(m, "pagoda:num_requests_running"), 2);
  EXPECT_EQ(test::metric(m, "pagoda:num_requests_waiting"), 1);
  EXPECT_DOUBLE_EQ(test::metric(m, "pagoda:kv_cache_usage_perc"), 0.3);
  EXPECT_DOUBLE_EQ(test::metric(m, "pagoda:kv_cache_fragmentation_ratio"), 1.0 - 40.0 / 48.0);
  EXPECT_EQ(test::metric(m, "pagoda:kv_cache_blocks{state=\"used\"}"), 3);
  EXPECT_EQ(test::metric(m, "pagoda:kv_cache_blocks{state=\"cached\"}"), 2);
  EXPECT_EQ(test::metric(m, "pagoda:kv_cache_blocks{state=\"free\"}"), 5);
  EXPECT_EQ(test::metric(m, "pagoda:prefix_cache_queries_total"), 100);
  EXPECT_EQ(test::metric(m, "pagoda:prefix_cache_hits_total"), 64);
  EXPECT_EQ(test::metric(m, "pagoda:num_preemptions_total"), 0);
  EXPECT_EQ(test::metric(m, "pagoda:prompt_tokens_total"), 100);
  EXPECT_EQ(test::metric(m, "pagoda:generation_tokens_total"), 7);
  EXPECT_EQ(test::metric(m, "pagoda:request_success_total{finished_reason=\"length\"}"), 4);
  EXPECT_EQ(test::metric(m, "pagoda:request_success_total{finished_reason=\"stop\"}"), 0);
  EXPECT_EQ(test::metric(m, "pagoda:tenant_kv_blocks{tenant=\"alice\",state=\"used\"}"), 2);
  EXPECT_EQ(test::metric(m, "pagoda:tenant_kv_blocks{tenant=\"\",state=\"cached\"}"), 2);
  EXPECT_EQ(test::metric(m, "pagoda:tenant_kv_quota_blocks{tenant=\"alice\"}"), 8);
  EXPECT_EQ(test::metric(m, "pagoda:time_to_first_token_seconds_bucket{le=\"0.1\"}"), 1);
  EXPECT_EQ(test::metric(m, "pagoda:time_to_first_token_seconds_bucket{le=\"1\"}"), 3);
  EXPECT_EQ(test::metric(m, "pagoda:time_to_first_token_seconds_bucket{le=\"+Inf\"}"), 4);
  EXPECT_EQ(test::metric(m, "pagoda:time_to_first_token_seconds_count"), 4);
  EXPECT_DOUBLE_EQ(test::metric(m, "pagoda:time_to_first_token_seconds_sum"), 5.5);
  EXPECT_EQ(test::metric(m, "pagoda:inter_token_latency_seconds_count"), 0);
  EXPECT_EQ(test::metric(m, "pagoda:e2e_request_latency_seconds_count"), 0);
  EXPECT_EQ(test::metric(m, "pagoda:http_requests_total{endpoint=\"/v1/completions\",code=\"200\"}"), 4);

  // Label values are escaped; each family has HELP and TYPE once.
  EXPECT_NE(text.find("model_name=\"my \\\"model\\\"\""), std::string::npos);
  EXPECT_NE(text.find("# TYPE pagoda:time_to_first_token_seconds histogram\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE pagoda:prefix_cache_hits_total counter\n"), std::string::npos);
  std::size_t first = text.find("# TYPE pagoda:kv_cache_blocks gauge");
  EXPECT_EQ(text.find("# TYPE pagoda:kv_cache_blocks gauge", first + 1), std::string::npos);
  EXPECT_EQ(escape_label("a\\b\n\"c\""), "a\\\\b\\n\\\"c\\\"");
}

}  // namespace
}  // namespace pagoda::server
