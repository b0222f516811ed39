// Retrieval attention (RetrievalAttention, MagicPIG): the kv_policy
// `retrieval`. Nothing is evicted; each decode step reads, per (layer, KV
// head), the sinks, the recent window and the top-k keys an ANN index over
// that head's keys returns for each query row of the head's group, and
// attends to exactly those slots (attention/gather_attention.h).
//
//   --kv-policy retrieval[:index=hnsw|ivfpq|exact,k=128,sinks=4,recent=64,...]
//
// Parameters (kv_policy_spec):
//   index        hnsw (default; hnswlib), ivfpq (faiss IVF-PQ) or exact
//                (brute force: the ground truth, for tests and measurements)
//   k            keys per query row: a count ("128", the default) or a
//                fraction of the slots the query sees ("0.01", "1%")
//   sinks        the first live slots, always read (default 4)
//   recent       the newest slots, always read (default 64)
//   max_tokens   steps with more query tokens than this read everything
//                (prompt chunks; default 8, enough for speculative drafts)
//   m, ef_construction, ef_search            hnsw (retrieval_index.h)
//   nlist, pq_m, nbits, nprobe, train        ivfpq (retrieval_index.h)
//
// The index of a (layer, KV head) holds the keys of the sequence's SEALED
// (full) blocks only, decoded through the view's codec, added in
// on_layer_written as blocks fill. Slots past the last full block are always
// read, as part of the recent window, so a key is never missed for not being
// indexed yet. select() returns false (read everything) for steps of more than
// max_tokens query tokens. Beside its index, each (layer, KV head) keeps a
// token-major f16 copy of the indexed keys (key_rows_of), from which
// gather_attention scores the retrieved keys one row each instead of reading
// their whole channel-major tiles; a layer whose decoded keys are not all
// f16-representable (quantized KV) keeps no copy and is scored from the tiles.
// When k reaches the number of indexed keys, every
// indexed slot is read without a search, so retrieval with k >= the context
// length is full attention. The top-k ranks raw q.k: soft-capping is monotone
// and does not change it; a merged entry's bias (kv_backend.h) is not seen.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "attention/kv_selector.h"
#include "pagoda/status.h"
#include "policy/kv_policy.h"
#include "policy/retrieval_index.h"

namespace pagoda {

enum class retrieval_index_kind : std::uint8_t { hnsw, ivfpq, exact };

struct retrieval_params {
  retrieval_index_kind index = retrieval_index_kind::hnsw;
  int k_tokens = 128;       // keys per query row, when > 0
  double k_fraction = 0.0;  // else this fraction of the visible slots
  int sinks = 4;
  int recent = 64;
  int max_tokens = 8;
  hnsw_params hnsw;
  ivfpq_params ivfpq;

  // Keys per query row at n_kv slots: at least 1.
  int resolve_k(int n_kv) const;
};

// Errors name the parameter and what it accepts ("retrieval: unknown
// parameter 'ef'; known: index, k, ...", "retrieval: ef_search applies to
// index=hnsw").
result<retrieval_params> parse_retrieval_params(const kv_policy_spec& spec);

// The selector of one sequence: an index per (layer, KV head).
class retrieval_selector final : public kv_read_selector {
 public:
  // With index=ivfpq, a pq_m that does not divide head_dim becomes the largest
  // divisor of head_dim below it (the model is not known when params are parsed).
  retrieval_selector(const retrieval_params& p, int n_layers, int n_kv_heads, int head_dim);

  void on_layer_written(int layer, const paged_kv_view& k, std::span<const std::int32_t> kv_pos, int n_kv) override;
  bool select(const kv_select_query& q, std::vector<slot_range>& out) override;
  key_rows key_rows_of(int layer, int kv_head) const override;
  std::size_t memory_bytes() const override;
  void on_slots_changed(int n_kv, bool kept) override;

  // Slots [0, indexed_end(layer)) are in the layer's indexes (dead ones excepted).
  int indexed_end(int layer) const { return indexed_end_[layer]; }
  const key_index& index(int layer, int kv_head) const { return *indexes_[row(layer, kv_head)]; }
  // The first index error, if any: the layer it hit reads everything since.
  const status& error_status() const { return error_; }

 private:
  std::size_t row(int layer, int kv_head) const { return static_cast<std::size_t>(layer) * n_kv_heads_ + kv_head; }
  void add_blocks(int layer, const paged_kv_view& k, std::span<const std::int32_t> kv_pos, int end);
  void copy_rows(int layer, int h, int b0, const float* keys, std::span<const std::int32_t> kv_pos);
  // Keeps the chunks of (layer, h)'s copy that hold rows below slot.
  void trim_rows(int layer, int h, int slot);
  void forget_from(int layer, int slot);
  // The index's top-k for each query row, within [lo, hi), sorted, unique.
  void candidates(const kv_select_query& q, int k, int lo, int hi, std::vector<std::int32_t>& out) const;

  retrieval_params params_;
  int n_layers_, n_kv_heads_, head_dim_;
  int block_size_ = 0;  // from the first view
  std::vector<std::unique_ptr<key_index>> indexes_;  // [layer][kv head]
  std::vector<int> indexed_end_;                      // [layer]: a block boundary
  std::vector<std::uint8_t> failed_;                  // [layer]: an add failed: read everything
  // The key copy of one (layer, KV head): [indexed_end][head_dim] f16, the
  // keys as decoded (dead slots zero), in chunks of 2^k_chunk_shift rows.
  // 256 rows: 64 KiB at head_dim 128, the least a (layer, KV head) holds
  // once a block is sealed (x 32 layers x 8 KV heads: 16 MiB).
  static constexpr int k_chunk_shift = 8;
  struct row_copy {
    std::vector<std::unique_ptr<std::uint16_t[]>> owned;
    std::vector<const std::uint16_t*> chunks;  // owned's, for key_rows
  };
  std::vector<row_copy> rows_;  // [layer][kv head]; emptied for a layer whose keys f16 does not hold exactly
  std::vector<std::uint8_t> rows_exact_;  // [layer]
  std::vector<float> block_keys_;         // add_blocks' scratch: [block_size][head_dim]
  std::vector<std::int32_t> block_slots_; // add_blocks' scratch: the block's live slots
  status error_;
};

// An upper bound of a retrieval_selector's memory at n indexed slots
// (kv_side.h), per (layer, KV head): the f16 key copy in chunks of 256 rows;
// hnsw: its element records at a capacity that at most doubles past 1024,
// expected upper-level links twice over and the label map; ivfpq: the training
// buffer (at most doubled), the coarse centroids and codebooks, each key's code
// and id at list capacities that at most double; exact: f32 keys and slots,
// doubled. The selector's own scratch is in the fixed part. Transient copies
// of a rebuild (hnsw) or a training step (ivfpq) are not counted; the bound is
// checked against memory_bytes() by tests/policy/retrieval_side_test.cpp.
side_charge retrieval_side_memory(const retrieval_params& p, int n_layers, int n_kv_heads, int head_dim);

// The `retrieval` policy: no eviction, a retrieval_selector per sequence.
result<std::unique_ptr<kv_policy>> make_retrieval_policy(const kv_policy_spec& spec);

}  // namespace pagoda
