// pagoda pull and -hf against a Hugging Face hub served on loopback by the
// test: the tree API (sizes, lfs.oid = SHA-256) and resolve/main/FILE, for a
// fake repository holding the real stories260K.gguf and a second GGUF. No
// network: HF_ENDPOINT points at the test's server.
#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"

namespace pagoda::test {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string sha256_hex(const std::string& bytes) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(bytes.data(), bytes.size(), md, &n, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned int i = 0; i < n; ++i) hex += fmt::format("{:02x}", md[i]);
  return hex;
}

struct hub_entry {
  std::string bytes;
  std::string published_sha256;  // "" : not in LFS (no lfs object listed)
};

// The hub's URL layout for the repositories the test adds. Counts what it is
// asked, and keeps the Range and Authorization headers it saw.
class fake_hub {
 public:
  fake_hub() {
    srv_.Get(R"(/api/models/([^/]+)/([^/]+)/tree/main)", [this](const httplib::Request& req, httplib::Response& res) {
      std::lock_guard lock(mu_);
      ++n_api_;
      auths_.push_back(req.get_header_value("Authorization"));
      const std::string repo = req.matches[1].str() + "/" + req.matches[2].str();
      if (!required_token_.empty() && req.get_header_value("Authorization") != "Bearer " + required_token_) {
        res.status = 401;
        res.set_header("X-Error-Message", "Invalid username or password.");
        return;
      }
      auto it = repos_.find(repo);
      if (it == repos_.end()) {
        res.status = 404;
        res.set_header("X-Error-Message", "Repository not found");
        res.set_content(R"({"error":"Repository not found"})", "application/json");
        return;
      }
      nlohmann::json tree = nlohmann::json::array();
      tree.push_back({{"type", "file"}, {"path", "README.md"}, {"size", 12}, {"oid", std::string(40, 'a')}});
      for (const auto& [path, e] : it->second) {
        nlohmann::json item = {{"type", "file"}, {"path", path}, {"size", e.bytes.size()}, {"oid", std::string(40, 'b')}};
        if (!e.published_sha256.empty())
          item["lfs"] = {{"oid", e.published_sha256}, {"size", e.bytes.size()}, {"pointerSize", 134}};
        tree.push_back(item);
      }
      res.set_content(tree.dump(), "application/json");
    });
    srv_.Get(R"(/([^/]+)/([^/]+)/resolve/main/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
      std::lock_guard lock(mu_);
      ++n_file_gets_;
      ranges_.push_back(req.get_header_value("Range"));
      auths_.push_back(req.get_header_value("Authorization"));
      const std::string repo = req.matches[1].str() + "/" + req.matches[2].str();
      auto it = repos_.find(repo);
      if (it == repos_.end() || !it->second.count(req.matches[3].str())) {
        res.status = 404;
        return;
      }
      const std::string& bytes = it->second.at(req.matches[3].str()).bytes;
      if (cut_after_ >= 0 && !req.has_header("Range")) {
        // The connection drops after cut_after_ bytes of the whole file.
        const std::size_t cut = static_cast<std::size_t>(cut_after_);
        cut_after_ = -1;
        res.set_content_provider(bytes.size(), "application/octet-stream",
                                 [bytes, cut](std::size_t offset, std::size_t, httplib::DataSink& sink) {
                                   if (offset >= cut) return false;
                                   sink.write(bytes.data() + offset, cut - offset);
                                   return true;
                                 });
        return;
      }
      res.set_content(bytes, "application/octet-stream");  // httplib answers a Range with 206
    });
    port_ = srv_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { srv_.listen_after_bind(); });
  }
  ~fake_hub() {
    srv_.stop();
    thread_.join();
  }

  void add(const std::string& repo, const std::string& path, hub_entry e) {
    std::lock_guard lock(mu_);
    repos_[repo][path] = std::move(e);
  }
  void cut_next_download_after(long bytes) {
    std::lock_guard lock(mu_);
    cut_after_ = bytes;
  }
  void require_token(std::string token) {
    std::lock_guard lock(mu_);
    required_token_ = std::move(token);
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int n_file_gets() {
    std::lock_guard lock(mu_);
    return n_file_gets_;
  }
  int n_api() {
    std::lock_guard lock(mu_);
    return n_api_;
  }
  std::vector<std::string> ranges() {
    std::lock_guard lock(mu_);
    return ranges_;
  }
  std::vector<std::string> auths() {
    std::lock_guard lock(mu_);
    return auths_;
  }

 private:
  httplib::Server srv_;
  std::thread thread_;
  int port_ = 0;
  std::mutex mu_;
  std::map<std::string, std::map<std::string, hub_entry>> repos_;
  long cut_after_ = -1;
  std::string required_token_;
  int n_file_gets_ = 0;
  int n_api_ = 0;
  std::vector<std::string> ranges_, auths_;
};

