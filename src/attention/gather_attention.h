// Attention over an explicit, scattered list of KV slots: what retrieval
// attention reads (policy/retrieval.h), the sinks, the recent window and the
// top-k keys an ANN index returned, token by token rather than whole ranges.
//
// Same inputs, masks and output layout as paged_attention (attention_task):
// a query token at position p sees a listed slot whose stored position is
// <= p (and > p - window with a sliding window); dead slots (negative
// positions) are never seen; scores are soft-capped when softcap > 0, and a
// view's per-slot bias (merged entries, kv_backend.h) is added to the capped
// score. The softmax runs over the listed slots a row sees, so with the list
// of every slot the result is full attention.
//
// How the bytes are read. Keys: most codecs keep key tiles channel-major (one
// SIMD lane per token), so one token's key touches every cache line of its
// tile. Listed slots that a token-major copy holds (key_rows, kept by the
// retrieval selector) are scored from the copy, one row per key; the others
// are scored a tile at a time through the codec's qk kernel, which costs the
// same reads as one key of the tile (consecutive blocks of one block class
// with listed slots in one qk run, through that class's codec). Values are
// token-major: a block with few listed slots
// decodes just those rows; a block where at least a quarter of the slots are
// listed goes through the codec's av kernel with zero weights elsewhere (zero
// weights add nothing, exactly).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attention/paged_attention.h"

namespace pagoda {

// Per-thread reusable buffers; grown on demand, never shrunk.
struct gather_scratch {
  std::vector<const void*> tiles;
  std::vector<float> q;        // [rows][head_dim], pre-scaled
  std::vector<float> scores;   // [rows][n_slots]
  std::vector<float> tile_io;  // [rows][run tokens]: one qk/av run's scores or weights
  std::vector<float> row;      // [8][head_dim]: a batch of decoded value rows
  std::vector<float> acc;      // [rows][head_dim]
  std::vector<float> inv;      // [rows]: 1 / each row's softmax sum
  std::vector<int> lo, hi;     // [tokens]: the listed entries each query token sees, [lo, hi)
};

// Attention of t's query tokens over the listed slots only. t.ranges is
// ignored: `slots` says what is read. Listed slots below rows.n_slots are
// scored from rows (the same values as the view's, so the same result up to
// float summation order).
// REQUIRES: slots strictly increasing, each in [0, t.n_kv); k and v cover
// t.n_kv slots; rows, if any, hold t.kv_head's keys, t.head_dim wide. A query
// row that sees no listed slot gets zeros.
void gather_attention(const attention_task& t, std::span<const std::int32_t> slots, gather_scratch& scratch,
                      const key_rows& rows = {});

// Plain reference twin: decodes each listed key and value row and computes in
// double precision, one query row at a time, the masks spelled out slot by slot.
void gather_attention_ref(const attention_task& t, std::span<const std::int32_t> slots);

// scores[r * ld + e] = q[r] . rows.row(slots[e]), for r < n_q and e < n: q
// is [n_q][head_dim] f32. Dispatches on the SIMD level; the reference twin
// sums in float in index order. REQUIRES: every slots[e] < rows.n_slots.
void score_key_rows(const float* q, int n_q, int head_dim, const key_rows& rows, const std::int32_t* slots,
                    std::size_t n, float* scores, std::size_t ld);
void score_key_rows_ref(const float* q, int n_q, int head_dim, const key_rows& rows, const std::int32_t* slots,
                        std::size_t n, float* scores, std::size_t ld);

// acc[r][d] += w[r * w_stride] * row[d] for r < n_q, d < head_dim, rows of
// zero weight skipped: one decoded value row into the query rows'
// accumulators. Dispatches on the SIMD level; the reference twin is the plain
// loop (an FMA per element at the AVX2 level, so results differ by rounding).
void add_weighted_row(const float* row, int head_dim, const float* w, std::size_t w_stride, int n_q, float* acc);
void add_weighted_row_ref(const float* row, int head_dim, const float* w, std::size_t w_stride, int n_q, float* acc);

// The slots of sorted, disjoint ranges, in order (appended to out).
void append_slots_of_ranges(std::span<const slot_range> ranges, std::vector<std::int32_t>& out);

// Decodes slots [slot, slot + n) of one head of a view (sealed tiles through
// their block's class codec, a staged last block through the staged codec) into
// out[n][head_dim]. REQUIRES: the slots lie in one block, below v.n_tokens.
void decode_kv_rows(const paged_kv_view& v, int head, int slot, int n, float* out);

}  // namespace pagoda
