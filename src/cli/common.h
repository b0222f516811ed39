// Options and helpers shared by the pagoda subcommands.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "kv/kv_storage.h"
#include "model/llama.h"
#include "pagoda/status.h"

namespace pagoda::cli {

struct model_options {
  std::string path;
  int threads = 0;  // 0: every core
  int ctx = 0;      // 0: the model's context length
};

struct kv_options {
  std::string dtype = "auto";  // both K and V; "auto" = the model's float type (f16 for quantized weights)
  std::string type_k;          // overrides dtype for K
  std::string type_v;          // overrides dtype for V
  int block_size = 16;
  double cache_size_mib = 0;   // pool size in MiB, or
  std::int64_t max_kv_tokens = 0;  // pool size in tokens
};

void add_model_options(CLI::App* app, model_options& opts);
void add_kv_options(CLI::App* app, kv_options& opts);

// Loads the model, printing nothing; errors carry the path.
result<std::unique_ptr<llama_model>> load_model(const model_options& opts);

// The context length to use: --ctx, else the model's trained context.
int context_length(const model_options& opts, const llama_hparams& hp);

result<kv_layout> make_kv_layout(const llama_model& model, const kv_options& opts);

// Blocks in the pool: from --kv-cache-size or --max-kv-tokens, else enough for default_tokens.
result<std::int64_t> pool_blocks(const kv_layout& layout, const kv_options& opts, std::int64_t default_tokens);

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
