// The KV warehouse's endpoints, kept apart from the HTTP library:
//
//   POST   /v1/kv/warm        computes and persists the KV of a prompt (or chat)
//                             without generating: the body of a completion
//                             ("prompt") or chat ("messages") call, sampling
//                             fields ignored; answers once every full block is
//                             in the prefix cache and written to the store tiers.
//   GET    /v1/kv/stats       per tier (memory, disk, redis): entries, bytes,
//                             hits, misses, loads, errors; the write-back queue.
//   DELETE /v1/kv?tenant=NAME erases a tenant's cached KV from the pool and from
//                             every store tier ("" or "-" is the global tenant).
//
// Who may call them: warm runs as the caller's tenant (its API key decides,
// as for completions); with the admin key it may name any tenant in a
// "tenant" field. stats and DELETE need the admin key (`--admin-key`); without
// one configured they are refused (403), since they see and erase every
// tenant's data.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "sched/engine_loop.h"
#include "server/api_error.h"
#include "server/openai_request.h"

namespace pagoda {
class kv_warehouse;
}

namespace pagoda::server {

class kv_admin {
 public:
  // warehouse may be null (no store tier: warm fills the pool only).
  // REQUIRES: loop and warehouse outlive this.
  kv_admin(engine_loop& loop, kv_warehouse* warehouse, std::string admin_key);

  bool admin_enabled() const { return !admin_key_.empty(); }
  // Whether presented is the admin key (constant time).
  bool is_admin(std::string_view presented) const;

  // POST /v1/kv/warm. tenant: the caller's, from its API key; admin: whether
  // it presented the admin key (then body["tenant"] may choose another).
  // Blocks until the KV is computed and stored.
  api_result<nlohmann::json> warm(const nlohmann::json& body, const api_context& ctx, const std::string& tenant,
                                  bool admin, const std::string& request_id);
  // GET /v1/kv/stats.
  nlohmann::json stats();
  // DELETE /v1/kv?tenant=NAME.
  api_result<nlohmann::json> erase_tenant(const std::optional<std::string>& tenant);

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
