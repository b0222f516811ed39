#include "server/auth.h"

#include <cctype>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace pagoda::server {

using nlohmann::json;

bool valid_tenant_name(std::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-'))
      return false;
  return true;
}

namespace {

result<tenant_spec> parse_tenant(const json& t, const std::string& where) {
  if (!t.is_object()) return error(errc::invalid_argument, "{}: expected an object", where);
  tenant_spec spec;
  for (const auto& [key, value] : t.items()) {
    if (key == "name") {
      if (!value.is_string() || !valid_tenant_name(value.get_ref<const std::string&>()))
        return error(errc::invalid_argument, "{}.name: expected 1-64 characters of [A-Za-z0-9_.-]", where);
      spec.name = value.get<std::string>();
    } else if (key == "api_keys") {
      if (!value.is_array()) return error(errc::invalid_argument, "{}.api_keys: expected an array of strings", where);
      for (std::size_t i = 0; i < value.size(); ++i) {
        if (!value[i].is_string() || value[i].get_ref<const std::string&>().empty())
          return error(errc::invalid_argument, "{}.api_keys[{}]: expected a non-empty string", where, i);
        spec.api_keys.push_back(value[i].get<std::string>());
      }
    } else if (key == "quota_blocks") {
      if (!value.is_number_integer() || value.get<std::int64_t>() < 1 || value.get<std::int64_t>() > (1ll << 30))
        return error(errc::invalid_argument, "{}.quota_blocks: expected an integer in [1, 2^30]", where);
      spec.quota_blocks = static_cast<std::int32_t>(value.get<std::int64_t>());
    } else {
      return error(errc::invalid_argument, "{}: unknown field '{}' (expected name, api_keys, quota_blocks)", where, key);
    }
  }
  if (spec.name.empty()) return error(errc::invalid_argument, "{}: missing field 'name'", where);
  if (spec.api_keys.empty()) return error(errc::invalid_argument, "{}: a tenant needs at least one key in 'api_keys'", where);
  return spec;
}

}  // namespace

result<std::vector<tenant_spec>> parse_tenants(std::string_view text, std::string_view source) {
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return error(errc::invalid_argument, "{}: not valid JSON", source);
  if (!doc.is_object() || !doc.contains("tenants") || !doc["tenants"].is_array())
    return error(errc::invalid_argument, "{}: expected an object with a 'tenants' array", source);
  for (const auto& [key, value] : doc.items())
    if (key != "tenants") return error(errc::invalid_argument, "{}: unknown field '{}'", source, key);
  std::vector<tenant_spec> out;
  std::set<std::string> names;
  const json& list = doc["tenants"];
  for (std::size_t i = 0; i < list.size(); ++i) {
    auto t = parse_tenant(list[i], fmt::format("{}: tenants[{}]", source, i));
    if (!t.ok()) return t.error();
    if (!names.insert(t->name).second)
      return error(errc::invalid_argument, "{}: tenants[{}]: tenant '{}' is listed twice", source, i, t->name);
    out.push_back(std::move(*t));
  }
  return out;
}

namespace {

result<std::string> read_text_file(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) return error(errc::not_found, "cannot open {} {}", what, path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

result<std::vector<tenant_spec>> load_tenants_file(const std::string& path) {
  PAGODA_ASSIGN_OR_RETURN(std::string text, read_text_file(path, "tenants file"));
  return parse_tenants(text, path);
}

result<std::vector<std::string>> parse_api_keys(std::string_view text, std::string_view source) {
  std::vector<std::string> keys;
  std::size_t line_no = 0;
  while (!text.empty()) {
    ++line_no;
    const std::size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    text.remove_prefix(end == std::string_view::npos ? text.size() : end + 1);
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.remove_suffix(1);
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
    if (line.empty() || line.front() == '#') continue;
    for (char c : line)
      if (static_cast<unsigned char>(c) < 0x21 || c == 0x7f)
        return error(errc::invalid_argument, "{}:{}: an API key must not hold spaces or control characters", source, line_no);
    keys.emplace_back(line);
  }
  if (keys.empty()) return error(errc::invalid_argument, "{}: holds no API key (one key per line)", source);
  return keys;
}

result<std::vector<std::string>> load_api_key_file(const std::string& path) {
  PAGODA_ASSIGN_OR_RETURN(std::string text, read_text_file(path, "API key file"));
  return parse_api_keys(text, path);
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  // One pass over a, whatever b holds: no early exit, no length-dependent branch.
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  const std::size_t nb = b.size();
  for (std::size_t i = 0; i < a.size(); ++i) {
    const unsigned char cb = nb ? static_cast<unsigned char>(b[i % nb]) : 0;
    diff |= static_cast<unsigned char>(a[i]) ^ cb;
  }
  return diff == 0;
}

std::optional<std::string_view> bearer_token(std::string_view h) {
  constexpr std::string_view scheme = "bearer ";
  if (h.size() <= scheme.size()) return std::nullopt;
  for (std::size_t i = 0; i < scheme.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(h[i])) != scheme[i]) return std::nullopt;
  std::string_view key = h.substr(scheme.size());
  while (!key.empty() && key.front() == ' ') key.remove_prefix(1);
  while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.remove_suffix(1);
  if (key.empty()) return std::nullopt;
  return key;
}

status key_store::add(std::string key, std::string tenant) {
  if (key.empty()) return error(errc::invalid_argument, "an API key must not be empty");
  for (const entry& e : keys_)
    if (e.key == key) return error(errc::invalid_argument, "API key given twice (tenant '{}' and '{}')", e.tenant, tenant);
  keys_.push_back({std::move(key), std::move(tenant)});
  return {};
}

status key_store::add_tenants(const std::vector<tenant_spec>& tenants) {
  for (const tenant_spec& t : tenants)
    for (const std::string& k : t.api_keys) PAGODA_RETURN_IF_ERROR(add(k, t.name));
  return {};
}

std::optional<std::size_t> key_store::find(std::string_view presented) const {
  std::optional<std::size_t> match;
  for (std::size_t i = 0; i < keys_.size(); ++i)
    if (constant_time_equal(presented, keys_[i].key)) match = i;
  return match;
}

std::optional<std::string> key_store::authenticate(std::string_view presented) const {
  const std::optional<std::size_t> match = find(presented);
  if (!match) return std::nullopt;
  return keys_[*match].tenant;
}

}  // namespace pagoda::server
