// pagoda: one binary, one subcommand per job.
#include <cstdio>
#include <functional>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "cli/common.h"

int main(int argc, char** argv) {
  using namespace pagoda::cli;
  normalize_args(argc, argv);
  CLI::App app{"Pagoda: an LLM inference engine built around its KV cache"};
  app.require_subcommand(1);
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return action ? action() : 0;
}
