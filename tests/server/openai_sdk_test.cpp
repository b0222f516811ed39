// The OpenAI Node SDK against `pagoda serve`: runs the node:test suite in
// tests/server/node/openai_sdk.test.mjs, which starts the server itself. The
// npm package `openai` (pinned by tests/server/node/package-lock.json) is
// installed by the dependency step (scripts/install-deps.sh ->
// scripts/install-node-test-deps.sh), never during the test: tests do not
// reach the network.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace pagoda::test {
namespace {

namespace fs = std::filesystem;

struct shell_result {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

shell_result shell(const std::string& cmd) {
  shell_result r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int st = pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The installed openai version, or "" when not installed.
std::string installed_version(const fs::path& dir) {
  std::ifstream in(dir / "node_modules" / "openai" / "package.json");
  if (!in) return "";
  auto j = nlohmann::json::parse(in, nullptr, false);
  return j.is_object() && j.contains("version") && j["version"].is_string() ? j["version"].get<std::string>() : "";
}

std::string locked_version(const fs::path& dir) {
  std::ifstream in(dir / "package-lock.json");
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded()) return "";
  return j["packages"]["node_modules/openai"].value("version", "");
}

TEST(openai_sdk, node_client_suite) {
  const fs::path dir = fs::path(PAGODA_SOURCE_DIR) / "tests" / "server" / "node";
  ASSERT_EQ(shell("command -v node").exit_code, 0) << "Node.js is needed (scripts/install-deps.sh installs it)";
  const std::string want = locked_version(dir);
  ASSERT_FALSE(want.empty()) << "tests/server/node/package-lock.json does not pin openai";
  ASSERT_EQ(installed_version(dir), want)
      << "tests/server/node/node_modules does not hold openai " << want
      << ": run scripts/install-deps.sh (or scripts/install-node-test-deps.sh) first";
  const std::string model = std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf";
  shell_result run = shell("cd " + quote(dir.string()) + " && PAGODA_CLI=" + quote(fs::absolute(PAGODA_CLI).string()) +
                           " PAGODA_MODEL=" + quote(model) + " PAGODA_VISION_DIR=" +
                           quote(std::string(PAGODA_SOURCE_DIR) + "/tests/data/oracle/vision") +
                           " timeout 300 node --test --test-reporter=spec openai_sdk.test.mjs");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  // The suite's own count, so a run that silently found no tests fails too.
  EXPECT_NE(run.output.find("pass 32\n"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("fail 0\n"), std::string::npos) << run.output;
}

}  // namespace
}  // namespace pagoda::test
