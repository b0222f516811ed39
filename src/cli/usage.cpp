#include "cli/usage.h"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace pagoda::cli {
namespace {

std::vector<std::string> subcommand_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(sub->get_name());
  return names;
}

const CLI::App* find_subcommand(const CLI::App& app, std::string_view name) {
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    if (sub->check_name(std::string(name))) return sub;
  return nullptr;
}

// "--name" and "-n" of every option of app and of the commands above it
// (a subcommand's parents' options are accepted after it too).
std::vector<std::string> option_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* a = &app; a; a = a->get_parent()) {
    for (const CLI::Option* o : a->get_options()) {
      for (const std::string& l : o->get_lnames()) names.push_back("--" + l);
      for (const std::string& s : o->get_snames()) names.push_back("-" + s);
    }
  }
  return names;
}

// An option word, not a value: "-x..." or "--x...", never a number ("-1", "-.5").
bool is_option_word(std::string_view w) {
  if (w.size() < 2 || w[0] != '-' || w == "--") return false;
  const char c = w[1] == '-' ? (w.size() > 2 ? w[2] : '\0') : w[1];
  return std::isalpha(static_cast<unsigned char>(c)) != 0;
}

std::string command_path(const CLI::App& app) {
  std::string path;
  for (const CLI::App* a = &app; a; a = a->get_parent())
    path = a->get_parent() ? " " + a->get_name() + path : path;
  return "pagoda" + path;
}

}  // namespace

int edit_distance(std::string_view a, std::string_view b) {
  // Optimal string alignment: Levenshtein plus adjacent transpositions.
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = static_cast<int>(i);
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = static_cast<int>(j);
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      const int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

std::string nearest_name(std::string_view typed, const std::vector<std::string>& names) {
  std::string_view bare = typed;
  while (!bare.empty() && bare.front() == '-') bare.remove_prefix(1);
  const int limit = std::clamp(static_cast<int>(bare.size()) / 3, 1, 3);
  std::string best;
  int best_d = limit + 1;
  for (const std::string& name : names) {
    const int d = edit_distance(typed, name);
    if (d < best_d) best_d = d, best = name;
  }
  return best;
}

std::string unknown_command_error(const CLI::App& app, int argc, const char* const* argv) {
  const CLI::App* at = &app;
  for (int i = 1; i < argc; ++i) {
    const std::string_view word = argv[i];
    if (word.empty() || word[0] == '-' || subcommand_names(*at).empty()) return "";
    if (const CLI::App* sub = find_subcommand(*at, word)) {
      at = sub;
      continue;
    }
    const std::vector<std::string> names = subcommand_names(*at);
    const std::string near = nearest_name(word, names);
    const std::string where = at == &app ? "" : fmt::format(" for '{}'", command_path(*at));
    if (!near.empty())
      return fmt::format("unknown command '{}'{}; did you mean '{}'? (see {} --help)", word, where, near, command_path(*at));
    return fmt::format("unknown command '{}'{}; the commands are {} (see {} --help)", word, where, fmt::join(names, ", "),
                       command_path(*at));
  }
  return "";
}

std::string unknown_option_error(const CLI::App& app, int argc, const char* const* argv) {
  // The chosen subcommand, and where its arguments start in argv.
  const CLI::App* at = &app;
  int first = 1;
  for (int i = 1; i < argc; ++i) {
    const std::vector<CLI::App*> parsed = at->get_subcommands();
    if (parsed.empty()) break;
    if (parsed.front()->check_name(argv[i])) {
      at = parsed.front();
      first = i + 1;
    }
  }
  const std::vector<std::string> known = option_names(*at);
  for (int i = first; i < argc; ++i) {
    std::string_view word = argv[i];
    if (word == "--") break;
    if (!is_option_word(word)) continue;
    word = word.substr(0, word.find('='));
    if (word.size() > 2 && word[1] != '-') word = word.substr(0, 2);  // -n5, -abc: the first short flag
    if (std::find(known.begin(), known.end(), word) != known.end()) continue;
    const std::string near = nearest_name(word, known);
    if (!near.empty())
      return fmt::format("unknown option '{}' for '{}'; did you mean '{}'? (see {} --help)", word, command_path(*at),
                         near, command_path(*at));
    return fmt::format("unknown option '{}' for '{}' (see {} --help)", word, command_path(*at), command_path(*at));
  }
  return "";
}

}  // namespace pagoda::cli
