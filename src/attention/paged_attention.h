// Causal attention over paged KV views, on encoded tiles (codec qk/av).
//
// Two passes per (sequence, KV head, group of query tokens): scores for every
// KV slot the group can see through the key codec, an exact softmax per query
// row over its own visible range, then the weighted value sum through the value
// codec. Every KV byte is read once per group. Codecs get the whole run of a
// head's tiles at once; a staged (f16) last block of a sealed format goes
// through the f16 codec. A table that mixes block classes (kv_backend.h) is
// read one maximal run of same-class tiles at a time, each through its
// class's codec, its scores in the columns of its blocks; with one class
// there is one run, the call it always was.
//
// Masking is by stored positions, not by slot number: a query token at
// position p sees the KV slots whose stored position is <= p (<= q_see, a
// bidirectional span's last position, when given) and, with a sliding window
// w > 0, > p - w. A negative stored position marks a DEAD slot
// (a policy row that keeps fewer tokens than the table has slots, see
// policy/kv_policy.h): dead slots lead the row and nobody sees them. Stored positions strictly increase along the
// slots (kv_manager keeps them so), so what a row sees is one contiguous run of
// slots, found by binary search. Blocks dropped from the middle of a sequence
// simply are not there; no slot is masked for being missing.
//
// Batch invariance: a query row's output depends only on its own q, its
// position and the cache contents it sees, never on which other rows share its
// group (prefill chunk) or step. Slots a row must not see get weight exactly 0,
// and the codecs add 0-weighted rows exactly. This holds bitwise for every
// format that is not sealed; sealed formats (per-channel scales) are
// deterministic but a query sees its own block as f16 while the block is open
// and as codes once a later write has sealed it (kv_backend.h).
//
// Sparse reads (attention_task::ranges, from a kv_read_selector): only slots
// inside the ranges are read and get weight; the masks above still apply
// inside them. The blocks a group reads are collected into one run of tiles
// (block-aligned ranges read nothing else); a range that starts or ends inside
// a block reads that whole block's tile and gives its unselected slots weight
// exactly 0. A query row that sees no selected slot gets a zero output. Rows
// stay batch invariant under a given set of ranges (a row's scores form the
// same run of columns whatever the group), and ranges covering every slot give
// bitwise the output of no ranges.
//
// Attention sinks (attention_task::sinks): a head's sink logit joins the
// softmax of each of its rows after scaling, capping and bias, with no value;
// the weights (and the statistics) are the probabilities of the slots, which
// then sum to less than 1. A row that sees no slot still gets a zero output.
//
// Per-slot bias (paged_kv_view::bias, merged entries): when the key view has
// one, each score gets its slot's bias added after scaling and soft-capping,
// before the mask and the softmax.
//
// Statistics (optional, for eviction policies): the softmax weights a task
// computed, per KV slot, summed over the query heads of the KV head's group:
// over every query row of the task (H2O's accumulated attention), and for the
// last n_window query tokens one row each (SnapKV's observation window). Slots
// that were not read get no weight.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "attention/kv_selector.h"
#include "kv/kv_backend.h"

