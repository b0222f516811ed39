#include "sched/runner_sync.h"

namespace pagoda {

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
    // A sliding window's NULL entries are a prefix; the rest changed from the
    // first entry that differs (appends, a copy-on-write, a rewrite).
    std::size_t n_null = 0;
    while (n_null < now.size() && !now[n_null].valid()) ++n_null;
    std::size_t from = n_null;
    const std::size_t common = std::min(had.size(), now.size());
    while (from < common && had[from] == now[from]) ++from;
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
