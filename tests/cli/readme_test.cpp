// The README's command table and option paragraphs name only flags that the
// commands' --help lists, so a reader never types a flag that is refused.
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "cli/cli_util.h"

namespace pagoda::test {
namespace {

std::string readme() {
  std::ifstream in(std::string(PAGODA_SOURCE_DIR) + "/README.md");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Flags (-x, --xyz) inside backquotes of `text`.
std::vector<std::string> flags_in(const std::string& text) {
  std::vector<std::string> out;
  const std::regex code("`([^`]*)`"), flag(R"((?:^|[\s\[/(|])(--?[A-Za-z][A-Za-z0-9-]*))");
  for (std::sregex_iterator c(text.begin(), text.end(), code), end; c != end; ++c) {
    const std::string span = (*c)[1];
    for (std::sregex_iterator f(span.begin(), span.end(), flag); f != end; ++f) out.push_back((*f)[1]);
  }
  return out;
}

bool help_lists(const std::string& help, const std::string& flag) {
  const std::regex word("(^|[\\s,(])" + std::regex_replace(flag, std::regex("-"), "\\-") + "([\\s,=){]|$)");
  return std::regex_search(help, word);
}

std::string help_of(const std::string& sub) {
  auto r = run_cli(sub + " --help");
  EXPECT_EQ(r.exit_code, 0) << sub;
  return r.out;
}

TEST(cli_readme, command_table_flags_are_in_each_help) {
  std::istringstream in(readme());
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) {
    std::smatch m;
    if (!std::regex_search(line, m, std::regex(R"(^\| `pagoda (\w+))"))) continue;
    ++rows;
    const std::string sub = m[1];
    // kv's own subcommands each take --store.
    const std::string help = sub == "kv" ? help_of("kv ls") : help_of(sub);
    const std::string cell = line.substr(0, line.find("` |") + 1);
    for (const std::string& f : flags_in(cell)) EXPECT_TRUE(help_lists(help, f)) << "pagoda " << sub << ": " << f;
  }
  EXPECT_GE(rows, 9);
}

// "Engine and KV options shared by `run`, `batch`, `perplexity`: ..." and the
// like: every flag named is in the help of every command named.
TEST(cli_readme, shared_option_paragraphs_match_each_command) {
  const std::string text = readme();
  const std::regex para(R"(options shared by ((?:`\w+`(?:, | and )?)+): ([^\n]*(?:\n[^\n]+)*))");
  int n = 0;
  for (std::sregex_iterator p(text.begin(), text.end(), para), end; p != end; ++p) {
    ++n;
    const std::string commands = (*p)[1], body = (*p)[2];
    const std::regex name("`(\\w+)`");
    for (std::sregex_iterator c(commands.begin(), commands.end(), name); c != end; ++c) {
      const std::string help = help_of((*c)[1]);
      for (const std::string& f : flags_in(body)) EXPECT_TRUE(help_lists(help, f)) << "pagoda " << (*c)[1] << ": " << f;
    }
  }
  EXPECT_GE(n, 2);
}

}  // namespace
}  // namespace pagoda::test
