// One KV group: the layers of a model whose K/V are kept the same way share
// one block table per sequence, one block pool, one prefix index and one
// arena in the KV backend. The KV manager (kv_manager.h) is a coordinator
// over groups (vLLM v1's KVCacheCoordinator over its per-group managers): it
// owns sequences, tokens, positions, prefix keys, tenants and quotas, and
// asks each group what a step needs, allocates in all of them or none, and
// commits. Groups never see each other.
//
// Kinds (what a new kind implements is the two functions marked "kind"):
//   full            every position stays (full attention): today's path.
//   sliding_window  a query at position p sees p - window + 1 .. p, so a
//                   table entry whose every position is at or below
//                   next_position - window is freed (it becomes NULL, a
//                   block_id() entry) and its block, once full and keyed,
//                   stays in the group's prefix cache until evicted; a
//                   prefix hit needs only the blocks in its first query's
//                   window. Gemma 2/3 interleave such layers with full ones
//                   (llama.cpp's iSWA cache, vLLM's hybrid allocator); on
//                   Mistral v0.1 every layer slides.
// A draft model's layers (another layer count and head shape) would be one
// more full group with its own arena; layers that read one KV (cross-layer
// sharing) map to one group's slots in the backend.
//
// Block ids are global: group g owns [first_block(), first_block() +
// n_blocks()), and within that range each KV class (block_pool.h) a
// contiguous run. Tables, ops and the backend use global ids; the pool and
// the index inside use ids relative to first_block(). Every group of a
// manager has the same classes: the class of the blocks at a table index is
// the coordinator's rule, the same in every group.
//
// Invariants a group keeps (check_invariants with the tables of every sequence):
// - a block's ref count equals the number of table entries that hold it;
// - a sliding-window table's NULL entries are a prefix of it (everything
//   before the first entry a sequence still needs); full tables have none;
// - the prefix index holds exactly the hashed blocks, each full (fill).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kv/block_pool.h"
#include "kv/kv_metrics.h"
#include "kv/kv_ops.h"
#include "kv/prefix_index.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

enum class kv_group_kind : std::uint8_t { full, sliding_window };
const char* kv_group_kind_name(kv_group_kind kind);

struct kv_group_config {
  kv_group_kind kind = kv_group_kind::full;
  std::int32_t window_tokens = 0;          // sliding_window: a query at p sees positions p - window + 1 .. p
  std::vector<std::int32_t> class_blocks;  // [class]: blocks of each KV class (class 0: the default type)
  cache_eviction eviction = cache_eviction::lru;  // the order cached blocks leave in (block_pool.h)
};

// What a group needs of its coordinator.
class kv_group_host {
 public:
  virtual void emit(kv_op op) = 0;
  virtual const std::string& tenant_name(tenant_id t) const = 0;

 protected:
  ~kv_group_host() = default;
};

// A prompt's leading full blocks as a sequence with some tenant, salt and
// class runs keys them (slot k at position k): what a group looks up.
struct prefix_probe {
  std::span<const token_id> tokens;
  std::span<const block_key> keys;      // [blocks]: chained keys
  std::span<const block_key> parents;   // [blocks]
  std::span<const std::string> extras;  // [blocks]
  std::span<const std::uint8_t> classes;  // [blocks]: the class each block must be of
  tenant_id tenant;
  std::int32_t block_size = 0;
  std::size_t size() const { return keys.size(); }
};

class kv_group {
 public:
  kv_group(std::int32_t index, const kv_group_config& config, std::int32_t first_block, std::int32_t block_size,
           bool prefix_caching, kv_group_host& host);
  virtual ~kv_group() = default;
  kv_group(const kv_group&) = delete;
  kv_group& operator=(const kv_group&) = delete;

  // --- kind ------------------------------------------------------------------
  // The largest m <= max_blocks such that this group holds, in its prefix
  // cache, every block of probe's first m that a sequence continuing after
  // them still reads (full attention: all m; a window: those in the window
  // of the query at position m * block_size). A group never answers more
  // than max_blocks; 0 is always possible.
  virtual std::int32_t longest_cached_prefix(const prefix_probe& probe, std::int32_t max_blocks) const = 0;
  // The first table index a query at next_position or later still reads,
  // for a sequence whose first n_full blocks are full with these stored
  // positions (empty: slot k at position k). Entries before it may be freed.
  virtual std::int32_t first_needed_block(std::span<const std::int32_t> positions, std::int32_t n_full,
                                          std::int64_t next_position) const = 0;

  // --- identity --------------------------------------------------------------
  std::int32_t id() const { return id_; }
  kv_group_kind kind() const { return kind_; }
  std::int32_t window_tokens() const { return window_tokens_; }
  std::int32_t block_size() const { return block_size_; }
  std::int32_t first_block() const { return first_; }
  std::int32_t n_blocks() const { return pool_.n_blocks(); }
  bool owns(block_id b) const { return b.value >= first_ && b.value < first_ + pool_.n_blocks(); }
  std::int32_t class_of(block_id b) const { return pool_.class_of(local(b)); }
  const block_pool& pool() const { return pool_; }
  const prefix_index& index() const { return index_; }
  bool prefix_caching() const { return prefix_caching_; }

