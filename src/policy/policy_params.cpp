// Reading a policy spec's parameters (policy_params_internal.h).
#include <algorithm>
#include <charconv>
#include <cmath>

#include "policy/policy_params_internal.h"

namespace pagoda::policy_detail {
namespace {

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

const std::string* param_reader::take(std::string_view key) {
  if (std::find(known_.begin(), known_.end(), key) == known_.end()) known_.emplace_back(key);
  return spec_.find(key);
}

bool param_reader::has(std::string_view key) { return take(key) != nullptr; }

status param_reader::bad_value(std::string_view key, std::string_view value, std::string_view what) const {
  return error(errc::invalid_argument, "{}: {}={}: {}", spec_.name, key, value, what);
}

result<kv_budget> param_reader::budget(std::string_view key, kv_budget fallback) {
  PAGODA_ASSIGN_OR_RETURN(const std::optional<kv_budget> b, optional_budget(key));
  return b ? *b : fallback;
}

result<std::optional<kv_budget>> param_reader::optional_budget(std::string_view key) {
  const std::string* v = take(key);
  if (v == nullptr) return std::optional<kv_budget>();
  result<kv_budget> b = parse_budget_value(*v);
  if (!b.ok()) return bad_value(key, *v, b.error().message());
  return std::optional<kv_budget>(*b);
}

result<int> param_reader::integer(std::string_view key, int fallback, int lo, int hi) {
  const std::string* v = take(key);
  if (v == nullptr) return fallback;
  int x = 0;
  const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), x);
  if (ec != std::errc() || end != v->data() + v->size()) {
    return bad_value(key, *v, fmt::format("expected a whole number in [{}, {}]", lo, hi));
  }
  if (x < lo || x > hi) return bad_value(key, *v, fmt::format("must be in [{}, {}]", lo, hi));
  return x;
}

result<double> param_reader::number(std::string_view key, double fallback, double lo, double hi) {
  const std::string* v = take(key);
  if (v == nullptr) return fallback;
  double x = 0;
  const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), x);
  if (ec != std::errc() || end != v->data() + v->size() || !std::isfinite(x)) {
    return bad_value(key, *v, fmt::format("expected a number in [{}, {}]", lo, hi));
  }
  if (x < lo || x > hi) return bad_value(key, *v, fmt::format("must be in [{}, {}]", lo, hi));
  return x;
}

result<bool> param_reader::flag(std::string_view key, bool fallback) {
  const std::string* v = take(key);
  if (v == nullptr) return fallback;
  if (*v == "1" || *v == "true") return true;
  if (*v == "0" || *v == "false") return false;
  return bad_value(key, *v, "expected 0 or 1");
}

result<std::string> param_reader::choice(std::string_view key, std::string_view fallback,
                                         std::initializer_list<std::string_view> options) {
  const std::string* v = take(key);
  if (v == nullptr) return std::string(fallback);
  if (std::find(options.begin(), options.end(), *v) != options.end()) return *v;
  std::vector<std::string> names(options.begin(), options.end());
  return bad_value(key, *v, fmt::format("expected one of {}", join(names)));
}

status param_reader::finish() const {
  for (const auto& [key, value] : spec_.params) {
    if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
    if (known_.empty()) return error(errc::invalid_argument, "{}: takes no parameters (got '{}')", spec_.name, key);
    return error(errc::invalid_argument, "{}: unknown parameter '{}'; known: {}", spec_.name, key, join(known_));
  }
  return ok_status();
}

}  // namespace pagoda::policy_detail
