// Inside the policy module: reading a spec's `key=value` parameters with
// defaults, ranges and messages that name the policy and the parameter, and
// the creators the factory's table (kv_policy.cpp) lists.
#pragma once

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "policy/kv_policy.h"

namespace pagoda::policy_detail {

// Each getter reads one key (its value or the default) and records the key as
// known; finish() then refuses every key no getter asked for, naming the known
// ones. Messages read "h2o: recent=abc: expected ..." (the caller adds where
// the spec came from, such as "--kv-policy").
class param_reader {
 public:
  explicit param_reader(const kv_policy_spec& spec) : spec_(spec) {}

  result<kv_budget> budget(std::string_view key, kv_budget fallback);
  result<std::optional<kv_budget>> optional_budget(std::string_view key);
  // An integer in [lo, hi]; `fallback` when absent (it may lie outside the
  // range, as a "not given" marker).
  result<int> integer(std::string_view key, int fallback, int lo, int hi);
  // A finite number in [lo, hi].
  result<double> number(std::string_view key, double fallback, double lo, double hi);
  // 0 / 1 / false / true.
  result<bool> flag(std::string_view key, bool fallback);
  // One of `options`.
  result<std::string> choice(std::string_view key, std::string_view fallback,
                             std::initializer_list<std::string_view> options);
  // Whether the spec gives key (and records it as known).
  bool has(std::string_view key);

  // Unknown keys: "h2o: unknown parameter 'bugdet'; known: budget, slack, chunk, recent".
  status finish() const;
  status bad_value(std::string_view key, std::string_view value, std::string_view what) const;

 private:
  const std::string* take(std::string_view key);

  const kv_policy_spec& spec_;
  std::vector<std::string> known_;
};

// parse_kv_budget without the "budget 'x': " before its messages.
result<kv_budget> parse_budget_value(std::string_view text);

using policy_creator = result<std::unique_ptr<kv_policy>> (*)(const kv_policy_spec&);

// The eviction policies (docs/policies.md): flat_policy.cpp (one budget for
// every row) and pyramid.cpp (budgets by layer and head).
result<std::unique_ptr<kv_policy>> make_window_policy(const kv_policy_spec& spec);
result<std::unique_ptr<kv_policy>> make_h2o_policy(const kv_policy_spec& spec);
result<std::unique_ptr<kv_policy>> make_merge_policy(const kv_policy_spec& spec);
result<std::unique_ptr<kv_policy>> make_cluster_policy(const kv_policy_spec& spec);
result<std::unique_ptr<kv_policy>> make_snapkv_policy(const kv_policy_spec& spec);
result<std::unique_ptr<kv_policy>> make_pyramid_policy(const kv_policy_spec& spec);

}  // namespace pagoda::policy_detail
