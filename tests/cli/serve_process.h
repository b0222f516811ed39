// A real `pagoda serve` process for end-to-end tests: started with --port 0,
// its port read from the line it prints on stdout, stopped with SIGTERM (a
// graceful shutdown) or SIGKILL (a crash).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace pagoda::test {

// In a forked child: replaces it with `pagoda ARGS...` (exits 127 if that
// fails). $PAGODA_TEST_BINARY, when set, names another pagoda binary to run
// (an older build, to see a test fail before its fix).
[[noreturn]] inline void exec_pagoda(std::vector<std::string> args) {
  const char* other = std::getenv("PAGODA_TEST_BINARY");
  args.insert(args.begin(), other && *other ? other : PAGODA_CLI);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execv(argv[0], argv.data());
  ::_exit(127);
}

class serve_process {
 public:
  // args: everything after `pagoda serve` (--port 0 is added).
  explicit serve_process(std::vector<std::string> args) : args_(std::move(args)) { start(); }
  // max_file_bytes: the server's RLIMIT_FSIZE (a disk that fills up: writes past
  // it fail with EFBIG).
  serve_process(std::vector<std::string> args, rlim_t max_file_bytes)
      : args_(std::move(args)), max_file_bytes_(max_file_bytes) {
    start();
  }
  // Another subcommand that prints the same "listening on" line on stdout
  // (`pagoda router`): args after `pagoda COMMAND` (--port 0 is added).
  serve_process(std::string command, std::vector<std::string> args)
      : args_(std::move(args)), command_(std::move(command)) {
    start();
  }
  ~serve_process() { stop(SIGKILL); }
  serve_process(const serve_process&) = delete;
  serve_process& operator=(const serve_process&) = delete;

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }
  // Whether the process ended on its own (a crash); reaps it then.
  bool exited() {
    if (pid_ <= 0) return true;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) != pid_) return false;
    pid_ = -1;
    return true;
  }

  void start() {
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    pid_ = ::fork();
    if (pid_ == 0) {
      if (max_file_bytes_ != RLIM_INFINITY) {
        const rlimit lim{max_file_bytes_, max_file_bytes_};
        ::setrlimit(RLIMIT_FSIZE, &lim);
      }
      ::dup2(out[1], 1);
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 2);
      ::close(out[0]);
      std::vector<std::string> all = {command_, "--port", "0"};
      all.insert(all.end(), args_.begin(), args_.end());
      exec_pagoda(std::move(all));
    }
    ::close(out[1]);
    out_fd_ = out[0];
    // "pagoda serve: listening on http://127.0.0.1:PORT"
    std::string text;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (text.find('\n', text.find("listening on")) == std::string::npos &&
           std::chrono::steady_clock::now() < deadline) {
      pollfd p{out_fd_, POLLIN, 0};
      if (::poll(&p, 1, 200) <= 0) continue;
      char buf[512];
      const ssize_t n = ::read(out_fd_, buf, sizeof buf);
      if (n <= 0) break;
      text.append(buf, static_cast<std::size_t>(n));
    }
    const std::size_t at = text.find("listening on http://");
    ASSERT_NE(at, std::string::npos) << "pagoda " << command_ << " did not start: " << text;
    const std::size_t colon = text.find(':', at + 20);
    port_ = std::stoi(text.substr(colon + 1));
  }

  // SIGTERM waits for the graceful shutdown (write-back drained); SIGKILL is a crash.
  void stop(int sig = SIGTERM) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
    if (out_fd_ >= 0) ::close(out_fd_);
    out_fd_ = -1;
  }

 private:
  std::vector<std::string> args_;
  std::string command_ = "serve";
  rlim_t max_file_bytes_ = RLIM_INFINITY;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  int port_ = 0;
};

}  // namespace pagoda::test
