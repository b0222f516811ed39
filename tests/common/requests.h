// Engine requests for tests (needs the sched module).
#pragma once

#include <string>

#include "common/stories.h"
#include "sched/engine_core.h"

namespace pagoda::test {

// Greedy, EOS ignored: exactly max_tokens tokens, the same under any load.
inline request greedy_request(const std::string& id, const std::string& prompt, int max_tokens) {
  request r;
  r.id = id;
  r.prompt = stories().vocab().encode(prompt, true);
  r.max_tokens = max_tokens;
  r.sampling = sampling_params::greedy();
  r.ignore_eos = true;
  return r;
}

}  // namespace pagoda::test
