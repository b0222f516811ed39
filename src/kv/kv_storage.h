// The CPU KV backend (kv_backend.h): one arena per KV group (kv_arena.h),
// each over its group's layers and blocks, and the routing between them: a
// layer's writes and views go to its group's arena (with the group's own
// layer number), a block's ops to the arena that owns its id.
//
// A storage built from one layout is one group of every layer, exactly the
// classic paged KV cache: block ids 0 .. n_blocks - 1 in class order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kv/kv_arena.h"
#include "kv/kv_backend.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// One group's part of a storage: the model layers it holds (ascending, each
// layer in exactly one group) and its blocks per class.
struct kv_group_blocks {
  std::vector<int> layers;
  std::vector<std::int64_t> class_blocks;  // [class]
  // Non-empty: the group holds another model's KV (a draft model's), of
  // its own shape: its class layouts over that model's layers, and `layers`
  // numbers that model's layers (0 .. n - 1). The storage's layer routing
  // (write, k_view by layer) never reaches it; that model reads and writes
  // it through a kv_group_backend. Block ops route by block id as for any group.
  std::vector<kv_layout> own_classes;
};

class kv_storage final : public kv_backend {
 public:
  // class_layouts[c]: class c's formats over every model layer (class 0 the
  // default; all of one shape). Groups in order: ids follow group order, and
  // within a group class order. Each group maps n_staging_slots staging
  // slots when one of its formats is sealed. Every group's tiles are backed
  // as `memory` says (kv_arena.h).
  // Errors: a bad layout, a class whose shape differs, a group or class
  // without blocks, layers not split exactly once among the groups, memory
  // that cannot be mapped.
  static result<std::unique_ptr<kv_storage>> create(std::span<const kv_layout> class_layouts,
                                                    std::span<const kv_group_blocks> groups,
                                                    std::int64_t n_staging_slots = 1, kv_pool_memory memory = {});
  // One group of every layer: n_blocks of class 0 (layout), then each extra class's.
  static result<std::unique_ptr<kv_storage>> create(const kv_layout& layout, std::int64_t n_blocks,
                                                    std::int64_t n_staging_slots = 1,
                                                    std::span<const kv_class_spec> extra_classes = {},
                                                    kv_pool_memory memory = {});
  ~kv_storage() override;
  kv_storage(const kv_storage&) = delete;
  kv_storage& operator=(const kv_storage&) = delete;

  const kv_layout& layout() const override { return layout_; }
  std::int64_t n_blocks() const override { return n_blocks_; }
  int n_groups() const override { return static_cast<int>(arenas_.size()); }
  int layer_group(int layer) const override { return layer_group_[static_cast<std::size_t>(layer)]; }
  int group_of(block_id b) const override;
  int block_class(block_id b) const override { return arena_of(b).block_class(b); }
  const kv_layout& block_layout(block_id b) const override {
    const kv_arena& a = arena_of(b);
    return a.class_layout(a.block_class(b));
  }
  // Group g's arena (its layout, classes, first block and staging).
  const kv_arena& arena(int g) const { return *arenas_[static_cast<std::size_t>(g)]; }
  kv_arena& arena(int g) { return *arenas_[static_cast<std::size_t>(g)]; }
  // Whether group g holds another model's KV (kv_group_blocks::own_classes).
  bool foreign_group(int g) const { return foreign_[static_cast<std::size_t>(g)] != 0; }
  // Classes of group 0 (every group has the same).
  int n_classes() const { return arenas_.front()->n_classes(); }
  // Every byte this storage holds: tiles, staging slots, static parameters, key summaries.
  std::size_t total_bytes() const;
  // Staging slots of every group together.
  kv_staging_stats staging() const;

