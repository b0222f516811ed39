#include "server/http_server.h"

#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/write.hpp>
#include <fmt/format.h>

#include "core/assert.h"
#include "server/bounded_json.h"
#include "server/connection_limits.h"
#include "server/dashboard.h"
#include "server/generate_call.h"
#include "server/http_connection.h"
#include "server/kv_calls.h"
#include "server/kv_summary.h"
#include "server/llama_api.h"
#include "server/openai_response.h"
#include "server/server_log.h"
#include "server/tokenize_api.h"

namespace pagoda::server {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using boost::system::error_code;
using nlohmann::json;

namespace {

constexpr int k_listen_backlog = 4096;
constexpr std::chrono::milliseconds k_stop_grace{2000};
constexpr std::chrono::milliseconds k_accept_retry{50};
constexpr std::size_t k_trim_after_bytes = 1u << 20;  // request + answer of a /tokenize worth malloc_trim
constexpr int k_max_overflow_replies = 256;  // connections past a cap answered at once; the rest are closed

std::int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The endpoint label of a path: fixed names only, so a scan of random paths
// cannot grow the metrics without bound.
std::string endpoint_label(std::string_view path) {
  for (const char* p : {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/version",
                        "/tokenize", "/detokenize", "/v1/kv/warm", "/v1/kv/stats", "/v1/kv/summary", "/v1/kv",
                        "/props", "/slots", "/dashboard", "/dashboard/blocks"})
    if (path == p) return p;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "other";
}

http_response method_not_allowed(std::string_view method, std::string_view where, const char* allow) {
  api_error e;
  e.http_status = 405;
  e.message = fmt::format("Method {} is not allowed on {} (allowed: {})", method.substr(0, 16), where, allow);
  http_response r = error_response(e);
  r.fields.emplace_back("Allow", allow);
  return r;
}

// The Access-Control-Request-Headers a preflight may be answered with as
// sent: header names and separators only.
bool plain_header_list(std::string_view v) {
  return v.size() <= 1024 && std::all_of(v.begin(), v.end(), [](char c) {
           return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == ',' || c == ' ';
         });
}

// The answer to a CORS preflight (OPTIONS): what a page may send. The
// origin's own header is added by the server's decorate hook, as on every reply.
http_response preflight_response(const http_request& req) {
  http_response r;
  r.status = 204;
  r.content_type.clear();
  r.fields.emplace_back("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
  const std::optional<std::string_view> asked = req.field("Access-Control-Request-Headers");
  r.fields.emplace_back("Access-Control-Allow-Headers",
                        asked && plain_header_list(*asked) ? std::string(*asked) : "Authorization, Content-Type");
  r.fields.emplace_back("Access-Control-Max-Age", "600");
  return r;
}

// "%2F" -> "/" (for a model id in a path; never for credentials).
std::string percent_decode(std::string_view s) {
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
      out += static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// The value of `name` in the target's query ("/v1/kv?tenant=a%20b" -> "a b").
std::optional<std::string> query_param(std::string_view target, std::string_view name) {
  const std::size_t q = target.find('?');
  if (q == std::string_view::npos) return std::nullopt;
  std::string_view rest = target.substr(q + 1);
  while (!rest.empty()) {
    const std::size_t amp = rest.find('&');
    const std::string_view pair = rest.substr(0, amp);
    rest.remove_prefix(amp == std::string_view::npos ? rest.size() : amp + 1);
    const std::size_t eq = pair.find('=');
    if (pair.substr(0, eq) == name) return eq == std::string_view::npos ? std::string() : percent_decode(pair.substr(eq + 1));
  }
  return std::nullopt;
}

}  // namespace

int raise_open_file_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return -1;
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    getrlimit(RLIMIT_NOFILE, &rl);
  }
  return rl.rlim_cur == RLIM_INFINITY ? INT32_MAX : static_cast<int>(std::min<rlim_t>(rl.rlim_cur, INT32_MAX));
}

struct http_server::impl {
  server_options opts;
  api_context ctx;
  key_store keys;
  engine_loop& loop;
  kv_admin* kv;
  std::string kv_type;  // the engine's KV type(s), named on access lines
  body_budget budget;
  // Each API key's share of `budget` (indexed as `keys`), and the admin key's.
  std::vector<std::unique_ptr<body_budget>> key_budgets;
  body_budget admin_budget;
  connection_hooks hooks;
  std::atomic<int> n_connections{0};
  std::atomic<int> n_overflow_replies{0};
  std::atomic<bool> stopping{false};
  const std::int64_t started_unix_s = unix_seconds();
  stats_reporter stats;

