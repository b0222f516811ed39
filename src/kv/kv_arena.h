// One KV group's storage (kv_storage.h holds one per group): per layer of the
// group, one arena of K tiles and one of V tiles, indexed by block id. A
// block holds block_size tokens of every layer of its group.
// Tile address: arena(layer, K|V) + (head * n_blocks + block) * tile_bytes:
// head-major, so one head's tiles of consecutive block ids are adjacent and
// attention over a sequence whose blocks were allocated in order streams
// through memory (in this VM, scattered 4 KiB reads run at half the speed of
// sequential ones).
// Each layer's K and V have their own format (type and scale granularity).
//
// Layers here are the group's own (0 .. n_layers - 1 of its layout); block ids
// are global (the group owns [first_block, first_block + n_blocks)).
//
// Block classes (kv_backend.h): each class has arenas of its own, laid out as
// above over its own blocks (tile index = block id - the class's first block),
// so a class's tiles are as contiguous as a one-class pool's. Per block the
// arena keeps its class and, per layer and role, one paged_kv_class per class
// that views point at (built once at create). With one class views carry no
// class arrays and every path is the one-class one. Per-slot biases and key
// summaries do not depend on formats: one array over every block of the
// group serves all classes.
//
// Staging slots (sealed formats, see kv_backend.h):
//   - A slot holds an f16 copy of one block of every sealed tensor (all layers
//     of the group, K and/or V) of its block's class: bytes = the largest
//     kv_layout::staging_bytes_per_slot() over the classes, so any slot serves
//     a block of any class. Sealed tensors are numbered per class.
//   - Slots are bound to blocks lazily: the first write into a block (at its
//     first slot) takes a slot; sealing releases it, and so do release_block()
//     and a copy or write of a whole block. A HELD block (hold_staging,
//     tentative slots) keeps its slot when sealed, with the staged f16 copy
//     whole beside the codes, until end_holds() or truncate_block() /
//     release_block() / write_block() of it.
//   - create() maps every slot up front, so a write never maps memory. A
//     sequence holds at most two at once: its open block, and while a chunk
//     that fills it is written layer by layer, the next open block (later
//     layers seal the first). A verification step holds no more: its last
//     token and k drafts span at most two blocks (the scheduler keeps
//     k + 1 <= block_size, scheduler::propose_drafts), and the holds of one
//     step end before the next step writes. The engine maps two per
//     --max-num-seqs sequence (k_staging_slots_per_sequence). Running out is
//     a broken invariant (more open blocks than that), asserted with a message.
//
// Tiles: every class's K and V tiles of every layer are one mapping
// (tile_memory()), each tensor at a page boundary. Lazily zeroed base pages
// by default; with kv_pool_memory::huge_pages, transparent huge pages
// faulted in whole by create() (see map_tiles in kv_arena.cpp for why that
// is not the default). Staging, biases, merge data and key summaries are
// mapped apart, in base pages, touched only where used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/anon_memory.h"
#include "kv/kv_backend.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// Staging slots one sequence may hold at once (see above).
inline constexpr std::int64_t k_staging_slots_per_sequence = 2;

// How an arena's tiles are backed (--kv-huge-pages).
struct kv_pool_memory {
  // Transparent huge pages (2 MiB on x86), faulted in whole when the arena is
  // created: attention's reads of the tiles take fewer TLB misses, and the
  // pages are found, zeroed and compacted at start instead of by the first
  // requests that write them; the whole pool is resident from the start.
  bool huge_pages = false;
  // With huge_pages: fault the tiles in at create. False: as written (for
  // benchmarks whose layouts map more layers than they use).
  bool fault_in = true;
};

struct kv_staging_stats {
  std::int64_t slots_mapped = 0;
  std::int64_t slots_in_use = 0;
  std::int64_t peak_slots_in_use = 0;
  std::size_t bytes_mapped = 0;
};

class kv_arena {
 public:
  // Maps zeroed memory for each class's blocks (classes[c].layout: the
  // group's layers; class 0 the default formats) from global id first_block
  // on, backed as `memory` says, and, when a format of any class is sealed,
  // n_staging_slots staging slots (at least 1, at most the blocks).
  // model_layers[l]: the model's number of the group's layer l (for rotate callbacks).
  // Errors: a bad layout; a class whose shape differs from class 0's or that
  // has no block (invalid_argument); memory that cannot be mapped
  // (resource_exhausted; huge pages the kernel does not give are not an
  // error: tile_memory().huge() says what was got).
  static result<std::unique_ptr<kv_arena>> create(std::span<const kv_class_spec> classes, std::int64_t first_block,
                                                  std::vector<int> model_layers, std::int64_t n_staging_slots = 1,
                                                  kv_pool_memory memory = {});
  ~kv_arena();
  kv_arena(const kv_arena&) = delete;
  kv_arena& operator=(const kv_arena&) = delete;

