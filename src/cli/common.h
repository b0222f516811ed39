// Options and helpers shared by the pagoda subcommands.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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

// KV cache types (quant/kv_format_spec.h has the grammar): --kv-cache-dtype sets
// K and V (a type, "k8v4" or "int8+int4/token"), -ctk/-ctv override one side,
// --kv-layer-types overrides layer ranges, --kv-scales supplies calibrated
// ranges (quantized types without an explicit scale mode then use them).
struct kv_options {
  std::string dtype = "auto";  // both K and V; "auto" = the model's float type (f16 for quantized weights)
  std::string type_k;          // overrides dtype for K
  std::string type_v;          // overrides dtype for V
  std::string layer_types;     // "0-1:f16,2-:int4"
  std::string scales_path;     // from pagoda calibrate
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
// A --kv-cache-size budget also pays for n_seqs staging slots (the f16 window of
// sealed formats), so the pool's real bytes stay within it.
result<std::int64_t> pool_blocks(const kv_layout& layout, const kv_options& opts, std::int64_t default_tokens,
                                 std::int64_t n_seqs = 1);

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
