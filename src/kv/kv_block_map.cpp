#include "kv/kv_block_map.h"

#include <algorithm>
#include <map>

#include "kv/kv_manager.h"

namespace pagoda {

kv_block_map make_kv_block_map(const kv_manager& kv, std::int64_t step) {
  kv_block_map m;
  m.block_size = kv.block_size();
  m.step = step;
  std::map<std::int32_t, std::int32_t> index;  // tenant id -> index into m.tenants
  for (std::int32_t g = 0; g < kv.n_groups(); ++g) {
    const kv_group& grp = kv.group(g);
    kv_block_map::group& out = m.groups.emplace_back();
    out.kind = grp.kind();
    out.first_block = grp.first_block();
    const auto n = static_cast<std::size_t>(grp.n_blocks());
    out.refs.resize(n);
    out.cached.resize(n);
    out.owners.resize(n, -1);
    out.classes.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const block_id b(grp.first_block() + static_cast<std::int32_t>(i));
      const std::int32_t ref = grp.ref_count(b);
      out.refs[i] = static_cast<std::uint8_t>(std::min(ref, 255));
      out.cached[i] = grp.is_hashed(b) ? 1 : 0;
      out.classes[i] = static_cast<std::uint8_t>(grp.class_of(b));
      if (ref == 0 && !grp.is_hashed(b)) continue;  // free: no owner
      const tenant_id t = grp.owner(b);
      auto [it, inserted] = index.emplace(t.value, static_cast<std::int32_t>(m.tenants.size()));
      if (inserted) m.tenants.push_back(kv.tenant_name(t));
      out.owners[i] = it->second;
    }
  }
  return m;
}

}  // namespace pagoda
