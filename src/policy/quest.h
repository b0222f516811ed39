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
//   bounds=int8    how the bound is computed (below): int8 (default), int4 or f32.
//
// Bounds. bounds=f32 computes the sum above from the backend's f32 summaries
// on every step. bounds=int8 (the default) computes a slightly larger bound
// from a compact copy the selector keeps per (layer, KV head): each block's
// min rounded down and max rounded up to int8 codes on a per-block scale, the
// query rows rounded to 7-bit codes, exact integer dot products (VNNI) and a
// term that covers the query's rounding, so it is still an upper bound of
// every score (quest_bound8). It reads a quarter of the bytes, contiguously
// (the backend keeps summaries as [block][layer][head]: one (layer, head)'s
// are 1.5 KiB every 384 KiB on a 32-layer model), and a quarter of the
// instructions; the copy costs 2 x head_dim + 8 bytes per block per layer
// and KV head (memory_bytes()). bounds=int4 keeps 4-bit codes over per-channel
// scales instead (quest_bounds4 below): head_dim + 8 bytes per block (136 at
// head_dim 128, 264 for int8), a bound as sound but looser, so it may choose
// other blocks (bench/RESULTS.md, "Sparse reads (Quest)", measures both).
//
// Per step, outside the bound kernel, the work is a few branch-free passes
// over the candidates (the k-th largest bound by quest_kth_largest, then the
// chosen blocks' ranges) and one comparison of the cached block ids with the
// table; a block's codes are made once, when it is sealed.
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

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "attention/kv_selector.h"
#include "kv/kv_backend.h"
#include "pagoda/status.h"
#include "policy/kv_policy.h"

namespace pagoda {

inline constexpr int k_quest_max_query_tokens = 8;

// How the bound is computed (bounds=, below).
enum class quest_bounds_kind { f32, int8, int4 };

struct quest_params {
  double budget = 0.125;  // fraction of blocks read, when pages == 0
  int pages = 0;          // > 0: blocks read
  int sinks = 16;         // tokens
  int min_context = -1;   // tokens; -1: automatic (see above)
  quest_bounds_kind bounds = quest_bounds_kind::int8;  // bounds=

