#include "server/dashboard.h"

#include <algorithm>

namespace pagoda::server {

nlohmann::json kv_blocks_json(const kv_block_map& map, const std::vector<std::string>& class_types,
                              const std::string& kv_policy) {
  using nlohmann::json;
  std::int64_t n_free = 0, n_cached = 0, n_used = 0, n_shared = 0;
  json groups = json::array();
  const bool classes = class_types.size() > 1;
  for (const kv_block_map::group& g : map.groups) {
    const std::size_t n = g.refs.size();
    std::string states(n, '.'), cls;
    for (std::size_t i = 0; i < n; ++i) {
      if (g.refs[i] > 0) {
        states[i] = static_cast<char>('0' + std::min<int>(g.refs[i], 9));
        ++n_used;
        n_shared += g.refs[i] > 1;
      } else if (g.cached[i]) {
        states[i] = 'c';
        ++n_cached;
      } else {
        ++n_free;
      }
      if (classes) cls.push_back(static_cast<char>('0' + std::min<int>(g.classes[i], 9)));
    }
    json entry = {{"kind", kv_group_kind_name(g.kind)},
                  {"first_block", g.first_block},
                  {"n_blocks", n},
                  {"states", std::move(states)},
                  {"owners", g.owners}};
    if (classes) entry["class"] = std::move(cls);
    groups.push_back(std::move(entry));
  }
  return {{"object", "kv.blocks"},
          {"block_size_tokens", map.block_size},
          {"step", map.step},
          {"kv_policy", kv_policy},
          {"tenants", map.tenants},
          {"classes", class_types},
          {"groups", std::move(groups)},
          {"counts", {{"free", n_free}, {"cached", n_cached}, {"used", n_used}, {"shared", n_shared}}}};
}

}  // namespace pagoda::server
