// pagoda router: a KV-aware proxy in front of `pagoda serve` replicas
// (src/router/router.h, docs/router.md). It loads the model's vocabulary and
// chat template only (no weights) to key requests as the replicas do.
// SIGINT / SIGTERM stop it.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "router/router.h"
#include "sched/engine_setup.h"
#include "server/api_setup.h"
#include "server/auth.h"

namespace pagoda::cli {
namespace {

struct router_cli_options {
  std::string model;
  std::vector<std::string> replicas;
  std::string replicas_file;
  std::string policy = "prefix";
  int poll_ms = 250;
  int balance_slack = 4;
  double connect_timeout_s = 2;
  std::string admin_key;
  std::string tenants_file;
  std::string chat_template;
  std::string served_model_name;
  std::string host = "127.0.0.1";
  int port = 8090;
  int io_threads = 2;
  int workers = 2;
  bool no_access_log = false;
};

// --replica URLs, then the replicas file's lines (blank lines and '#' comments skipped).
result<std::vector<std::string>> replica_urls(const router_cli_options& o) {
  std::vector<std::string> urls = o.replicas;
  if (!o.replicas_file.empty()) {
    std::ifstream in(o.replicas_file);
    if (!in) return error(errc::not_found, "--replicas-file {}: cannot open it", o.replicas_file);
    std::string line;
    while (std::getline(in, line)) {
      while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.pop_back();
      const std::size_t start = line.find_first_not_of(" \t");
      if (start == std::string::npos || line[start] == '#') continue;
      urls.push_back(line.substr(start));
    }
  }
  if (urls.empty())
    return error(errc::invalid_argument,
                 "no replica given: pass --replica http://HOST:PORT (once per `pagoda serve`) or --replicas-file FILE");
  return urls;
}

int run_router(const router_cli_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(std::vector<std::string> urls, replica_urls(o));
  router::router_options ro;
  for (const std::string& u : urls) {
    PAGODA_ASSIGN_OR_RETURN_CLI(router::replica_address a, router::parse_replica_url(u));
    for (const router::replica_address& b : ro.replicas)
      if (b.url == a.url) return fail(error(errc::invalid_argument, "replica {} is given twice", a.url));
    ro.replicas.push_back(std::move(a));
  }
  // The vocabulary and chat template only: the weights stay on disk (the
  // fingerprint reads a few pages of each tensor).
  PAGODA_ASSIGN_OR_RETURN_CLI(auto file, gguf::file::open(o.model));
  PAGODA_ASSIGN_OR_RETURN_CLI(auto vocab, tokenizer::from_gguf(*file));
  server::api_options aopts;
  aopts.model_path = o.model;
  aopts.served_model_name = o.served_model_name;
  aopts.chat_template = o.chat_template;
  std::string warning;
  // The replicas enforce their own limits; the router only needs to read what they accept.
  constexpr int k_any_length = 1 << 24;
  PAGODA_ASSIGN_OR_RETURN_CLI(server::api_context ctx,
                              server::make_api_context(*file, *vocab, k_any_length, aopts, &warning));
  ctx.limits.max_choices = 1 << 20;
  ctx.limits.max_prompts = 1 << 20;
  if (!warning.empty()) std::fprintf(stderr, "pagoda router: warning: %s\n", warning.c_str());
  server::key_store tenants;
  if (!o.tenants_file.empty()) {
    PAGODA_ASSIGN_OR_RETURN_CLI(auto specs, server::load_tenants_file(o.tenants_file));
    PAGODA_RETURN_IF_ERROR_CLI(tenants.add_tenants(specs).with_context(o.tenants_file));
  }

  ro.host = o.host;
  ro.port = o.port;
  ro.route.policy = o.policy == "round-robin" ? router::route_policy::round_robin : router::route_policy::prefix;
  ro.route.balance_slack = o.balance_slack;
  ro.poll_interval = std::chrono::milliseconds(o.poll_ms);
  ro.upstream.connect_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(o.connect_timeout_s * 1000));
  ro.admin_key = o.admin_key;
  if (const char* env = std::getenv("PAGODA_ADMIN_KEY"); ro.admin_key.empty() && env) ro.admin_key = env;
  ro.model_fingerprint = fmt::format("{:016x}", model_fingerprint(*file));
  ro.n_io_threads = o.io_threads;
  ro.n_workers = o.workers;
  ro.access_log = !o.no_access_log;
  ro.version = PAGODA_VERSION_STRING;
  const std::size_t n_replicas = ro.replicas.size();

