// GET /v1/kv/summary: what a replica holds in its memory prefix cache, for
// the KV-aware router (src/router, docs/router.md) to poll.
//
// Answer (JSON):
//   {"object": "kv.summary",
//    "generation": "INSTANCE-N",      changes whenever the index does; INSTANCE
//                                     is random per process, so a restarted
//                                     replica never repeats an old value
//    "model_fingerprint": "16 hex",   sched/engine_setup.h: model_fingerprint
//    "block_size_tokens": 16,
//    "running": 2, "waiting": 0,      the engine's load now
//    "blocks": 1234,                  keys of the full blocks in the prefix index
//    "keys": "0123456789abcdef..."}   (used and cached), 16 hex digits each
// With ?since=GENERATION equal to the current one the keys are left out and
// "unchanged": true is set (the load is still fresh), so an idle replica
// costs the router a few bytes a poll.
//
// Keys are the prefix index's chained keys (kv/prefix_index.h): tokens,
// tenant and cache salt; a router that tokenizes a request with the same
// model and block size computes the same keys (router/request_keys.h).
// Who may call it: the admin key, as GET /v1/kv/stats (kv_admin.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kv/prefix_index.h"
#include "pagoda/status.h"

namespace pagoda {
class engine_core;
}

namespace pagoda::server {

struct kv_summary {
  std::string generation;
  std::string model_fingerprint;  // 16 hex digits
  int block_size_tokens = 0;
  int n_running = 0;
  int n_waiting = 0;
  bool unchanged = false;         // the caller's ?since matched: keys left out
  std::vector<block_key> keys;    // when !unchanged
};

// The process's summary instance: random, drawn once.
std::uint64_t summary_instance();

// Engine thread: the prefix index's keys and generation (the load is the
// caller's, from the engine snapshot). since: the generation the caller has.
// fingerprint: the model's, filled on the first call (keep it per engine).
kv_summary collect_kv_summary(engine_core& core, const std::optional<std::string>& since, std::string& fingerprint);

nlohmann::json kv_summary_json(const kv_summary& s);
// A summary as the router reads it; errors name what is wrong.
result<kv_summary> parse_kv_summary(std::string_view body);

}  // namespace pagoda::server
