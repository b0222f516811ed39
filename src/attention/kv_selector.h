// Sparse reads: which KV slots a step's queries read (query-aware policies such
// as Quest's top-k pages and retrieval attention). The forward pass asks a
// sequence's selector, per layer and KV head, after the step's K/V are written
// and the queries exist; attention then reads only the chosen slots (plus
// nothing else: a selector includes the sinks and the newest slots itself).
// The KV is not changed: a sparse read is not lossy for the cache, only for
// the step that read it.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kv/kv_backend.h"

namespace pagoda {

// Slots [begin, end) of a sequence's table.
struct slot_range {
  std::int32_t begin = 0;
  std::int32_t end = 0;
  friend bool operator==(const slot_range&, const slot_range&) = default;
};

// Token-major copies of one KV head's keys, for reading scattered keys a row
// at a time: a channel-major key tile (one SIMD lane per token) costs its
// whole 4 KiB for any one of its keys. Row s is slot s's key exactly as the
// view decodes it (every value f16-representable), or zeros for a dead slot.
// Rows are held in chunks of 2^chunk_shift, so that a growing copy never
// moves (a doubling vector would copy the whole copy inside a decode step).
struct key_rows {
  const std::uint16_t* const* chunks = nullptr;  // [chunk] -> [1 << chunk_shift][head_dim] f16
  int chunk_shift = 0;
  int n_slots = 0;  // rows of slots [0, n_slots) are held
  // REQUIRES: 0 <= s < n_slots.
  const std::uint16_t* row(std::int32_t s, int head_dim) const {
    return chunks[s >> chunk_shift] + static_cast<std::size_t>(s & ((1 << chunk_shift) - 1)) * head_dim;
  }
};

// What a selector may look at when it chooses for one (layer, KV head).
struct kv_select_query {
  int layer = 0;
  int kv_head = 0;
  const paged_kv_view* k = nullptr;  // the sequence's keys of this layer (stored + this step's)
  // The backend k was taken from, for per-block key summaries
  // (kv_backend::key_summary_of; Quest); nullptr when there is none.
  const kv_backend* kv = nullptr;
  std::span<const std::int32_t> kv_pos;  // [n_kv] stored positions of the slots
  int n_kv = 0;                       // slots the step's queries can see at most
  // The step's query rows of this KV head's group, pre-scaled by the attention
  // scale: row (i * n_rep + j) is query token i, query head kv_head * n_rep + j.
  const float* q = nullptr;           // [n_rows][head_dim]
  int n_rows = 0;
  int n_rep = 1;
  int head_dim = 0;
  std::span<const std::int32_t> q_pos;  // [n_rows / n_rep] positions of the query tokens
};

// What attention read against what it could have read, summed over query
// rows, layers and KV heads: one "row" is one query token of one layer and KV
// head. A row sees the slots at or before its own (its layer's window, if
// any); it reads all of them, or the ones its sequence's selector chose. Blocks
// count the blocks of `block_size` slots those slots lie in. A sparse read's
// saving is 1 - read / visible (Prometheus pagoda:kv_read_*_total, batch's
// summary, perplexity's "read").
struct kv_read_counts {
  std::int64_t rows = 0;
  std::int64_t tokens_visible = 0;
  std::int64_t tokens_read = 0;
  std::int64_t blocks_visible = 0;
  std::int64_t blocks_read = 0;

  kv_read_counts& operator+=(const kv_read_counts& o) {
    rows += o.rows;
    tokens_visible += o.tokens_visible;
    tokens_read += o.tokens_read;
    blocks_visible += o.blocks_visible;
    blocks_read += o.blocks_read;
    return *this;
  }
  friend bool operator==(const kv_read_counts&, const kv_read_counts&) = default;
};

// Reads of prompt steps (a sequence still computing its prompt) and of
// decode steps (generating; a verification's rows included) apart: a prompt's
// rows see a triangle of tokens and would swamp the decode figures.
struct kv_read_stats {
  kv_read_counts prompt;
  kv_read_counts decode;
};

// What a selector's sampled recall check has counted (retrieval's indexes):
// over the sampled searches, `found` of the exact top-k's `wanted` slots were
// among the index's results; `searches` counts every index search. Counters
// only grow over a selector's life.
struct index_recall {
  std::uint64_t found = 0;
  std::uint64_t wanted = 0;
  std::uint64_t searches = 0;

  index_recall& operator+=(const index_recall& o) {
    found += o.found;
    wanted += o.wanted;
    searches += o.searches;
    return *this;
  }
  friend bool operator==(const index_recall&, const index_recall&) = default;
};

// The reads of one attention task: n_rows query rows, the last of them
// seeing slots [0, n_kv) and each earlier one a slot fewer (new tokens
// append), limited to the newest window_slots slots when window_slots > 0;
// they read every visible slot, or, when `sparse`, those in `ranges` (sorted,
// disjoint: kv_read_selector::select's contract).
kv_read_counts count_reads(int n_kv, int n_rows, int window_slots, int block_size, bool sparse,
                           std::span<const slot_range> ranges);

class kv_read_selector {
 public:
  virtual ~kv_read_selector() = default;
  // Once per layer, after the step's K/V of that layer are written and before
  // its attention (one thread): the sequence now has n_kv slots in k/v, whose
  // positions are kv_pos. A selector that indexes keys takes the new ones here.
  virtual void on_layer_written(int layer, const paged_kv_view& k, std::span<const std::int32_t> kv_pos, int n_kv) {}
  // Called concurrently for different KV heads of one layer. Fills `out` with
  // sorted, disjoint, non-empty ranges within [0, q.n_kv) and returns true,
  // or returns false to read every slot (short contexts, prompt chunks).
  // Causal and window masks still apply inside the chosen ranges.
  virtual bool select(const kv_select_query& q, std::vector<slot_range>& out) = 0;
  // The token-major key copies this selector holds for (layer, kv_head), if
  // any ({} otherwise). Valid until the next on_layer_written or
  // on_slots_changed; may be read concurrently with select().
  virtual key_rows key_rows_of(int layer, int kv_head) const { return {}; }
  // The bytes this selector holds (indexes), for memory accounting.
  virtual std::size_t memory_bytes() const { return 0; }
  // The kind of approximate index its searches use ("ivfpq", "hnsw"), and
  // their sampled recall so far; an empty name: it searches no index. The
  // name has static storage (a literal): the engine keeps views of it.
  virtual std::string_view index_name() const { return {}; }
  virtual index_recall sampled_recall() const { return {}; }
  // Called when slots were truncated or compacted away: the selector forgets
  // what it knew of slots >= n_kv (a rollback) or of everything (kept = false).
  virtual void on_slots_changed(int n_kv, bool kept) {}
};

}  // namespace pagoda
