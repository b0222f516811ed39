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
};

void add_engine_options(CLI::App* app, engine_options& opts);

// The engine core configuration for a loaded model (tenant quotas parsed).
result<engine_core_config> make_engine_config(const llama_model& model, engine_options opts);

}  // namespace pagoda::cli
