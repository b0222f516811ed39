// Usage errors a user can act on: an unknown subcommand or option names the
// nearest known one ("did you mean 'run'?"), and every usage error exits 2
// (as getopt-based tools do), whatever CLI11's own code for it.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

namespace pagoda::cli {

inline constexpr int k_usage_exit_code = 2;

// A usage error raised by our own checks (flags that do not go together, a
// bad spec): one line, exit 2.
class usage_error : public CLI::ParseError {
 public:
  explicit usage_error(std::string message) : CLI::ParseError("UsageError", std::move(message), k_usage_exit_code) {}
};

// Levenshtein distance (insertions, deletions, substitutions, and swaps of two
// neighbours, which typing makes most: "temprature", "sevre").
int edit_distance(std::string_view a, std::string_view b);

// The name of `names` nearest `typed`, when near enough to be what was meant
// (at most a third of its letters wrong, 1 to 3 edits); "" otherwise.
std::string nearest_name(std::string_view typed, const std::vector<std::string>& names);

// Checked before parsing: each word naming a subcommand (`pagoda WORD`, `pagoda
// kv WORD`) is one. "" when so, else the one-line error for it, with the
// nearest command or the list of commands.
std::string unknown_command_error(const CLI::App& app, int argc, const char* const* argv);

// After CLI11 refused extra arguments: the first option of argv that the chosen
// subcommand does not know, with the nearest one it does. "" when no unknown
// option is found (then CLI11's own message stands).
std::string unknown_option_error(const CLI::App& app, int argc, const char* const* argv);

}  // namespace pagoda::cli
