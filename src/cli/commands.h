// Subcommand registration: each adds its options to the app and, when chosen,
// sets `action` to the function main() runs after parsing.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

// In a subcommand returning int: unwrap a result or print its error and return 1.
#define PAGODA_ASSIGN_OR_RETURN_CLI(lhs, expr) \
  PAGODA_ASSIGN_OR_RETURN_CLI_IMPL(PAGODA_CONCAT(pagoda_cli_res_, __LINE__), lhs, expr)
#define PAGODA_ASSIGN_OR_RETURN_CLI_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return ::pagoda::cli::fail(tmp.error()); \
  lhs = std::move(tmp).value()
// In a subcommand returning int: print a failed status and return 1.
#define PAGODA_RETURN_IF_ERROR_CLI(expr)                               \
  do {                                                                 \
    if (::pagoda::status pagoda_cli_st = (expr); !pagoda_cli_st.ok()) \
      return ::pagoda::cli::fail(pagoda_cli_st);                       \
  } while (0)

namespace pagoda::cli {

void register_run(CLI::App& app, std::function<int()>& action);
void register_chat(CLI::App& app, std::function<int()>& action);
void register_tokenize(CLI::App& app, std::function<int()>& action);
void register_perplexity(CLI::App& app, std::function<int()>& action);
void register_info(CLI::App& app, std::function<int()>& action);
void register_calibrate(CLI::App& app, std::function<int()>& action);
void register_synth(CLI::App& app, std::function<int()>& action);
void register_batch(CLI::App& app, std::function<int()>& action);
void register_serve(CLI::App& app, std::function<int()>& action);
void register_kv(CLI::App& app, std::function<int()>& action);
void register_router(CLI::App& app, std::function<int()>& action);
void register_pull(CLI::App& app, std::function<int()>& action);
void register_plan(CLI::App& app, std::function<int()>& action);

}  // namespace pagoda::cli