constexpr const char* k_repo = "tester/tiny-GGUF";

class Pull : public ::testing::Test {
 protected:
  void SetUp() override {
    cache_ = fs::temp_directory_path() / ("pagoda_pull_test_" + std::to_string(getpid()));
    fs::remove_all(cache_);
    setenv("HF_ENDPOINT", hub_.endpoint().c_str(), 1);
    setenv("PAGODA_MODELS", cache_.c_str(), 1);
    setenv("HF_HOME", (cache_ / "hf_home").c_str(), 1);  // no token file of this machine's user
    unsetenv("HF_TOKEN");
    unsetenv("HF_TOKEN_PATH");
    unsetenv("HF_HUB_OFFLINE");
    stories_ = read_bytes(model_path());
    ASSERT_GT(stories_.size(), 1000u);
    other_ = stories_ + std::string(64, '\0');  // a second, different GGUF
    hub_.add(k_repo, "tiny-Q8_0.gguf", {stories_, sha256_hex(stories_)});
    hub_.add(k_repo, "tiny-Q4_K_M.gguf", {other_, sha256_hex(other_)});
  }
  void TearDown() override { fs::remove_all(cache_); }

  std::string local(const std::string& file) const { return (cache_ / "tester__tiny-GGUF" / file).string(); }
  // The files of the cache folder (nothing else may be left behind).
  std::vector<std::string> cached_files() const {
    std::vector<std::string> out;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(cache_, ec); !ec && it != fs::recursive_directory_iterator(); ++it)
      if (it->is_regular_file()) out.push_back(fs::relative(it->path(), cache_).string());
    return out;
  }

  fake_hub hub_;
  fs::path cache_;
  std::string stories_, other_;
};

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

TEST_F(Pull, QuantPicksTheFileCaseInsensitivelyAndTheHashIsVerified) {
  auto r = run_cli(std::string("pull ") + k_repo + ":q8_0");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(trim(r.out), local("tiny-Q8_0.gguf"));
  EXPECT_EQ(read_bytes(local("tiny-Q8_0.gguf")), stories_);
  EXPECT_EQ(read_bytes(local("tiny-Q8_0.gguf") + ".sha256").substr(0, 64), sha256_hex(stories_));
  EXPECT_NE(r.err.find("sha256 verified"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(local("tiny-Q8_0.gguf.part")));
  EXPECT_EQ(hub_.n_file_gets(), 1);
}

TEST_F(Pull, WithoutQuantQ4KMIsTheDefaultAndSaysSo) {
  auto r = run_cli(std::string("pull ") + k_repo);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(trim(r.out), local("tiny-Q4_K_M.gguf"));
  EXPECT_EQ(read_bytes(local("tiny-Q4_K_M.gguf")), other_);
  EXPECT_NE(r.err.find("Q4_K_M, the default"), std::string::npos) << r.err;
}

TEST_F(Pull, ASecondPullOfACompleteFileDownloadsNothing) {
  ASSERT_EQ(run_cli(std::string("pull ") + k_repo + ":Q8_0").exit_code, 0);
  auto again = run_cli(std::string("pull ") + k_repo + ":Q8_0");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(trim(again.out), local("tiny-Q8_0.gguf"));
  EXPECT_NE(again.err.find("already pulled"), std::string::npos) << again.err;
  EXPECT_EQ(hub_.n_file_gets(), 1);
}

TEST_F(Pull, AnInterruptedDownloadResumesWithARangeRequest) {
  const long half = static_cast<long>(stories_.size() / 2);
  hub_.cut_next_download_after(half);
  auto first = run_cli(std::string("pull ") + k_repo + ":Q8_0");
  EXPECT_EQ(first.exit_code, 1);
  EXPECT_NE(first.err.find("run the same command again to resume"), std::string::npos) << first.err;
  ASSERT_TRUE(fs::exists(local("tiny-Q8_0.gguf.part")));
  EXPECT_EQ(static_cast<long>(fs::file_size(local("tiny-Q8_0.gguf.part"))), half);
  EXPECT_FALSE(fs::exists(local("tiny-Q8_0.gguf")));

  auto second = run_cli(std::string("pull ") + k_repo + ":Q8_0");
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_NE(second.err.find("resuming"), std::string::npos) << second.err;
  const std::vector<std::string> ranges = hub_.ranges();
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[0], "");
  EXPECT_EQ(ranges[1], "bytes=" + std::to_string(half) + "-");
  EXPECT_EQ(sha256_hex(read_bytes(local("tiny-Q8_0.gguf"))), sha256_hex(stories_));
  EXPECT_FALSE(fs::exists(local("tiny-Q8_0.gguf.part")));
}

