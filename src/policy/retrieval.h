// Retrieval attention (RetrievalAttention, MagicPIG): the kv_policy
// `retrieval`. Nothing is evicted; each decode step reads, per (layer, KV
// head), the sinks, the recent window and the top-k keys of each query row of
// the head's group, and attends to exactly those slots
// (attention/gather_attention.h).
//
//   --kv-policy retrieval[:index=auto|exact|ivfpq|hnsw,k=128,sinks=4,recent=64,...]
//
// Parameters (kv_policy_spec):
//   index        auto (default): IVF-PQ from auto_min sealed slots; below it
//                the exact top-k up to exact_max slots, full attention past
//                that; exact: always the exact top-k (no index);
//                ivfpq (faiss IVF-PQ) or hnsw (hnswlib) from the start
//   auto_min     index=auto: the sealed slots at which a layer's IVF-PQ index
//                starts being built (default 16384, bench/RESULTS.md
//                "Retrieval attention"); at least `train`
//   exact_max    when more candidate slots than this are not in an index
//                (below auto_min, or while the index is being built), the
//                step reads everything: on this machine the exact top-k costs
//                more than full attention at every length measured (default
//                1024; index=exact ignores it)
//   k            keys per query row: a count ("128", the default) or a
//                fraction of the slots the query sees ("0.01", "1%")
//   sinks        the first live slots, always read (default 4)
//   recent       the newest slots, always read (default 64)
//   max_tokens   steps with more query tokens than this read everything
//                (prompt chunks; default 8, enough for speculative drafts)
//   background   1 (default): indexes are built on a thread of the selector's
//                own; 0: inline in on_layer_written (tests, measurements)
//   recall_every every Nth index search also computes the exact top-k over
//                the same keys and counts |ANN ∩ exact| (recall()); 0: never
//                (default 4096: a sample decodes every indexed key of the
//                head from the view, more than a full read of its K; that is
//                once per 16 steps of a 32-layer, 8-KV-head model)
//   m, ef_construction, ef_search            hnsw (retrieval_index.h)
//   nlist, pq_m, nbits, nprobe, train        ivfpq and auto (retrieval_index.h)
//
// The exact top-k: q.k of every candidate key of the sequence's SEALED (full)
// blocks, read from the KV tiles by the codec's own qk kernel (what full
// attention scores with), so it is exact for every KV type; then, per query
// row, the keys at or above the k-th largest maximum of 16-slot groups, and
// the k best of those (ties to the smaller slot). Slots past the last full block are always read, as part of the
// recent window. Beside it, on_layer_written keeps a token-major f16 copy of
// the sealed keys as blocks fill (decoded through the view's codec, at most
// 128 slots per layer and call, so a long cached prompt's first step does
// not copy it all; an index starts when the copy reaches its start): the
// builder's source, and gather_attention's for scattered keys (key_rows_of)
// when every value is f16-exact.
//
// An index is built beside the exact path, never in front of it. A layer
// whose index kind is on (hnsw from the first sealed block, ivfpq from
// `train` copied slots, auto from auto_min) hands its copied blocks
// to a background thread in order; a (layer, KV head)'s index covers slots
// [0, indexed_end(layer, kv_head)), and select() takes the index's top-k over
// that part and the exact top-k over the sealed slots past it (or, past
// exact_max of those, reads everything), so a block is never missed between
// the two, and the first token after a long prompt waits for no index.
// IVF-PQ is trained once per (layer, KV head) on `train` keys sampled evenly
// from the keys copied when it starts, on a private index that is published
// when built; later blocks are added to the trained lists (no retraining: the
// lists drift as later keys move, which the sampled recall shows). A
// compaction (on_slots_changed with kept = false) drops indexes and training.
//
// Memory: once a (layer, KV head)'s IVF-PQ index holds a chunk of 256 slots,
// the f16 copy of that chunk is released (IVF-PQ codes instead of the copy);
// gather_attention then scores that head's selected keys from the KV tiles.
// The exact path and HNSW keep the copy, which key_rows_of hands to
// gather_attention when the keys are f16-exact and the copy is whole.
//
// select() returns false (read everything) for steps of more than max_tokens
// query tokens. When k reaches the candidate slots, every slot is read without
// a search, so retrieval with k >= the context length is full attention. The
// top-k ranks raw q.k: soft-capping is monotone and does not change it; a
// merged entry's bias (kv_backend.h) is not seen.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "attention/kv_selector.h"
#include "pagoda/status.h"
#include "policy/kv_policy.h"
#include "policy/retrieval_index.h"

namespace pagoda {

enum class retrieval_index_kind : std::uint8_t { auto_, exact, ivfpq, hnsw };

struct retrieval_params {
  retrieval_index_kind index = retrieval_index_kind::auto_;
  int auto_min = 16384;     // index=auto: sealed slots from which IVF-PQ is built
  int exact_max = 1024;     // more candidates than this outside the index: read everything
  int k_tokens = 128;       // keys per query row, when > 0
  double k_fraction = 0.0;  // else this fraction of the visible slots
  int sinks = 4;
  int recent = 64;
  int max_tokens = 8;
  bool background = true;
  int recall_every = 4096;
  hnsw_params hnsw;
  ivfpq_params ivfpq;
  // Tests and benches: the index each (layer, KV head) builds, in place of
  // the kind's (not parsed; nullptr: the kind's).
  std::unique_ptr<key_index> (*make_index)(int head_dim) = nullptr;

