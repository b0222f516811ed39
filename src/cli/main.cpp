// pagoda: one binary, one subcommand per job.
#include <cstdio>
#include <functional>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "cli/common.h"

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
  register_tokenize(app, action);
  register_perplexity(app, action);
  register_info(app, action);
  register_calibrate(app, action);
  register_synth(app, action);
  register_batch(app, action);
  register_serve(app, action);
  register_kv(app, action);
  register_router(app, action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (const std::string note = gpu_flags_note(); !note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  return action ? action() : 0;
}
