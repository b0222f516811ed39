// pagoda serve: the OpenAI-compatible HTTP server (src/server) on one model.
//
// The engine runs on its own thread (engine_loop); one or a few I/O threads
// serve every connection and a small worker pool parses and tokenizes
// (server/http_server.h). SIGINT / SIGTERM stop the engine (in-flight requests
// end with finish_reason "abort") and then the server.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <fmt/ranges.h>

#include "cli/commands.h"
#include "cli/engine_options.h"
#include "server/api_setup.h"
#include "server/http_server.h"
#include "server/image_input.h"

namespace pagoda::cli {
namespace {

struct serve_options {
  engine_options engine;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::vector<std::string> api_keys;
  std::string api_key_file;
  std::string admin_key;  // the /v1/kv admin endpoints (also $PAGODA_ADMIN_KEY)
  std::string tenants_file;
  bool no_auth = false;
  std::string chat_template;  // "" = from the model
  std::string served_model_name;
  std::string model_positional;  // `serve MODEL` (vLLM's spelling of -m)
  int max_waiting = 128;
  int max_prompt_tokens = 0;  // 0: the context
  int max_tokens_limit = 0;   // 0: the context
  int max_n = 16;
  int max_tokenize_tokens = 0;  // 0: the larger of 65536 and the context
  bool no_kv_store = false;   // no disk tier (else --kv-store, or the per-user default)
  server::http_limits limits;
  double header_timeout_s = 10, body_timeout_s = 60, idle_timeout_s = 75, send_timeout_s = 60;
  int io_threads = 2;
  int workers = 2;
  double stats_interval_s = 10;
  bool no_access_log = false;
  std::vector<std::string> cors_origins;
  // Images (docs/serving.md, "Images"): the vision projector and its limits.
  std::string mmproj;
  server::image_options images;
  int image_threads = 0;  // 0: the engine's --threads
  int image_cache_mb = 64;  // --image-cache-mb
};

// The keys from --api-key, $PAGODA_API_KEY, --api-key-file and --tenants; the
// tenants' quotas go into cfg. A key source that yields no key is an error
// unless --no-auth says that an open server is meant.
result<server::key_store> load_keys(const serve_options& o, engine_core_config& cfg) {
  server::key_store keys;
  for (const std::string& k : o.api_keys) PAGODA_RETURN_IF_ERROR(keys.add(k, "").with_context("--api-key"));
  if (const char* env = std::getenv("PAGODA_API_KEY"); env && *env)
    PAGODA_RETURN_IF_ERROR(keys.add(env, "").with_context("PAGODA_API_KEY"));
  if (!o.api_key_file.empty()) {
    PAGODA_ASSIGN_OR_RETURN(std::vector<std::string> file_keys, server::load_api_key_file(o.api_key_file));
    for (std::string& k : file_keys) PAGODA_RETURN_IF_ERROR(keys.add(std::move(k), "").with_context(o.api_key_file));
  }
  if (!o.tenants_file.empty()) {
    PAGODA_ASSIGN_OR_RETURN(auto tenants, server::load_tenants_file(o.tenants_file));
    if (tenants.empty() && !o.no_auth)
      return error(errc::invalid_argument,
                   "{} lists no tenant, so no request could authenticate; add one, or pass --no-auth to serve "
                   "without API keys", o.tenants_file);
    PAGODA_RETURN_IF_ERROR(keys.add_tenants(tenants).with_context(o.tenants_file));
    for (const server::tenant_spec& t : tenants) {
      if (!t.quota_blocks) continue;
      if (cfg.tenant_quota_blocks.contains(t.name))
        return error(errc::invalid_argument, "tenant '{}' has a quota both in {} and in --tenant-quota", t.name,
                     o.tenants_file);
      cfg.tenant_quota_blocks[t.name] = *t.quota_blocks;
    }
  }
  if (o.no_auth && keys.enabled())
    return error(errc::invalid_argument, "--no-auth conflicts with the API keys given (--api-key, $PAGODA_API_KEY, "
                                         "--api-key-file, --tenants)");
  return keys;
}

server::server_options http_options(const serve_options& o) {
  using ms = std::chrono::milliseconds;
  auto millis = [](double s) { return ms(static_cast<std::int64_t>(s * 1000.0)); };
  server::server_options s;
  s.host = o.host;
  s.port = o.port;
  s.limits = o.limits;
  s.limits.header_timeout = millis(o.header_timeout_s);
  s.limits.body_timeout = millis(o.body_timeout_s);
  s.limits.idle_timeout = millis(o.idle_timeout_s);
  s.limits.send_timeout = millis(o.send_timeout_s);
  s.n_io_threads = o.io_threads;
  s.n_workers = o.workers;
  s.access_log = !o.no_access_log;
  s.stats_interval = millis(o.stats_interval_s);
  s.version = PAGODA_VERSION_STRING;
  s.cors_origins = o.cors_origins;
  // Every connection is a descriptor: keep some for the model, the store and logs.
  constexpr int k_reserved_fds = 256;
  const int fds = server::raise_open_file_limit();
  if (fds > 0 && s.limits.max_connections > fds - k_reserved_fds) {
    const int cap = std::max(16, fds - k_reserved_fds);
    std::fprintf(stderr, "pagoda serve: warning: --max-connections %d is above what %d open files allow; using %d\n",
                 s.limits.max_connections, fds, cap);
    s.limits.max_connections = cap;
  }
  return s;
}

void print_startup(const serve_options& o, const server::api_context& ctx, const engine_core_config& cfg,
                   const kv_metrics& kv, const server::server_options& sopts, bool auth_required) {
  std::fprintf(stderr, "pagoda serve: model '%s' (%s), context %d, %s, chat template %s, %s\n",
               ctx.model_names.front().c_str(), o.engine.config.model_path.c_str(), cfg.max_model_len,
               kv_pool_line(cfg, kv).c_str(), server::chat_format_name(ctx.chat),
               auth_required ? "API keys required" : "no API key");
  std::fprintf(stderr,
               "pagoda serve: HTTP: %d I/O thread(s), %d worker(s), at most %d connections, header %zu bytes / %d "
               "fields / %.0f s, body %zu bytes / %.0f s, idle %.0f s\n",
               sopts.n_io_threads, sopts.n_workers, sopts.limits.max_connections, sopts.limits.max_header_bytes,
               sopts.limits.max_header_count, o.header_timeout_s, sopts.limits.max_body_bytes, o.body_timeout_s,
               o.idle_timeout_s);
  if (ctx.images) {
    const server::image_options& io = ctx.images->options();
    const vision::vision_hparams& hp = ctx.images->mmproj().hparams();
    std::fprintf(stderr,
                 "pagoda serve: images: %s (%s, %dx%d, %d tokens per chunk), at most %d per request, %s / %lld "
                 "pixels / %d px a side each, encoded on %d thread(s) beside the engine%s%s%s%s\n",
                 o.mmproj.c_str(), vision::projector_name(hp.projector), hp.image_size, hp.image_size,
                 hp.n_output_tokens(), io.max_images,
                 human_bytes(static_cast<double>(io.limits.max_bytes)).c_str(),
                 static_cast<long long>(io.limits.max_pixels), io.limits.max_side, ctx.images->n_threads(),
                 cfg.kv_image_type.empty() ? "" : ", KV type ", cfg.kv_image_type.c_str(),
                 cfg.kv_image_policy.empty() ? "" : ", KV policy ", cfg.kv_image_policy.c_str());
  }
  if (!o.cors_origins.empty())
    std::fprintf(stderr, "pagoda serve: CORS: pages from %s may call the API (--cors-origin)\n",
                 fmt::format("{}", fmt::join(o.cors_origins, ", ")).c_str());
  if (!auth_required && o.host != "127.0.0.1" && o.host != "localhost" && o.host != "::1")
    std::fprintf(stderr, "pagoda serve: warning: listening on %s without API keys: anyone who reaches it can use it\n",
                 o.host.c_str());
}

int serve(serve_options o) {
  if (o.no_kv_store) {
    if (!o.engine.kv_store.empty()) return fail(error(errc::invalid_argument, "--kv-store and --no-kv-store conflict"));
  }
  const bool default_store = !o.no_kv_store && o.engine.kv_store.empty();
  if (default_store) o.engine.kv_store = default_kv_store_dir();
  PAGODA_ASSIGN_OR_RETURN_CLI(auto model, load_model(o.engine.config));
  PAGODA_ASSIGN_OR_RETURN_CLI(engine_core_config cfg, make_engine_config(*model, o.engine));
  auto loaded = load_draft_model(o.engine.config);  // outlives the engine below
  if (!loaded.ok()) return fail_engine(loaded.error());  // as run and batch: a bad --draft-model is a usage error
  auto draft = std::move(*loaded);
  cfg.draft_model = draft.get();
  cfg.max_waiting = o.max_waiting;
  PAGODA_ASSIGN_OR_RETURN_CLI(server::key_store keys, load_keys(o, cfg));

  server::api_options aopts;
  aopts.model_path = o.engine.config.model_path;
  aopts.served_model_name = o.served_model_name;
  aopts.chat_template = o.chat_template;
  aopts.max_prompt_tokens = o.max_prompt_tokens;
  aopts.max_tokens_limit = o.max_tokens_limit;
  aopts.default_kv_policy = cfg.kv_policy;
  aopts.max_n = o.max_n;
  aopts.max_tokenize_tokens = o.max_tokenize_tokens;
  std::string warning;
  PAGODA_ASSIGN_OR_RETURN_CLI(server::api_context ctx, server::make_api_context(*model, cfg.max_model_len, aopts, &warning));
  if (!warning.empty()) std::fprintf(stderr, "pagoda serve: warning: %s\n", warning.c_str());
  // Before the engine takes its pool: a wrong --mmproj stops the server at once.
  std::unique_ptr<server::image_input> images;
  if (!o.mmproj.empty()) {
    server::image_options io = o.images;
    io.n_threads = o.image_threads > 0 ? o.image_threads : o.engine.config.n_threads;
    io.cache_bytes = static_cast<std::size_t>(o.image_cache_mb) << 20;
    PAGODA_ASSIGN_OR_RETURN_CLI(images, server::image_input::open(o.mmproj, *model, io));
    ctx.images = images.get();
  }
  const server::server_options sopts = http_options(o);

  // Signals go to one waiting thread; block them before any thread starts so
  // every thread inherits the mask.
  sigset_t sigs = block_stop_signals();
  signal(SIGXFSZ, SIG_IGN);  // a file size limit fails the store's writes (EFBIG), not the server

  const bool auth_required = keys.enabled();
  auto made = engine_core::create(*model, cfg);
  if (!made.ok()) return fail_engine(made.error());
  auto eng = std::move(*made);
  // Declared before the loop: the engine thread writes to it until the loop
  // stops; its destructor then drains the write-back queue.
  auto opened = open_warehouse(*model, o.engine);
  if (!opened.ok() && default_store && opened.error().code() == errc::resource_exhausted) {
    // The default directory held by another server on this machine (a second
    // replica, another model): serve without a disk tier rather than not at
    // all; a directory given with --kv-store stays an error.
    std::fprintf(stderr, "pagoda serve: warning: %s; serving without a disk tier (give each server its own --kv-store)\n",
                 opened.error().message().c_str());
    o.engine.kv_store.clear();
    opened = open_warehouse(*model, o.engine);
  }
  if (!opened.ok()) return fail(opened.error());
  std::unique_ptr<kv_warehouse> warehouse = std::move(*opened);
  if (warehouse) attach_warehouse(*eng, *warehouse);
  if (warehouse) ctx.store_tiers = warehouse->tier_names();
  const kv_metrics kv = eng->kv_stats();
  engine_loop loop(std::move(eng), o.max_waiting);
  std::string admin_key = o.admin_key;
  if (const char* env = std::getenv("PAGODA_ADMIN_KEY"); admin_key.empty() && env) admin_key = env;
  server::kv_admin kv_admin(loop, warehouse.get(), admin_key);
  server::http_server http(sopts, ctx, std::move(keys), loop, &kv_admin);
  PAGODA_ASSIGN_OR_RETURN_CLI(int port, http.bind());

  print_startup(o, ctx, cfg, kv, sopts, auth_required);
  if (warehouse) {
    std::string tiers;
    for (const auto& t : warehouse->tiers()) {
      tiers += std::string(tiers.empty() ? "" : " -> ") + t->tier();
      if (std::string_view(t->tier()) == "redis")  // where, never the password
        if (auto r = parse_redis_url(o.engine.config.kv_store_remote); r.ok())
          tiers += fmt::format(" ({}://{}:{}/{})", r->tls ? "rediss" : "redis", r->host, r->port, r->db);
    }
    std::fprintf(stderr, "pagoda serve: KV store %s%s%s (--no-kv-store turns it off); records %s\n", tiers.c_str(),
                 o.engine.kv_store.empty() ? "" : " at ", o.engine.kv_store.c_str(),
                 o.engine.config.kv_store_secret_file.empty()
                     ? "only checksummed: whoever can write the store can forge them (--kv-store-secret-file)"
                     : "MACed under --kv-store-secret-file");
  }
  // One line on stdout that scripts and tests wait for (with --port 0 it names the port).
  std::printf("pagoda serve: listening on http://%s:%d\n", o.host.c_str(), port);
  std::fflush(stdout);
  std::fprintf(stderr,
               "pagoda serve: try: curl http://%s:%d/v1/completions -H 'Content-Type: application/json'%s "
               "-d '{\"prompt\": \"Once upon a time\", \"max_tokens\": 32}'\n",
               o.host.c_str(), port, auth_required ? " -H \"Authorization: Bearer $KEY\"" : "");

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

// The HTTP limits (server/http_limits.h says where each default comes from).
void add_http_options(CLI::App* cmd, serve_options& o) {
  server::http_limits& l = o.limits;
  const CLI::Validator positive = finite_positive(1e7);  // seconds; far beyond any use, and within a millisecond count
  cmd->add_option("--max-body-bytes", l.max_body_bytes, "largest request body, however framed; larger gets 413 (default 4 MiB)")
      ->check(CLI::Range(std::size_t{1024}, std::size_t{1} << 30));
  cmd->add_option("--max-body-memory", l.max_body_memory_bytes,
                  "request bodies held at once by all connections; beyond it 503 (default 128 MiB)")
      ->check(CLI::Range(std::size_t{1} << 20, std::size_t{1} << 40));
  cmd->add_option("--max-body-memory-per-key", l.max_body_memory_per_key_bytes,
                  "request bodies held at once by one API key's requests; beyond it 429 (default 32 MiB)")
      ->check(CLI::Range(std::size_t{1} << 20, std::size_t{1} << 40));
  cmd->add_option("--max-header-bytes", l.max_header_bytes, "largest request header; larger gets 431 (default 32 KiB)")
      ->check(CLI::Range(std::size_t{1024}, std::size_t{1} << 20));
  cmd->add_option("--max-header-count", l.max_header_count, "most header fields in a request; more gets 431 (default 100)")
      ->check(CLI::Range(8, 10000));
  cmd->add_option("--max-connections", l.max_connections, "connections open at once; beyond it 503 (default 8192)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-connections-per-address", l.max_connections_per_address,
                  "connections open at once from one client address (IPv6: one /64); beyond it 503, /health still "
                  "answered; 0: no cap (default 1024)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--max-json-depth", l.json.max_depth, "deepest JSON nesting in a body; deeper gets 400 (default 64)")
      ->check(CLI::Range(4, 10000));
  cmd->add_option("--max-json-values", l.json.max_values, "most JSON values in a body; more gets 400 (default 262144)")
      ->check(CLI::Range(std::size_t{16}, std::size_t{1} << 30));
  cmd->add_option("--max-json-string-bytes", l.json.max_string_bytes,
                  "longest JSON string or key in a body; longer gets 400 (default 2 MiB)")
      ->check(CLI::Range(std::size_t{64}, std::size_t{1} << 30));
  cmd->add_option("--http-header-timeout", o.header_timeout_s,
                  "seconds for a request header to arrive (from accept or its first byte); then 408 (default 10)")
      ->check(positive);
  cmd->add_option("--http-body-timeout", o.body_timeout_s, "seconds for a request body to arrive; then 408 (default 60)")
      ->check(positive);
  cmd->add_option("--http-idle-timeout", o.idle_timeout_s, "seconds a keep-alive connection may idle between requests (default 75)")
      ->check(positive);
  cmd->add_option("--http-send-timeout", o.send_timeout_s,
                  "seconds a write to a client may stall before the connection closes (default 60)")
      ->check(positive);
  cmd->add_option("--http-threads", o.io_threads, "I/O threads serving every connection (default 2)")->check(CLI::Range(1, 64));
  cmd->add_option("--http-workers", o.workers, "threads parsing and tokenizing request bodies (default 2)")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--log-stats-interval", o.stats_interval_s,
                  "seconds between engine stats lines while busy; 0: none (default 10)")
      ->check(finite_range(0.0, 86400.0));
  cmd->add_flag("--no-access-log", o.no_access_log, "no per-request access lines on stderr");
  cmd->add_option("--cors-origin", o.cors_origins,
                  "ORIGIN: let browser pages from ORIGIN (scheme://host[:port], or * for any) call the API: "
                  "Access-Control-Allow-Origin on replies, OPTIONS preflights answered (repeatable or a comma "
                  "list; default: none, no CORS headers)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->delimiter(',')
      ->check(CLI::Validator(
          [](std::string& origin) -> std::string {
            if (origin == "*") return "";
            const std::size_t scheme = origin.find("://");
            const bool web = origin.starts_with("http://") || origin.starts_with("https://");
            if (!web || origin.size() == scheme + 3 || origin.find('/', scheme + 3) != std::string::npos)
              return "'" + origin + "' is not an origin: scheme://host[:port] with no path (a browser's Origin "
                     "header, e.g. http://localhost:3000), or *";
            return "";
          },
          "ORIGIN"));
}

// Images in chat requests (server/image_input.h).
void add_image_options(CLI::App* cmd, serve_options& o) {
  vision::image_limits& l = o.images.limits;
  cmd->add_option("--mmproj", o.mmproj,
                  "FILE: llama.cpp's vision projector GGUF (idefics3/SmolVLM, gemma3) matching the model: chat requests may "
                  "then carry image_url parts (data: URLs of PNG or JPEG)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--image-max-bytes", l.max_bytes,
                  "largest image file (after base64 decoding); larger gets 400 (default 20 MiB; the body limits "
                  "--max-body-bytes and --max-json-string-bytes apply to its data: URL first)")
      ->check(CLI::Range(std::int64_t{1024}, std::int64_t{1} << 30));
  cmd->add_option("--image-max-pixels", l.max_pixels, "largest image, width x height; larger gets 400 (default 4096 x 4096)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 28));
  cmd->add_option("--image-max-side", l.max_side, "widest or tallest image in pixels; larger gets 400 (default 8192)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--max-images-per-request", o.images.max_images, "most image parts in one request; more gets 400 (default 8)")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--image-cache-mb", o.image_cache_mb,
                  "MiB of encoder outputs kept by image bytes (LRU), so a repeated image is not encoded again; 0: none "
                  "(default 64)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--image-threads", o.image_threads,
                  "threads encoding images, beside the engine's (default: --threads); one image is encoded at a time")
      ->check(CLI::Range(0, 1024));
}

void register_serve(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<serve_options>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)");
  add_engine_options(cmd, opts->engine);
  use_positional_model(cmd, opts->model_positional);
  cmd->add_option("--host", opts->host, "address to listen on (default 127.0.0.1)");
  cmd->add_option("--port", opts->port, "port to listen on; 0 picks a free one (default 8080)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", opts->api_keys,
                  "require 'Authorization: Bearer KEY' on /v1 (repeatable; also $PAGODA_API_KEY)");
  cmd->add_option("--api-key-file", opts->api_key_file,
                  "file of API keys of the global tenant, one a line (keeps keys out of `ps`)");
  cmd->add_option("--admin-key", opts->admin_key,
                  "the key for the KV store's admin endpoints: GET /v1/kv/stats, DELETE /v1/kv, warming for any "
                  "tenant (also $PAGODA_ADMIN_KEY; default: none, those endpoints answer 403)");
  cmd->add_option("--tenants", opts->tenants_file, "JSON file mapping API keys to tenants and their block quotas");
  cmd->add_flag("--no-auth", opts->no_auth,
                "serve without API keys even when --tenants lists none (an empty key source is otherwise an error)");
  cmd->add_option("--chat-template", opts->chat_template,
                  "chat format: plain, chatml, llama2, llama3, mistral, gemma, phi3, zephyr, deepseek, deepseek3 "
                  "(default: recognised from the model)")
      ->each(check_chat_template_name);
  cmd->add_option("--served-model-name", opts->served_model_name, "the model's name in the API (default: file name)");
  cmd->add_option("--max-waiting", opts->max_waiting, "requests queued at once before 429 (default 128)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-prompt-tokens", opts->max_prompt_tokens, "longest prompt accepted (default: the context)")
      ->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--max-tokens-limit", opts->max_tokens_limit, "largest max_tokens a request may ask (default: the context)")
      ->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--max-n", opts->max_n, "most choices per request, n x prompts (default 16)")->check(CLI::Range(1, 128));
  cmd->add_option("--max-tokenize-tokens", opts->max_tokenize_tokens,
                  "most tokens a /tokenize answers or a /detokenize takes; more gets 413 (default: the larger of "
                  "65536 and the context)")
      ->check(CLI::Range(0, 1 << 24));
  add_http_options(cmd, *opts);
  add_image_options(cmd, *opts);
  cmd->add_flag("--no-kv-store", opts->no_kv_store,
                "keep KV blocks in memory only (default: a disk store at $XDG_CACHE_HOME/pagoda/kv or ~/.cache/pagoda/kv, "
                "8 GiB; --kv-store picks another)");
  cmd->callback([opts, &action] {
    resolve_positional_model(opts->engine.config.model_path, opts->model_positional);
    action = [opts] { return serve(*opts); };
  });
}

}  // namespace pagoda::cli