  // Keys per query row at n_kv slots: at least 1.
  int resolve_k(int n_kv) const;
  // The sealed slots at which a layer's index starts (INT_MAX: never).
  int index_from() const;
};

// Errors name the parameter and what it accepts ("retrieval: unknown
// parameter 'ef'; known: index, k, ...", "retrieval: ef_search applies to
// index=hnsw").
result<retrieval_params> parse_retrieval_params(const kv_policy_spec& spec);

// What the sampled recall estimate has counted (kv_selector.h): over the
// sampled searches, `found` of the exact top-k's `wanted` slots were among the
// index's results (recall = found / wanted); `searches`, sampled or not.
using retrieval_recall = index_recall;

class retrieval_builder;  // retrieval_build.cpp: the background thread

// The selector of one sequence: per (layer, KV head) a key copy and an index.
// Threads: on_layer_written, on_slots_changed and the destructor on the
// forward thread; select() concurrently for different KV heads, never during
// those; the builder thread beside all of them (it reads key copies under
// copy_mu_ and publishes into an index under that index's mutex).
class retrieval_selector final : public kv_read_selector {
 public:
  // With ivfpq, a pq_m that does not divide head_dim becomes the largest
  // divisor of head_dim below it (the model is not known when params are parsed).
  retrieval_selector(const retrieval_params& p, int n_layers, int n_kv_heads, int head_dim);
  ~retrieval_selector() override;

  void on_layer_written(int layer, const paged_kv_view& k, std::span<const std::int32_t> kv_pos, int n_kv) override;
  bool select(const kv_select_query& q, std::vector<slot_range>& out) override;
  key_rows key_rows_of(int layer, int kv_head) const override;
  std::size_t memory_bytes() const override;
  void on_slots_changed(int n_kv, bool kept) override;

  // Slots [0, sealed_end(layer)) are in the layer's key copies (a block boundary).
  int sealed_end(int layer) const { return layers_[layer].sealed_end; }
  // Slots [0, indexed_end(layer, h)) are in that index (dead ones excepted);
  // the builder moves it forward concurrently.
  int indexed_end(int layer, int kv_head) const;
  // Keys in (layer, kv_head)'s index.
  int index_size(int layer, int kv_head) const;
  // Blocks until the builder has nothing queued or in flight (tests, benches).
  void wait_built();
  // The sampled recall of the index searches so far (a counter pair).
  retrieval_recall recall() const;
  // "ivfpq" (index=auto or ivfpq), "hnsw"; none for index=exact.
  std::string_view index_name() const override;
  index_recall sampled_recall() const override { return recall(); }
  // The first index error, if any: the layer it hit reads everything since.
  status error_status() const;

 private:
  friend class retrieval_builder;
  struct head_state;  // retrieval_selector.cpp
  struct layer_state {
    int sealed_end = 0;   // the key copies hold [0, sealed_end)
    int queued_end = 0;   // blocks below were handed to the builder
    bool exact_copy = true;  // every copied value equals the view's: key_rows_of may hand it out
    std::vector<std::uint8_t> live;  // [sealed_end]: the slot's position is >= 0 (copy_mu_)
    std::atomic<bool> failed{false};  // an index add failed: the layer reads everything
  };

  std::size_t row(int layer, int kv_head) const { return static_cast<std::size_t>(layer) * n_kv_heads_ + kv_head; }
  void copy_blocks(int layer, const paged_kv_view& k, std::span<const std::int32_t> kv_pos, int end);
  void release_indexed_chunks(int layer);
  void stop_builds();
  void requeue_from_indexes();
  void forget_from(int layer, int slot);
  // Exact top-k per query row over the copied keys of [lo, hi), appended.
  void exact_candidates(const kv_select_query& q, int k, int lo, int hi, std::vector<std::int32_t>& out) const;
  void sample_recall(const kv_select_query& q, const head_state& hs, int k, int lo, int hi) const;
  void fail(int layer, const status& s);

  retrieval_params params_;
  int n_layers_, n_kv_heads_, head_dim_;
  int block_size_ = 0;  // from the first view
  std::unique_ptr<layer_state[]> layers_;
  std::unique_ptr<head_state[]> heads_;  // [layer][kv head]
  std::vector<float> block_keys_;        // copy_blocks' scratch: [block_size][head_dim]
  mutable std::mutex copy_mu_;           // the copies' chunk lists: the forward thread changes, the builder reads
  mutable std::mutex error_mu_;
  status error_;
  mutable std::atomic<std::uint64_t> searches_{0}, recall_found_{0}, recall_wanted_{0};
  std::unique_ptr<retrieval_builder> builder_;  // started with the first index job
};

// An upper bound of a retrieval_selector's memory at n sealed slots
// (kv_side.h), per (layer, KV head): the f16 key copy in chunks of 256 rows
// (charged whole even where IVF-PQ released it: the exact path below auto_min
// holds it all); hnsw: its element records at a capacity that at most doubles
// past 1024, expected upper-level links twice over and the label map; ivfpq
// and auto: the coarse centroids and codebooks, each key's code and id at list
// capacities that at most double. Beside the rows: each layer's slot liveness
// and the builder's scratch (one head's keys of a job, f32, doubled; the
// training sample). A private index the builder has not published yet (an
// HNSW graph of a whole prompt, a training step) is not counted; the bound is
// checked against memory_bytes() by tests/policy/retrieval_side_test.cpp.
side_charge retrieval_side_memory(const retrieval_params& p, int n_layers, int n_kv_heads, int head_dim);

// The `retrieval` policy: no eviction, a retrieval_selector per sequence.
result<std::unique_ptr<kv_policy>> make_retrieval_policy(const kv_policy_spec& spec);

}  // namespace pagoda
