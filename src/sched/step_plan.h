// The data between the scheduler and a runner (DESIGN.md): the scheduler plans
// a step (step_plan), a runner executes it (step_output), and the scheduler
// commits what was computed (scheduler::update). Plain data, so any runner
// (the CPU one today, a GPU one later) can execute a plan, and tests can fake
// one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "attention/attention_stats.h"
#include "attention/kv_selector.h"
#include "kv/kv_hooks.h"
#include "kv/kv_manager.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// One sequence's share of a step: compute K/V (and logits) of `tokens`.
struct scheduled_seq {
  seq_id seq;
  std::vector<token_id> tokens;          // new tokens; their K/V go to KV slots n_stored ..
  std::vector<std::int32_t> positions;   // [tokens]: their positions
  std::int32_t n_stored = 0;             // KV slots stored before this step
  // Views into the scheduler's KV manager, valid until update():
  std::span<const std::int32_t> stored_positions;  // [n_stored]
  std::span<const block_id> blocks;      // block table covering n_stored + tokens.size() slots
  bool all_logits = false;               // one logits row per new token (prompt scoring), else one
  int stats_window = -1;                 // >= 0: collect attention statistics, this many window rows
  // Rows that hold different tokens (a per-head policy): row r = layer *
  // n_kv_heads + head has its own positions, row_positions[r * row_stride +
  // slot] for the n_stored + tokens.size() slots; null: stored_positions for all.
  const std::int32_t* row_positions = nullptr;
  std::size_t row_stride = 0;
  // A sparse-read policy's selector (attention/kv_selector.h), or null.
  kv_read_selector* selector = nullptr;
};

// Fill `block` from an external KV source with the block stored under `ref`
// (its key and the layout of the class `block` is of), for `tenant`.
struct block_load {
  seq_id seq;
  block_id block;
  stored_block_ref ref;
  std::string tenant;
};

struct step_plan {
  std::vector<kv_op> ops;             // first, in order: evictions, copies, truncations, releases
  std::vector<block_load> loads;      // then these
  std::vector<scheduled_seq> seqs;    // then one forward pass over these
  bool empty() const { return ops.empty() && loads.empty() && seqs.empty(); }
};

struct step_output {
  // Not ok: the step failed part way; nothing of it may be committed.
  status result;
  // One row per seq (all_logits: one per token), in plan order; [rows][n_vocab].
  std::vector<float> logits;
  std::vector<std::uint8_t> loaded;     // [plan.loads]: 0 not filled, else 1 + the source tier it came from
  std::vector<attention_stats> stats;   // [plan.seqs]; meaningful where stats_window >= 0
  std::vector<std::uint8_t> sparse;     // [plan.seqs]: 1 when a selector chose a sparse read for any of its tokens
};

// Executes plans. Implementations: cpu_runner; fakes in tests.
class model_runner {
 public:
  virtual ~model_runner() = default;
  // Performs plan.ops, then plan.loads, then the forward pass of plan.seqs,
  // and fills `out` (out.result says whether it all happened).
  virtual void execute(const step_plan& plan, step_output& out) = 0;
};

}  // namespace pagoda
