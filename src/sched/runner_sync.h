// The scheduler's side of the runner's per-sequence state (step_plan.h,
// runner_state.h): what the runner holds for one sequence as far as the
// scheduler told it, and the deltas that bring it in line with the KV
// manager. A sequence's KV state is sent in full once per life in the pool
// (its first run, after a preemption, a fork's first run); afterwards a
// step carries only what changed: appended or replaced table entries (found
// by comparing with the copy here, so no path that rewrites a table can be
// missed), positions from the first slot a compaction, drop or truncation
// rewrote, and the step's own positions, which the runner appends itself.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "kv/kv_manager.h"
#include "sched/step_plan.h"

namespace pagoda {

struct runner_mirror {
  bool known = false;            // the runner holds the sequence's state (its setup was sent)
  bool fresh_kv = true;          // its KV state starts over at the next run
  std::int32_t n_positions = 0;  // leading stored positions the runner holds as the KV manager has them
  std::array<std::vector<block_id>, k_max_kv_groups> tables;  // the runner's tables, as sent
  std::int64_t selector_bytes = 0;  // its selector's memory, as the runner last reported
  index_recall recall;              // its selector's sampled recall, as the runner last reported

  // The sequence left the pool (preempted, or a refused admission): its KV state goes.
  void forget_kv() {
    fresh_kv = true;
    n_positions = 0;
    for (auto& t : tables) t.clear();
    selector_bytes = 0;
    recall = {};
  }
  // Stored positions from `slot` on were rewritten (compaction, drop, truncation).
  void positions_changed_from(std::int32_t slot) { n_positions = std::min(n_positions, std::max(slot, 0)); }
};

// Fills q's KV state updates (fresh_kv, tables, keep_positions,
// stored_positions) for seq as the KV manager holds it now, and records that
// the runner holds it, the step's n_new tokens included, after the step.
// REQUIRES: q.n_stored set; kv.contains(seq).
void sync_kv_state(const kv_manager& kv, seq_id seq, std::int32_t n_new, runner_mirror& m, scheduled_seq& q);

}  // namespace pagoda
