// pagoda chat (and run -cnv) driven as a user drives it: through a
// pseudo-terminal, typing lines and reading until the "> " prompt comes back.
// No sleeps: every read waits for a marker, with a generous timeout.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"

namespace pagoda::test {
namespace {

constexpr int k_timeout_ms = 300'000;  // a loaded machine; the model is tiny
const std::string k_prompt = "\n> ";   // the REPL's prompt (after ONLCR: "\r\n> ")

// The pagoda binary on the slave side of a pty, as if in a terminal.
class pty_session {
 public:
  explicit pty_session(const std::vector<std::string>& args) {
    master_ = posix_openpt(O_RDWR | O_NOCTTY);
    if (master_ < 0 || grantpt(master_) != 0 || unlockpt(master_) != 0) return;
    const std::string slave_name = ptsname(master_);
    std::vector<std::string> argv_s = {PAGODA_CLI};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    pid_ = fork();
    if (pid_ == 0) {
      setsid();  // a session of its own: the pty becomes its controlling terminal
      const int slave = open(slave_name.c_str(), O_RDWR);
      if (slave < 0) _exit(127);
      dup2(slave, 0);
      dup2(slave, 1);
      dup2(slave, 2);
      if (slave > 2) close(slave);
      close(master_);
      std::vector<char*> argv;
      for (std::string& a : argv_s) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~pty_session() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (master_ >= 0) close(master_);
  }
  bool started() const { return master_ >= 0 && pid_ > 0; }

  // Everything printed after the last marker found, up to and including the
  // next `marker`; "" (and a test failure) when it does not come in time.
  std::string read_until(const std::string& marker) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(k_timeout_ms);
    for (;;) {
      if (const std::size_t at = all_.find(marker, consumed_); at != std::string::npos) {
        std::string out = all_.substr(consumed_, at + marker.size() - consumed_);
        consumed_ = at + marker.size();
        return out;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0 || read_some(static_cast<int>(left.count())) <= 0) {
        ADD_FAILURE() << "no '" << marker << "' in time; the session printed:\n" << all_.substr(consumed_);
        return "";
      }
    }
  }
  // A typed line; what it prints ends at the next prompt.
  std::string type(const std::string& line) {
    const std::string s = line + "\n";
    EXPECT_EQ(write(master_, s.data(), s.size()), static_cast<ssize_t>(s.size()));
    return read_until(k_prompt);
  }
  // Ctrl-D at the start of a line: end of input.
  void send_eof() {
    const char eof = 4;
    EXPECT_EQ(write(master_, &eof, 1), 1);
  }
  // The exit code, reading (and so draining) the pty until the process ends.
  int wait_exit() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(k_timeout_ms);
    while (std::chrono::steady_clock::now() < deadline) {
      int st = 0;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      }
      read_some(100);  // until the output ends (the pty's slave side closed), or a while
    }
    ADD_FAILURE() << "the session did not exit; it printed:\n" << all_.substr(consumed_);
    return -1;
  }
  // Types a line that ends the session (/exit), then waits for the exit code.
  int wait_exit_after(const std::string& line) {
    const std::string l = line + "\n";
    EXPECT_EQ(write(master_, l.data(), l.size()), static_cast<ssize_t>(l.size()));
    return wait_exit();
  }

 private:
  // 1: read something; 0: nothing in timeout_ms; -1: the end of output (the
  // process closed the terminal: EIO).
  int read_some(int timeout_ms) {
    pollfd p{master_, POLLIN, 0};
    const int r = poll(&p, 1, timeout_ms);
    if (r == 0) return 0;
    char buf[4096];
    const ssize_t n = r < 0 ? -1 : read(master_, buf, sizeof buf);
    if (n <= 0) return -1;
    all_.append(buf, static_cast<std::size_t>(n));
    return 1;
  }

  int master_ = -1;
  pid_t pid_ = -1;
  bool exited_ = false;
  std::string all_;
  std::size_t consumed_ = 0;
};

struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    std::string t = (std::filesystem::temp_directory_path() / "pagoda_chat_XXXXXX").string();
    path = mkdtemp(t.data());
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// "conversation: M messages, T tokens" and "last turn: prompt P tokens, C
// cached" of a /stats.
struct turn_numbers {
  int conversation = -1, prompt = -1, cached = -1;
};
turn_numbers last_turn(const std::string& stats) {
  std::smatch m;
  turn_numbers t;
  if (std::regex_search(stats, m, std::regex(R"(conversation: \d+ messages?, (\d+) tokens)")))
    t.conversation = std::stoi(m[1]);
  if (std::regex_search(stats, m, std::regex(R"(last turn: prompt (\d+) tokens, (\d+) cached)"))) {
    t.prompt = std::stoi(m[1]);
    t.cached = std::stoi(m[2]);
  }
  return t;
}

// The reply a typed line got: what follows the echoed line, before the prompt.
std::string reply_of(const std::string& out, const std::string& typed) {
  std::size_t b = out.find(typed);
  b = b == std::string::npos ? 0 : b + typed.size();
  std::string r = out.substr(b, out.size() - b - std::min(out.size() - b, k_prompt.size() + 1));
  r.erase(0, r.find_first_not_of("\r\n"));
  return r;
}

const std::string k_turn1 =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends.";
const std::string k_turn2 = "One day, Lily saw a big red ball.";

