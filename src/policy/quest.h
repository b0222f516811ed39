// Quest (Tang et al., ICML 2024): query-aware sparse reads over paged KV. It
// evicts nothing. Every sealed block keeps the per-channel min and max of its
// keys (kv_layout::key_summaries, kept by the KV backend); since
//   q . k = sum_d q_d k_d <= sum_d max(q_d min_d, q_d max_d)
// for every key k of the block, that sum is an upper bound of the block's
// scores. Each decode step reads, per layer and KV head, the blocks with the
// largest bound for the step's queries, plus the sink blocks and the newest
// block, and attention reads nothing else (attention_task::ranges).
//
// Parameters (`--kv-policy quest:budget=0.125,sinks=16`):
//   budget=F       fraction of the blocks read in all (sinks and the newest
//                  block included), in (0, 1]: "0.125" or "12.5%". Default 0.125.
//   pages=N        read N blocks in all instead of a fraction.
//   sinks=T        the first T tokens (of the live slots) are always read. Default 16.
//   min_context=T  below T tokens of context, read everything. Default: the
//                  context at which the budget reaches 4 blocks beyond the
//                  sinks and the newest block (with pages=N: 0).
//
// Choices:
//   - Decode only: a group of more than k_quest_max_query_tokens query tokens
//     (a prompt chunk) reads everything. The bound of a group is the max over
//     its rows, so a chunk's selection is a union that grows with the chunk
//     while each row's share of it shrinks; the paper applies Quest to decode
//     only. Up to 8 tokens covers speculative verification.
//   - Blocks without a summary (not yet full: the newest; or when the backend
//     keeps none) are always read, and so is the block of the newest slot.
//   - The bound ignores soft-capping (monotone: the ranking is the same) and
//     per-slot bias (Quest does not merge entries).
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "attention/kv_selector.h"
#include "kv/kv_backend.h"
#include "pagoda/status.h"
#include "policy/kv_policy.h"

namespace pagoda {

inline constexpr int k_quest_max_query_tokens = 8;

struct quest_params {
  double budget = 0.125;  // fraction of blocks read, when pages == 0
  int pages = 0;          // > 0: blocks read
  int sinks = 16;         // tokens
  int min_context = -1;   // tokens; -1: automatic (see above)

  // The blocks read out of n_blocks, at least 1.
  int blocks_read(int n_blocks) const;
  // The context (in tokens) below which everything is read, for this block size.
  int min_context_tokens(int block_size) const;
};

// Errors name the parameter ("quest: budget 1.5: expected a fraction in (0, 1] ...").
result<quest_params> parse_quest_params(const kv_policy_spec& spec);

// The kv_policy: needs key summaries, evicts nothing, makes quest_selectors.
result<std::unique_ptr<kv_policy>> make_quest_policy(const kv_policy_spec& spec);

// The per-sequence selector. Stateless between calls (the key summaries live
// in the backend), so select() may run concurrently for any heads; its
// scratch is per thread and grows to the largest context seen, then no call
// allocates.
class quest_selector final : public kv_read_selector {
 public:
  explicit quest_selector(const quest_params& params) : params_(params) {}
  // REQUIRES: q.k, and q.kv for a selection (without a backend: false).
  bool select(const kv_select_query& q, std::vector<slot_range>& out) override;

 private:
  quest_params params_;
};

// Quest's bound for a run of blocks: out[i] = max over rows r < n_rows of
// sum_d max(q[r][d] * blocks[i].min[d], q[r][d] * blocks[i].max[d]). q is
// [n_rows][head_dim]. A NaN sum becomes +inf (the block is read); the SIMD
// levels compute max(q lo, q hi) as q+ hi + q- lo, so an infinite min or max
// channel may give +inf there where the reference is finite. On finite
// summaries the levels differ by float rounding only. Dispatches on the SIMD level.
void quest_bounds(const float* q, int n_rows, int head_dim, std::span<const key_summary> blocks, float* out);
// Plain reference twin: the same sum, in double, then rounded to float.
void quest_bounds_ref(const float* q, int n_rows, int head_dim, std::span<const key_summary> blocks, float* out);

}  // namespace pagoda
