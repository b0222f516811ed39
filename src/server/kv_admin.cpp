#include "server/kv_admin.h"

#include <fmt/format.h>

#include "sched/engine_setup.h"
#include "server/auth.h"
#include "server/prometheus.h"
#include "store/store_key.h"
#include "store/warehouse.h"

namespace pagoda::server {

using nlohmann::json;

namespace {

constexpr std::chrono::milliseconds k_wait_slice{50};

// Per prompt of a warm call: what the engine reported and the blocks now stored.
struct warmed {
  int prompt_tokens = 0;
  int cached_tokens = 0;
  std::vector<stored_block_ref> refs;  // the prompt's full blocks, as the prefix cache and the store name them
};

}  // namespace

kv_admin::kv_admin(engine_loop& loop, kv_warehouse* warehouse, std::string admin_key)
    : loop_(loop), warehouse_(warehouse), admin_key_(std::move(admin_key)) {}

bool kv_admin::is_admin(std::string_view presented) const {
  return !admin_key_.empty() && constant_time_equal(presented, admin_key_);
}

api_error kv_admin::forbidden(std::string_view what) {
  api_error e;
  e.http_status = 403;
  e.type = "permission_error";
  e.code = "admin_key_required";
  e.message = fmt::format("{} needs the admin key (start the server with --admin-key and send it as the Bearer token)", what);
  return e;
}

api_result<json> kv_admin::warm(const json& body, const api_context& ctx, const std::string& caller_tenant, bool admin,
                                const std::string& request_id) {
  if (!body.is_object()) return bad_request("", "The request body must be a JSON object");
  std::string tenant = caller_tenant;
  json call_body = body;
  if (auto it = call_body.find("tenant"); it != call_body.end()) {
    if (!admin) return forbidden("Naming a tenant in /v1/kv/warm");
    if (!it->is_string()) return bad_request("tenant", "'tenant' must be a string");
    tenant = it->get<std::string>();
    if (tenant == "-") tenant.clear();
    call_body.erase(it);
  }
  const api_kind kind = call_body.contains("messages") ? api_kind::chat : api_kind::completion;
  api_result<api_call> parsed = parse_request(kind, call_body, ctx, tenant);
  if (!parsed.ok()) return parsed.error;
  api_call& call = *parsed.value;

  std::vector<std::string> ids;
  std::vector<request> reqs;
  for (std::size_t i = 0; i < call.requests.size(); ++i) {
    request r = std::move(call.requests[i]);
    r.id = fmt::format("{}/{}", request_id, i);
    r.max_tokens = 0;  // the prompt only: nothing is sampled
    r.n = 1;
    r.logprobs = -1;
    r.stop.clear();
    ids.push_back(r.id);
    reqs.push_back(std::move(r));
  }
  std::vector<warmed> out(reqs.size());
  // The keys come from the engine's own KV manager, so they name exactly what it caches.
  std::vector<std::vector<token_id>> prompts;
  for (const request& r : reqs) prompts.push_back(r.prompt);
  const std::string salt = reqs.empty() ? "" : reqs.front().cache_salt;

  auto channel = std::make_shared<request_channel>();
  if (status st = loop_.submit(std::move(reqs), channel); !st.ok()) return from_status(st);
  std::size_t n_finished = 0;
  std::vector<engine_event> events;
  while (n_finished < ids.size()) {
    events.clear();
    if (!channel->wait(events, k_wait_slice)) return from_status(channel->failure());
    for (const engine_event& e : events) {
      if (e.finish_reason == "error") {
        loop_.cancel(ids);
        return from_status(error(errc::internal, "computing the prompt's KV failed: {}", e.error));
      }
      if (!e.request_finished) continue;
      for (std::size_t i = 0; i < ids.size(); ++i)
        if (ids[i] == e.request_id) out[i] = {e.usage.prompt_tokens, e.usage.cached_tokens, {}};
      ++n_finished;
    }
  }
  // Every block the prompts filled is committed; once the ops of that step are
  // applied, the commit hook has queued them for the store tiers.
  const status synced = loop_.run_synced([&](engine_core& core) {
    for (std::size_t i = 0; i < prompts.size(); ++i)
      out[i].refs = prompt_refs(core, prompts[i], sequence_options{tenant, salt, true});
  });
  if (!synced.ok()) return from_status(synced);
  if (warehouse_) warehouse_->flush();

  json prompts_json = json::array();
  int total_tokens = 0, total_cached = 0, total_blocks = 0, total_stored = 0;
  for (const warmed& w : out) {
    const int blocks = static_cast<int>(w.refs.size());
    const int stored = warehouse_ ? warehouse_->n_stored(tenant, w.refs) : 0;
    prompts_json.push_back({{"prompt_tokens", w.prompt_tokens},
                            {"cached_tokens", w.cached_tokens},
                            {"blocks", blocks},
                            {"stored_blocks", stored}});
    total_tokens += w.prompt_tokens;
    total_cached += w.cached_tokens;
    total_blocks += blocks;
    total_stored += stored;
  }
  return json{{"object", "kv.warm"},
              {"model", ctx.model_names.front()},
              {"tenant", tenant},
              {"prompt_tokens", total_tokens},
              {"cached_tokens", total_cached},
              {"blocks", total_blocks},
              {"stored_blocks", total_stored},
              {"store_tiers", warehouse_ ? json(warehouse_->tier_names()) : json::array()},
              {"prompts", prompts_json}};
}

namespace {

store_metrics gather(const engine_snapshot& snap, kv_warehouse* warehouse) {
  store_metrics m;
  store_metrics::tier mem;
  mem.name = "memory";
  mem.hits = snap.kv.n_prefix_hit_blocks;
  mem.misses = snap.kv.n_prefix_query_blocks - snap.kv.n_prefix_hit_blocks;
  mem.loads = mem.errors = mem.writes = -1;  // not a store: nothing is loaded into or written to it
  mem.evictions = snap.kv.n_evictions;
  mem.entries = snap.kv.n_blocks_used + snap.kv.n_blocks_cached;
  mem.capacity_bytes = 0;
  m.tiers.push_back(mem);
  if (!warehouse) return m;
  const warehouse_counters c = warehouse->counters();
  const std::vector<store_tier_stats> stats = warehouse->tier_stats();
  std::vector<histogram_snapshot> lat = warehouse->load_seconds_by_tier();
  for (std::size_t i = 0; i < stats.size(); ++i) {
    const store_tier_stats& s = stats[i];
    store_metrics::tier t;
    t.name = s.tier;
    t.hits = s.hits;
    t.misses = s.misses;
    t.loads = i < c.loads_by_tier.size() ? c.loads_by_tier[i] : 0;
    t.errors = s.errors;
    t.writes = s.writes;
    t.evictions = s.evictions;
    t.entries = s.entries;
    t.bytes = s.bytes;
    t.capacity_bytes = s.capacity_bytes;
    if (i < lat.size()) t.load_seconds = std::move(lat[i]);
    m.tiers.push_back(std::move(t));
  }
  m.queue_blocks = c.queue_blocks;
  m.dropped = c.dropped;
  m.write_errors = c.write_errors;
  m.corrupt = c.corrupt;
  m.load_misses = c.load_misses;
  return m;
}

}  // namespace

json kv_admin::stats() {
  const engine_snapshot snap = loop_.snapshot();
  const store_metrics m = gather(snap, warehouse_);
  json tiers = json::array();
  for (const store_metrics::tier& t : m.tiers) {
    json j = {{"tier", t.name}, {"hits", t.hits}, {"misses", t.misses}, {"evictions", t.evictions}};
    j["entries"] = t.entries >= 0 ? json(t.entries) : json(nullptr);
    j["bytes"] = t.bytes >= 0 ? json(t.bytes) : json(nullptr);
    if (t.capacity_bytes > 0) j["capacity_bytes"] = t.capacity_bytes;
    if (t.loads >= 0) j["loads"] = t.loads;
    if (t.errors >= 0) j["errors"] = t.errors;
    if (t.writes >= 0) j["writes"] = t.writes;
    if (t.load_seconds && t.load_seconds->count > 0)
      j["load_seconds_mean"] = t.load_seconds->sum / static_cast<double>(t.load_seconds->count);
    tiers.push_back(std::move(j));
  }
  json out = {{"object", "kv.stats"}, {"block_size_tokens", snap.kv.block_size_tokens}, {"tiers", tiers}};
  if (warehouse_) {
    const warehouse_counters c = warehouse_->counters();
    out["write_back"] = {{"queued", c.queued},
                         {"written", c.written},
                         {"already_stored", c.already_stored},
                         {"dropped", c.dropped},
                         {"errors", c.write_errors},
                         {"queue_blocks", c.queue_blocks}};
    out["loads"] = {{"lookups", c.lookups},   {"pending", c.lookups_pending}, {"loaded", c.loads},
                    {"misses", c.load_misses}, {"corrupt", c.corrupt},        {"refused", c.prefetch_refused}};
  }
  return out;
}

api_result<json> kv_admin::erase_tenant(const std::optional<std::string>& tenant_arg) {
  if (!tenant_arg) return bad_request("tenant", "DELETE /v1/kv needs ?tenant=NAME ('-' for the global tenant)");
  const std::string tenant = *tenant_arg == "-" ? std::string() : *tenant_arg;
  std::int32_t n_memory = 0;
  // First the pool (after the ops already queued, which may still hand the
  // tenant's blocks to the store), then every store tier.
  const status st = loop_.run_synced([&](engine_core& core) { n_memory = core.kv().evict_cached_blocks(tenant); });
  if (!st.ok()) return from_status(st);
  json tiers = json::array({json{{"tier", "memory"}, {"erased", n_memory}}});
  if (warehouse_) {
    for (const auto& tier : warehouse_->tiers()) {
      warehouse_->flush();  // nothing of the tenant may land after its erase
      result<std::size_t> n = tier->erase_tenant(tenant_hash(tenant));
      if (!n.ok()) return from_status(n.error());
      tiers.push_back({{"tier", tier->tier()}, {"erased", *n}});
    }
  }
  return json{{"object", "kv.deleted"}, {"tenant", tenant}, {"tiers", tiers}};
}

std::string kv_admin::render_metrics(const engine_snapshot& snap, const std::string& model_name) {
  return render_store_metrics(gather(snap, warehouse_), model_name);
}

}  // namespace pagoda::server
