// Options and helpers shared by the pagoda subcommands.
#pragma once

#include <signal.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "model/llama.h"
#include "pagoda/config.h"
#include "pagoda/status.h"
#include "cli/model_source.h"
#include "cli/usage.h"
#include "kv/kv_metrics.h"
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

// Rewrites llama.cpp-style multi-letter short flags (-ctk, -ctv, -ngl, -fa,
// -hf, ...) to their long forms (CLI11 would read -ngl as -n gl).
void normalize_args(int& argc, char**& argv);

// Numbers that must be finite: CLI11's PositiveNumber and Range let NaN
// (and Range infinity) through.
CLI::Validator finite_positive(double hi = std::numeric_limits<double>::max());
CLI::Validator finite_range(double lo, double hi);

// llama.cpp's GPU flags (-ngl, --n-gpu-layers, -fa, -sm, -mg, -ts, ...),
// accepted and ignored; flag_notes() then has the one line saying so.
void add_gpu_options(CLI::App* app);
// vLLM's and TGI's flags that have no CPU meaning: --gpu-memory-utilization
// accepted with a note (the KV pool is sized by --kv-cache-size), --quantize
// (--quantization) refused, naming what to use instead (a usage error).
void add_vllm_options(CLI::App* app);
// The notes the flags given left, one line each, for stderr after parsing.
std::vector<std::string> flag_notes();

// `COMMAND MODEL`, as vLLM's `vllm serve MODEL`: a positional model, the same
// as -m. After parsing, resolve_positional_model() moves it into model_path; a
// usage error when both name different files (none at all is
// resolve_model_sources()'s error, as -hf may give it).
void use_positional_model(CLI::App* app, std::string& positional);
void resolve_positional_model(std::string& model_path, const std::string& positional);

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
// The same for an engine that could not be made: 2 (a usage error) when the
// flags of speculative decoding do not go together (--speculative,
// --draft-model: a draft model of another vocabulary, `draft` without one), else 1.
int fail_engine(const status& st);

std::string human_bytes(double bytes);
// The KV an engine runs with, for startup lines (serve, batch): types,
// sharing, the default policy, the class split, and the pool with what it
// holds at the context ("KV f16+f16, policy none, pool 64.00 MiB = 4096 blocks
// of 16 tokens (65536 tokens: 16 full-context sequences)").
std::string kv_pool_line(const engine_core_config& cfg, const kv_metrics& kv);
// --chat-template NAME (serve, chat): an unknown family is a usage error (exit 2) naming the known ones.
void check_chat_template_name(const std::string& name);

// Blocks SIGINT and SIGTERM in this thread (and every thread it starts
// later, which inherit the mask) for one thread to sigwait() on them;
// SIGPIPE is ignored (a client that hangs up fails a write, not the process).
// Call before starting any thread.
sigset_t block_stop_signals();

}  // namespace pagoda::cli