  sigset_t sigs = block_stop_signals();

  router::router_server srv(std::move(ro), router::request_hasher(std::move(ctx), std::move(tenants), {}));
  PAGODA_ASSIGN_OR_RETURN_CLI(int port, srv.bind());
  PAGODA_RETURN_IF_ERROR_CLI(srv.start());
  std::fprintf(stderr, "pagoda router: %zu replica(s), policy %s, polling every %d ms%s\n", n_replicas, o.policy.c_str(),
               o.poll_ms, o.admin_key.empty() && !std::getenv("PAGODA_ADMIN_KEY") ? " (no --admin-key: replicas' summaries will be refused, routing by load)" : "");
  std::printf("pagoda router: listening on http://%s:%d\n", o.host.c_str(), port);
  std::fflush(stdout);

  std::thread signal_waiter([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (sig != 0) std::fprintf(stderr, "pagoda router: %s, stopping\n", sig == SIGINT ? "interrupted" : "terminated");
    srv.stop();
  });
  srv.wait();
  pthread_kill(signal_waiter.native_handle(), SIGTERM);
  signal_waiter.join();
  return 0;
}

}  // namespace

void register_router(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<router_cli_options>();
  CLI::App* cmd = app.add_subcommand("router", "KV-aware proxy in front of `pagoda serve` replicas (docs/router.md)");
  add_model_source(cmd, opts->model, "the replicas' GGUF model (its vocabulary and chat template key requests)");
  cmd->add_option("--replica", opts->replicas, "a replica's URL, http://HOST:PORT (repeatable)");
  cmd->add_option("--replicas-file", opts->replicas_file, "file of replica URLs, one a line ('#' comments)");
  cmd->add_option("--policy", opts->policy, "prefix (the replica holding the longest prefix, balanced by load) or "
                                            "round-robin (default prefix)")
      ->check(CLI::IsMember({"prefix", "round-robin"}));
  cmd->add_option("--poll-ms", opts->poll_ms, "milliseconds between two polls of a replica's summary (default 250)")
      ->check(CLI::Range(10, 60'000));
  cmd->add_option("--balance-slack", opts->balance_slack,
                  "requests of load a prefix hit may cost over the least loaded replica (default 4)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--connect-timeout", opts->connect_timeout_s, "seconds to connect to a replica (default 2)")
      ->check(CLI::Range(0.01, 600.0));
  cmd->add_option("--admin-key", opts->admin_key,
                  "the replicas' --admin-key, sent to their /v1/kv/summary (also $PAGODA_ADMIN_KEY)");
  cmd->add_option("--tenants", opts->tenants_file, "the replicas' tenants file (API key -> tenant: tenants key their caches)");
  cmd->add_option("--chat-template", opts->chat_template, "the replicas' --chat-template, if they override it");
  cmd->add_option("--served-model-name", opts->served_model_name, "the replicas' --served-model-name, if set");
  cmd->add_option("--host", opts->host, "address to listen on (default 127.0.0.1)");
  cmd->add_option("--port", opts->port, "port to listen on; 0 picks a free one (default 8090)")->check(CLI::Range(0, 65535));
  cmd->add_option("--http-threads", opts->io_threads, "I/O threads (default 2)")->check(CLI::Range(1, 64));
  cmd->add_option("--http-workers", opts->workers, "threads tokenizing request bodies (default 2)")->check(CLI::Range(1, 256));
  cmd->add_flag("--no-access-log", opts->no_access_log, "no per-request lines on stderr");
  cmd->callback([opts, &action] { action = [opts] { return run_router(*opts); }; });
}

}  // namespace pagoda::cli