std::vector<std::string> chat_args(const std::vector<std::string>& extra) {
  std::vector<std::string> a = {"chat", "-m", model_path(), "--temp", "0", "-n", "24"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

TEST(cli_chat, turns_reuse_the_cache_and_save_load_continues_through_the_store) {
  temp_dir dir;
  const std::string store = (dir.path / "kv").string(), saved = (dir.path / "conversation.json").string();
  // stories260K has no chat template; chatml gives its turns markers.
  const std::vector<std::string> args = chat_args({"--chat-template", "chatml", "--system", "A story.", "--kv-store", store});
  {
    pty_session s(args);
    ASSERT_TRUE(s.started());
    const std::string banner = s.read_until(k_prompt);
    EXPECT_NE(banner.find("/help"), std::string::npos) << banner;

    const std::string r1 = reply_of(s.type(k_turn1), k_turn1);
    EXPECT_GT(r1.size(), 10u) << "no reply streamed: " << r1;
    const turn_numbers t1 = last_turn(s.type("/stats"));
    ASSERT_GT(t1.prompt, 32);

    const std::string r2 = reply_of(s.type(k_turn2), k_turn2);
    EXPECT_GT(r2.size(), 10u) << "no reply streamed: " << r2;
    const std::string stats = s.type("/stats");
    const turn_numbers t2 = last_turn(stats);
    // The second prompt holds the whole conversation, and the first turn's
    // blocks (its prompt and its reply, which the template renders as the
    // model wrote it) come from the prefix cache: what is computed is the
    // new turn's tokens and the first turn's last, partly filled block.
    ASSERT_GT(t1.conversation, t1.prompt) << stats;
    ASSERT_GT(t2.prompt, t1.conversation) << stats;
    EXPECT_GE(t2.cached, (t1.conversation - 1) / 16 * 16) << stats;
    EXPECT_LT(t2.prompt - t2.cached, t2.prompt - t1.conversation + 17) << stats;
    EXPECT_LT(t2.prompt - t2.cached, t2.prompt / 2) << stats;
    EXPECT_NE(stats.find("conversation: 5 messages"), std::string::npos) << stats;
    EXPECT_NE(stats.find("tok/s"), std::string::npos) << stats;
    EXPECT_NE(stats.find("blocks in use"), std::string::npos) << stats;

    const std::string save = s.type("/save " + saved);
    EXPECT_NE(save.find("saved 5 messages"), std::string::npos) << save;

    const std::string cleared = s.type("/clear");
    EXPECT_NE(cleared.find("cleared"), std::string::npos) << cleared;
    const std::string after_clear = s.type("/stats");
    EXPECT_NE(after_clear.find("conversation: 1 message,"), std::string::npos) << after_clear;  // the system message
    EXPECT_NE(after_clear.find("last turn: none yet"), std::string::npos) << after_clear;

    EXPECT_EQ(s.wait_exit_after("/exit"), 0);
  }
  std::ifstream in(saved);
  const nlohmann::json j = nlohmann::json::parse(in);
  ASSERT_EQ(j["messages"].size(), 5u);
  EXPECT_EQ(j["messages"][0]["role"], "system");
  EXPECT_EQ(j["messages"][1]["content"], k_turn1);
  EXPECT_EQ(j["messages"][3]["content"], k_turn2);
  EXPECT_EQ(j["messages"][4]["role"], "assistant");

  // A new process: the conversation's KV comes from the disk store.
  pty_session s(args);
  ASSERT_TRUE(s.started());
  s.read_until(k_prompt);
  const std::string loaded = s.type("/load " + saved);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(loaded, m, std::regex(R"(loaded 5 messages .*: (\d+) tokens, (\d+) from the KV cache \((\d+) from the KV store\))")))
      << loaded;
  const int n_tokens = std::stoi(m[1]), from_store = std::stoi(m[3]);
  EXPECT_GE(from_store, n_tokens / 16 * 16 - 16) << loaded;
  EXPECT_GT(from_store, 0) << loaded;

  const std::string r3 = reply_of(s.type("What did Lily do?"), "What did Lily do?");
  EXPECT_GT(r3.size(), 10u) << r3;
  const std::string stats = s.type("/stats");
  EXPECT_NE(stats.find("conversation: 7 messages"), std::string::npos) << stats;
  const turn_numbers t3 = last_turn(stats);
  EXPECT_GE(t3.cached, n_tokens / 16 * 16) << stats;  // the loaded conversation is the new turn's prefix
  s.send_eof();
  EXPECT_EQ(s.wait_exit(), 0);
}

TEST(cli_chat, a_conversation_longer_than_the_context_is_an_error_not_a_crash) {
  pty_session s(chat_args({"--ctx", "64"}));
  ASSERT_TRUE(s.started());
  s.read_until(k_prompt);
  std::string long_message;
  for (int i = 0; i < 12; ++i) long_message += "The cat sat on the mat. ";
  const std::string out = s.type(long_message);
  EXPECT_NE(out.find("the context holds 64 (--ctx); /clear starts a new one"), std::string::npos) << out;
  // The session goes on, and the refused message is not in the history.
  const std::string stats = s.type("/stats");
  EXPECT_NE(stats.find("conversation: 0 messages"), std::string::npos) << stats;
  const std::string r = reply_of(s.type("Once upon a time"), "Once upon a time");
  EXPECT_GT(r.size(), 5u) << r;
  EXPECT_EQ(s.wait_exit_after("/exit"), 0);
}

TEST(cli_chat, run_cnv_starts_the_same_session_and_bad_commands_are_errors) {
  temp_dir dir;
  const std::string bad = (dir.path / "bad.json").string();
  std::ofstream(bad) << "{\"messages\": [{\"role\": \"robot\", \"content\": \"hi\"}]}";
  pty_session s({"run", "-m", model_path(), "-cnv", "-n", "8", "--temp", "0"});
  ASSERT_TRUE(s.started());
  s.read_until(k_prompt);
  EXPECT_NE(s.type("/help").find("/save FILE"), std::string::npos);
  EXPECT_NE(s.type("/frobnicate").find("unknown command"), std::string::npos);
  EXPECT_NE(s.type("/load").find("/load needs a file name"), std::string::npos);
  EXPECT_NE(s.type("/load " + (dir.path / "missing.json").string()).find("cannot open"), std::string::npos);
  EXPECT_NE(s.type("/load " + bad).find("role 'robot' is not system, user or assistant"), std::string::npos);
  const std::string reply = s.type("Once upon a time");
  EXPECT_GT(reply_of(reply, "Once upon a time").size(), 5u) << reply;
  EXPECT_EQ(s.wait_exit_after("\x03"), 0);  // Ctrl-C at the prompt ends the session cleanly
}

}  // namespace
}  // namespace pagoda::test
