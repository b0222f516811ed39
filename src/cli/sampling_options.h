// Sampling flags shared by the commands that generate for one user (run,
// chat): llama.cpp's spellings, with vLLM's where they differ.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "pagoda/request.h"
#include "pagoda/status.h"

namespace pagoda::cli {

struct sampling_flags {
  sampling_params sampling;
  bool ignore_eos = false;
  std::vector<std::string> logit_bias;  // llama.cpp's TOKEN+BIAS / TOKEN-BIAS
  CLI::Option* seed_option = nullptr;   // set by add_sampling_options
  bool seed_given = false;              // -s: else a fresh seed, printed so the run can be repeated
};

// --temp, --top-k, --top-p, --min-p, the penalties, --ignore-eos, -l and -s.
void add_sampling_options(CLI::App* app, sampling_flags& flags);

// After parsing: draws a seed unless -s gave one, parses the logit biases and
// validates the values (a clear error naming the flag).
status finish_sampling_options(sampling_flags& flags);

}  // namespace pagoda::cli
