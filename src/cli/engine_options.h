// Options of the commands that run the engine with scheduling limits (batch,
// serve): the model and KV flags of common.h plus scheduling, prefix caching
// and tenants.
#pragma once

#include <string>
#include <vector>

#include "cli/common.h"
#include "sched/engine_core.h"

namespace pagoda::cli {

struct engine_options {
  engine_config config;
  std::vector<std::string> tenant_quotas;  // NAME=BLOCKS
  std::string kv_store;                    // PATH[,size=GiB]
};

void add_engine_options(CLI::App* app, engine_options& opts);

// Parses what the flags left as text (tenant quotas, --kv-store) into opts.config.
status finish_engine_options(engine_options& opts);

// The engine core configuration for a loaded model.
result<engine_core_config> make_engine_config(const llama_model& model, engine_options opts);

// An engine core with the KV warehouse the flags ask for, attached. The
// warehouse is declared first, so it outlives the core.
// Destroying it applies the ops the last step left, so the warehouse has
// every block the run cached.
struct engine_stack {
  std::unique_ptr<llama_model> draft;       // --draft-model (null: none); outlives core
  std::unique_ptr<kv_warehouse> warehouse;  // null: no persistent tier
  std::unique_ptr<engine_core> core;
  engine_stack() = default;
  engine_stack(engine_stack&&) = default;
  engine_stack& operator=(engine_stack&&) = default;
  ~engine_stack();
};
result<engine_stack> open_engine(const llama_model& model, engine_options opts);

// The warehouse the flags ask for (null without --kv-store/--kv-store-remote).
result<std::unique_ptr<kv_warehouse>> open_warehouse(const llama_model& model, engine_options opts);

// Where `serve` keeps KV blocks unless told otherwise: $XDG_CACHE_HOME/pagoda/kv,
// else ~/.cache/pagoda/kv; "" when neither variable is set.
std::string default_kv_store_dir();

}  // namespace pagoda::cli
