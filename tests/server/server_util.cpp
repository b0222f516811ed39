#include "server/server_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>

#include <gtest/gtest.h>

#include "common/engine_configs.h"
#include "common/gguf_payload.h"
#include "model/gguf_writer.h"
#include "sched/engine_setup.h"

namespace pagoda::test {

std::unique_ptr<llama_model> stories_with_chat_template(const std::string& jinja) {
  auto src = gguf::file::open(stories_path());
  if (!src.ok()) {
    ADD_FAILURE() << src.error().message();
    return nullptr;
  }
  gguf::writer w;
  for (const gguf::metadata_entry& e : (*src)->metadata()) {
    if (e.key == "tokenizer.chat_template") continue;
    if (e.key == "general.alignment") {
      w.set_alignment(static_cast<std::uint32_t>(e.val.u));
      continue;
    }
    w.add_raw(e.key, static_cast<std::uint32_t>(e.val.type), payload_of(e.val));
  }
  w.add_string("tokenizer.chat_template", jinja);
  for (const gguf::tensor_info& t : (*src)->tensors())
    w.add_tensor(t.name, t.type, std::span<const std::int64_t>(t.ne, t.n_dims), std::span(t.data, t.size_bytes));
  // The model reads tensors in place: the bytes live as long as the process.
  static std::mutex mu;
  static std::vector<std::unique_ptr<std::vector<std::byte>>> keep;
  std::lock_guard lock(mu);
  keep.push_back(std::make_unique<std::vector<std::byte>>(w.to_bytes()));
  auto file = gguf::file::from_memory(*keep.back());
  if (!file.ok()) {
    ADD_FAILURE() << file.error().message();
    return nullptr;
  }
  auto model = llama_model::from_gguf(std::move(*file));
  if (!model.ok()) {
    ADD_FAILURE() << model.error().message();
    return nullptr;
  }
  return std::move(*model);
}

engine_core_config engine_config_for(const llama_model& model, std::int64_t n_blocks, int max_seqs) {
  const llama_hparams& hp = model.hparams();
  return test::uniform_engine(hp, {.n_blocks = n_blocks, .max_num_seqs = max_seqs});
}

server_setup default_setup() {
  server_setup s;
  s.engine = engine_config_for(stories());
  s.api.model_path = stories_path();
  s.http.host = "127.0.0.1";
  s.http.port = 0;
  s.http.access_log = false;  // the tests' output stays readable
  s.http.stats_interval = std::chrono::milliseconds(0);
  return s;
}

namespace {

class gated_runner final : public runner_wrapper {
 public:
  gated_runner(std::unique_ptr<model_runner> inner, std::function<void()> wait)
      : runner_wrapper(std::move(inner)), wait_(std::move(wait)) {}
  void execute(const step_plan& plan, step_output& out) override {
    if (!plan.seqs.empty() || !plan.loads.empty()) wait_();
    inner().execute(plan, out);
  }

 private:
  std::function<void()> wait_;
};

}  // namespace

void step_gate::close() {
  std::lock_guard lock(mu_);
  closed_ = true;
}

void step_gate::open() {
  {
    std::lock_guard lock(mu_);
    closed_ = false;
  }
  cv_.notify_all();
}

void step_gate::let_through(int n_steps) {
  {
    std::lock_guard lock(mu_);
    n_permits_ += n_steps;
  }
  cv_.notify_all();
}

int step_gate::n_held() const {
  std::lock_guard lock(mu_);
  return n_held_;
}

void step_gate::attach(engine_core& core) {
  core.wrap_runner([this](std::unique_ptr<model_runner> inner) {
    return std::make_unique<gated_runner>(std::move(inner), [this] {
      std::unique_lock lock(mu_);
      ++n_held_;
      cv_.wait(lock, [&] { return !closed_ || n_permits_ > 0; });
      if (closed_) --n_permits_;
      --n_held_;
    });
  });
}

bool poll_until(const std::function<bool()>& pred, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return pred();
    std::this_thread::yield();
  }
  return true;
}

server::api_context stories_api_context() {
  server::api_options opts;
  opts.model_path = stories_path();
  auto ctx = server::make_api_context(stories(), 512, opts, nullptr);
  EXPECT_TRUE(ctx.ok());
  return *ctx;
}

