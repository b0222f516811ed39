#include "cli/engine_options.h"

#include <cstdlib>

namespace pagoda::cli {

void add_engine_options(CLI::App* app, engine_options& opts) {
  add_model_options(app, opts.config);
  add_kv_options(app, opts.config);
  app->add_option("--max-num-seqs", opts.config.max_num_seqs, "sequences running at once")->check(CLI::Range(1, 65536));
  app->add_option("--max-num-batched-tokens", opts.config.max_num_batched_tokens, "tokens per engine step")
      ->check(CLI::Range(1, 1 << 20));
  app->add_option("--scheduling-policy", opts.config.scheduling_policy,
                  "admission order of waiting requests: cache-aware (longest cached prefix first; the default), or fcfs")
      ->check(CLI::IsMember({"fcfs", "cache-aware"}));
  app->add_option("--max-passed-steps", opts.config.max_passed_steps,
                  "cache-aware: steps a request may be passed over by later arrivals before it goes in arrival order")
      ->check(CLI::Range(0, 1 << 20));
  // Two flags, not CLI11's "!--no-..." negation: --help would show the
  // negation's value ({false}) beside "default on".
  app->add_flag("--enable-prefix-caching", opts.config.enable_prefix_caching,
                "reuse cached KV blocks of shared prompt prefixes (default on)");
  app->add_flag_callback("--no-enable-prefix-caching", [&opts] { opts.config.enable_prefix_caching = false; },
                         "do not reuse cached KV blocks of shared prompt prefixes (wins over --enable-prefix-caching)");
  app->add_option("--prefix-cache-eviction", opts.config.prefix_cache_eviction,
                  "order cached prefix blocks are evicted in: lfu (reuse counts, aged: one-off prompts pass through "
                  "without flushing reused prefixes; the default) or lru")
      ->check(CLI::IsMember({"lfu", "lru"}));
  app->add_option("--tenant-quota", opts.tenant_quotas, "NAME=BLOCKS: cap a tenant's KV blocks (repeatable)");
  app->add_option("--kv-store", opts.kv_store,
                  "PATH[,size=GiB]: keep KV blocks on disk (LMDB) across restarts, default size 8 GiB");
  app->add_option("--kv-store-remote", opts.config.kv_store_remote,
                  "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?password_file=F] or rediss://...[?ca=F&cert=F&key=F] (TLS): "
                  "share KV blocks with other servers through Redis (docs/kv-store.md)");
  app->add_option("--kv-store-secret-file", opts.config.kv_store_secret_file,
                  "PATH: a secret (mode 0600) that MACs stored KV blocks, so a forged block is a miss; replicas "
                  "sharing a tier share it");
  app->add_option("--kv-store-ttl", opts.config.kv_store_ttl_s, "drop stored KV blocks unused this many seconds (0: never)")
      ->check(finite_range(0.0, 1e12));
}

status finish_engine_options(engine_options& opts) {
  for (const std::string& q : opts.tenant_quotas) PAGODA_RETURN_IF_ERROR(add_tenant_quota(opts.config, q));
  if (!opts.kv_store.empty()) PAGODA_RETURN_IF_ERROR(parse_kv_store_option(opts.config, opts.kv_store));
  return {};
}

result<engine_core_config> make_engine_config(const llama_model& model, engine_options opts) {
  PAGODA_RETURN_IF_ERROR(finish_engine_options(opts));
  return make_engine_core_config(model, opts.config);
}

engine_stack::~engine_stack() {
  if (!core) return;
  std::vector<engine_event> events;
  core->flush(events);
}

result<engine_stack> open_engine(const llama_model& model, engine_options opts) {
  PAGODA_RETURN_IF_ERROR(finish_engine_options(opts));
  PAGODA_ASSIGN_OR_RETURN(engine_core_config cfg, make_engine_core_config(model, opts.config));
  engine_stack s;
  PAGODA_ASSIGN_OR_RETURN(s.draft, load_draft_model(opts.config));
  cfg.draft_model = s.draft.get();
  PAGODA_ASSIGN_OR_RETURN(s.warehouse, make_warehouse(opts.config, model));
  PAGODA_ASSIGN_OR_RETURN(s.core, engine_core::create(model, cfg));
  if (s.warehouse) attach_warehouse(*s.core, *s.warehouse);
  return s;
}

result<std::unique_ptr<kv_warehouse>> open_warehouse(const llama_model& model, engine_options opts) {
  PAGODA_RETURN_IF_ERROR(finish_engine_options(opts));
  return make_warehouse(opts.config, model);
}

std::string default_kv_store_dir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/pagoda/kv";
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/pagoda/kv";
  return "";
}

}  // namespace pagoda::cli
