// A redis-server of the test's own on loopback: started on a free port, without
// persistence, stopped (or killed) by the test.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace pagoda::test {

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

inline bool port_open(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// extra: more redis-server arguments ("--requirepass", "pw", ...). tls: the
// port is a TLS port (--tls-port; extra names the certificates) and there is
// no plaintext one.
class redis_server {
 public:
  explicit redis_server(int port = 0) : port_(port ? port : free_port()) { start(); }
  redis_server(std::vector<std::string> extra, bool tls) : port_(free_port()), extra_(std::move(extra)), tls_(tls) {
    start();
  }
  ~redis_server() { stop(); }
  redis_server(const redis_server&) = delete;
  redis_server& operator=(const redis_server&) = delete;

  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  bool running() const { return pid_ > 0; }

  void start() {
    pid_ = ::fork();
    if (pid_ == 0) {
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      ::dup2(null, 2);
      const std::string port = std::to_string(port_);
      std::vector<std::string> args = {"redis-server", "--port", tls_ ? "0" : port, "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--maxmemory", "256mb", "--maxmemory-policy",
                                       "allkeys-lfu", "--loglevel", "warning"};
      if (tls_) args.insert(args.end(), {"--tls-port", port});
      args.insert(args.end(), extra_.begin(), extra_.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execvp("redis-server", argv.data());
      ::_exit(127);
    }
    for (int i = 0; i < 200 && !port_open(port_); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(port_open(port_)) << "redis-server did not start on port " << port_ << " (is it installed?)";
  }
  // Stops it; kill = SIGKILL (a crash) instead of SIGTERM.
  void stop(bool kill = false) {
    if (pid_ <= 0) return;
    ::kill(pid_, kill ? SIGKILL : SIGTERM);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
  }

 private:
  int port_;
  std::vector<std::string> extra_;
  bool tls_ = false;
  pid_t pid_ = -1;
};

}  // namespace pagoda::test