  // --- blocks ----------------------------------------------------------------
  std::int32_t ref_count(block_id b) const { return pool_.ref_count(local(b)); }
  bool is_hashed(block_id b) const { return pool_.is_hashed(local(b)); }
  tenant_id owner(block_id b) const { return pool_.owner(local(b)); }
  // Token slots written in b (the most any holder wrote).
  std::int32_t fill(block_id b) const { return fill_[static_cast<std::size_t>(local(b).value)]; }
  // Raises b's fill to n (a commit or a copy filled it); lowers it only when told (truncate, compaction).
  void set_fill(block_id b, std::int32_t n, bool may_lower = false);
  std::int64_t stored_tokens_in_used() const { return stored_tokens_in_used_; }

  // Whether d's blocks can be taken now (each class's free + evictable blocks).
  bool can_take(const class_demand& d) const;
  // One block of each class in `classes`, in that order, for tenant t. The
  // first n_own come from t's own cached blocks of that class where it has
  // some (a tenant at its quota pays with its own cache). REQUIRES: can_take.
  std::vector<block_id> take(tenant_id t, std::span<const std::int32_t> classes, std::int32_t n_own);
  void hold(block_id b);
  // One holder fewer; at ref 0 an unhashed block is reported released.
  void release(block_id b);
  // Releases every entry of the table, deepest first (so a cached chain's tail leaves first).
  void release_table(std::span<const block_id> table);

  // The block cached under the probe's block i, of the class and tenant it must have.
  std::optional<block_id> find(const prefix_probe& probe, std::size_t i) const;
  // Registers a full block b (held, unhashed) under key; reports it cached.
  // false when another block holds the key already (b stays unregistered).
  bool cache(block_id b, block_key key, block_key parent, std::span<const token_id> tokens, std::string_view extras,
             tenant_id tenant);
  // A used block leaves the prefix index without an eviction report (its holder
  // rewrites it; the commit hook saw its bytes when it entered).
  void unhash(block_id b);
  // Evicts cached (ref 0) blocks: all, one tenant's (both eviction_reason::admin),
  // or t's of least worth (block_pool::next_cached_of; eviction_reason::quota).
  std::int32_t evict_cached();
  std::int32_t evict_cached(tenant_id t);
  bool evict_next_cached_of(tenant_id t);

  // --- metrics ----------------------------------------------------------------
  std::int32_t peak_used() const { return peak_used_; }
  void reset_peak() { peak_used_ = pool_.n_used(); }
  std::int64_t n_evictions() const;
  std::int64_t n_evictions(eviction_reason r) const { return n_evictions_[static_cast<std::size_t>(r)]; }
  std::int64_t n_freed_out_of_window() const { return n_freed_out_of_window_; }
  void count_freed_out_of_window(std::int64_t n) { n_freed_out_of_window_ += n; }

  // Pool, index and accounting against the tables of every sequence: ref
  // counts, ownership by tenant, NULL entries (a prefix, sliding windows
  // only), fills at least what tables read, stored tokens, hashed = indexed.
  // tables: each sequence's table in this group, its tenant and stored slots.
  struct table_ref {
    std::int64_t seq = 0;
    tenant_id tenant;
    std::span<const block_id> table;
    std::int32_t n_stored = 0;
  };
  status check_invariants(std::span<const table_ref> tables) const;

 protected:
  block_id local(block_id b) const { return block_id(b.value - first_); }
  block_id global(block_id b) const { return block_id(b.value + first_); }
  // The place a cached block leaves the index: reports the eviction, erases, counts it under why.
  void forget_cached(block_id local_b, eviction_reason why);
  void drop_cached(block_id local_b, eviction_reason why);

  const std::int32_t id_;
  const kv_group_kind kind_;
  const std::int32_t window_tokens_;
  const std::int32_t first_;
  const std::int32_t block_size_;
  const bool prefix_caching_;
  kv_group_host& host_;
  block_pool pool_;
  prefix_index index_;
  std::vector<std::int32_t> fill_;  // [n_blocks] by local id
  std::int64_t stored_tokens_in_used_ = 0;
  std::int32_t peak_used_ = 0;
  std::array<std::int64_t, k_n_eviction_reasons> n_evictions_{};  // [eviction_reason]
  std::int64_t n_freed_out_of_window_ = 0;
};

// Full attention: every block of a prefix, every entry kept.
class full_attention_group final : public kv_group {
 public:
  using kv_group::kv_group;
  std::int32_t longest_cached_prefix(const prefix_probe& probe, std::int32_t max_blocks) const override;
  std::int32_t first_needed_block(std::span<const std::int32_t>, std::int32_t, std::int64_t) const override {
    return 0;
  }
};

// A sliding window of window_tokens() positions.
class sliding_window_group final : public kv_group {
 public:
  using kv_group::kv_group;
  std::int32_t longest_cached_prefix(const prefix_probe& probe, std::int32_t max_blocks) const override;
  std::int32_t first_needed_block(std::span<const std::int32_t> positions, std::int32_t n_full,
                                  std::int64_t next_position) const override;
};

std::unique_ptr<kv_group> make_kv_group(std::int32_t index, const kv_group_config& config, std::int32_t first_block,
                                        std::int32_t block_size, bool prefix_caching, kv_group_host& host);

}  // namespace pagoda