namespace pagoda {

// Per-thread reusable buffers; grown on demand, never shrunk.
struct attention_scratch {
  std::vector<const void*> tiles;  // [blocks] tile pointers of one head
  std::vector<int> blocks;    // [blocks] block indices a group reads, ascending; column c is slot
                              // blocks[c / block_size] * block_size + c % block_size
  std::vector<slot_range> holes;       // score COLUMNS of read blocks whose slots are not selected
  std::vector<const float*> bias;      // [blocks] the key view's bias of each read block, or nullptr
  std::vector<float> q;       // [rows][head_dim], pre-scaled
  std::vector<float> scores;  // [rows][ld]
  std::vector<float> acc;     // [rows][head_dim]
  std::vector<float> row_sum; // [rows]
  std::vector<int> lo, hi;    // [tokens]: the slots each query token sees, [lo, hi)
  // A sparse-read selector's input and answer (the forward pass fills them).
  std::vector<float> select_q;
  std::vector<slot_range> select_ranges;
};

// Where one task adds its statistics; both arrays are indexed by KV slot.
struct attention_stats_out {
  float* accumulated = nullptr;  // [n_kv]: += weight, over every query row
  float* window = nullptr;       // [n_window][n_kv]: += weight of the last n_window query tokens
  int n_window = 0;
};

struct attention_task {
  const paged_kv_view* k = nullptr;
  const paged_kv_view* v = nullptr;
  int kv_head = 0;
  int n_rep = 1;          // query heads per KV head (GQA)
  int head_dim = 0;
  float scale = 1.0f;     // usually 1/sqrt(head_dim)
  // Queries: n_tokens tokens; token i, query head (kv_head * n_rep + j) is at
  // q + i * q_stride + (kv_head * n_rep + j) * head_dim.
  const float* q = nullptr;
  std::size_t q_stride = 0;
  int n_tokens = 0;
  // Positions: q_pos[n_tokens] of the queries, kv_pos[n_kv] of the KV slots
  // (strictly increasing). window > 0: a sliding window of that many positions.
  const std::int32_t* q_pos = nullptr;
  const std::int32_t* kv_pos = nullptr;
  int n_kv = 0;
  int window = 0;
  // Optional: q_see[n_tokens], the highest position each query sees (a
  // bidirectional image span's tokens see the span's last); the window still
  // counts back from q_pos. Null: q_pos (causal).
  const std::int32_t* q_see = nullptr;
  // softcap > 0: each score s = scale * q.k becomes softcap * tanh(s / softcap)
  // before the mask and the softmax (Gemma 2's attention-logit soft-capping).
  float softcap = 0.0f;
  // Attention sinks (gpt-oss): sinks[h] is a learned logit of query head h
  // that joins each of its rows' softmax without a value, so the row's
  // weights sum to less than 1 (ggml's soft_max with sinks). Null: none.
  const float* sinks = nullptr;
  // Sparse read (attention/kv_selector.h): only slots inside these sorted,
  // disjoint, non-empty ranges within [0, n_kv) are read; the masks above
  // still apply inside them. Empty: every slot.
  std::span<const slot_range> ranges;
  // Output laid out like q.
  float* out = nullptr;
  std::size_t out_stride = 0;
  attention_stats_out stats;  // accumulated == window == nullptr: none
};

// REQUIRES: k and v cover n_kv slots; every query sees at least one slot
// (by positions; with ranges it may see none of the selected ones).
void paged_attention(const attention_task& task, attention_scratch& scratch);

// Plain reference twin: decodes each needed key/value with the codec and
// computes attention (and the statistics) in double precision, one query at a
// time, with the ranges and bias spelled out slot by slot.
void paged_attention_ref(const attention_task& task);

// The slots [lo, hi) a query at position q_pos sees (see above); see_pos:
// the highest position it sees (q_pos when causal).
void visible_slots(const std::int32_t* kv_pos, int n_kv, std::int32_t q_pos, int window, int& lo, int& hi);
void visible_slots(const std::int32_t* kv_pos, int n_kv, std::int32_t q_pos, std::int32_t see_pos, int window, int& lo,
                   int& hi);
// The highest position query i of t sees.
inline std::int32_t see_of(const attention_task& t, int i) { return t.q_see ? t.q_see[i] : t.q_pos[i]; }

// The sink logit of query head kv_head * n_rep + j of t, -infinity without sinks.
float sink_of(const attention_task& t, int j);

// Softmax of s[0, n) in place, returning the sum of exponentials; the entries are
// left unnormalised (exp(s - max)). Dispatches on the SIMD level. A finite
// `sink` is one more logit without a value (an attention sink): it takes part
// in the max and adds exp(sink - max) to the sum, as ggml's soft_max with sinks.
float softmax_unnormalized(float* s, int n, float sink = -INFINITY);
float softmax_unnormalized_ref(float* s, int n, float sink = -INFINITY);

// s[i] = cap * tanh(s[i] / cap) for i in [0, n), in place (cap > 0). The SIMD
// levels compute tanh(x) as 1 - 2 / (exp(2x) + 1) with the softmax's exp, so
// they differ from the reference (std::tanh) by a few float ulps of cap.
void softcap_inplace(float* s, int n, float cap);
void softcap_inplace_ref(float* s, int n, float cap);

}  // namespace pagoda