  mutable std::mutex counts_mu;
  http_counts counts;
  std::mutex conns_mu;
  struct open_connection {
    std::weak_ptr<http_connection> conn;
    std::string address;  // client_address_key()
  };
  std::unordered_map<http_connection*, open_connection> conns;
  address_counter per_address;

  // Declared in this order so that destruction runs the other way: I/O
  // objects and the worker pool (whose tasks hold connections) go before the
  // io_context, which goes before what its handlers refer to (above).
  asio::io_context ioc;
  asio::thread_pool workers;
  asio::thread_pool store_thread{1};  // waits on the KV store (kv_calls.h)
  asio::thread_pool image_thread{1};  // parses chat bodies with images and encodes them (image_input.h)
  generate_env env;
  std::optional<kv_env> kv_calls;  // with kv
  // The server's own handlers (accept, stats, stop) run on this strand, so
  // they never race whatever the number of I/O threads.
  asio::strand<asio::io_context::executor_type> control;
  tcp::acceptor acceptor;
  asio::steady_timer stats_timer;
  asio::steady_timer accept_retry;
  asio::steady_timer stop_timer;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  bool bound = false;
  bool warned_accept = false;
  std::string model_fingerprint;  // the engine thread's (kv_summary.h), filled by the first summary

  impl(server_options o, api_context c, key_store k, engine_loop& l, kv_admin* a)
      : opts(std::move(o)),
        ctx(std::move(c)),
        keys(std::move(k)),
        loop(l),
        kv(a),
        budget(opts.limits.max_body_memory_bytes),
        admin_budget(opts.limits.max_body_memory_per_key_bytes),
        per_address(opts.limits.max_connections_per_address),
        ioc(std::max(1, opts.n_io_threads)),
        workers(static_cast<std::size_t>(std::max(1, opts.n_workers))),
        env{ctx, loop, workers, opts.limits},
        control(ioc.get_executor()),
        acceptor(control),
        stats_timer(control),
        accept_retry(control),
        stop_timer(control) {
    env.id_salt = (static_cast<std::uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
    if (ctx.images) env.image_thread = &image_thread;
    if (kv) kv_calls.emplace(kv_env{env, *kv, store_thread});
    // The KV type(s) for access lines: the default class's, then each extra class's.
    const engine_snapshot snap = loop.snapshot();
    for (const std::string& t : snap.kv_class_types) kv_type += (kv_type.empty() ? "" : ",") + t;
    for (std::size_t i = 0; i < keys.size(); ++i)
      key_budgets.push_back(std::make_unique<body_budget>(opts.limits.max_body_memory_per_key_bytes));
    hooks.admit = [this](http_request& req, bool has_body) { return admit(req, has_body); };
    hooks.dispatch = [this](const std::shared_ptr<http_exchange>& ex) { route(ex); };
    hooks.finished = [this](const http_exchange& ex) { finished(ex); };
    hooks.rejected = [this](const http_request* req, int status) { rejected(req, status); };
    if (!opts.cors_origins.empty())
      hooks.decorate = [this](const http_request& req, http_fields& fields) { add_cors_fields(req, fields); };
    hooks.closed = [this](http_connection* c) {
      {
        std::lock_guard lock(conns_mu);
        auto it = conns.find(c);
        if (it != conns.end()) {
          per_address.give(it->second.address);
          conns.erase(it);
        }
      }
      if (--n_connections == 0 && stopping) asio::post(control, [this] { stop_timer.cancel(); });
    };
  }

  void do_accept();
  void on_accept(const error_code& ec, tcp::socket socket);
  void schedule_stats();

  void route(const std::shared_ptr<http_exchange>& ex);
  bool route_kv(const std::shared_ptr<http_exchange>& ex, std::string_view path, bool is_get, bool is_post);
  bool presents_admin_key(const http_request& req) const;
  void route_dashboard(const std::shared_ptr<http_exchange>& ex, std::string_view path);
  struct key_check {
    std::optional<std::size_t> index;  // in `keys`
    std::string problem;               // why not, for the 401
  };
  key_check check_key(const http_request& req) const;
  std::optional<http_rejection> admit(http_request& req, bool has_body);
  std::optional<std::string> authorize(http_exchange& ex) const;
  void on_worker(const std::shared_ptr<http_exchange>& ex, std::function<http_response(http_request&)> fn);
  json model_card(const std::string& name) const;
  void add_cors_fields(const http_request& req, http_fields& fields) const;
  void route_llama(const std::shared_ptr<http_exchange>& ex, std::string_view path);
  void finished(const http_exchange& ex);
  void rejected(const http_request* req, int status);
  void count(const std::string& endpoint, int status) {
    std::lock_guard lock(counts_mu);
    ++counts[{endpoint, status}];
  }
};

// --- accepting -------------------------------------------------------------------

void http_server::impl::do_accept() {
  // The accepted socket gets a strand of its own; the handler runs on `control`.
  acceptor.async_accept(asio::make_strand(ioc), asio::bind_executor(control, [this](const error_code& ec, tcp::socket socket) {
    on_accept(ec, std::move(socket));
  }));
}

void http_server::impl::on_accept(const error_code& ec, tcp::socket socket) {
  if (stopping || !acceptor.is_open()) return;
  if (ec) {
    // Out of descriptors (EMFILE), or a connection reset before accept: wait
    // a little instead of spinning, and say so once.
    if (!warned_accept) server_logger().warn("accept failed: {} (retrying)", ec.message());
    warned_accept = true;
    accept_retry.expires_after(k_accept_retry);
    accept_retry.async_wait([this](const error_code& e) {
      if (!e) do_accept();
    });
    return;
  }
  error_code peer_ec;
  const tcp::endpoint peer = socket.remote_endpoint(peer_ec);
  const std::string address = peer_ec ? std::string() : client_address_key(peer.address());
  const char* refusal = nullptr;
  if (n_connections.load() >= opts.limits.max_connections)
    refusal = "The server has too many open connections; retry later";
  else if (!per_address.take(address))
    refusal = "Too many open connections from your address; close some, or retry later";
  if (refusal) {
    count("other", 503);
    if (n_overflow_replies.load() < k_max_overflow_replies) {
      const bool up = !loop.stopped();
      std::make_shared<overflow_reply>(std::move(socket), n_overflow_replies, up ? 200 : 503,
                                       json{{"status", up ? "ok" : "stopping"}}.dump(), refusal)
          ->start();
    }
    // else: the socket closes here, unanswered
  } else {
    ++n_connections;
    auto conn = std::make_shared<http_connection>(std::move(socket), opts.limits, budget, hooks);
    {
      std::lock_guard lock(conns_mu);
      conns.emplace(conn.get(), open_connection{conn, address});
    }
    conn->start();
  }
  do_accept();
}

void http_server::impl::schedule_stats() {
  if (opts.stats_interval.count() <= 0) return;
  stats_timer.expires_after(opts.stats_interval);
  stats_timer.async_wait([this](const error_code& ec) {
    if (ec || stopping) return;
    // The snapshot is a copy the engine published: this never waits for a step.
    const std::string line = stats.next(loop.snapshot(), std::chrono::steady_clock::now());
    if (!line.empty()) server_logger().info("{}", line);
    schedule_stats();
  });
}

// --- routes ----------------------------------------------------------------------

http_server::impl::key_check http_server::impl::check_key(const http_request& req) const {
  if (req.count("Authorization") > 1) return {std::nullopt, "Send one Authorization header, not several."};
  // The value exactly as received: no decoding of any kind.
  const std::optional<std::string_view> token = bearer_token(req.field("Authorization").value_or(""));
  if (token)
    if (std::optional<std::size_t> i = keys.find(*token)) return {i, ""};
  return {std::nullopt,
          token ? "Incorrect API key provided." : "Missing API key: send the header 'Authorization: Bearer KEY'."};
}

// With keys configured, a request that carries a body needs a valid key (a
// tenant's or the admin key) before a byte of it is read, whatever its path:
// a client without one is answered 401 from its header and closed (the
// connection then drains what it still sends for at most the 2 s linger,
// holding none of it), so keyless uploads cannot spend the body budget.
// The body then counts against its key's share too. Requests without a
// body are authorized by their route, as before.
std::optional<http_rejection> http_server::impl::admit(http_request& req, bool has_body) {
  if (!keys.enabled() || !has_body) return std::nullopt;
  if (kv && presents_admin_key(req)) {
    req.body_bytes.set_account(&admin_budget);
    return std::nullopt;
  }
  const key_check k = check_key(req);
  if (k.index) {
    req.body_bytes.set_account(key_budgets[*k.index].get());
    return std::nullopt;
  }
  return http_rejection{401, k.problem, "invalid_api_key", {{"WWW-Authenticate", "Bearer"}}};
}

std::optional<std::string> http_server::impl::authorize(http_exchange& ex) const {
  if (!keys.enabled()) return std::string();
  const key_check k = check_key(ex.request());
  if (k.index) return keys.tenant(*k.index);
  api_error e;
  e.http_status = 401;
  e.code = "invalid_api_key";
  e.message = k.problem;
  http_response r = error_response(e);
  r.fields.emplace_back("WWW-Authenticate", "Bearer");
  ex.respond(std::move(r));
  return std::nullopt;
}

json http_server::impl::model_card(const std::string& name) const {
  return {{"id", name},
          {"object", "model"},
          {"created", started_unix_s},
          {"owned_by", "pagoda"},
          {"root", name},
          {"parent", nullptr},
          {"max_model_len", ctx.limits.max_model_len}};
}

// Access-Control-Allow-Origin for a request from an allowed origin: "*"
// when any is, else the origin itself (and Vary: Origin, for caches).
void http_server::impl::add_cors_fields(const http_request& req, http_fields& fields) const {
  const std::optional<std::string_view> origin = req.field("Origin");
  if (!origin) return;
  const auto& allowed = opts.cors_origins;
  if (std::find(allowed.begin(), allowed.end(), "*") != allowed.end()) {
    fields.emplace_back("Access-Control-Allow-Origin", "*");
  } else if (std::find(allowed.begin(), allowed.end(), *origin) != allowed.end()) {
    fields.emplace_back("Access-Control-Allow-Origin", std::string(*origin));
    fields.emplace_back("Vary", "Origin");
  }
}

// GET /props and GET /slots (llama_api.h), from the engine's snapshot.
void http_server::impl::route_llama(const std::shared_ptr<http_exchange>& ex, std::string_view path) {
  const http_request& req = ex->request();
  const bool admin = kv && presents_admin_key(req);
  std::optional<std::string> tenant;
  if (!admin) {
    tenant = authorize(*ex);
    if (!tenant) return;
    ex->tenant = *tenant;
  }
  const engine_snapshot snap = loop.snapshot();
  if (path == "/props") return ex->respond(json_response(200, props_json(ctx, snap, opts.version)));
  if (query_param(req.target, "fail_on_no_slot") == "1" && snap.n_running >= snap.max_num_seqs) {
    api_error e;
    e.http_status = 503;
    e.type = "service_unavailable";
    e.message = fmt::format("No slot available: {} of {} sequences running", snap.n_running, snap.max_num_seqs);
    return ex->respond(error_response(e));
  }
  // A tenant's key sees its own tenant's sequences; the admin key, or a server without keys, all.
  if (!keys.enabled() || admin) tenant.reset();
  ex->respond(json_response(200, slots_json(ctx, snap, tenant)));
}

// GET /dashboard (the page: it holds no data) and GET /dashboard/blocks
// (dashboard.h; the admin key when API keys are set).
void http_server::impl::route_dashboard(const std::shared_ptr<http_exchange>& ex, std::string_view path) {
  if (path != "/dashboard/blocks") {
    http_response r;
    r.content_type = "text/html; charset=utf-8";
    r.body = std::string(dashboard_page());
    return ex->respond(std::move(r));
  }
  if (keys.enabled() && !(kv && presents_admin_key(ex->request())))
    return ex->respond(error_response(kv_admin::forbidden("GET /dashboard/blocks")));
  loop.want_block_map();
  const engine_snapshot snap = loop.snapshot();
  if (!snap.block_map)
    return ex->respond(json_response(200, {{"object", "kv.blocks"}, {"pending", true}}));
  ex->respond(json_response(200, kv_blocks_json(*snap.block_map, snap.kv_class_types, ctx.default_kv_policy)));
}

// Runs fn(request) on the worker pool and answers with its response.
void http_server::impl::on_worker(const std::shared_ptr<http_exchange>& ex,
                                  std::function<http_response(http_request&)> fn) {
  asio::post(workers, [ex, fn = std::move(fn)] {
    http_response r = fn(ex->request());
    ex->post([ex, r = std::move(r)]() mutable {
      if (!ex->gone()) ex->respond(std::move(r));
    });
  });
}

void http_server::impl::route(const std::shared_ptr<http_exchange>& ex) {
  const http_request& req = ex->request();
  const std::string_view path = req.path();
  ex->endpoint = endpoint_label(path);
  const bool is_get = req.method == "GET" || req.method == "HEAD", is_post = req.method == "POST";
  auto wrong_method = [&](const char* allow) { ex->respond(method_not_allowed(req.method, ex->endpoint, allow)); };

  if (req.method == "OPTIONS" && !opts.cors_origins.empty()) return ex->respond(preflight_response(req));
  if (path == "/health") {
    if (!is_get) return wrong_method("GET, HEAD");
    if (loop.stopped()) return ex->respond(json_response(503, {{"status", "stopping"}}));
    // The store tiers' state: a Redis that is down does not stop serving (the
    // pool and the disk serve on), so it is detail, not the status.
    nlohmann::json body = {{"status", "ok"}};
    if (kv) body["kv_store"] = kv->health();
    return ex->respond(json_response(200, body));
  }
  if (path == "/metrics") {
    if (!is_get) return wrong_method("GET, HEAD");
    http_counts c;
    {
      std::lock_guard lock(counts_mu);
      c = counts;
    }
    http_response r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    const engine_snapshot snap = loop.snapshot();
    r.body = render_metrics(snap, c, ctx.model_names.front());
    if (kv) r.body += kv->render_metrics(snap, ctx.model_names.front());
    if (ctx.images) r.body += render_image_metrics(ctx.images->counters(), ctx.model_names.front());
    return ex->respond(std::move(r));
  }
  if (path == "/version") {
    if (!is_get) return wrong_method("GET, HEAD");
    return ex->respond(json_response(200, {{"version", opts.version}}));
  }
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (!is_post) return wrong_method("POST");
    std::optional<std::string> tenant = authorize(*ex);
    if (!tenant) return;
    ex->tenant = *tenant;
    return start_generate(env, ex, path == "/v1/completions" ? api_kind::completion : api_kind::chat, *tenant);
  }
  if (path == "/tokenize" || path == "/detokenize") {
    if (!is_post) return wrong_method("POST");
    std::optional<std::string> tenant = authorize(*ex);
    if (!tenant) return;
    ex->tenant = *tenant;
    const bool tokenize = path == "/tokenize";
    return on_worker(ex, [this, tokenize, tenant = *tenant](http_request& r) {
      const std::size_t n_body_bytes = r.body.size();
      http_response resp = [&] {
        api_result<json> body = parse_bounded_json(r.body, opts.limits.json);
        r.drop_body();
        if (!body.ok()) return error_response(body.error);
        api_result<json> out = tokenize ? tokenize_response(*body.value, ctx, tenant) : detokenize_response(*body.value, ctx);
        return out.ok() ? json_response(200, *out.value) : error_response(out.error);
      }();
      // The JSON trees just freed were many small blocks in this worker's
      // malloc arena, which glibc keeps; after a large request, give them
      // back so RSS returns to where it was.
      if (n_body_bytes + resp.body.size() > k_trim_after_bytes) malloc_trim(0);
      return resp;
    });
  }
  if (path == "/props" || path == "/slots") {
    if (!is_get) return wrong_method("GET, HEAD");
    return route_llama(ex, path);
  }
  if (path == "/dashboard" || path == "/dashboard/" || path == "/dashboard/blocks") {
    if (!is_get) return wrong_method("GET, HEAD");
    return route_dashboard(ex, path);
  }
  if (kv && route_kv(ex, path, is_get, is_post)) return;
  if (path == "/v1/models" || path.rfind("/v1/models/", 0) == 0) {
    if (!is_get) return wrong_method("GET, HEAD");
    if (!authorize(*ex)) return;
    if (path == "/v1/models") {
      json data = json::array();
      data.push_back(model_card(ctx.model_names.front()));
      return ex->respond(json_response(200, {{"object", "list"}, {"data", data}}));
    }
    const std::string name = percent_decode(path.substr(std::string_view("/v1/models/").size()));
    if (std::find(ctx.model_names.begin(), ctx.model_names.end(), name) == ctx.model_names.end()) {
      api_error e = bad_request("model", fmt::format("The model '{}' does not exist", name.substr(0, 200)), "model_not_found");
      e.http_status = 404;
      e.type = "not_found_error";
      return ex->respond(error_response(e));
    }
    return ex->respond(json_response(200, model_card(ctx.model_names.front())));
  }
  api_error e;
  e.http_status = 404;
  e.type = "not_found_error";
  e.message = fmt::format("Not found: {} {}", req.method.substr(0, 16), std::string(path.substr(0, 200)));
  ex->respond(error_response(e));
}

bool http_server::impl::presents_admin_key(const http_request& req) const {
  if (req.count("Authorization") != 1) return false;
  const std::optional<std::string_view> token = bearer_token(*req.field("Authorization"));
  return token && kv->is_admin(*token);
}

// The KV store's endpoints (kv_admin.h): warm and DELETE run asynchronously
// (kv_calls.h), stats on the worker pool. False: not one of them.
bool http_server::impl::route_kv(const std::shared_ptr<http_exchange>& ex, std::string_view path, bool is_get,
                                 bool is_post) {
  auto wrong_method = [&](const char* allow) { ex->respond(method_not_allowed(ex->request().method, path, allow)); };
  const http_request& req = ex->request();
  if (path == "/v1/kv/warm") {
    if (!is_post) return wrong_method("POST"), true;
    const bool admin = presents_admin_key(req);
    std::string tenant;
    if (!admin) {
      std::optional<std::string> t = authorize(*ex);
      if (!t) return true;
      tenant = std::move(*t);
    }
    ex->tenant = tenant;
    start_warm(*kv_calls, ex, std::move(tenant), admin);
    return true;
  }
  if (path == "/v1/kv/stats") {
    if (!is_get) return wrong_method("GET, HEAD"), true;
    if (!presents_admin_key(req)) return ex->respond(error_response(kv_admin::forbidden("GET /v1/kv/stats"))), true;
    on_worker(ex, [this](http_request&) { return json_response(200, kv->stats()); });
    return true;
  }
  if (path == "/v1/kv/summary") {
    if (!is_get) return wrong_method("GET, HEAD"), true;
    if (!presents_admin_key(req)) return ex->respond(error_response(kv_admin::forbidden("GET /v1/kv/summary"))), true;
    auto out = std::make_shared<kv_summary>();
    loop.run_synced_async(
        [this, out, since = query_param(req.target, "since")](engine_core& core) {
          *out = collect_kv_summary(core, since, model_fingerprint);
        },
        [this, ex, out](status st) {
          const engine_snapshot snap = loop.snapshot();
          out->n_running = snap.n_running;
          out->n_waiting = snap.n_waiting;
          ex->post([ex, out, st = std::move(st)] {
            if (ex->gone()) return;
            ex->respond(st.ok() ? json_response(200, kv_summary_json(*out)) : error_response(from_status(st)));
          });
        });
    return true;
  }
  if (path == "/v1/kv") {
    if (req.method != "DELETE") return wrong_method("DELETE"), true;
    if (!presents_admin_key(req)) return ex->respond(error_response(kv_admin::forbidden("DELETE /v1/kv"))), true;
    start_erase(*kv_calls, ex, query_param(req.target, "tenant"));
    return true;
  }
  return false;
}

// --- accounting ------------------------------------------------------------------

void http_server::impl::finished(const http_exchange& ex) {
  count(ex.endpoint, ex.status());
  if (!opts.access_log) return;
  const http_request& req = ex.request();
  access_entry a;
  a.remote = req.remote;
  a.method = req.method;
  a.target = req.target;
  a.version = req.version;
  a.status = ex.status();
  a.tenant = ex.tenant;
  a.prompt_tokens = ex.prompt_tokens;
  a.cached_tokens = ex.cached_tokens;
  a.completion_tokens = ex.completion_tokens;
  if (ex.prompt_tokens >= 0) {
    a.kv_type = kv_type;
    a.kv_policy = ex.kv_policy;
  }
  a.ttft_ms = ex.ttft_ms;
  a.error = ex.error_code;
  a.duration_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - req.started).count();
  server_logger().info("{}", format_access(a));
}

