#include "policy/streaming.h"

#include <algorithm>
#include <cstdlib>

namespace pagoda {

bool streams_past_context(const kv_policy_spec& spec, int max_model_len) {
  if (spec.name != "window") return false;
  const std::string* positions = spec.find("positions");
  if (!positions || *positions != "cache") return false;
  const std::string* budget = spec.find("budget");
  if (!budget) return false;
  auto b = parse_kv_budget(*budget);
  if (!b.ok() || b->tokens <= 0) return false;  // a fraction grows with the stream
  // What the sequence may hold between compactions: the window, its sinks,
  // the slack (default none; counted as at least 64 tokens here) and a
  // step's tokens; half the context leaves room for the step.
  const auto number = [&](const char* key, long fallback) {
    const std::string* v = spec.find(key);
    return v ? std::atol(v->c_str()) : fallback;
  };
  return b->tokens + number("sinks", 4) + std::max(number("slack", 64), 64l) < max_model_len / 2;
}

bool streams_past_context(std::string_view spec_text, int max_model_len) {
  auto spec = parse_kv_policy_spec(spec_text);
  return spec.ok() && streams_past_context(*spec, max_model_len);
}

}  // namespace pagoda
