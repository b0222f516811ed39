// Runs the pagoda binary and captures what it prints.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace pagoda::test {

struct cli_result {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') q += "'\\''";
    else q += c;
  }
  return q + "'";
}

inline std::string model_path() { return std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf"; }
inline std::string data_path(const std::string& name) { return std::string(PAGODA_SOURCE_DIR) + "/tests/data/" + name; }

// `args` is appended to the binary's path as is: quote values with shell_quote.
inline cli_result run_cli(const std::string& args) {
  static int counter = 0;
  std::string err_path = "/tmp/pagoda_cli_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++) + ".err";
  std::string cmd = std::string(PAGODA_CLI) + " " + args + " 2>" + err_path;
  cli_result r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 65536> buf;
  std::size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int st = pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream e(err_path);
  std::stringstream ss;
  ss << e.rdbuf();
  r.err = ss.str();
  std::remove(err_path.c_str());
  return r;
}

}  // namespace pagoda::test
