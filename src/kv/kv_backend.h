// The KV backend: what the model and the runner need from KV storage, and
// nothing about where the bytes live (DESIGN.md: the model never sees the block
// pool). kv_storage is the CPU implementation; a GPU one would be another.
//
// The model writes a sequence's K/V into KV slots of its block table
// (write), and attention reads them through paged_kv_view (k_view, v_view).
// The runner applies the block ops the KV manager reports (copy_block,
// truncate_block, release_block) before a step's writes, and moves whole blocks
// in and out as bytes (read_block, write_block) for eviction hooks and
// external KV sources.
//
// Sealing and staging. A sealed format (per-channel scales: KIVI keys) can only
// encode a whole block. While a block of such a format is partly filled, its
// tokens live in an f16 STAGING SLOT (KIVI's residual window); the write that
// fills the block seals it: the staged tokens are encoded into the tile and the
// slot is released. Views read the sealed tiles plus, for a partly filled last
// block, the staged f16 tile. For sealed formats the stored codes are
// independent of how writes were split (inputs are rounded to f16 whether or
// not they pass through staging), but attention results are not batch
// invariant: a query reads its own block as f16 while the block is open and as
// codes once it is sealed. They are deterministic.
//
// Tentative slots (speculative decoding: K/V of drafts not yet verified). A
// block that is to receive tentative slots is HELD (hold_staging) for the
// step: when a write seals it, its f16 staging is kept beside the codes
// instead of released, so
//   - truncate_block(b, n) with 0 < n < block_size restores the first n
//     slots' staging exactly (a block not held is reopened from its codes,
//     which requantizes the kept tokens under new scales), and the block's
//     later seal encodes the f16 values plain decoding's would: the same bytes;
//   - a view whose last slot is inside a held sealed block reads that block
//     staged, as the one-token step at that slot read it (a verification
//     step's rows then see what plain decoding's steps saw).
// A hold ends with end_holds() (the tentative slots still there were
// verified), truncate_block, release_block or write_block of the block.
// Formats that are not sealed encode each token alone: holds change nothing.
//
// Groups and classes. The model's layers are split into KV GROUPS (kv_group.h):
// the layers of one group share block tables, and each group has its own
// blocks, global ids [first, first + n) of one id space (group_of(b) names
// it). A layer's writes and views take its group's table (layer_group). A
// group's blocks come in CLASSES (a long document in int4 beside a question
// in f16), each with its own per-layer K and V formats; class c of a group
// owns a contiguous run of its ids; a block's group and class never change.
// A table may mix classes, a block being wholly one class, and every op takes
// any block: writes and views follow each block's class, copy_block stays
// within a group and class, read_block / write_block move
// block_layout(b).tile_bytes_per_block() bytes (the group's layers in the
// class's formats), and gather decodes each source slot in its block's class
// and encodes it in its destination block's. A staged (open) block of a
// sealed format reads as f16 whatever its class. A backend of one group and
// one class reports exactly what it did before either existed.
//
// NULL table entries (block_id()): a sliding-window group frees the leading
// blocks of a table that no later query reads. A view's tables may hold them;
// attention never reads them (they are out of every query's window), and
// writes never target them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>

#include "kv/kv_gather.h"
#include "kv/kv_layout.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// Where one block class keeps one layer's K or V (paged_kv_view::classes):
// head h's tile of block b (a block of this class, global id) is at
// base + h * head_stride + (b - first_block) * tile_bytes.
struct paged_kv_class {
  const kv_codec* codec = nullptr;
  kv_format format;
  const std::byte* base = nullptr;
  std::size_t tile_bytes = 0;
  std::size_t head_stride = 0;  // class blocks * tile_bytes
  std::int32_t first_block = 0;
  const kv_static_params* static_params = nullptr;  // [n_kv_heads], or nullptr

  const void* tile(std::int32_t b, int head) const {
    return base + static_cast<std::size_t>(head) * head_stride + static_cast<std::size_t>(b - first_block) * tile_bytes;
  }
};

