// The CPU KV backend (kv_backend.h): per layer, one arena of K tiles and one of
// V tiles, indexed by block id. A block holds block_size tokens of every layer.
// Tile address: arena(layer, K|V) + (head * n_blocks + block) * tile_bytes:
// head-major, so one head's tiles of consecutive block ids are adjacent and
// attention over a sequence whose blocks were allocated in order streams
// through memory (in this VM, scattered 4 KiB reads run at half the speed of
// sequential ones).
// Each layer's K and V have their own format (type and scale granularity).
//
// Block classes (kv_backend.h): each class has arenas of its own, laid out as
// above over its own blocks (tile index = block id - the class's first block),
// so a class's tiles are as contiguous as a one-class pool's. Per block the
// storage keeps its class ([n_blocks] bytes) and, per layer and role, one
// paged_kv_class per class that views point at (built once at create). With
// one class views carry no class arrays and every path is the one-class one.
// Per-slot biases and key summaries do not depend on formats: one array over
// every block serves all classes.
//
// Windowed layers (kv_window_layout): a sliding-window layer may keep its
// tiles in a smaller arena of window slots instead, indexed by the slot the
// KV manager bound to the block (kv_backend::bind_window; window_slots.h).
// Reading or writing such a layer's tiles of a block that holds no slot is a
// broken invariant, asserted.
//
// Staging slots (sealed formats, see kv_backend.h):
//   - A slot holds an f16 copy of one block of every sealed tensor (all layers,
//     K and/or V) of its block's class: bytes = the largest
//     kv_layout::staging_bytes_per_slot() over the classes, so any slot serves
//     a block of any class. Sealed tensors are numbered per class.
//   - Slots are bound to blocks lazily: the first write into a block (at its
//     first slot) takes a slot; sealing releases it, and so do release_block()
//     and a copy or write of a whole block.
//   - create() maps every slot up front, so a write never maps memory. A
//     sequence holds at most two at once: its open block, and while a chunk
//     that fills it is written layer by layer, the next open block (later
//     layers seal the first). The engine maps two per --max-num-seqs
//     sequence (k_staging_slots_per_sequence). Running out is a broken
//     invariant (more open blocks than that), asserted with a message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kv/kv_backend.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// Staging slots one sequence may hold at once (see above).
inline constexpr std::int64_t k_staging_slots_per_sequence = 2;

// Which layers keep their K/V in window slots, and how many slots.
struct kv_window_layout {
  std::vector<std::uint8_t> layers;  // [n_layers] 1: windowed; empty: none
  std::int64_t n_slots = 0;
  bool any() const;
  // Bytes of one window slot (the windowed layers' K and V tiles of one block).
  std::size_t slot_bytes(const kv_layout& layout) const;
};

struct kv_staging_stats {
  std::int64_t slots_mapped = 0;
  std::int64_t slots_in_use = 0;
  std::int64_t peak_slots_in_use = 0;
  std::size_t bytes_mapped = 0;
};

class kv_storage final : public kv_backend {
 public:
  // Maps (lazily zeroed) memory for n_blocks blocks of class 0 (layout), then
  // each extra class's blocks, and, when a format of any class is sealed,
  // n_staging_slots staging slots (at least 1, at most n_blocks()).
  // Errors: a bad layout; an extra class whose shape differs from layout's
  // or that has no block (invalid_argument); extra classes together with
  // window slots (unsupported).
  static result<std::unique_ptr<kv_storage>> create(const kv_layout& layout, std::int64_t n_blocks,
                                                    std::int64_t n_staging_slots = 1,
                                                    const kv_window_layout& windows = {},
                                                    std::span<const kv_class_spec> extra_classes = {});
  ~kv_storage() override;
  kv_storage(const kv_storage&) = delete;
  kv_storage& operator=(const kv_storage&) = delete;

  const kv_layout& layout() const override { return classes_[0].layout; }
  std::int64_t n_blocks() const override { return n_blocks_; }
  int n_classes() const override { return static_cast<int>(classes_.size()); }
  const kv_layout& class_layout(int c) const override { return classes_[c].layout; }
  std::int64_t class_first_block(int c) const override { return classes_[c].first_block; }
  std::int64_t class_n_blocks(int c) const override { return classes_[c].n_blocks; }
  int block_class(block_id b) const override { return block_class_.empty() ? 0 : block_class_[b.value]; }
  // Every byte this storage holds: tiles, staging slots, static parameters, key summaries.
  std::size_t total_bytes() const;
  kv_staging_stats staging() const;