void http_server::impl::rejected(const http_request* req, int status) {
  count(req ? endpoint_label(req->path()) : "other", status);
  if (!opts.access_log) return;
  access_entry a;
  a.status = status;
  if (req) {
    a.remote = req->remote;
    a.method = req->method;
    a.target = req->target;
    a.version = req->version;
    a.duration_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - req->started).count();
  }
  server_logger().info("{}", format_access(a));
}

// --- http_server -----------------------------------------------------------------

http_server::http_server(server_options opts, api_context ctx, key_store keys, engine_loop& loop, kv_admin* kv)
    : impl_(std::make_unique<impl>(std::move(opts), std::move(ctx), std::move(keys), loop, kv)) {
  PAGODA_ASSERT(impl_->ctx.vocab != nullptr && !impl_->ctx.model_names.empty(), "the server needs a vocabulary and a model name");
}

http_server::~http_server() {
  stop();
  impl_->workers.join();
  impl_->store_thread.join();
  impl_->image_thread.join();
}

result<int> listen_on(boost::asio::ip::tcp::acceptor& acceptor, const std::string& host, int port) {
  error_code ec;
  tcp::resolver resolver(acceptor.get_executor());
  auto found = resolver.resolve(host, std::to_string(port), tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || found.empty())
    return error(errc::invalid_argument, "--host {}: not an address of this machine ({})", host, ec.message());
  const tcp::endpoint ep = found.begin()->endpoint();
  const std::string where = fmt::format("{}:{}", host, port);
  if (acceptor.open(ep.protocol(), ec); ec) return error(errc::io_error, "cannot open a socket for {}: {}", where, ec.message());
  // SO_REUSEADDR only lets a restart bind over connections in TIME_WAIT; on
  // Linux it never lets two listeners share a port (SO_REUSEPORT would).
  acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (acceptor.bind(ep, ec); ec) {
    acceptor.close();
    if (ec == asio::error::address_in_use)
      return error(errc::io_error, "cannot listen on {}: the port is in use (another server?); pick another --port", where);
    return error(errc::io_error, "cannot listen on {}: {}", where, ec.message());
  }
  if (acceptor.listen(k_listen_backlog, ec); ec) return error(errc::io_error, "cannot listen on {}: {}", where, ec.message());
  return static_cast<int>(acceptor.local_endpoint().port());
}

