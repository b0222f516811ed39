// GET /metrics: the engine's state in Prometheus text format (version 0.0.4).
//
// Names follow vLLM's (vllm:X becomes pagoda:X) where vLLM has the metric:
//   pagoda:num_requests_running, pagoda:num_requests_waiting            gauges
//   pagoda:kv_cache_usage_perc                                         gauge, 0..1 (used / total blocks)
//   pagoda:prefix_cache_queries_total, pagoda:prefix_cache_hits_total  counters, tokens
//   pagoda:num_preemptions_total                                       counter
//   pagoda:prompt_tokens_total, pagoda:generation_tokens_total         counters
//   pagoda:request_success_total{finished_reason}                      counter
//   pagoda:time_to_first_token_seconds, pagoda:inter_token_latency_seconds,
//   pagoda:e2e_request_latency_seconds                                 histograms
// and what vLLM has not:
//   pagoda:kv_cache_fragmentation_ratio                 1 - stored tokens / slots of used blocks
//   pagoda:kv_cache_blocks{state="used|cached|free"}    they add up to the pool
//   pagoda:kv_cache_evictions_total, pagoda:kv_cache_cow_copies_total
//   pagoda:tenant_kv_blocks{tenant, state="used|cached"}, pagoda:tenant_kv_quota_blocks{tenant}
//     (tenant="" is the global cache)
//   pagoda:http_requests_total{endpoint, code}          answered HTTP requests
// Every series carries model_name, as vLLM's do.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "sched/engine_loop.h"

namespace pagoda::server {

// (endpoint, HTTP status) -> requests answered.
using http_counts = std::map<std::pair<std::string, int>, std::int64_t>;

std::string render_metrics(const engine_snapshot& s, const http_counts& http, const std::string& model_name);

// A label value with \, " and newlines escaped.
std::string escape_label(std::string_view v);

}  // namespace pagoda::server