  void write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k, const float* v) override;
  paged_kv_view k_view(int layer, std::span<const block_id> blocks, int n_slots) const override;
  paged_kv_view v_view(int layer, std::span<const block_id> blocks, int n_slots) const override;
  void copy_block(block_id src, block_id dst, int n_tokens) override;
  void truncate_block(block_id b, int n_tokens) override;
  void release_block(block_id b) override;
  void bind_window(block_id b, std::int32_t slot) override;
  void read_block(block_id b, std::span<std::byte> out) const override;
  status write_block(block_id b, std::span<const std::byte> in) override;
  std::optional<key_summary> key_summary_of(block_id b, int layer, int head) const override;
  void gather(const kv_gather& g, const key_rotation& rotate) override;
  // The per-slot bias of block b's slots for (layer, head): [block_size], or
  // nullptr when the block has none (tests, tools).
  const float* bias_of(block_id b, int layer, int head) const;

 private:
  struct tensor {
    std::byte* data = nullptr;
    std::size_t size_bytes = 0;
    std::size_t tile_bytes = 0;
    const kv_codec* codec = nullptr;
    kv_format format;
    int cls = 0;            // the block class it belongs to
    int sealed_index = -1;  // position among its class's sealed tensors; -1: not sealed
    bool windowed = false;  // tiles indexed by window slot, not block id
    std::int64_t first_block = 0;  // the class's first block id: tile index = block id - first_block
    std::int64_t n_tiles = 0;  // per KV head: the class's blocks, or the window slots
    std::vector<float> static_values;               // [2][n_kv_heads][head_dim]: scales, offsets
    std::vector<kv_static_params> static_params;    // [n_kv_heads]
    const kv_static_params* params(int head) const { return static_params.empty() ? nullptr : &static_params[head]; }
  };
  // One block class: blocks [first_block, first_block + n_blocks) in layout's formats.
  struct block_class_data {
    kv_layout layout;
    std::int64_t first_block = 0;
    std::int64_t n_blocks = 0;
    std::vector<tensor> k;  // [n_layers]
    std::vector<tensor> v;  // [n_layers]
    int n_sealed = 0;       // sealed tensors of this class
  };
  kv_storage() = default;
  status add_class(const kv_layout& layout, std::int64_t n_blocks, const kv_window_layout& windows);
  status init_tensor(tensor& t, const kv_format& fmt, int layer, bool windowed);
  void build_view_classes();
  // Block b's tensor of (layer, role).
  tensor& k_of(block_id b, int layer) { return classes_[block_class(b)].k[layer]; }
  tensor& v_of(block_id b, int layer) { return classes_[block_class(b)].v[layer]; }
  const tensor& tensor_of(block_id b, int layer, kv_role role) const {
    const block_class_data& c = classes_[block_class(b)];
    return role == kv_role::key ? c.k[layer] : c.v[layer];
  }
  // Slots [t0, t0 + run) of one block of one tensor; x is [run][n_kv_heads][head_dim].
  void write_run(tensor& a, int layer, block_id b, int t0, int run, const float* x);
  paged_kv_view view(int layer, kv_role role, std::span<const block_id> blocks, int n_tokens) const;
  std::byte* tile(const tensor& t, block_id b, int head) const;
  // Fills slot `slot`'s f16 staging of tensor t with the first n tokens decoded from its tile.
  void stage_from_tile(tensor& t, block_id b, std::int32_t slot, int n);
  // Key summaries: [n_blocks][n_layers][n_kv_heads][3][head_dim], and which (block, layer) hold one.
  void summarize(int layer, block_id b);
  void forget_summaries(block_id b);
  float* summary(block_id b, int layer, int head) const;

  // Compaction (kv_storage_gather.cpp).
  // Decodes row `head` of (layer, role) of the given slots of a table into
  // out (row stride `stride` floats), each in its block's class, from the
  // staged f16 copy where a block is staged.
  void decode_slots(int layer, kv_role role, std::span<const block_id> table, int head,
                    std::span<const std::int32_t> slots, float* out, std::size_t stride);
  // Slots [t0, t1) of block b of tensor t (layer `layer`) get rows
  // x[t1 - t0][n_kv_heads][head_dim]; slots below t0 keep what they hold.
  void rewrite_block(tensor& t, int layer, block_id b, int t0, int t1, const float* x);
  void gather_layer(const kv_gather& g, int layer, const key_rotation& rotate);
  float* bias_at(block_id b, int layer, int head) const;
  void clear_bias(block_id b);

  // Staging slots.
  std::byte* slot_data(std::int32_t slot) const;
  std::byte* staged_tile(std::int32_t slot, int sealed_index, int head) const;
  std::int32_t acquire_slot(block_id b);
  void release_slot(std::int32_t slot);

  std::int64_t n_blocks_ = 0;  // over every class
  std::vector<block_class_data> classes_;  // [n classes]; class 0 is the default layout
  // With more than one class: [n_blocks] each block's class, and
  // [n_layers][2 (K, V)][n classes] what views point at. Empty with one.
  std::vector<std::uint8_t> block_class_;
  std::vector<paged_kv_class> view_classes_;

  int slot_stride_ = 0;              // fills per staging slot: the most sealed tensors of a class
  std::size_t staged_tile_bytes_ = 0;  // one head's f16 tile
  std::size_t slot_bytes_ = 0;
  std::int64_t n_slots_ = 0;
  std::byte* staging_ = nullptr;   // [n_slots_][slot_bytes_]
  std::vector<std::int32_t> block_slot_;  // [n_blocks]: slot or -1
  std::vector<std::int32_t> slot_block_;  // [slots]: block or -1
  std::vector<std::int32_t> slot_fill_;   // [slots][slot_stride_]: tokens staged per sealed tensor of
                                          // the slot's block's class (block_size: sealed)
  std::vector<std::int32_t> free_slots_;
  std::int64_t slots_in_use_ = 0;
  std::int64_t peak_slots_in_use_ = 0;
  std::vector<float> gather_;  // write scratch: [block_size][head_dim]
  float* summaries_ = nullptr;            // [n_blocks][n_layers][n_kv_heads][3][head_dim], or null
  std::size_t summaries_bytes_ = 0;
  std::vector<std::uint8_t> summarized_;  // [n_blocks][n_layers]
  // Per-slot biases (merged entries): [n_layers][n_blocks][n_kv_heads][block_size],
  // mapped lazily; has_bias_[layer * n_blocks + block] says where any is set.
  float* bias_ = nullptr;
  std::size_t bias_bytes_ = 0;
  std::vector<std::uint8_t> has_bias_;
  bool any_bias_ = false;  // some block ever had a bias: views carry the arrays
  // Window slots: [n_blocks] the slot of each block (-1: none), [slots] the block of each.
  std::int64_t n_window_slots_ = 0;
  std::vector<std::int32_t> window_slot_;
  std::vector<std::int32_t> window_block_;
};

}  // namespace pagoda