result<int> http_server::bind() {
  impl& s = *impl_;
  result<int> port = listen_on(s.acceptor, s.opts.host, s.opts.port);
  s.bound = port.ok();
  return port;
}

status http_server::serve() {
  impl& s = *impl_;
  PAGODA_ASSERT(s.bound, "serve() before bind()");
  if (s.stopping) return {};
  s.work.emplace(s.ioc.get_executor());
  s.do_accept();
  s.schedule_stats();
  std::vector<std::thread> threads;
  for (int i = 1; i < s.opts.n_io_threads; ++i) threads.emplace_back([&s] { s.ioc.run(); });
  s.ioc.run();
  for (std::thread& t : threads) t.join();
  // Connections still open (the grace period ran out) hold their exchange and
  // it holds them: close them, or they would never be freed.
  std::vector<std::shared_ptr<http_connection>> live;
  {
    std::lock_guard lock(s.conns_mu);
    for (auto& [p, o] : s.conns)
      if (auto c = o.conn.lock()) live.push_back(std::move(c));
  }
  for (auto& c : live) c->close_after_run();
  return {};
}

void http_server::stop() {
  if (!impl_ || impl_->stopping.exchange(true)) return;
  impl& s = *impl_;
  asio::post(s.control, [&s] {
    error_code ec;
    s.acceptor.close(ec);
    s.stats_timer.cancel();
    s.accept_retry.cancel();
    std::vector<std::shared_ptr<http_connection>> live;
    {
      std::lock_guard lock(s.conns_mu);
      for (auto& [p, o] : s.conns)
        if (auto c = o.conn.lock()) live.push_back(std::move(c));
    }
    for (auto& c : live) c->stop();
    s.work.reset();  // run() returns once the connections are done...
    if (live.empty()) return;
    s.stop_timer.expires_after(k_stop_grace);
    s.stop_timer.async_wait([&s](const error_code& e) {
      if (!e) s.ioc.stop();  // ...or after the grace period
    });
  });
}

http_counts http_server::counts() const {
  std::lock_guard lock(impl_->counts_mu);
  return impl_->counts;
}

int http_server::n_connections() const { return impl_->n_connections.load(); }

}  // namespace pagoda::server