TEST_F(Pull, TwoPullsOfOneFileNeverWriteItTogether) {
  fs::create_directories(fs::path(local("tiny-Q8_0.gguf")).parent_path());
  const std::string part = local("tiny-Q8_0.gguf.part");
  const int fd = ::open(part.c_str(), O_RDWR | O_CREAT, 0644);  // as a pull under way holds it
  ASSERT_GE(fd, 0);
  ASSERT_EQ(flock(fd, LOCK_EX | LOCK_NB), 0);
  auto r = run_cli(std::string("pull ") + k_repo + ":Q8_0");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("another process is pulling " + local("tiny-Q8_0.gguf") + " now"), std::string::npos) << r.err;
  EXPECT_EQ(hub_.n_file_gets(), 0);
  ::close(fd);
  auto after = run_cli(std::string("pull ") + k_repo + ":Q8_0");
  ASSERT_EQ(after.exit_code, 0) << after.err;
  EXPECT_EQ(read_bytes(local("tiny-Q8_0.gguf")), stories_);
}

TEST_F(Pull, AWrongHashIsRefusedAndNothingIsLeft) {
  hub_.add(k_repo, "tiny-Q8_0.gguf", {stories_, std::string(64, '0')});
  auto r = run_cli(std::string("pull ") + k_repo + ":Q8_0");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("does not match the published " + std::string(64, '0')), std::string::npos) << r.err;
  EXPECT_EQ(cached_files(), std::vector<std::string>{}) << "left behind";
}

TEST_F(Pull, AFileThatIsNotGGUFIsRefused) {
  hub_.add(k_repo, "tiny-F16.gguf", {"<html>a login page</html>", ""});  // no published hash
  auto r = run_cli(std::string("pull ") + k_repo + ":F16");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("not a GGUF file"), std::string::npos) << r.err;
  EXPECT_EQ(cached_files(), std::vector<std::string>{});
}

TEST_F(Pull, AMissingRepoAndAMissingQuantAreClearErrors) {
  auto repo = run_cli("pull tester/nothing-here:Q4_K_M");
  EXPECT_EQ(repo.exit_code, 1);
  EXPECT_NE(repo.err.find("tester/nothing-here: no such repository at " + hub_.endpoint() + " (HTTP 404"),
            std::string::npos)
      << repo.err;
  auto quant = run_cli(std::string("pull ") + k_repo + ":Q2_K");
  EXPECT_EQ(quant.exit_code, 1);
  EXPECT_NE(quant.err.find("has no GGUF file named Q2_K; it has: tiny-Q4_K_M.gguf, tiny-Q8_0.gguf"), std::string::npos)
      << quant.err;
  auto bad = run_cli("pull not-a-repo");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("is not a Hugging Face repository: OWNER/NAME[:QUANT]"), std::string::npos) << bad.err;
  EXPECT_EQ(hub_.n_file_gets(), 0);
}

TEST_F(Pull, HfFileTakesAnExactNameAndASplitGGUFIsRefused) {
  auto exact = run_cli(std::string("pull ") + k_repo + " --hf-file tiny-Q8_0.gguf");
  ASSERT_EQ(exact.exit_code, 0) << exact.err;
  EXPECT_EQ(trim(exact.out), local("tiny-Q8_0.gguf"));
  hub_.add(k_repo, "big-Q6_K-00001-of-00002.gguf", {stories_, sha256_hex(stories_)});
  hub_.add(k_repo, "big-Q6_K-00002-of-00002.gguf", {other_, sha256_hex(other_)});
  auto split = run_cli(std::string("pull ") + k_repo + ":Q6_K");
  EXPECT_EQ(split.exit_code, 1);
  EXPECT_NE(split.err.find("big-Q6_K-00001-of-00002.gguf is part 1 of a GGUF split into 2 files"), std::string::npos)
      << split.err;
  EXPECT_EQ(hub_.n_file_gets(), 1);
}