  const kv_layout& layout() const { return classes_[0].layout; }
  std::int64_t first_block() const { return first_block_; }
  std::int64_t n_blocks() const { return n_blocks_; }
  bool owns(block_id b) const { return b.value >= first_block_ && b.value < first_block_ + n_blocks_; }
  int n_classes() const { return static_cast<int>(classes_.size()); }
  const kv_layout& class_layout(int c) const { return classes_[c].layout; }
  // Class c's blocks: [class_first_block(c), class_first_block(c) + class_n_blocks(c)).
  std::int64_t class_first_block(int c) const { return classes_[c].first_block; }
  std::int64_t class_n_blocks(int c) const { return classes_[c].n_blocks; }
  int block_class(block_id b) const { return block_class_.empty() ? 0 : block_class_[at(b)]; }
  const std::vector<int>& model_layers() const { return model_layers_; }
  // Every byte this arena holds: tiles, staging slots, static parameters, key summaries.
  std::size_t total_bytes() const;
  // The one mapping that holds every class's tiles (rounded up to whole huge
  // pages when they were asked for), and what it got (huge()).
  const anon_memory& tile_memory() const { return tiles_; }
  kv_staging_stats staging() const;

  // kv_backend's operations, with the group's layer numbers.
  void write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k, const float* v);
  paged_kv_view k_view(int layer, std::span<const block_id> blocks, int n_slots) const;
  paged_kv_view v_view(int layer, std::span<const block_id> blocks, int n_slots) const;
  void copy_block(block_id src, block_id dst, int n_tokens);
  void truncate_block(block_id b, int n_tokens);
  void release_block(block_id b);
  void hold_staging(block_id b);
  void end_holds();
  void read_block(block_id b, std::span<std::byte> out) const;
  status write_block(block_id b, std::span<const std::byte> in);
  std::optional<key_summary> key_summary_of(block_id b, int layer, int head) const;
  void gather(const kv_gather& g, const kv_backend::key_rotation& rotate);
  // The per-slot bias of block b's slots for (layer, head): [block_size], or
  // nullptr when the block has none (tests, tools).
  const float* bias_of(block_id b, int layer, int head) const;
  // MiniCache (kv_merge.h): kv_backend's merge_write and attach_merge, and
  // block b's side data of merged layer `layer` for one KV head.
  void merge_write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k, const float* v,
                   const float* prod_k, const float* prod_v);
  void attach_merge(int layer, paged_kv_view& k, paged_kv_view& v) const;
  kv_merge_head merge_head(block_id b, int layer, int head) const;

 private:
  struct tensor {
    std::byte* data = nullptr;     // in tiles_
    std::size_t size_bytes = 0;
    std::size_t tile_bytes = 0;
    const kv_codec* codec = nullptr;
    kv_format format;
    int cls = 0;            // the block class it belongs to
    int sealed_index = -1;  // position among its class's sealed tensors; -1: not sealed
    std::int64_t first_block = 0;  // the class's first (global) block id: tile index = block id - first_block
    std::int64_t n_tiles = 0;      // per KV head: the class's blocks
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
  kv_arena() = default;
  // b's index among the group's blocks. REQUIRES: owns(b).
  std::size_t at(block_id b) const { return static_cast<std::size_t>(b.value - first_block_); }
  status add_class(const kv_layout& layout, std::int64_t n_blocks);
  status init_tensor(tensor& t, const kv_format& fmt, int layer);
  // Maps tiles_ and points every tensor's data into it.
  status map_tiles(const kv_pool_memory& memory);
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
  std::uint8_t& summarized(block_id b, int layer) { return summarized_[at(b) * layout().n_layers + layer]; }

  // Compaction (kv_arena_gather.cpp).
  // Decodes row `head` of (layer, role) of the given slots of a table into
  // out (row stride `stride` floats), each in its block's class, from the
  // staged f16 copy where a block is staged.
  void decode_slots(int layer, kv_role role, std::span<const block_id> table, int head,
                    std::span<const std::int32_t> slots, float* out, std::size_t stride);
  // Slots [t0, t1) of block b of tensor t (layer `layer`) get rows
  // x[t1 - t0][n_kv_heads][head_dim]; slots below t0 keep what they hold.
  void rewrite_block(tensor& t, int layer, block_id b, int t0, int t1, const float* x);
  void gather_layer(const kv_gather& g, int layer, const kv_backend::key_rotation& rotate);
  // A merged layer's side data of a gather's sources, by destination slot
  // i and head h (at i * n_kv_heads + h; own rows [n][n_kv_heads][head_dim]),
  // and its write into the destination blocks: ratios follow their slots,
  // retained tokens keep their own rows while their block has room (a block
  // that receives more merges the least divergent ones into k, v, the rows
  // about to be written). A folded entry keeps the ratios and own rows of
  // the kept token it stands for.
  struct merge_moves {
    std::vector<float> ratio_k, ratio_v, divergence, own_k, own_v;
  };
  merge_moves read_merge_moves(const kv_gather& g, int layer) const;
  void write_merge_moves(const kv_gather& g, int layer, const merge_moves& m, float* k, float* v);
  float* bias_at(block_id b, int layer, int head) const;
  std::uint8_t& has_bias(block_id b, int layer) { return has_bias_[static_cast<std::size_t>(layer) * n_blocks_ + at(b)]; }
  void clear_bias(block_id b);
  std::size_t merge_bytes_per_block_head() const;

  // Staging slots.
  std::byte* slot_data(std::int32_t slot) const;
  std::byte* staged_tile(std::int32_t slot, int sealed_index, int head) const;
  std::int32_t acquire_slot(block_id b);
  // Encodes a's tile of block id from its staged f16 copy in `slot`.
  void seal_from_staging(tensor& a, block_id id, std::int32_t slot);
  // Merged layer `layer` of block b has its last slot merged: its sealed
  // tensors are encoded from whole_k / whole_v (a block merged whole:
  // [n_kv_heads][block_size][head_dim]) or from staging, which is then
  // released once every sealed tensor of b is sealed.
  void seal_merged(int layer, block_id b, const float* whole_k, const float* whole_v);
  void release_slot(std::int32_t slot);
  std::int32_t& slot_of(block_id b) { return block_slot_[at(b)]; }
  std::int32_t slot_of(block_id b) const { return block_slot_[at(b)]; }
  // Every sealed tensor of staging slot `slot`'s block (of class cls) is
  // sealed (and no merged one awaits its reader's rewrite).
  bool slot_sealed(std::int32_t slot, int cls) const;
  bool held(block_id b) const { return !held_.empty() && held_[at(b)] != 0; }
  void unhold(block_id b) {
    if (!held_.empty()) held_[at(b)] = 0;
  }

  std::int64_t first_block_ = 0;
  std::int64_t n_blocks_ = 0;  // over every class
  anon_memory tiles_;          // every tensor's tiles (tensor::data points into it)
  std::vector<int> model_layers_;  // [n_layers]: the model's layer of each of ours
  std::vector<block_class_data> classes_;  // [n classes]; class 0 is the default layout
  // With more than one class: [n_blocks] each block's class (by index at()),
  // and [n_layers][2 (K, V)][n classes] what views point at. Empty with one.
  std::vector<std::uint8_t> block_class_;
  std::vector<paged_kv_class> view_classes_;

  int slot_stride_ = 0;              // fills per staging slot: the most sealed tensors of a class
  std::size_t staged_tile_bytes_ = 0;  // one head's f16 tile
  std::size_t slot_bytes_ = 0;
  std::int64_t n_slots_ = 0;
  std::byte* staging_ = nullptr;   // [n_slots_][slot_bytes_]
  std::vector<std::int32_t> block_slot_;  // [n_blocks] by at(): slot or -1
  std::vector<std::int32_t> slot_block_;  // [slots]: global block or -1
  std::vector<std::int32_t> slot_fill_;   // [slots][slot_stride_]: tokens staged per sealed tensor of
                                          // the slot's block's class (block_size: sealed)
  // [slots][slot_stride_]: a sealed tensor of a merged layer (MiniCache)
  // sealed by its producer's write and not yet rewritten by its reader's
  // merge_write, which needs the staging: the slot is not released meanwhile.
  std::vector<std::uint8_t> merge_pending_;
  std::vector<std::int32_t> free_slots_;
  std::vector<std::uint8_t> held_;          // [n_blocks] by at(): hold_staging, until the hold ends
  std::vector<std::int32_t> held_blocks_;   // blocks held since the last end_holds (some may be no longer)
  std::int64_t slots_in_use_ = 0;
  std::int64_t peak_slots_in_use_ = 0;
  std::vector<float> gather_;  // write scratch: [block_size][head_dim]
  float* summaries_ = nullptr;            // [n_blocks][n_layers][n_kv_heads][3][head_dim], or null
  std::size_t summaries_bytes_ = 0;
  std::vector<std::uint8_t> summarized_;  // [n_blocks][n_layers]
  // Per-slot biases (merged entries): [n_layers][n_blocks][n_kv_heads][block_size],
  // mapped lazily; has_bias_[layer * n_blocks + at(block)] says where any is set.
  float* bias_ = nullptr;
  std::size_t bias_bytes_ = 0;
  std::vector<std::uint8_t> has_bias_;
  bool any_bias_ = false;  // some block ever had a bias: views carry the arrays
  // MiniCache side data (kv_merge.h): [n_layers] -> [n_blocks][n_kv_heads]
  // [merge_shape().head_floats()] for merged layers, null for the others.
  std::vector<float*> merge_;
  std::size_t merge_bytes_ = 0;  // of each merged layer's array
  std::vector<float> merge_scratch_;  // [2][3][head_dim]
  std::vector<float> merge_block_;    // [2 (K, V)][n_kv_heads][block_size][head_dim]: a block merged whole
};

}  // namespace pagoda
