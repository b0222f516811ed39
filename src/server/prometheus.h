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
#include <optional>
#include <vector>
#include <string>
#include <utility>

#include "sched/engine_loop.h"
#include "server/image_input.h"

namespace pagoda::server {

// (endpoint, HTTP status) -> requests answered.
using http_counts = std::map<std::pair<std::string, int>, std::int64_t>;

std::string render_metrics(const engine_snapshot& s, const http_counts& http, const std::string& model_name);

// The KV store tiers (memory first, then the warehouse's), in blocks:
//   pagoda:kv_store_{hits,misses,loads,errors,writes,evictions}_total{tier}   counters
//   pagoda:kv_store_{entries,bytes,capacity_bytes}{tier}                       gauges
//   pagoda:kv_store_load_seconds{tier}                                         histogram, per block
//   pagoda:kv_store_write_queue_blocks, pagoda:kv_store_write_dropped_total,
//   pagoda:kv_store_write_errors_total, pagoda:kv_store_corrupt_total,
//   pagoda:kv_store_forged_total, pagoda:kv_store_load_misses_total
struct store_metrics {
  struct tier {
    std::string name;  // "memory", "disk", "redis"
    std::int64_t hits = 0, misses = 0, loads = 0, errors = 0, writes = 0, evictions = 0;
    std::int64_t quarantined = -1, compactions = -1;  // -1: not a disk tier (not rendered)
    std::int64_t entries = -1, bytes = -1, capacity_bytes = 0;  // -1: unknown
    std::optional<histogram_snapshot> load_seconds;              // none for memory
  };
  std::vector<tier> tiers;
  std::int64_t queue_blocks = 0, dropped = 0, write_errors = 0, corrupt = 0, forged = 0, load_misses = 0;
};
std::string render_store_metrics(const store_metrics& m, const std::string& model_name);

// Images (`serve --mmproj`, image_input.h):
//   pagoda:images_encoded_total, pagoda:images_refused_total          counters
//   pagoda:image_encode_seconds_total                                 counter (decoding included)
//   pagoda:image_prompt_tokens_total, pagoda:image_prompt_tokens_cached_total
//                                                                     counters, tokens of answered requests
std::string render_image_metrics(const image_counters& c, const std::string& model_name);

// A label value with \, " and newlines escaped.
std::string escape_label(std::string_view v);

}  // namespace pagoda::server
