#include "router/request_keys.h"

#include "kv/kv_class_rule.h"

namespace pagoda::router {

std::vector<block_key> prompt_keys(const prompt_info& p, int block_size, std::size_t max_blocks) {
  std::vector<block_key> keys;
  if (block_size <= 0) return keys;
  const auto bs = static_cast<std::size_t>(block_size);
  const std::span<const token_id> tokens(p.prompt);
  block_key parent = k_root_parent_key;
  for (std::size_t i = 0; i < max_blocks && (i + 1) * bs <= tokens.size(); ++i) {
    const std::string extras = kv_rule::block_extras(p.first_extras, i, 0, {});
    parent = hash_block(parent, tokens.subspan(i * bs, bs), extras);
    keys.push_back(parent);
  }
  return keys;
}

request_hasher::request_hasher(server::api_context ctx, server::key_store tenants, server::json_limits limits)
    : ctx_(std::move(ctx)), tenants_(std::move(tenants)), limits_(limits) {}

std::optional<prompt_info> request_hasher::prompt_of(server::api_kind kind, std::string_view body,
                                                     std::optional<std::string_view> authorization) const {
  std::string tenant;
  if (tenants_.enabled() && authorization) {
    // An unknown key is the replica's to refuse; hashing it as the global
    // tenant only costs a lookup that finds nothing.
    if (const std::optional<std::string_view> key = server::bearer_token(*authorization))
      tenant = tenants_.authenticate(*key).value_or("");
  }
  server::api_result<nlohmann::json> json = server::parse_bounded_json(body, limits_);
  if (!json.ok()) return std::nullopt;
  server::api_result<server::api_call> call = server::parse_request(kind, *json.value, ctx_, tenant);
  if (!call.ok() || call.value->requests.empty()) return std::nullopt;
  request& r = call.value->requests.front();
  return prompt_info{std::move(r.prompt), first_block_extras(tenant, r.cache_salt)};
}

}  // namespace pagoda::router
