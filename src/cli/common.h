// Options and helpers shared by the pagoda subcommands.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "model/llama.h"
#include "pagoda/config.h"
#include "pagoda/status.h"
#include "sched/engine_setup.h"

namespace pagoda::cli {

// Flags of the model (-m, -t, -c) and of the KV cache, into the public engine
// configuration (pagoda/config.h) that every command running a model fills.
void add_model_options(CLI::App* app, engine_config& opts);
void add_kv_options(CLI::App* app, engine_config& opts);

// Loads the model, printing nothing; errors carry the path.
result<std::unique_ptr<llama_model>> load_model(const engine_config& opts);

// One document per separator, trimmed; empty documents dropped (perplexity, calibrate).
std::vector<std::string> split_documents(const std::string& text, const std::string& sep);
// The documents of a text file; an error when it cannot be read or holds none.
result<std::vector<std::string>> read_documents(const std::string& path, const std::string& sep);

// Rewrites llama.cpp-style multi-letter short flags (-ctk, -ctv) to their long forms.
void normalize_args(int& argc, char**& argv);

// A one-line progress bar on stderr, drawn only when stderr is a terminal.
class progress_bar {
 public:
  progress_bar(std::string label, std::int64_t total);
  void update(std::int64_t done);
  void finish();

 private:
  std::string label_;
  std::int64_t total_;
  bool enabled_;
  int last_percent_ = -1;
};

// Prints "pagoda: error: <message>" to stderr and returns exit code 1.
int fail(const status& st);

std::string human_bytes(double bytes);

}  // namespace pagoda::cli
