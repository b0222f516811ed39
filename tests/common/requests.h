// Engine requests for tests (needs the sched module).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "common/stories.h"
#include "sched/engine_core.h"

namespace pagoda::test {

// Greedy, EOS ignored: exactly max_tokens tokens, the same under any load.
inline request greedy_ids(const std::string& id, std::vector<token_id> prompt, int max_tokens) {
  request r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling = sampling_params::greedy();
  r.ignore_eos = true;
  return r;
}

// The same for a text prompt, in stories260K's tokens.
inline request greedy_request(const std::string& id, const std::string& prompt, int max_tokens) {
  return greedy_ids(id, stories().vocab().encode(prompt, true), max_tokens);
}

}  // namespace pagoda::test
