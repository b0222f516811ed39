// StreamingLLM past the context: a sequence whose KV policy keeps a fixed
// number of tokens and renumbers their positions within the cache
// (`window:budget=N,positions=cache`, N a token count) never holds more than
// about N tokens, nor reads a position past them, so it may generate beyond
// the model's context length (docs/policies.md).
#pragma once

#include <string_view>

#include "policy/kv_policy.h"

namespace pagoda {

// Whether `spec` lets a sequence run past a context of max_model_len tokens:
// a window with positions=cache whose budget is a token count that leaves
// room for a step within the context.
bool streams_past_context(const kv_policy_spec& spec, int max_model_len);
// The same for a spec as text (an unparseable one does not).
bool streams_past_context(std::string_view spec_text, int max_model_len);

// The most tokens a request may ask for past its prompt when it streams:
// generation is bounded by time, not memory, so this is a sanity cap.
inline constexpr int k_max_streaming_tokens = 1 << 24;

}  // namespace pagoda