// One layer's K or V as one sequence sees it: its block table and length.
// Read a block through the methods (tile, codec_of, format_of, params_of),
// which follow its class; the raw fields codec .. static_params describe
// class 0 and are the whole story only when classes is null.
struct paged_kv_view {
  const kv_codec* codec = nullptr;
  kv_format format;
  kv_tile_shape shape;
  const std::byte* base = nullptr;
  std::size_t tile_bytes = 0;
  std::size_t head_stride = 0;  // n_blocks * tile_bytes
  std::span<const block_id> blocks;  // the layer's group's table (NULL entries are never read)
  std::int32_t first_block = 0;      // the group's first block id: per-block arrays are indexed by b - first_block
  int n_tokens = 0;  // KV slots covered
  // [n_kv_heads] static parameters, or nullptr.
  const kv_static_params* static_params = nullptr;
  // A partly filled last block of a sealed format, staged in f16: head h's tile
  // is staged + h * staged_tile_bytes, read with staged_codec / staged_format.
  const std::byte* staged = nullptr;
  std::size_t staged_tile_bytes = 0;
  const kv_codec* staged_codec = nullptr;
  kv_format staged_format;
  // Per-slot additive logits (keys only), or nullptr: a merged entry that
  // stands for m tokens adds log m to its score, so the softmax gives it the
  // mass of m tokens. Block b's bias for head h is
  // bias + ((b - first_block) * n_kv_heads + h) * block_size, meaningful where has_bias[b - first_block].
  const float* bias = nullptr;              // [group blocks][n_kv_heads][block_size], this layer
  const std::uint8_t* has_bias = nullptr;   // [group blocks]
  int n_kv_heads = 0;
  // Block classes (see above), or nullptr when the group has one: block b is
  // of class block_class[b - first_block], stored as that class's entry says
  // for this layer and role.
  const paged_kv_class* classes = nullptr;     // [n classes]
  const std::uint8_t* block_class = nullptr;   // [group blocks]
  // MiniCache (kv_merge.h), set on the views the upper layer of a merged
  // pair reads (kv_backend::attach_merge): per block and KV head, the
  // reader's per-slot ratios and retained rows, [group blocks][n_kv_heads]
  // [merge_shape.head_floats()]. A key view scales each slot's score by its
  // K ratio, a value view each slot's weight by its V ratio, and a retained
  // slot is read from the reader's own rows. Null: rows as stored.
  const float* merge = nullptr;
  kv_merge_shape merge_shape;

  const void* tile(int block_index, int head) const {
    const std::int32_t b = blocks[block_index].value;
    if (classes) return classes[block_class[b - first_block]].tile(b, head);
    return base + static_cast<std::size_t>(head) * head_stride + static_cast<std::size_t>(b - first_block) * tile_bytes;
  }
  // Class 0's static parameters of head: use params_of for a given block.
  const kv_static_params* params(int head) const { return static_params ? static_params + head : nullptr; }
  // The class of table block block_index (0 without classes).
  int class_of(int block_index) const { return classes ? block_class[blocks[block_index].value - first_block] : 0; }
  const kv_codec* codec_of(int block_index) const { return classes ? classes[class_of(block_index)].codec : codec; }
  const kv_format& format_of(int block_index) const {
    return classes ? classes[class_of(block_index)].format : format;
  }
  const kv_static_params* params_of(int block_index, int head) const {
    if (!classes) return params(head);
    const kv_static_params* sp = classes[class_of(block_index)].static_params;
    return sp ? sp + head : nullptr;
  }
  // Same-class runs: the end of the maximal run of table blocks
  // indices[i], indices[i + 1], ... that share indices[i]'s class, i.e. the
  // least j > i whose block is of another class, or indices.size(). Without
  // classes every run is the whole list. A codec call (qk, av) must not span
  // two classes. REQUIRES: i < indices.size().
  std::size_t class_run_end(std::span<const int> indices, std::size_t i) const {
    if (!classes) return indices.size();
    const int c = class_of(indices[i]);
    std::size_t j = i + 1;
    while (j < indices.size() && class_of(indices[j]) == c) ++j;
    return j;
  }
  // Whether block_index is read from staging rather than from its tile.
  bool is_staged(int block_index) const {
    return staged != nullptr && block_index == (n_tokens - 1) / shape.block_size;
  }
  const void* staged_tile(int head) const { return staged + static_cast<std::size_t>(head) * staged_tile_bytes; }
  kv_merge_ref merge_of(int block_index, int head) const {
    const auto b = static_cast<std::size_t>(blocks[block_index].value - first_block);
    return {merge + (b * static_cast<std::size_t>(n_kv_heads) + head) * merge_shape.head_floats(), merge_shape};
  }
  // The bias of block_index's slots for head, or nullptr when it has none.
  const float* bias_of(int block_index, int head) const {
    if (!bias) return nullptr;
    const auto b = static_cast<std::size_t>(blocks[block_index].value - first_block);
    return has_bias[b] ? bias + (b * static_cast<std::size_t>(n_kv_heads) + head) * shape.block_size : nullptr;
  }
};

// What one sealed block's keys look like for one layer and KV head, channel by
// channel, over its block_size tokens as stored (decoded from the tile, so a
// bound holds for the keys attention reads). Each pointer is [head_dim].
struct key_summary {
  const float* min = nullptr;
  const float* max = nullptr;
  const float* mean = nullptr;
};

class kv_backend {
 public:
  virtual ~kv_backend() = default;

