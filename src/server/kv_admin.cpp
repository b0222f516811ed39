#include "server/kv_admin.h"

#include <fmt/format.h>

#include "sched/engine_setup.h"
#include "server/auth.h"
#include "server/prometheus.h"
#include "store/store_key.h"
#include "store/warehouse.h"

namespace pagoda::server {

using nlohmann::json;

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

api_result<warm_plan> kv_admin::plan_warm(const json& body, const api_context& ctx, const std::string& caller_tenant,
                                          bool admin, const std::string& request_id) const {
  if (!body.is_object()) return bad_request("", "The request body must be a JSON object");
  warm_plan plan;
  plan.tenant = caller_tenant;
  json call_body = body;
  if (auto it = call_body.find("tenant"); it != call_body.end()) {
    if (!admin) return forbidden("Naming a tenant in /v1/kv/warm");
    if (!it->is_string()) return bad_request("tenant", "'tenant' must be a string");
    api_result<std::string> named = named_tenant(it->get<std::string>(), "'tenant'");
    if (!named.ok()) return named.error;
    plan.tenant = *named.value;
    call_body.erase(it);
  }
  const api_kind kind = call_body.contains("messages") ? api_kind::chat : api_kind::completion;
  api_result<api_call> parsed = parse_request(kind, call_body, ctx, plan.tenant);
  if (!parsed.ok()) return parsed.error;
  api_call& call = *parsed.value;
  for (std::size_t i = 0; i < call.requests.size(); ++i) {
    request r = std::move(call.requests[i]);
    r.id = fmt::format("{}/{}", request_id, i);
    r.max_tokens = 0;  // the prompt only: nothing is sampled
    r.n = 1;
    r.logprobs = -1;
    r.stop.clear();
    plan.requests.push_back(std::move(r));
  }
  return plan;
}

void kv_admin::key_prompts(engine_core& core, const warm_plan& plan, std::vector<warmed_prompt>& out) {
  out.resize(plan.requests.size());
  for (std::size_t i = 0; i < plan.requests.size(); ++i) {
    const request& r = plan.requests[i];
    // The classes the scheduler gave the prompt's typed parts (its add_request
    // refused a type the engine lacks, so each is found here).
    std::vector<kv_class_run> classes;
    for (const prompt_segment& p : r.segments) {
      if (p.kv_type.empty()) continue;
      const result<std::uint8_t> cls = find_kv_class(core.config(), p.kv_type);
      if (cls.ok() && *cls != 0) classes.push_back(kv_class_run{p.begin, p.end, *cls});
    }
    out[i].refs = prompt_refs(core, r.prompt, sequence_options{plan.tenant, r.cache_salt, true, classes});
  }
}

json kv_admin::answer_warm(const warm_plan& plan, const std::vector<warmed_prompt>& out, const std::string& model_name) {
  if (warehouse_) {
    // Every block the prompts filled is committed and its op applied, so the
    // commit hook has queued it: wait for these blocks only.
    std::vector<stored_block_ref> all;
    for (const warmed_prompt& w : out) all.insert(all.end(), w.refs.begin(), w.refs.end());
    warehouse_->flush(plan.tenant, all);
  }
  json prompts_json = json::array();
  int total_tokens = 0, total_cached = 0, total_blocks = 0, total_stored = 0;
  for (const warmed_prompt& w : out) {
    const int blocks = static_cast<int>(w.refs.size());
    const int stored = warehouse_ ? warehouse_->n_stored(plan.tenant, w.refs) : 0;
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
              {"model", model_name},
              {"tenant", plan.tenant},
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
    if (s.tier == "disk") {
      t.quarantined = s.quarantined;
      t.compactions = s.compactions;
    }
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
  m.forged = c.forged;
  m.load_misses = c.load_misses;
  return m;
}

}  // namespace

json kv_admin::health() const {
  json tiers = json::array();
  if (!warehouse_) return tiers;
  for (const auto& t : warehouse_->tiers()) {
    const std::string why = t->down_reason();
    json one = {{"tier", t->tier()}, {"up", why.empty()}};
    if (!why.empty()) one["reason"] = why;
    tiers.push_back(std::move(one));
  }
  return tiers;
}

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
    if (t.quarantined >= 0) j["quarantined"] = t.quarantined;
    if (t.compactions >= 0) j["compactions"] = t.compactions;
    if (t.load_seconds && t.load_seconds->count > 0)
      j["load_seconds_mean"] = t.load_seconds->sum / static_cast<double>(t.load_seconds->count);
    tiers.push_back(std::move(j));
  }
  json out = {{"object", "kv.stats"}, {"block_size_tokens", snap.kv.block_size_tokens}, {"tiers", tiers}};
  // Side memory paid in pool blocks (kv_manager.h, "Side blocks"): the pool's budget covers it.
  out["side_memory"] = {{"blocks", snap.kv.n_side_blocks},
                        {"block_bytes", snap.kv.side_block_bytes},
                        {"charged_bytes", static_cast<std::int64_t>(snap.kv.n_side_blocks) * snap.kv.side_block_bytes},
                        {"measured_bytes", snap.kv.side_measured_bytes},
                        {"bound_bytes", snap.kv.side_bound_bytes}};
  if (warehouse_) {
    const warehouse_counters c = warehouse_->counters();
    out["write_back"] = {{"queued", c.queued},
                         {"written", c.written},
                         {"already_stored", c.already_stored},
                         {"dropped", c.dropped},
                         {"errors", c.write_errors},
                         {"queue_blocks", c.queue_blocks}};
    out["loads"] = {{"lookups", c.lookups},   {"pending", c.lookups_pending}, {"loaded", c.loads},
                    {"misses", c.load_misses}, {"corrupt", c.corrupt},        {"forged", c.forged},
                    {"refused", c.prefetch_refused}};
  }
  return out;
}

api_result<std::string> kv_admin::named_tenant(const std::string& name, std::string_view what) {
  // "" is not a way to say the global tenant: an empty parameter is far more
  // often a client's missing variable than a wish to erase everyone's cache.
  if (name == "-") return std::string();
  if (!valid_tenant_name(name))
    return bad_request("tenant", fmt::format("{} must be a tenant name (1-64 characters of [A-Za-z0-9_.-]) or '-' for "
                                             "the global tenant",
                                             what));
  return name;
}

api_result<std::string> kv_admin::tenant_to_erase(const std::optional<std::string>& tenant_arg) {
  if (!tenant_arg) return bad_request("tenant", "DELETE /v1/kv needs ?tenant=NAME ('-' for the global tenant)");
  return named_tenant(*tenant_arg, "?tenant=");
}

std::int32_t kv_admin::erase_in_pool(engine_core& core, const std::string& tenant) {
  return core.kv().evict_cached_blocks(tenant);
}

api_result<json> kv_admin::erase_in_store(const std::string& tenant, std::int32_t n_memory) {
  json tiers = json::array({json{{"tier", "memory"}, {"erased", n_memory}}});
  if (warehouse_) {
    // The tenant's blocks the engine handed over are queued among others'
    // (no write-back of the tenant can start after this: it runs nothing).
    warehouse_->flush();
    for (const auto& tier : warehouse_->tiers()) {
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
