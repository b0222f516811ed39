// The /metrics text: names, labels, histogram shape, escaping.
#include "server/prometheus.h"

#include <gtest/gtest.h>

#include "server/server_util.h"

namespace pagoda::server {
namespace {

TEST(prometheus, renders_side_memory) {
  engine_snapshot s;
  s.kv.n_blocks_total = 10;
  s.kv.n_blocks_used = 3;
  s.kv.n_side_blocks = 2;
  s.kv.side_block_bytes = 1000;
  s.kv.side_measured_bytes = 1500;
  s.kv.tenants = {{"alice", 3, 0, std::nullopt, 2}};
  auto m = test::parse_metrics(render_metrics(s, {}, "m"));
  EXPECT_EQ(test::metric(m, "pagoda:kv_side_blocks"), 2);
  EXPECT_EQ(test::metric(m, "pagoda:kv_side_charged_bytes"), 2000);
  EXPECT_EQ(test::metric(m, "pagoda:kv_side_memory_bytes"), 1500);
  EXPECT_EQ(test::metric(m, "pagoda:tenant_kv_blocks{tenant=\"alice\",state=\"side\"}"), 2);
}

TEST(prometheus, renders_evictions_by_reason) {
  engine_snapshot s;
  s.kv.n_evictions = 9;
  s.kv.n_evictions_by_reason = {5, 3, 1};  // capacity, quota, admin
  auto m = test::parse_metrics(render_metrics(s, {}, "m"));
  EXPECT_EQ(test::metric(m, "pagoda:kv_cache_evictions_total"), 9);
  EXPECT_EQ(test::metric(m, "pagoda:prefix_cache_evictions_total{reason=\"capacity\"}"), 5);
  EXPECT_EQ(test::metric(m, "pagoda:prefix_cache_evictions_total{reason=\"quota\"}"), 3);
  EXPECT_EQ(test::metric(m, "pagoda:prefix_cache_evictions_total{reason=\"admin\"}"), 1);
}

TEST(prometheus, renders_kv_reads_by_policy_and_phase) {
  engine_snapshot s;
  s.kv_reads["quest"].decode = kv_read_counts{4, 400, 50, 28, 4};
  s.kv_reads["quest"].prompt = kv_read_counts{8, 100, 100, 16, 16};
  auto m = test::parse_metrics(render_metrics(s, {}, "m"));
  EXPECT_EQ(test::metric(m, "pagoda:kv_attention_rows_total{policy=\"quest\",phase=\"decode\"}"), 4);
  EXPECT_EQ(test::metric(m, "pagoda:kv_visible_tokens_total{policy=\"quest\",phase=\"decode\"}"), 400);
  EXPECT_EQ(test::metric(m, "pagoda:kv_read_tokens_total{policy=\"quest\",phase=\"decode\"}"), 50);
  EXPECT_EQ(test::metric(m, "pagoda:kv_visible_blocks_total{policy=\"quest\",phase=\"decode\"}"), 28);
  EXPECT_EQ(test::metric(m, "pagoda:kv_read_blocks_total{policy=\"quest\",phase=\"decode\"}"), 4);
  EXPECT_EQ(test::metric(m, "pagoda:kv_read_tokens_total{policy=\"quest\",phase=\"prompt\"}"), 100);
}

TEST(prometheus, renders_index_recall_by_index_kind) {
  engine_snapshot s;
  s.recall_by_index["ivfpq"] = index_recall{90, 128, 1000};
  auto m = test::parse_metrics(render_metrics(s, {}, "m"));
  EXPECT_EQ(test::metric(m, "pagoda:kv_index_searches_total{index=\"ivfpq\"}"), 1000);
  EXPECT_EQ(test::metric(m, "pagoda:kv_index_recall_wanted_total{index=\"ivfpq\"}"), 128);
  EXPECT_EQ(test::metric(m, "pagoda:kv_index_recall_found_total{index=\"ivfpq\"}"), 90);
}

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
  spec_decode_stats& d = s.spec_decode["draft"];
  d.n_drafts = 3;
  d.n_draft_tokens = 12;
  d.n_accepted_tokens = 7;
  d.accepted_per_pos[0] = 5;  // a draft at position 1 is accepted only after position 0
  d.accepted_per_pos[1] = 2;
  d.draft_seconds = 0.25;
  d.verify_seconds = 0.5;
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
  EXPECT_EQ(test::metric(m, "pagoda:tenant_kv_blocks{tenant=\"alice\",state=\"side\"}"), 0);
  EXPECT_EQ(test::metric(m, "pagoda:time_to_first_token_seconds_bucket{le=\"0.1\"}"), 1);
  EXPECT_EQ(test::metric(m, "pagoda:time_to_first_token_seconds_bucket{le=\"1\"}"), 3);
  EXPECT_EQ(test::metric(m, "pagoda:time_to_first_token_seconds_bucket{le=\"+Inf\"}"), 4);
  EXPECT_EQ(test::metric(m, "pagoda:time_to_first_token_seconds_count"), 4);
  EXPECT_DOUBLE_EQ(test::metric(m, "pagoda:time_to_first_token_seconds_sum"), 5.5);
  EXPECT_EQ(test::metric(m, "pagoda:inter_token_latency_seconds_count"), 0);
  EXPECT_EQ(test::metric(m, "pagoda:e2e_request_latency_seconds_count"), 0);
  EXPECT_EQ(test::metric(m, "pagoda:http_requests_total{endpoint=\"/v1/completions\",code=\"200\"}"), 4);
  EXPECT_EQ(test::metric(m, "pagoda:spec_decode_num_drafts_total{drafter=\"draft\"}"), 3);
  EXPECT_EQ(test::metric(m, "pagoda:spec_decode_num_draft_tokens_total{drafter=\"draft\"}"), 12);
  EXPECT_EQ(test::metric(m, "pagoda:spec_decode_num_accepted_tokens_total{drafter=\"draft\"}"), 7);
  EXPECT_EQ(test::metric(m, "pagoda:spec_decode_num_accepted_tokens_per_pos_total{drafter=\"draft\",position=\"1\"}"), 2);
  EXPECT_DOUBLE_EQ(test::metric(m, "pagoda:spec_decode_draft_seconds_total{drafter=\"draft\"}"), 0.25);
  EXPECT_DOUBLE_EQ(test::metric(m, "pagoda:spec_decode_verify_seconds_total{drafter=\"draft\"}"), 0.5);