  // The model's shape (every layer, KV heads, head_dim, block_size) in class
  // 0's formats: what a layer's writes and views are shaped by.
  virtual const kv_layout& layout() const = 0;
  // Blocks of every group and class (ids 0 .. n_blocks() - 1).
  virtual std::int64_t n_blocks() const = 0;

  // Groups and classes (see above). A backend of one group and one class need not override these.
  virtual int n_groups() const { return 1; }
  // The group holding layer's K/V (its writes and views take that group's table).
  virtual int layer_group(int layer) const { return 0; }
  virtual int group_of(block_id b) const { return 0; }
  virtual int block_class(block_id b) const { return 0; }
  // What b's bytes are: its group's layers in its class's formats.
  virtual const kv_layout& block_layout(block_id b) const { return layout(); }
  // Bytes of b's read_block / write_block.
  std::size_t block_bytes(block_id b) const { return block_layout(b).tile_bytes_per_block(); }

  // Stores K and V of n consecutive tokens of one sequence into KV slots
  // [slot, slot + n) of its table. k and v are [n][n_kv_heads][head_dim].
  // REQUIRES: blocks covers slot + n - 1; slots of a block are written in
  // order (a block's first write starts at its first slot, or where
  // truncate_block / copy_block left it).
  virtual void write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k,
                     const float* v) = 0;
  // MiniCache (kv_merge.h, kv_layout::merge_reader): the reader of merged
  // KV layer `layer` stores its rows of slots [slot, slot + n): k, v are
  // its own ([n][n_kv_heads][head_dim]), prod_k, prod_v the producer's rows
  // of the same tokens (written by write() before). The layer's slots and
  // side data are rewritten as kv_merge_token says.
  // REQUIRES: layout().merged(layer).
  virtual void merge_write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k,
                           const float* v, const float* prod_k, const float* prod_v);
  // Points the views of merged KV layer `layer` at its reader's side data
  // (paged_kv_view::merge); leaves them as they are when this backend keeps
  // none (a KV mirror: its reader reads the rows as stored).
  virtual void attach_merge(int layer, paged_kv_view& k, paged_kv_view& v) const {}
  // The first n_slots KV slots of the table, for one layer.
  virtual paged_kv_view k_view(int layer, std::span<const block_id> blocks, int n_slots) const = 0;
  virtual paged_kv_view v_view(int layer, std::span<const block_id> blocks, int n_slots) const = 0;

  // Block ops (kv_manager.h). copy_block: the first n_tokens slots of src, every
  // layer of its group, K and V, into dst, which may be written from slot n_tokens on.
  // REQUIRES: src and dst of the same group and class.
  virtual void copy_block(block_id src, block_id dst, int n_tokens) = 0;
  // Slots [n_tokens, block_size) of b become writable again; the first
  // n_tokens keep what they hold (a sealed block is reopened in staging).
  virtual void truncate_block(block_id b, int n_tokens) = 0;
  // b went back to the free pool: drop whatever per-block state it holds.
  virtual void release_block(block_id b) = 0;
  // Tentative slots (see above): b is to receive some this step; end_holds()
  // ends every hold. A backend without sealed formats need not override these.
  virtual void hold_staging(block_id b) {}
  virtual void end_holds() {}
  // A whole FULL block as bytes: every layer of its group, K and V tiles,
  // scales included, in a fixed order; block_bytes(b) bytes (block_layout(b)).
  // Meaningful only to a backend with the same block_layout.
  // REQUIRES: every slot of b was written.
  virtual void read_block(block_id b, std::span<std::byte> out) const = 0;
  // The inverse: b then holds a full block with these bytes (key summaries
  // are recomputed). Errors: a size that is not block_bytes(b).
  virtual status write_block(block_id b, std::span<const std::byte> in) = 0;

  // The key summary of a sealed block for (layer, KV head); std::nullopt when
  // the layout keeps none or b is not full.
  virtual std::optional<key_summary> key_summary_of(block_id b, int layer, int head) const = 0;

  // Compaction (kv_gather.h, kv_manager::compact): for every layer of group
  // g.group, K and V, slots [g.first, g.first + g.n) of g.dst_table (that
  // group's table) are rewritten from slots of g.src_table (decoded, folded as
  // g.fold says, re-encoded), with their per-slot biases. Slots of
  // g.dst_table below g.first keep what they hold. rotate (needed when
  // g.rotate is set) turns keys by a number of positions:
  // rotate(model layer, k [n][n_kv_heads][head_dim], n, delta [n]).
  using key_rotation = std::function<void(int layer, float* k, int n, const std::int32_t* delta)>;
  virtual void gather(const kv_gather& g, const key_rotation& rotate) = 0;
};

}  // namespace pagoda
