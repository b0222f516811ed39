// The KV warehouse's endpoints, kept apart from the HTTP library (kv_calls.h
// runs them over connections):
//
//   POST   /v1/kv/warm        computes and persists the KV of a prompt (or chat)
//                             without generating: the body of a completion
//                             ("prompt") or chat ("messages") call, sampling
//                             fields ignored; answers once every full block is
//                             in the prefix cache and its own blocks are
//                             written to the store tiers. Asynchronous like a
//                             completion: a client that hangs up cancels it.
//   GET    /v1/kv/stats       per tier (memory, disk, redis): entries, bytes,
//                             hits, misses, loads, errors; the write-back queue.
//   GET    /v1/kv/summary     the prefix cache's keys and the load, for the
//                             router (kv_summary.h; registered in http_server.cpp).
//   DELETE /v1/kv?tenant=NAME erases a tenant's cached KV from the pool and from
//                             every store tier ("" or "-" is the global tenant),
//                             as a barrier (engine_loop::close_tenant_async):
//                             the tenant's running requests are aborted first,
//                             and its new ones refused (503) until the erase is done.
//
// Who may call them: warm runs as the caller's tenant (its API key decides,
// as for completions); with the admin key it may name any tenant in a
// "tenant" field. stats and DELETE need the admin key (`--admin-key`); without
// one configured they are refused (403), since they see and erase every
// tenant's data.
//
// Threads: parsing runs on the HTTP workers, the engine parts on the engine
// thread, and whatever waits for the store (write-back, tier erases) on the
// server's store thread, so no HTTP worker waits for the engine or a tier.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "sched/engine_loop.h"
#include "server/api_error.h"
#include "server/openai_request.h"

namespace pagoda {
class kv_warehouse;
}

namespace pagoda::server {

// A validated warm call: the engine requests (ids set, nothing sampled).
struct warm_plan {
  std::string tenant;
  std::vector<request> requests;  // [prompt]
};

// What one prompt of a warm call gave.
struct warmed_prompt {
  int prompt_tokens = 0;
  int cached_tokens = 0;
  // Its full blocks in every KV group, as the engine's prefix cache and the store name them.
  std::vector<stored_block_ref> refs;
};

class kv_admin {
 public:
  // warehouse may be null (no store tier: warm fills the pool only).
  // REQUIRES: loop and warehouse outlive this.
  kv_admin(engine_loop& loop, kv_warehouse* warehouse, std::string admin_key);

  bool admin_enabled() const { return !admin_key_.empty(); }
  // Whether presented is the admin key (constant time).
  bool is_admin(std::string_view presented) const;
  engine_loop& loop() { return loop_; }

  // POST /v1/kv/warm, step 1 (any thread): the body into engine requests
  // named request_id/0, /1, ... tenant: the caller's, from its API key;
  // admin: whether it presented the admin key (then body["tenant"] may
  // choose another).
  api_result<warm_plan> plan_warm(const nlohmann::json& body, const api_context& ctx, const std::string& tenant,
                                  bool admin, const std::string& request_id) const;
  // Step 2 (engine thread, once the requests finished and their block ops
  // are applied: engine_loop::run_synced_async): the keys of each prompt's
  // full blocks, computed as the scheduler computes them (tenant, salt and
  // the KV classes of the prompt's typed parts).
  static void key_prompts(engine_core& core, const warm_plan& plan, std::vector<warmed_prompt>& out);
  // Step 3 (the store thread: it waits): waits until the warm's own blocks
  // are written back (not the rest of the queue), then counts them in the
  // tiers and builds the answer.
  nlohmann::json answer_warm(const warm_plan& plan, const std::vector<warmed_prompt>& out, const std::string& model_name);

  // GET /v1/kv/stats.
  nlohmann::json stats();
  // /health's detail: each store tier, up or down (and why); [] without a store.
  nlohmann::json health() const;

  // DELETE /v1/kv?tenant=NAME: the tenant named by the query ("-" is the
  // global tenant ""), or a 400 for a missing, empty or malformed name.
  static api_result<std::string> tenant_to_erase(const std::optional<std::string>& tenant_arg);
  // A tenant an admin names (query or body): "-" is the global tenant;
  // anything but a valid tenant name is a 400 naming `what`.
  static api_result<std::string> named_tenant(const std::string& name, std::string_view what);
  // Engine thread, inside engine_loop::close_tenant_async (the tenant's
  // requests aborted, every op applied): drops its cached blocks from the
  // pool; returns how many.
  static std::int32_t erase_in_pool(engine_core& core, const std::string& tenant);
  // The store thread, after erase_in_pool: waits for the write-back queue
  // (the tenant's blocks the engine handed over), then erases the tenant in
  // every tier and builds the answer.
  api_result<nlohmann::json> erase_in_store(const std::string& tenant, std::int32_t n_memory);

  // The store's Prometheus families (appended to /metrics); "" without a warehouse.
  std::string render_metrics(const engine_snapshot& snap, const std::string& model_name);

  // 403 for a call that needs the admin key.
  static api_error forbidden(std::string_view what);

 private:
  engine_loop& loop_;
  kv_warehouse* warehouse_;
  std::string admin_key_;
};

}  // namespace pagoda::server
