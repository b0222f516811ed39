#include "server/kv_summary.h"

#include <random>

#include <fmt/format.h>

#include "sched/engine_core.h"
#include "sched/engine_setup.h"

namespace pagoda::server {

using nlohmann::json;

namespace {

constexpr std::size_t k_key_hex = 16;

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

}  // namespace

std::uint64_t summary_instance() {
  static const std::uint64_t instance = [] {
    std::random_device rd;
    return (static_cast<std::uint64_t>(rd()) << 32) | rd();
  }();
  return instance;
}

kv_summary collect_kv_summary(engine_core& core, const std::optional<std::string>& since, std::string& fingerprint) {
  const prefix_index& index = core.kv().index();
  kv_summary s;
  s.generation = fmt::format("{:016x}-{}", summary_instance(), index.generation());
  // Computed once per server (it reads a few spans of every tensor).
  if (fingerprint.empty()) fingerprint = fmt::format("{:016x}", model_fingerprint(core.model()));
  s.model_fingerprint = fingerprint;
  s.block_size_tokens = core.kv().block_size();
  s.unchanged = since && *since == s.generation;
  if (!s.unchanged) {
    s.keys.reserve(index.size());
    index.for_each_key([&](block_key k) { s.keys.push_back(k); });
  }
  return s;
}

json kv_summary_json(const kv_summary& s) {
  json j = {{"object", "kv.summary"},
            {"generation", s.generation},
            {"model_fingerprint", s.model_fingerprint},
            {"block_size_tokens", s.block_size_tokens},
            {"running", s.n_running},
            {"waiting", s.n_waiting}};
  if (s.unchanged) {
    j["unchanged"] = true;
    return j;
  }
  std::string keys;
  keys.reserve(s.keys.size() * k_key_hex);
  for (block_key k : s.keys) fmt::format_to(std::back_inserter(keys), "{:016x}", k);
  j["blocks"] = s.keys.size();
  j["keys"] = std::move(keys);
  return j;
}

result<kv_summary> parse_kv_summary(std::string_view body) {
  const json j = json::parse(body, nullptr, false);
  if (!j.is_object() || j.value("object", "") != "kv.summary")
    return error(errc::invalid_argument, "not a kv.summary object");
  kv_summary s;
  auto str = [&](const char* name, std::string& out) {
    const auto it = j.find(name);
    if (it == j.end() || !it->is_string()) return false;
    out = it->get<std::string>();
    return true;
  };
  auto num = [&](const char* name, int& out) {
    const auto it = j.find(name);
    if (it == j.end() || !it->is_number_integer() || it->get<std::int64_t>() < 0 || it->get<std::int64_t>() > INT32_MAX)
      return false;
    out = it->get<int>();
    return true;
  };
  if (!str("generation", s.generation) || !str("model_fingerprint", s.model_fingerprint))
    return error(errc::invalid_argument, "kv.summary without a string 'generation' and 'model_fingerprint'");
  if (!num("block_size_tokens", s.block_size_tokens) || s.block_size_tokens == 0 || !num("running", s.n_running) ||
      !num("waiting", s.n_waiting))
    return error(errc::invalid_argument, "kv.summary without integer 'block_size_tokens', 'running' and 'waiting'");
  s.unchanged = j.value("unchanged", false);
  if (s.unchanged) return s;
  std::string keys;
  if (!str("keys", keys) || keys.size() % k_key_hex != 0)
    return error(errc::invalid_argument, "kv.summary 'keys' must be a string of 16-digit hex keys");
  s.keys.reserve(keys.size() / k_key_hex);
  for (std::size_t at = 0; at < keys.size(); at += k_key_hex) {
    block_key k = 0;
    for (std::size_t i = 0; i < k_key_hex; ++i) {
      const int d = hex_digit(keys[at + i]);
      if (d < 0) return error(errc::invalid_argument, "kv.summary 'keys': '{}' at {} is not a hex digit", keys[at + i], at + i);
      k = (k << 4) | static_cast<block_key>(d);
    }
    s.keys.push_back(k);
  }
  return s;
}

}  // namespace pagoda::server