  // The blocks read out of n_blocks, at least 1.
  int blocks_read(int n_blocks) const;
  // The context (in tokens) below which everything is read, for this block size.
  int min_context_tokens(int block_size) const;
};

// Errors name the parameter ("quest: budget '1.5': expected a fraction in (0, 1] ...").
result<quest_params> parse_quest_params(const kv_policy_spec& spec);

// The kv_policy: needs key summaries, evicts nothing, makes quest_selectors.
result<std::unique_ptr<kv_policy>> make_quest_policy(const kv_policy_spec& spec);

// --- bounds -------------------------------------------------------------------

// The f32 bound for a run of blocks: out[i] = max over rows r < n_rows of
// sum_d max(q[r][d] * blocks[i].min[d], q[r][d] * blocks[i].max[d]). q is
// [n_rows][head_dim]. A NaN sum becomes +inf (the block is read); the SIMD
// levels compute max(q lo, q hi) as q+ hi + q- lo, so an infinite min or max
// channel may give +inf there where the reference is finite. On finite
// summaries the levels differ by float rounding only. Dispatches on the SIMD level.
void quest_bounds(const float* q, int n_rows, int head_dim, std::span<const key_summary> blocks, float* out);
// Plain reference twin: the same sum, in double, then rounded to float.
void quest_bounds_ref(const float* q, int n_rows, int head_dim, std::span<const key_summary> blocks, float* out);

// The int8 bound. Codes are padded with zeros to k_quest_code_align channels.
inline constexpr int k_quest_code_align = 64;
inline int quest_padded_dim(int head_dim) { return (head_dim + k_quest_code_align - 1) / k_quest_code_align * k_quest_code_align; }

// One block's summary as codes, rounded outward: scale * code_lo[d] <= min[d]
// and scale * code_hi[d] >= max[d], codes in [-127, 127]; l1 = sum_d
// |code_lo[d]| + |code_hi[d]|.
struct quest_block8 {
  float scale = 0;
  std::int32_t l1 = 0;
};
// Writes code_lo then code_hi ([2][padded_dim]) to codes. Non-finite min or
// max channels give scale = +inf (the bound is then +inf: the block is read).
quest_block8 quest_encode_block(const key_summary& s, int head_dim, std::int8_t* codes);

// Query rows as codes: |q| = scale * (code + e) with |e| <= 1/2 per channel
// (7-bit codes, so the AVX2 path's 16-bit pair sums cannot saturate). pos
// and neg are disjoint (at most one of them is nonzero per channel): the
// AVX2 kernels rely on it (quest_avx2.cpp), as quest_encode_query makes them.
struct quest_query8 {
  int n_rows = 0;
  int padded_dim = 0;
  std::vector<std::uint8_t> pos;  // [n_rows][padded_dim]: round(max(q, 0) / scale)
  std::vector<std::uint8_t> neg;  // [n_rows][padded_dim]: round(max(-q, 0) / scale)
  std::vector<float> scale;       // [n_rows]: max|q_r| / 127
};
void quest_encode_query(const float* q, int n_rows, int head_dim, quest_query8& out);

// out[i] = max over rows r of scale_r * block_i.scale * (P - N + l1_i / 2),
// P = sum_d pos[r][d] code_hi_i[d], N = sum_d neg[r][d] code_lo_i[d] (exact
// integers): an upper bound of sum_d max(q_d min_d, q_d max_d), hence of every
// score of the block (up to the final multiplication's rounding). codes is
// [n][2][padded_dim] (quest_encode_block's layout, consecutive blocks).
// Exact integer sums: every SIMD level gives the reference's bits.
void quest_bounds8(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out);
void quest_bounds8_ref(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out);

// The int4 bound (bounds=int4): the int8 bound's arithmetic on codes of half
// the size (pd4 / 2 + pd4 / 2 bytes per block, pd4 = head_dim rounded up to
// k_quest4_align: 128 B at head_dim 128, with 8 B of quest_block8 beside).
// Four bits per channel would waste most codes on the channels a per-block
// scale cannot fit (keys have outlier channels 8-10x the others), so each
// (layer, KV head) row first divides channel d by a power of two s_d
// (quest_channel_scales, fixed when the row's first codes are made); the
// bound is then the int8 bound of y_d = x_d / s_d against the folded query
// q'_d = q_d s_d (q'_d y_d = q_d x_d; exact, s_d being a power of two). Codes
// are c in [-7, 7] per block scale, rounded outward, stored in nibbles as
// 8 - c_lo for the min (negated: the kernels then sum pos x hi + neg x (-lo)
// in one accumulator) and c_hi + 8 for the max: per 128 channels, byte j
// holds channel j (low nibble) and channel 64 + j (high nibble), so one
// 64-byte load gives two vectors of channels.
inline constexpr int k_quest4_align = 128;
inline int quest4_padded_dim(int head_dim) { return (head_dim + k_quest4_align - 1) / k_quest4_align * k_quest4_align; }

// s_d: the power of two at or above the median over the summaries of
// max(|min_d|, |max_d|), at least 1/64 of the largest s (a channel that is
// quiet there may not be later); 1 for a row of zeros. Non-finite values are
// skipped. A block outside these scales gets a larger block scale, not a wrong bound.
void quest_channel_scales(std::span<const key_summary> sample, int head_dim, float* scales);
// Writes code_lo then code_hi as nibbles (2 x quest4_padded_dim / 2 bytes):
// scale * code_lo[d] <= min[d] / s_d and scale * code_hi[d] >= max[d] / s_d,
// codes in [-7, 7] (nibbles 8 - code_lo, code_hi + 8), padding channels coded
// 0; l1 as quest_block8's.
quest_block8 quest_encode_block4(const key_summary& s, int head_dim, const float* scales, std::uint8_t* codes);
// The folded query's codes (quest_encode_query of q_d s_d, padded to
// quest4_padded_dim) and, per row, bias = 8 x sum_d (pos + neg) (the nibbles'
// offset in pos x hi + neg x (-lo)) and half_scale = q.scale / 2, both zero-padded to whole groups of 4 rows.
struct quest_query4 {
  quest_query8 q;
  std::vector<std::int32_t> bias;  // [n_rows rounded up to 4]
  std::vector<float> half_scale;   // [n_rows rounded up to 4]
};
void quest_encode_query4(const float* q, int n_rows, int head_dim, const float* scales, quest_query4& out);
// quest_bounds8 of the nibble codes: out[i] = max over rows of
// finish8(P - N) with P = sum_d pos[r][d] code_hi_i[d], N = sum_d neg[r][d]
// code_lo_i[d] (exact integers; every SIMD level gives the reference's bits).
// codes: [n][2][pd4 / 2] bytes.
void quest_bounds4(const quest_query4& q, const std::uint8_t* codes, const quest_block8* blocks, int n, float* out);
void quest_bounds4_ref(const quest_query4& q, const std::uint8_t* codes, const quest_block8* blocks, int n, float* out);

// The k-th largest of x (1 <= k <= x.size(); no NaN in x), as std::nth_element
// would give it, in O(n) simple passes: a threshold from a sample of x, the
// values at or above it, and a branch-free quickselect among those (about
// k + 3 sqrt(8 k) values); a quickselect over all of x when the sample is too
// small or unlucky. scratch: 2 x.size() floats, reused across calls.
float quest_kth_largest(std::span<const float> x, int k, std::vector<float>& scratch);

// --- the selector ------------------------------------------------------------------

// The per-sequence selector. select() may run concurrently for different
// (layer, KV head) rows: with int8 bounds each row owns its codes, which it
// extends as blocks are sealed (checking each cached entry's block id
// against the table, so a copied or replaced block is re-read); its other
// scratch is per thread. on_slots_changed drops what a truncation or a
// compaction changed.
class quest_selector final : public kv_read_selector {
 public:
  quest_selector(const quest_params& params, int n_layers, int n_kv_heads, int head_dim);
  // REQUIRES: q.k; q.kv for a selection (without a backend: false).
  bool select(const kv_select_query& q, std::vector<slot_range>& out) override;
  void on_slots_changed(int n_kv, bool kept) override;
  std::size_t memory_bytes() const override;

 private:
  struct row {
    int block_size = 0;
    std::vector<block_id> ids;           // [cached]: the table's block at each index when encoded
    std::vector<std::int8_t> codes;      // [cached][per_block_]: int8 codes, or int4 nibbles
    std::vector<quest_block8> blocks;    // [cached]
    std::vector<float> channel_scale;    // int4: [head_dim], set with the first codes
    int scales_blocks = 0;               // int4: the blocks channel_scale was taken from
  };
  // Bounds of blocks [c0, c_end) into the thread's scratch; returns where the
  // blocks with a bound end (<= c_end: the first block without a summary).
  int coded_bounds(const kv_select_query& q, int c0, int c_end);
  // Extends r's codes to the blocks [r.ids.size(), c_end) that have a summary.
  void encode_new_blocks(const kv_select_query& q, row& r, int c_end);
  int f32_bounds(const kv_select_query& q, int c0, int c_end);

  quest_params params_;
  int n_kv_heads_ = 0;
  int padded_dim_ = 0;        // of the codes: quest_padded_dim or quest4_padded_dim
  std::size_t per_block_ = 0;  // code bytes per block
  std::vector<row> rows_;  // [n_layers][n_kv_heads]
};

}  // namespace pagoda