  void write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k, const float* v) override;
  void merge_write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k, const float* v,
                   const float* prod_k, const float* prod_v) override;
  void attach_merge(int layer, paged_kv_view& k, paged_kv_view& v) const override;
  paged_kv_view k_view(int layer, std::span<const block_id> blocks, int n_slots) const override;
  paged_kv_view v_view(int layer, std::span<const block_id> blocks, int n_slots) const override;
  void copy_block(block_id src, block_id dst, int n_tokens) override;
  void truncate_block(block_id b, int n_tokens) override;
  void release_block(block_id b) override;
  void hold_staging(block_id b) override;
  void end_holds() override;
  void read_block(block_id b, std::span<std::byte> out) const override;
  status write_block(block_id b, std::span<const std::byte> in) override;
  std::optional<key_summary> key_summary_of(block_id b, int layer, int head) const override;
  void gather(const kv_gather& g, const key_rotation& rotate) override;
  // The per-slot bias of block b's slots for (model layer, head): [block_size],
  // or nullptr when the block has none (tests, tools).
  const float* bias_of(block_id b, int layer, int head) const;

 private:
  kv_storage() = default;
  kv_arena& arena_of(block_id b) { return *arenas_[static_cast<std::size_t>(group_of(b))]; }
  const kv_arena& arena_of(block_id b) const { return *arenas_[static_cast<std::size_t>(group_of(b))]; }
  kv_arena& arena_of_layer(int layer) { return *arenas_[static_cast<std::size_t>(layer_group(layer))]; }
  const kv_arena& arena_of_layer(int layer) const { return *arenas_[static_cast<std::size_t>(layer_group(layer))]; }
  int local_layer(int layer) const { return layer_index_[static_cast<std::size_t>(layer)]; }

  kv_layout layout_;
  std::int64_t n_blocks_ = 0;
  std::vector<std::unique_ptr<kv_arena>> arenas_;  // [group]
  std::vector<std::uint8_t> foreign_;             // [group]: another model's KV
  std::vector<int> layer_group_;  // [model layer]: its group
  std::vector<int> layer_index_;  // [model layer]: its layer number within its group
};

// One foreign group of a storage (kv_group_blocks::own_classes) as the KV
// backend of the model it belongs to: that model's layers are the group's,
// its one KV group is this one, block ids are the storage's. Block ops go to
// the storage. REQUIRES: the storage outlives it.
class kv_group_backend final : public kv_backend {
 public:
  kv_group_backend(kv_storage& storage, int group);

  const kv_layout& layout() const override { return arena().class_layout(0); }
  std::int64_t n_blocks() const override { return storage_.n_blocks(); }
  // Blocks of other groups are not this model's: -1 (the forward pass refuses them).
  int group_of(block_id b) const override { return arena().owns(b) ? 0 : -1; }
  int block_class(block_id b) const override { return storage_.block_class(b); }
  const kv_layout& block_layout(block_id b) const override { return storage_.block_layout(b); }
  void write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k, const float* v) override;
  paged_kv_view k_view(int layer, std::span<const block_id> blocks, int n_slots) const override;
  paged_kv_view v_view(int layer, std::span<const block_id> blocks, int n_slots) const override;
  void copy_block(block_id src, block_id dst, int n_tokens) override { storage_.copy_block(src, dst, n_tokens); }
  void truncate_block(block_id b, int n_tokens) override { storage_.truncate_block(b, n_tokens); }
  void release_block(block_id b) override { storage_.release_block(b); }
  void read_block(block_id b, std::span<std::byte> out) const override { storage_.read_block(b, out); }
  status write_block(block_id b, std::span<const std::byte> in) override { return storage_.write_block(b, in); }
  std::optional<key_summary> key_summary_of(block_id b, int layer, int head) const override;
  void gather(const kv_gather& g, const key_rotation& rotate) override;

 private:
  const kv_arena& arena() const { return storage_.arena(group_); }
  kv_arena& arena() { return storage_.arena(group_); }
  kv_storage& storage_;
  int group_;
};

}  // namespace pagoda
