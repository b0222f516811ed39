// pagoda serve: the OpenAI-compatible HTTP server (src/server) on one model.
//
// The engine runs on its own thread (engine_loop); the HTTP threads parse,
// submit and stream. SIGINT / SIGTERM stop the engine (in-flight requests end
// with finish_reason "abort") and then the server.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/engine_options.h"
#include "server/api_setup.h"
#include "server/http_server.h"

namespace pagoda::cli {
namespace {

struct serve_options {
  engine_options engine;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::vector<std::string> api_keys;
  std::string admin_key;  // the /v1/kv admin endpoints (also $PAGODA_ADMIN_KEY)
  std::string tenants_file;
  std::string chat_template;  // "" = from the model
  std::string served_model_name;
  int max_waiting = 128;
  std::size_t max_body_bytes = 4u << 20;
  int max_prompt_tokens = 0;  // 0: the context
  int max_tokens_limit = 0;   // 0: the context
  int max_n = 16;
  int http_threads = 0;       // 0: enough for every running and waiting request
  bool no_kv_store = false;   // no disk tier (else --kv-store, or the per-user default)
};

int serve(serve_options o) {
  if (o.no_kv_store) {
    if (!o.engine.kv_store.empty()) return fail(error(errc::invalid_argument, "--kv-store and --no-kv-store conflict"));
  } else if (o.engine.kv_store.empty()) {
    o.engine.kv_store = default_kv_store_dir();
  }
  PAGODA_ASSIGN_OR_RETURN_CLI(auto model, load_model(o.engine.config));
  PAGODA_ASSIGN_OR_RETURN_CLI(engine_core_config cfg, make_engine_config(*model, o.engine));
  cfg.max_waiting = o.max_waiting;

  server::key_store keys;
  for (const std::string& k : o.api_keys)
    if (auto st = keys.add(k, ""); !st.ok()) return fail(st.with_context("--api-key"));
  if (const char* env = std::getenv("PAGODA_API_KEY"); env && *env)
    if (auto st = keys.add(env, ""); !st.ok()) return fail(st.with_context("PAGODA_API_KEY"));
  if (!o.tenants_file.empty()) {
    PAGODA_ASSIGN_OR_RETURN_CLI(auto tenants, server::load_tenants_file(o.tenants_file));
    if (auto st = keys.add_tenants(tenants); !st.ok()) return fail(st.with_context(o.tenants_file));
    for (const server::tenant_spec& t : tenants) {
      if (!t.quota_blocks) continue;
      if (cfg.tenant_quota_blocks.contains(t.name))
        return fail(error(errc::invalid_argument, "tenant '{}' has a quota both in {} and in --tenant-quota", t.name,
                          o.tenants_file));
      cfg.tenant_quota_blocks[t.name] = *t.quota_blocks;
    }
  }

  server::api_options aopts;
  aopts.model_path = o.engine.config.model_path;
  aopts.served_model_name = o.served_model_name;
  aopts.chat_template = o.chat_template;
  aopts.max_prompt_tokens = o.max_prompt_tokens;
  aopts.max_tokens_limit = o.max_tokens_limit;
  aopts.max_n = o.max_n;
  std::string warning;
  PAGODA_ASSIGN_OR_RETURN_CLI(server::api_context ctx, server::make_api_context(*model, cfg.max_model_len, aopts, &warning));
  if (!warning.empty()) std::fprintf(stderr, "pagoda serve: warning: %s\n", warning.c_str());

  server::server_options sopts;
  sopts.host = o.host;
  sopts.port = o.port;
  sopts.max_body_bytes = o.max_body_bytes;
  sopts.n_http_threads =
      o.http_threads > 0 ? o.http_threads : std::min(1024, o.engine.config.max_num_seqs + o.max_waiting + 16);

  // Signals go to one waiting thread; block them before any thread starts so
  // every thread inherits the mask.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);
  signal(SIGXFSZ, SIG_IGN);  // a file size limit fails the store's writes (EFBIG), not the server

  const bool auth_required = keys.enabled();
  PAGODA_ASSIGN_OR_RETURN_CLI(auto eng, engine_core::create(*model, cfg));
  // Declared before the loop: the engine thread writes to it until the loop
  // stops; its destructor then drains the write-back queue.
  PAGODA_ASSIGN_OR_RETURN_CLI(std::unique_ptr<kv_warehouse> warehouse, open_warehouse(*model, o.engine, cfg));
  if (warehouse) attach_warehouse(*eng, *warehouse);
  if (warehouse) ctx.store_tiers = warehouse->tier_names();
  const kv_metrics kv = eng->kv_stats();
  engine_loop loop(std::move(eng), o.max_waiting);
  std::string admin_key = o.admin_key;
  if (const char* env = std::getenv("PAGODA_ADMIN_KEY"); admin_key.empty() && env) admin_key = env;
  server::kv_admin kv_admin(loop, warehouse.get(), admin_key);
  server::http_server http(sopts, ctx, std::move(keys), loop, &kv_admin);
  PAGODA_ASSIGN_OR_RETURN_CLI(int port, http.bind());

  std::fprintf(stderr,
               "pagoda serve: model '%s' (%s), context %d, KV pool %d blocks of %d tokens, chat template %s, "
               "%s, %d HTTP threads\n",
               ctx.model_names.front().c_str(), o.engine.config.model_path.c_str(), cfg.max_model_len, kv.n_blocks_total,
               kv.block_size_tokens, server::chat_format_name(ctx.chat),
               auth_required ? "API keys required" : "no API key",
               sopts.n_http_threads);
  if (warehouse) {
    std::string tiers;
    for (const auto& t : warehouse->tiers()) tiers += std::string(tiers.empty() ? "" : " -> ") + t->tier();
    std::fprintf(stderr, "pagoda serve: KV store %s%s%s (--no-kv-store turns it off)\n", tiers.c_str(),
                 o.engine.kv_store.empty() ? "" : " at ", o.engine.kv_store.c_str());
  }
  // One line on stdout that scripts and tests wait for (with --port 0 it names the port).
  std::printf("pagoda serve: listening on http://%s:%d\n", o.host.c_str(), port);
  std::fflush(stdout);
  std::fprintf(stderr,
               "pagoda serve: try: curl http://%s:%d/v1/completions -H 'Content-Type: application/json'%s "
               "-d '{\"prompt\": \"Once upon a time\", \"max_tokens\": 32}'\n",
               o.host.c_str(), port, auth_required ? " -H 'Authorization: Bearer $KEY'" : "");

  std::atomic<bool> served{false};
  std::thread signal_waiter([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (served) return;  // woken below after serve() ended on its own
    std::fprintf(stderr, "pagoda serve: %s, stopping\n", sig == SIGINT ? "interrupted" : "terminated");
    loop.stop();
    http.stop();
  });
  status st = http.serve();
  loop.stop();
  served = true;
  pthread_kill(signal_waiter.native_handle(), SIGTERM);
  signal_waiter.join();
  if (!st.ok()) return fail(st);
  return 0;
}

}  // namespace

void register_serve(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<serve_options>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)");
  add_engine_options(cmd, opts->engine);
  cmd->add_option("--host", opts->host, "address to listen on (default 127.0.0.1)");
  cmd->add_option("--port", opts->port, "port to listen on; 0 picks a free one (default 8080)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", opts->api_keys,
                  "require 'Authorization: Bearer KEY' on /v1 (repeatable; also $PAGODA_API_KEY)");
  cmd->add_option("--admin-key", opts->admin_key,
                  "the key for the KV store's admin endpoints: GET /v1/kv/stats, DELETE /v1/kv, warming for any "
                  "tenant (also $PAGODA_ADMIN_KEY; default: none, those endpoints answer 403)");
  cmd->add_option("--tenants", opts->tenants_file, "JSON file mapping API keys to tenants and their block quotas");
  cmd->add_option("--chat-template", opts->chat_template,
                  "chat format: plain, chatml, llama2, llama3, mistral, gemma, phi3, zephyr, deepseek, deepseek3 "
                  "(default: recognised from the model)");
  cmd->add_option("--served-model-name", opts->served_model_name, "the model's name in the API (default: file name)");
  cmd->add_option("--max-waiting", opts->max_waiting, "requests queued at once before 429 (default 128)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-body-bytes", opts->max_body_bytes, "largest request body; larger gets 413 (default 4 MiB)")
      ->check(CLI::Range(std::size_t{1024}, std::size_t{1} << 30));
  cmd->add_option("--max-prompt-tokens", opts->max_prompt_tokens, "longest prompt accepted (default: the context)")
      ->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--max-tokens-limit", opts->max_tokens_limit, "largest max_tokens a request may ask (default: the context)")
      ->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--max-n", opts->max_n, "most choices per request, n x prompts (default 16)")->check(CLI::Range(1, 128));
  cmd->add_option("--http-threads", opts->http_threads, "HTTP connections served at once (default: max-num-seqs + max-waiting + 16)")
      ->check(CLI::Range(0, 4096));
  cmd->add_flag("--no-kv-store", opts->no_kv_store,
                "keep KV blocks in memory only (default: a disk store at $XDG_CACHE_HOME/pagoda/kv or ~/.cache/pagoda/kv, "
                "8 GiB; --kv-store picks another)");
  cmd->callback([opts, &action] { action = [opts] { return serve(*opts); }; });
}

}  // namespace pagoda::cli