TEST_F(Pull, HfOnRunAndInfoLoadsThePulledFileWithoutDownloadingAgain) {
  ASSERT_EQ(run_cli(std::string("pull ") + k_repo + ":Q8_0").exit_code, 0);
  ASSERT_EQ(hub_.n_file_gets(), 1);
  auto info = run_cli(std::string("info -hf ") + k_repo + ":Q8_0");
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_NE(info.out.find("model:           " + local("tiny-Q8_0.gguf")), std::string::npos) << info.out;
  auto run = run_cli(std::string("run --hf-repo ") + k_repo + ":Q8_0 -p 'Once upon a time' -n 8 --temp 0");
  ASSERT_EQ(run.exit_code, 0) << run.err;
  auto direct = run_cli("run -m " + model_path() + " -p 'Once upon a time' -n 8 --temp 0");
  EXPECT_EQ(run.out, direct.out);
  EXPECT_EQ(hub_.n_file_gets(), 1);
}

TEST_F(Pull, HfPullsWhatIsNotCachedAndRefusesTwoModels) {
  auto info = run_cli(std::string("info -hf ") + k_repo + ":Q8_0");
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_EQ(hub_.n_file_gets(), 1);
  auto both = run_cli("info -m " + model_path() + " -hf " + k_repo);
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_NE(both.err.find("two models given"), std::string::npos) << both.err;
  auto none = run_cli("info");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.err.find("a model is required: -m/--model MODEL, or -hf REPO[:QUANT]"), std::string::npos) << none.err;
}

TEST_F(Pull, HfTokenIsSentAsABearerHeader) {
  hub_.require_token("hf_secret");
  auto refused = run_cli(std::string("pull ") + k_repo + ":Q8_0");
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_NE(refused.err.find("HTTP 401"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("set HF_TOKEN"), std::string::npos) << refused.err;
  setenv("HF_TOKEN", "hf_secret", 1);
  auto r = run_cli(std::string("pull ") + k_repo + ":Q8_0");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> auths = hub_.auths();
  ASSERT_GE(auths.size(), 3u);  // the refused listing, the listing, the file
  EXPECT_EQ(auths[0], "");
  EXPECT_EQ(auths[1], "Bearer hf_secret");
  EXPECT_EQ(auths[2], "Bearer hf_secret");
}

TEST_F(Pull, NoNetworkIsOneLineAndTheCacheStillServes) {
  setenv("HF_ENDPOINT", "http://127.0.0.1:1", 1);  // nothing listens there
  auto offline = run_cli(std::string("pull ") + k_repo + ":Q8_0");
  EXPECT_EQ(offline.exit_code, 1);
  EXPECT_NE(offline.err.find("pagoda: error: cannot reach 127.0.0.1:1"), std::string::npos) << offline.err;
  EXPECT_EQ(std::count(offline.err.begin(), offline.err.end(), '\n'), 1) << offline.err;

  setenv("HF_ENDPOINT", hub_.endpoint().c_str(), 1);
  ASSERT_EQ(run_cli(std::string("pull ") + k_repo + ":Q8_0").exit_code, 0);
  setenv("HF_ENDPOINT", "http://127.0.0.1:1", 1);
  auto cached = run_cli(std::string("info -hf ") + k_repo + ":Q8_0");
  ASSERT_EQ(cached.exit_code, 0) << cached.err;
  EXPECT_NE(cached.err.find("using the cached " + local("tiny-Q8_0.gguf")), std::string::npos) << cached.err;
  setenv("HF_HUB_OFFLINE", "1", 1);
  setenv("HF_ENDPOINT", hub_.endpoint().c_str(), 1);
  const int api_before = hub_.n_api();
  auto hub_offline = run_cli(std::string("pull ") + k_repo + ":Q8_0");
  ASSERT_EQ(hub_offline.exit_code, 0) << hub_offline.err;
  EXPECT_EQ(hub_.n_api(), api_before);  // HF_HUB_OFFLINE: not even the listing
}

}  // namespace
}  // namespace pagoda::test
