// What the scheduler keeps per sequence for its KV policy (policy/kv_policy.h):
// the policy object, the positions of each (layer, KV head) row once rows hold
// different tokens, and the attention statistics the policy asked for. Pure
// bookkeeping, like the scheduler: it turns a policy's decision into a
// kv_compaction for the KV manager and keeps its own arrays in step with the
// slots the compaction leaves. A sparse-read policy's selector lives in the
// runner (runner_state.h): this records the slot changes the runner must pass
// on to it, and whether the rows changed (the runner then gets them anew).
//
// Rows: r = layer * n_kv_heads + kv_head. Until a decision differs between
// rows, every row holds the KV manager's slots and positions (uniform);
// afterwards each row has its own positions, and dead slots (negative
// positions) lead the rows that keep fewer tokens than the widest.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "attention/attention_stats.h"
#include "kv/kv_manager.h"
#include "policy/kv_policy.h"
#include "sched/step_plan.h"

namespace pagoda {

struct seq_policy_shape {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  int n_rows() const { return n_layers * n_kv_heads; }
};

// What decide() needs to know of the sequence besides its KV.
struct seq_policy_context {
  std::span<const token_id> tokens;  // the sequence's tokens by position (prompt, then generated)
  int n_seen = 0;                    // tokens computed so far
  int n_prompt = 0;
  int n_new = 0;                     // tokens the last step computed
  bool prompt_done_now = false;
};

class seq_policy {
 public:
  // policy may be null: statistics only (scheduler_config::attention_stats_window).
  seq_policy(std::unique_ptr<kv_policy> policy, const seq_policy_shape& shape, int stats_window);

  kv_policy* policy() const { return policy_.get(); }
  // Rows of the attention statistics window the runner must report; -1: none.
  int stats_window() const { return stats_window_; }
  // Whether rows hold different tokens (then row_positions() is what attention masks by).
  bool per_row() const { return per_row_; }
  int n_slots() const { return n_slots_; }

  // Before a step: the new tokens at `positions` take slots [n_slots, n_slots + n).
  // Per-row positions get them appended (beyond n_slots until commit()).
  void plan(std::span<const std::int32_t> positions);
  // Row r's positions for the step just planned: [n_slots + planned] entries.
  const std::int32_t* row_positions() const { return rows_.data(); }
  std::size_t row_stride() const { return stride_; }
  // Every row's positions of the n_slots() stored slots: [n_rows][n_slots] (per_row() only).
  std::vector<std::int32_t> stored_rows() const;

  // What the runner must be told since the last call: the slot changes its
  // selector follows (step_plan.h, in order), and whether a compaction or a
  // drop rewrote the rows. Both restart empty at reset().
  std::vector<slot_change> take_slot_changes() { return std::exchange(slot_changes_, {}); }
  bool take_rows_changed() { return std::exchange(rows_changed_, false); }

  // After a committed step of n_new tokens: the slots grow, and the step's
  // statistics (when collected; a.n_kv == n_slots after the step) are added.
  void commit(int n_new, attention_stats* a);
  // After a verification step (spec/speculative.h) whose first n_new rows
  // stand: each is committed as a one-token step of its own, from its window
  // row (the step collected one per row: a.n_window == its rows), so the
  // statistics are plain decoding's; a null `a`: none collected. The rows
  // after them were rejected drafts: their slots are gone, and the selector
  // forgets what it saw of them (a rollback slot change).
  void commit_verified(int n_new, int n_step, const attention_stats* a);

  // Between steps: the policy's decision as a compaction of the sequence's KV
  // (kv_manager positions and tokens from `kv`), or std::nullopt to keep it all.
  std::optional<kv_compaction> decide(const kv_manager& kv, seq_id seq, const seq_policy_context& ctx);
  // After kv_manager::compact(c) succeeded: rows, statistics and the selector's slots follow.
  void compacted(const kv_compaction& c);
  // Slots past n_slots are gone (truncate), or whole blocks (drop).
  void truncated(int n_slots);
  void dropped(std::span<const std::int32_t> block_indices);
  // The sequence left the KV (preempted): everything restarts.
  void reset();
  // A copy for a forked sequence (n > 1): the same state, a policy object of
  // its own (and no slot change: its selector starts new).
  using policy_factory = std::function<result<std::unique_ptr<kv_policy>>(const kv_policy_spec&)>;
  std::unique_ptr<seq_policy> fork(const policy_factory& make) const;

  // [n_slots][n_rows]: accumulated attention; empty when not collected.
  const std::vector<float>& totals() const { return totals_; }
  // The last window of query rows as attention statistics over the current
  // slots (nullptr when none collected).
  const attention_stats* window() const;
  // How many tokens the widest row and the rows on average keep (live slots).
  double mean_live_slots() const;
  // Side memory (kv/kv_side.h): an upper bound, per KV slot, of what this
  // sequence's policy state holds beyond its KV: the policy's own
  // (kv_policy::side_memory: a selector's index) plus the statistics kept
  // here (totals: a float per row and slot; the window: window rows of a float
  // per row and slot; per-row positions and a compaction's sources), each at
  // up to twice its size for vector growth. The scheduler charges it
  // (kv_manager.h, "Side blocks").
  side_charge side_memory() const { return side_memory_of(policy_.get(), shape_, stats_window_); }
  // The same for a policy (may be null) before its seq_policy exists (a request's admission check).
  static side_charge side_memory_of(const kv_policy* policy, const seq_policy_shape& shape, int stats_window);

 private:
  struct query_row {  // one query token's attention, [n_rows][n_kv]
    int n_kv = 0;
    std::vector<float> w;
  };
  void make_per_row(std::span<const std::int32_t> kv_positions);
  eviction_input input(const kv_manager& kv, seq_id seq, const seq_policy_context& ctx) const;
  // Moves every per-slot array (row positions, totals, window) to the new
  // slots: row r's new slot i comes from src(r, i) (-1: nothing).
  template <typename Src>
  void remap(int n_new_slots, Src src);

  std::unique_ptr<kv_policy> policy_;
  std::vector<slot_change> slot_changes_;
  bool rows_changed_ = false;
  kv_policy_needs needs_;
  seq_policy_shape shape_;
  int stats_window_ = -1;
  int n_slots_ = 0;
  bool per_row_ = false;
  std::vector<std::int32_t> rows_;  // [n_rows][stride_] when per_row_
  std::size_t stride_ = 0;
  std::vector<float> totals_;       // [n_slots][n_rows]
  std::vector<query_row> ring_;     // the last stats_window_ query rows, oldest first
  mutable attention_stats window_;  // built by window()
  mutable bool window_fresh_ = false;
  std::vector<std::int32_t> last_sources_;  // scratch of decide(): [n_rows][width] sources of the compaction
  int last_width_ = 0;
  bool last_uniform_ = true;
  std::vector<std::int32_t> last_positions_;  // [n_rows][width]
};

}  // namespace pagoda
