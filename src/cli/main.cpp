// pagoda: one binary, one subcommand per job.
#include <cstdio>
#include <functional>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/model_source.h"
#include "cli/usage.h"

int main(int argc, char** argv) {
  using namespace pagoda::cli;
  normalize_args(argc, argv);
  CLI::App app{"Pagoda: an LLM inference engine built around its KV cache"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("pagoda ") + PAGODA_VERSION_STRING);  // /version's string
  // Every --help shows each option's default (subcommands inherit this).
  app.option_defaults()->always_capture_default();
  // A bad flag is one line, like every other error.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("pagoda: error: ") + e.what() + " (see --help)\n";
  });
  std::function<int()> action;
  register_run(app, action);
  register_chat(app, action);
  register_tokenize(app, action);
  register_perplexity(app, action);
  register_info(app, action);
  register_calibrate(app, action);
  register_synth(app, action);
  register_batch(app, action);
  register_serve(app, action);
  register_kv(app, action);
  register_router(app, action);
  register_pull(app, action);
  register_plan(app, action);
  // A mistyped command or option names the nearest one; every usage error exits 2.
  auto usage = [](const std::string& message) {
    std::fprintf(stderr, "pagoda: error: %s\n", message.c_str());
    return k_usage_exit_code;
  };
  if (const std::string e = unknown_command_error(app, argc, argv); !e.empty()) return usage(e);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (dynamic_cast<const CLI::ExtrasError*>(&e))
      if (const std::string m = unknown_option_error(app, argc, argv); !m.empty()) return usage(m);
    const int code = app.exit(e);
    return code == 0 ? 0 : k_usage_exit_code;
  }
  for (const std::string& note : flag_notes()) std::fprintf(stderr, "%s\n", note.c_str());
  if (const int code = resolve_model_sources(); code >= 0) return code;  // -hf: pulls the model first
  return action ? action() : 0;
}