  // Label values are escaped; each family has HELP and TYPE once.
  EXPECT_NE(text.find("model_name=\"my \\\"model\\\"\""), std::string::npos);
  EXPECT_NE(text.find("# TYPE pagoda:time_to_first_token_seconds histogram\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE pagoda:prefix_cache_hits_total counter\n"), std::string::npos);
  std::size_t first = text.find("# TYPE pagoda:kv_cache_blocks gauge");
  EXPECT_EQ(text.find("# TYPE pagoda:kv_cache_blocks gauge", first + 1), std::string::npos);
  EXPECT_EQ(escape_label("a\\b\n\"c\""), "a\\\\b\\n\\\"c\\\"");
}

// KV groups (sliding-window layers beside full ones): every group's blocks
// by state, and what the windows let go; only with more than one group.
TEST(prometheus, renders_kv_groups_when_there_are_several) {
  engine_snapshot s;
  s.kv.n_blocks_total = 10;
  s.kv.block_size_tokens = 16;
  s.kv.groups.push_back(kv_group_usage{"full", 0, 10, 6, 3, 1});
  EXPECT_EQ(render_metrics(s, {}, "m").find("pagoda:kv_group_blocks"), std::string::npos);
  kv_group_usage w{"sliding_window", 32, 12, 4, 5, 3};
  w.n_freed_out_of_window = 7;
  s.kv.groups.push_back(w);
  auto m = test::parse_metrics(render_metrics(s, {}, "m"));
  EXPECT_EQ(test::metric(m, "pagoda:kv_group_blocks{group=\"0\",kind=\"full\",state=\"used\"}"), 6);
  EXPECT_EQ(test::metric(m, "pagoda:kv_group_blocks{group=\"1\",kind=\"sliding_window\",state=\"used\"}"), 4);
  EXPECT_EQ(test::metric(m, "pagoda:kv_group_blocks{group=\"1\",kind=\"sliding_window\",state=\"cached\"}"), 5);
  EXPECT_EQ(test::metric(m, "pagoda:kv_group_blocks{group=\"1\",kind=\"sliding_window\",state=\"free\"}"), 3);
  EXPECT_EQ(test::metric(m, "pagoda:kv_window_freed_blocks_total{group=\"1\"}"), 7);
}

// KV classes (--kv-segment-dtype): each class's blocks by state, labelled
// with its type; absent with one type.
TEST(prometheus, renders_kv_classes_when_there_are_some) {
  engine_snapshot s;
  s.kv.n_blocks_total = 30;
  EXPECT_EQ(render_metrics(s, {}, "m").find("pagoda:kv_class_blocks"), std::string::npos);
  s.kv.classes.resize(2);
  s.kv.classes[0].n_blocks = 10;
  s.kv.classes[0].n_used = 3;
  s.kv.classes[0].n_cached = 2;
  s.kv.classes[0].n_free = 5;
  s.kv.classes[1].n_blocks = 20;
  s.kv.classes[1].n_used = 1;
  s.kv.classes[1].n_cached = 0;
  s.kv.classes[1].n_free = 19;
  s.kv_class_types = {"f16+f16", "int4"};
  auto m = test::parse_metrics(render_metrics(s, {}, "m"));
  EXPECT_EQ(test::metric(m, "pagoda:kv_class_blocks{type=\"f16+f16\",state=\"used\"}"), 3);
  EXPECT_EQ(test::metric(m, "pagoda:kv_class_blocks{type=\"f16+f16\",state=\"cached\"}"), 2);
  EXPECT_EQ(test::metric(m, "pagoda:kv_class_blocks{type=\"int4\",state=\"used\"}"), 1);
  EXPECT_EQ(test::metric(m, "pagoda:kv_class_blocks{type=\"int4\",state=\"free\"}"), 19);
}

TEST(prometheus, renders_store_tiers) {
  store_metrics sm;
  store_metrics::tier mem;
  mem.name = "memory";
  mem.hits = 5;
  mem.misses = 2;
  mem.loads = mem.errors = mem.writes = -1;  // not applicable: not rendered
  mem.entries = 7;
  store_metrics::tier disk;
  disk.name = "disk";
  disk.hits = 3;
  disk.loads = 3;
  disk.entries = 9;
  disk.bytes = 4096;
  disk.capacity_bytes = 1 << 20;
  disk.quarantined = 1;
  disk.compactions = 2;
  disk.load_seconds = histogram_snapshot{{0.001, 0.01}, {1, 3}, 3, 0.012};
  store_metrics::tier redis;
  redis.name = "redis";
  redis.errors = 4;  // entries and bytes unknown: not rendered
  sm.tiers = {mem, disk, redis};
  sm.dropped = 6;
  sm.corrupt = 1;
  sm.forged = 2;
  const std::string text = render_store_metrics(sm, "m");
  auto m = test::parse_metrics(text);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_hits_total{tier=\"memory\"}"), 5);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_misses_total{tier=\"memory\"}"), 2);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_loads_total{tier=\"disk\"}"), 3);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_bytes{tier=\"disk\"}"), 4096);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_capacity_bytes{tier=\"disk\"}"), 1 << 20);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_errors_total{tier=\"redis\"}"), 4);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_quarantined_total{tier=\"disk\"}"), 1);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_compactions_total{tier=\"disk\"}"), 2);
  EXPECT_EQ(text.find("kv_store_quarantined_total{model_name=\"m\",tier=\"redis\"}"), std::string::npos);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_load_seconds_bucket{tier=\"disk\",le=\"0.01\"}"), 3);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_load_seconds_count{tier=\"disk\"}"), 3);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_write_dropped_total"), 6);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_corrupt_total"), 1);
  EXPECT_EQ(test::metric(m, "pagoda:kv_store_forged_total"), 2);
  EXPECT_EQ(text.find("kv_store_loads_total{model_name=\"m\",tier=\"memory\"}"), std::string::npos);
  EXPECT_EQ(text.find("kv_store_entries{model_name=\"m\",tier=\"redis\"}"), std::string::npos);
}

}  // namespace
}  // namespace pagoda::server
