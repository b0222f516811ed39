#include "sched/runner_sync.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace pagoda {

static_assert(std::has_unique_object_representations_v<block_id>, "tables are compared with memcmp");

void sync_kv_state(const kv_manager& kv, seq_id seq, std::int32_t n_new, runner_mirror& m, scheduled_seq& q) {
  q.fresh_kv = m.fresh_kv;
  if (m.fresh_kv) {
    for (auto& t : m.tables) t.clear();
    m.n_positions = 0;
    m.fresh_kv = false;
  }
  for (std::int32_t g = 0; g < kv.n_groups(); ++g) {
    const std::span<const block_id> now = kv.block_table(seq, g);
    std::vector<block_id>& had = m.tables[static_cast<std::size_t>(g)];
    // A sliding window's NULL entries are a prefix (kv_group.h); the rest
    // changed from the first entry that differs (appends, a copy-on-write, a
    // rewrite). Comparing whole runs first keeps a decode step's check at
    // memory speed.
    const auto n_null = static_cast<std::size_t>(
        std::partition_point(now.begin(), now.end(), [](block_id b) { return !b.valid(); }) - now.begin());
    const std::size_t common = std::min(had.size(), now.size());
    std::size_t from = std::min(n_null, common);
    if (from < common && std::memcmp(had.data() + from, now.data() + from, (common - from) * sizeof(block_id)) == 0)
      from = common;
    while (from < common && had[from] == now[from]) ++from;
    from = std::max(from, n_null);
    const bool nulls_moved = n_null > 0 && (had.size() < n_null || had[n_null - 1].valid());
    if (from == now.size() && had.size() == now.size() && !nulls_moved) continue;
    table_update u;
    u.group = g;
    u.n_null = static_cast<std::int32_t>(n_null);
    u.from = static_cast<std::int32_t>(from);
    u.entries.assign(now.begin() + static_cast<std::ptrdiff_t>(from), now.end());
    q.tables.push_back(std::move(u));
    had.assign(now.begin(), now.end());
  }
  const std::span<const std::int32_t> positions = kv.positions(seq);
  q.keep_positions = std::min(m.n_positions, q.n_stored);
  q.stored_positions.assign(positions.begin() + q.keep_positions, positions.end());
  m.n_positions = q.n_stored + n_new;
}

}  // namespace pagoda
