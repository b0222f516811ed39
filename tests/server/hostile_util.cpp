#include "server/hostile_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "common/stories.h"
#include "server/server_util.h"

namespace pagoda::test {

namespace {

using clock = std::chrono::steady_clock;

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

}  // namespace

key_files::key_files() {
  char tmpl[] = "/tmp/pagoda-hostile-XXXXXX";
  dir = ::mkdtemp(tmpl);
  tenants = dir + "/tenants.json";
  key_file = dir + "/keys.txt";
  empty_tenants = dir + "/empty.json";
  write_file(tenants, R"({"tenants": [{"name": "alice", "api_keys": ["sk-alice"]}]})");
  write_file(key_file, "# the global tenant's keys\nsk-global\n");
  write_file(empty_tenants, R"({"tenants": []})");
}

key_files::~key_files() {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

std::vector<std::string> hostile_server_args(const key_files& keys, std::vector<std::string> extra) {
  auto secs = [](int ms) { return std::to_string(ms / 1000.0); };
  std::vector<std::string> args = {"-m", stories_path(), "--ctx", "512", "--threads", "1", "--kv-cache-dtype", "f32",
                                   "--no-kv-store", "--tenants", keys.tenants, "--api-key-file", keys.key_file,
                                   "--http-header-timeout", secs(k_header_timeout_ms), "--http-body-timeout",
                                   secs(k_body_timeout_ms), "--http-idle-timeout", secs(k_idle_timeout_ms),
                                   "--max-connections", "6000", "--max-connections-per-address", "6000",
                                   "--log-stats-interval", "0"};
  // A flag in `extra` replaces the default one (each is given once).
  for (std::size_t i = 0; i < extra.size(); ++i) {
    for (std::size_t j = 0; j + 1 < args.size(); ++j)
      if (args[j] == extra[i] && args[j].rfind("--", 0) == 0) {
        args.erase(args.begin() + static_cast<std::ptrdiff_t>(j), args.begin() + static_cast<std::ptrdiff_t>(j) + 2);
        break;
      }
  }
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// --- health_watch ------------------------------------------------------------------

health_watch::health_watch(int port) : port_(port) {
  thread_ = std::thread([this] {
    const std::string req = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    // The watcher is the measuring instrument: ahead of the test's own
    // threads (which play the attackers), so a busy machine delays the
    // server's answer, not the reading of it. (Needs root; ignored otherwise.)
    setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), -10);
    const auto start = clock::now();
    while (!stop_) {
      const auto t0 = clock::now();
      const std::string raw = raw_exchange(port_, req, 2000);
      const long us = std::chrono::duration_cast<std::chrono::microseconds>(clock::now() - t0).count();
      ++n_;
      if (first_answer(raw).status != 200) ++n_failed_;
      if (us > max_us_.load()) {
        max_us_ = us;
        max_at_us_ = std::chrono::duration_cast<std::chrono::microseconds>(t0 - start).count();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
}

health_watch::~health_watch() { stop(); }

void health_watch::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

// --- RSS ---------------------------------------------------------------------------

long rss_bytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6) * 1024;
  return -1;
}

rss_watch::rss_watch(pid_t pid) : pid_(pid), peak_(rss_bytes(pid)) {
  thread_ = std::thread([this] {
    while (!stop_) {
      long v = rss_bytes(pid_);
      if (v > peak_) peak_ = v;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
}

rss_watch::~rss_watch() { stop(); }

void rss_watch::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

// --- HTTP bytes ----------------------------------------------------------------------

std::vector<http_answer> parse_answers(const std::string& raw) {
  std::vector<http_answer> out;
  std::size_t pos = 0;
  int n_info = 0;
  while (pos < raw.size() && raw.compare(pos, 7, "HTTP/1.") == 0) {
    const std::size_t head_end = raw.find("\r\n\r\n", pos);
    if (head_end == std::string::npos) break;
    http_answer a;
    a.status = std::atoi(raw.c_str() + pos + 9);
    a.headers = raw.substr(pos, head_end - pos);
    pos = head_end + 4;
    if (a.status >= 100 && a.status < 200) {
      ++n_info;
      continue;
    }
    a.n_informational = n_info;
    n_info = 0;
    std::string lower = a.headers;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (std::size_t cl = lower.find("content-length: "); cl != std::string::npos) {
      const std::size_t n = std::strtoul(lower.c_str() + cl + 16, nullptr, 10);
      a.body = raw.substr(pos, n);
      pos += std::min(n, raw.size() - pos);
    } else if (lower.find("transfer-encoding: chunked") != std::string::npos) {
      for (;;) {
        const std::size_t eol = raw.find("\r\n", pos);
        if (eol == std::string::npos) break;
        const std::size_t n = std::strtoul(raw.c_str() + pos, nullptr, 16);
        pos = eol + 2;
        if (n == 0) {
          pos += 2;
          break;
        }
        a.body += raw.substr(pos, n);
        pos += n + 2;
      }
    } else {
      a.body = raw.substr(pos);  // delimited by the close
      pos = raw.size();
    }
    a.json_body = json::parse(a.body, nullptr, false);
    out.push_back(std::move(a));
  }
  return out;
}

http_answer first_answer(const std::string& raw) {
  std::vector<http_answer> all = parse_answers(raw);
  return all.empty() ? http_answer{} : std::move(all.front());
}

std::string http_req(const std::string& method, const std::string& path, const std::string& body, const std::string& key,
                     const std::string& extra_headers) {
  std::string r = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  if (!key.empty()) r += "Authorization: Bearer " + key + "\r\n";
  r += extra_headers;
  if (method == "POST") r += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  return r + "\r\n" + body;
}

http_answer ask(int port, const std::string& bytes, int timeout_ms, bool shutdown_write) {
  return first_answer(raw_exchange(port, bytes, timeout_ms, shutdown_write));
}

int raw_connect_from(int port, const char* from) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in src{};
  src.sin_family = AF_INET;
  inet_pton(AF_INET, from, &src.sin_addr);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(static_cast<std::uint16_t>(port));
  dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0 ||
      connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

int raise_fd_limit() {
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
  getrlimit(RLIMIT_NOFILE, &rl);
  return static_cast<int>(rl.rlim_cur);
}

cli_outcome run_cli(const std::vector<std::string>& args, int timeout_ms) {
  cli_outcome r;
  int out[2];
  if (::pipe(out) != 0) return r;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    ::close(out[0]);
    exec_pagoda(args);
  }
  ::close(out[1]);
  const auto deadline = clock::now() + std::chrono::milliseconds(timeout_ms);
  char buf[4096];
  for (;;) {
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count());
    if (left <= 0) {
      ::kill(pid, SIGKILL);
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    if (::poll(&p, 1, left) <= 0) continue;
    const ssize_t n = ::read(out[0], buf, sizeof buf);
    if (n <= 0) break;
    r.output.append(buf, static_cast<std::size_t>(n));
  }
  ::close(out[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

json metrics_of(int port) {
  const http_answer a = ask(port, http_req("GET", "/metrics"), 5000);
  json out = json::object();
  for (const auto& [k, v] : parse_metrics(a.body)) out[k] = v;
  return out;
}

double metric_value(int port, const std::string& key) {
  json m = metrics_of(port);
  return m.contains(key) ? m[key].get<double>() : -1;
}

}  // namespace pagoda::test
