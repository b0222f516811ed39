// API keys and tenants.
//
// With any key configured, every /v1 call needs `Authorization: Bearer KEY`.
// Keys given with --api-key belong to the global tenant (""): their requests
// share one prefix cache. Keys listed in a tenants file belong to that tenant:
// its id enters the first block's hash, so its cached prefixes are its own,
// without the client sending a cache_salt; an optional quota caps its blocks.
//
// Tenants file (JSON):
//   {"tenants": [
//     {"name": "alice", "api_keys": ["sk-alice"], "quota_blocks": 256},
//     {"name": "bob",   "api_keys": ["sk-bob-1", "sk-bob-2"]}
//   ]}
// Names are 1-64 characters of [A-Za-z0-9_.-]; keys are unique across the
// file and the command line; unknown fields are errors (a typo in a security
// file should not pass silently).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pagoda/status.h"

namespace pagoda::server {

struct tenant_spec {
  std::string name;
  std::vector<std::string> api_keys;
  std::optional<std::int32_t> quota_blocks;
};

// An API key file (--api-key-file, so keys stay out of `ps`): one key per
// line, compared exactly as written (trailing spaces and a CR are trimmed);
// blank lines and lines starting with '#' are skipped. A file with no key is
// an error.
result<std::vector<std::string>> parse_api_keys(std::string_view text, std::string_view source);
result<std::vector<std::string>> load_api_key_file(const std::string& path);

// A tenant name a tenants file may declare: 1-64 characters of [A-Za-z0-9_.-]
// (so "" — the global tenant — and "-" never are).
bool valid_tenant_name(std::string_view s);

// Parses a tenants file's text; errors name the file (`source`) and the field.
result<std::vector<tenant_spec>> parse_tenants(std::string_view json_text, std::string_view source);
result<std::vector<tenant_spec>> load_tenants_file(const std::string& path);

// True when a and b are equal. The time taken depends on a.size() only (pass
// the presented, attacker-known value as a), never on where they differ.
bool constant_time_equal(std::string_view a, std::string_view b);

// "Bearer KEY" -> "KEY" (the scheme is case-insensitive), the key exactly as
// sent: nothing is decoded, so "sk-al%69ce" is not "sk-alice"; std::nullopt otherwise.
std::optional<std::string_view> bearer_token(std::string_view authorization);

class key_store {
 public:
  // errc::invalid_argument for an empty key or one already added.
  status add(std::string key, std::string tenant);
  status add_tenants(const std::vector<tenant_spec>& tenants);

  bool enabled() const { return !keys_.empty(); }
  std::size_t size() const { return keys_.size(); }
  // The tenant of the presented key, or std::nullopt when no key matches.
  // Every stored key is compared, in constant time each.
  std::optional<std::string> authenticate(std::string_view presented) const;
  // The index (0 .. size() - 1) of the presented key, compared as authenticate() does.
  std::optional<std::size_t> find(std::string_view presented) const;
  // REQUIRES: index < size().
  const std::string& tenant(std::size_t index) const { return keys_[index].tenant; }

 private:
  struct entry {
    std::string key;
    std::string tenant;
  };
  std::vector<entry> keys_;
};

}  // namespace pagoda::server
