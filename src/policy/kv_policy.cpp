// Policy specs and budgets as users write them, and the factory of policies.
#include "policy/kv_policy.h"

#include "policy/quest.h"
#include "policy/retrieval.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>

#include <fmt/ranges.h>

#include "policy/policy_params_internal.h"

namespace pagoda {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool is_word(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// A policy that keeps everything ("none", or "").
class none_policy final : public kv_policy {
 public:
  const kv_policy_spec& spec() const override { return spec_; }

 private:
  kv_policy_spec spec_;
};

result<std::unique_ptr<kv_policy>> make_none_policy(const kv_policy_spec& spec) {
  if (!spec.params.empty()) {
    return error(errc::invalid_argument, "none: takes no parameters (got '{}')", spec.params.front().first);
  }
  return std::unique_ptr<kv_policy>(std::make_unique<none_policy>());
}

struct policy_entry {
  std::string_view name;
  policy_detail::policy_creator create;
};

// Every policy make_kv_policy knows, in the order --help lists them. The
// sparse-read policies come from their own files (quest.h, retrieval.h).
constexpr policy_entry k_policies[] = {
    {"none", make_none_policy},
    {"window", policy_detail::make_window_policy},
    {"h2o", policy_detail::make_h2o_policy},
    {"snapkv", policy_detail::make_snapkv_policy},
    {"pyramid", policy_detail::make_pyramid_policy},
    {"merge", policy_detail::make_merge_policy},
    {"cluster", policy_detail::make_cluster_policy},
    {"quest", make_quest_policy},
    {"retrieval", make_retrieval_policy},
};

}  // namespace

const std::string* kv_policy_spec::find(std::string_view key) const {
  for (const auto& [k, v] : params) {
    if (k == key) return &v;
  }
  return nullptr;
}

std::string kv_policy_spec::to_string() const {
  std::string out = name.empty() ? "none" : name;
  for (std::size_t i = 0; i < params.size(); ++i) {
    out += fmt::format("{}{}={}", i == 0 ? ":" : ",", params[i].first, params[i].second);
  }
  return out;
}

result<kv_policy_spec> parse_kv_policy_spec(std::string_view text) {
  const std::string_view whole = trim(text);
  kv_policy_spec spec;
  const std::size_t colon = whole.find(':');
  const std::string name = lower(trim(whole.substr(0, colon)));
  if (name.empty() && colon == std::string_view::npos) return spec;  // "": none
  if (!is_word(name)) {
    return error(errc::invalid_argument, "{}: expected a policy name (letters, digits, '-', '_') before ':'", whole);
  }
  spec.name = name;
  if (colon == std::string_view::npos) return spec;
  std::string_view rest = whole.substr(colon + 1);
  if (trim(rest).empty()) return error(errc::invalid_argument, "{}: expected key=value after ':'", whole);
  while (true) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = trim(rest.substr(0, comma));
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0) {
      return error(errc::invalid_argument, "{}: expected key=value, got '{}'", whole, item);
    }
    const std::string key = lower(trim(item.substr(0, eq)));
    const std::string_view value = trim(item.substr(eq + 1));
    if (!is_word(key)) return error(errc::invalid_argument, "{}: '{}' is not a parameter name", whole, key);
    if (value.empty() || value.find('=') != std::string_view::npos) {
      return error(errc::invalid_argument, "{}: expected key=value, got '{}'", whole, item);
    }
    if (spec.find(key) != nullptr) return error(errc::invalid_argument, "{}: '{}' given twice", whole, key);
    spec.params.emplace_back(key, std::string(value));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return spec;
}

int kv_budget::resolve(int n_seen) const {
  if (n_seen <= 0) return 0;
  if (tokens > 0) return std::min(tokens, n_seen);
  // Round up, forgiving the last bit of floating error (0.1 x 30 is 3.0000000000000004).
  const double want = std::ceil(fraction * n_seen - 1e-9);
  return static_cast<int>(std::clamp(want, 1.0, static_cast<double>(n_seen)));
}

std::string kv_budget::to_string() const {
  if (tokens > 0) return std::to_string(tokens);
  std::string s = fmt::format("{}", fraction);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";  // "1" would read back as one token
  return s;
}

namespace policy_detail {

result<kv_budget> parse_budget_value(std::string_view text) {
  const std::string_view s = trim(text);
  const auto bad = [](std::string_view why) { return status(errc::invalid_argument, std::string(why)); };
  if (s.empty()) return bad("expected a fraction of the context (0.25, 25%) or a token count (256)");
  kv_budget b;
  if (std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), b.tokens);
    if (ec != std::errc()) return bad("too many tokens");
    if (b.tokens == 0) return bad("a budget of 0 tokens keeps nothing");
    return b;
  }
  const bool percent = s.back() == '%';
  const std::string_view number = percent ? s.substr(0, s.size() - 1) : s;
  double x = 0;
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), x);
  if (ec != std::errc() || end != number.data() + number.size() || !std::isfinite(x)) {
    return bad("expected a fraction of the context (0.25, 25%) or a token count (256)");
  }
  if (percent) x /= 100.0;
  if (x <= 0) return bad("must be more than 0");
  if (x > 1) return bad("a fraction must be at most 1 (100%); a token count is a whole number");
  b.fraction = x;
  return b;
}

}  // namespace policy_detail

result<kv_budget> parse_kv_budget(std::string_view text) {
  result<kv_budget> b = policy_detail::parse_budget_value(text);
  if (!b.ok()) return b.error().with_context(fmt::format("budget '{}'", trim(text)));
  return b;
}

bool eviction_decision::uniform() const {
  for (int r = 1; r < n_rows; ++r) {
    const std::span<const std::int32_t> a = row(0);
    const std::span<const std::int32_t> b = row(r);
    if (!std::equal(a.begin(), a.end(), b.begin(), b.end())) return false;
  }
  return true;
}

result<std::unique_ptr<kv_policy>> make_kv_policy(const kv_policy_spec& spec) {
  const std::string_view name = spec.is_none() ? "none" : std::string_view(spec.name);
  for (const policy_entry& e : k_policies) {
    if (e.name == name) return e.create(spec);
  }
  return error(errc::invalid_argument, "unknown KV policy '{}'; known: {}", spec.name, fmt::join(kv_policy_names(), ", "));
}

status check_kv_policy(const kv_policy_spec& spec) { return make_kv_policy(spec).take_status(); }

std::vector<std::string> kv_policy_names() {
  std::vector<std::string> names;
  for (const policy_entry& e : k_policies) names.emplace_back(e.name);
  return names;
}

}  // namespace pagoda