test_server::test_server(server_setup setup, const llama_model& model) {
  setup.engine.max_waiting = setup.max_waiting;
  auto eng = engine_core::create(model, setup.engine);
  if (!eng.ok()) {
    ADD_FAILURE() << eng.error().message();
    return;
  }
  auto ctx = server::make_api_context(model, setup.engine.max_model_len, setup.api, nullptr);
  if (!ctx.ok()) {
    ADD_FAILURE() << ctx.error().message();
    return;
  }
  ctx->images = setup.images;
  if (setup.kv_store) {
    std::vector<std::unique_ptr<block_store>> tiers;
    tiers.push_back(make_memory_store());
    warehouse_options o;
    o.model = model_fingerprint(model);
    warehouse_ = std::make_unique<kv_warehouse>(std::move(tiers), o);
    attach_warehouse(**eng, *warehouse_);
  }
  if (setup.prepare_engine) setup.prepare_engine(**eng);
  if (setup.step_gate) {
    gate_ = std::make_shared<step_gate>();
    gate_->attach(**eng);
  }
  loop_ = std::make_unique<engine_loop>(std::move(*eng), setup.max_waiting);
  if (setup.kv_store) kv_ = std::make_unique<server::kv_admin>(*loop_, warehouse_.get(), setup.admin_key);
  http_ = std::make_unique<server::http_server>(setup.http, std::move(*ctx), std::move(setup.keys), *loop_, kv_.get());
  auto port = http_->bind();
  if (!port.ok()) {
    ADD_FAILURE() << port.error().message();
    return;
  }
  port_ = *port;
  thread_ = std::thread([this] {
    status st = http_->serve();
    EXPECT_TRUE(st.ok()) << st.message();
  });
}

test_server::~test_server() {
  if (gate_) gate_->open();
  if (loop_) loop_->stop();
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

std::unique_ptr<httplib::Client> test_server::client(int timeout_s) const {
  auto c = std::make_unique<httplib::Client>("127.0.0.1", port_);
  c->set_read_timeout(timeout_s, 0);
  c->set_write_timeout(timeout_s, 0);
  c->set_connection_timeout(5, 0);
  c->set_keep_alive(true);
  return c;
}

std::map<std::string, double> test_server::metrics() {
  auto c = client();
  auto res = c->Get("/metrics");
  if (!res || res->status != 200) {
    ADD_FAILURE() << "GET /metrics failed";
    return {};
  }
  return parse_metrics(res->body);
}

namespace {

// The pieces of `text` between separators (a trailing empty piece dropped).
std::vector<std::string> split(const std::string& text, const std::string& sep) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find(sep, pos);
    if (end == std::string::npos) end = text.size();
    out.push_back(text.substr(pos, end - pos));
    pos = end + sep.size();
  }
  return out;
}

}  // namespace

std::map<std::string, double> parse_metrics(const std::string& text) {
  std::map<std::string, double> out;
  for (const std::string& line : split(text, "\n")) {
    if (line.empty() || line[0] == '#') continue;
    std::size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    std::string key = line.substr(0, sp);
    // Drop the model_name label every series carries.
    std::size_t mn = key.find("model_name=\"");
    if (mn != std::string::npos) {
      std::size_t close = mn + 12;
      while (close < key.size() && key[close] != '"') close += key[close] == '\\' ? 2 : 1;
      std::size_t cut_end = close + 1;
      if (cut_end < key.size() && key[cut_end] == ',') ++cut_end;
      key.erase(mn, cut_end - mn);
      if (key.size() >= 2 && key.substr(key.size() - 2) == "{}") key.resize(key.size() - 2);
    }
    out[key] = std::strtod(line.c_str() + sp + 1, nullptr);
  }
  return out;
}

double metric(const std::map<std::string, double>& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? std::numeric_limits<double>::quiet_NaN() : it->second;
}

http_reply post_json(httplib::Client& c, const std::string& path, const std::string& body, const httplib::Headers& headers) {
  http_reply r;
  auto res = c.Post(path, headers, body, "application/json");
  if (!res) return r;
  r.status = res->status;
  r.body = res->body;
  r.json_body = json::parse(r.body, nullptr, false);
  return r;
}

int raw_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool raw_read(int fd, std::string& out, int timeout_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  char buf[65536];
  for (;;) {
    int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    if (left <= 0) return true;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, left) <= 0) return true;
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return false;
    out.append(buf, static_cast<std::size_t>(n));
  }
}

bool raw_read_some(int fd, std::string& out, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return false;
  char buf[65536];
  ssize_t n = recv(fd, buf, sizeof(buf), 0);
  if (n <= 0) return false;
  out.append(buf, static_cast<std::size_t>(n));
  return true;
}

std::string raw_exchange(int port, const std::string& bytes, int timeout_ms, bool shutdown_write) {
  int fd = raw_connect(port);
  if (fd < 0) return {};
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may close early (413): read what it said
    sent += static_cast<std::size_t>(n);
  }
  if (shutdown_write) shutdown(fd, SHUT_WR);
  std::string out;
  raw_read(fd, out, timeout_ms);
  close(fd);
  return out;
}

std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> out;
  for (const std::string& event : split(body, "\n\n")) {
    if (event.rfind("data: ", 0) == 0) out.push_back(event.substr(6));
    else if (!event.empty()) out.push_back("<malformed: " + event + ">");
  }
  return out;
}

bool wait_idle(test_server& s, int timeout_ms) {
  return poll_until(
      [&] {
        const engine_snapshot snap = s.snapshot();
        return snap.kv.n_blocks_used == 0 && snap.n_running == 0 && snap.n_waiting == 0 && snap.n_requests_active == 0;
      },
      timeout_ms);
}

}  // namespace pagoda::test
