// Options of the commands that run the engine (batch, serve): scheduling,
// prefix caching, tenants, plus the model and KV options of common.h.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "cli/common.h"
#include "sched/engine.h"

namespace pagoda::cli {

struct engine_options {
  model_options model;
  kv_options kv;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  bool enable_prefix_caching = true;
  std::vector<std::string> tenant_quotas;  // NAME=BLOCKS
};

void add_engine_options(CLI::App* app, engine_options& opts);

// The engine configuration for a loaded model. The default pool holds
// max_num_seqs full contexts, capped at 4 GiB.
result<engine_config> make_engine_config(const llama_model& model, const engine_options& opts);

}  // namespace pagoda::cli
