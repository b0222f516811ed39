// The tensors behind the block pool: per layer, one arena of K tiles and one of
// V tiles, indexed by block id. A block holds block_size tokens of every layer.
// Tile address: arena(layer, K|V) + (head * n_blocks + block) * tile_bytes:
// head-major, so one head's tiles of consecutive block ids are adjacent and
// attention over a sequence whose blocks were allocated in order streams
// through memory (in this VM, scattered 4 KiB reads run at half the speed of
// sequential ones).
// Each layer's K and V have their own format (type and scale granularity).
//
// The model never sees block ids allocated or freed here: it writes K/V through
// write() and reads through paged_kv_view (DESIGN.md).
//
// Sealing and staging. A sealed format (per-channel scales: KIVI keys) can only
// encode a whole block. While a block of such a format is partly filled, its
// tokens live in an f16 STAGING SLOT (KIVI's residual window); the write that
// fills the block seals it: the staged tokens are encoded into the tile and the
// slot is released. Views read the sealed tiles plus, for a partly filled last
// block, the staged f16 tile.
//   - A slot holds an f16 copy of one block of every sealed tensor (all layers,
//     K and/or V): bytes = kv_layout::staging_bytes_per_slot().
//   - Slots are bound to blocks lazily: the first write into a block (at its
//     first position) takes a slot; sealing releases it. A block written again
//     from its first position (a new owner) reuses or drops its old slot.
//   - release_block(b) drops b's slot at once; the owner of block lifetimes (the
//     engine, simple_kv) calls it when b returns to the free pool partly filled.
//     Without it a stale slot lives until b is written again.
//   - create() maps n_staging_slots slots up front (one per sequence that can be
//     in flight; default 1, as for one sequence); more are mapped on demand in
//     chunks of that many, never freed before the storage. total_bytes() counts
//     every mapped byte.
// For sealed formats the stored codes are independent of how writes were split
// (inputs are rounded to f16 whether or not they pass through staging), but
// attention results are not batch invariant: a query reads its own block as f16
// while the block is open and as codes once it is sealed. They are deterministic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pagoda/status.h"
#include "pagoda/types.h"
#include "quant/kv_codec.h"
#include "quant/kv_scales.h"

namespace pagoda {

struct kv_layout {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;
  std::vector<kv_format> k_formats;  // [n_layers]
  std::vector<kv_format> v_formats;  // [n_layers]
  // Calibrated ranges for static_scales formats; null when none is static.
  std::shared_ptr<const kv_scales> scales;

  // Every layer K and V of the given types, in their default formats.
  static kv_layout uniform(int n_layers, int n_kv_heads, int head_dim, int block_size, kv_type k_type,
                           kv_type v_type);
  // Every format valid for the shape; scales present (and of this shape) when a format is static.
  status check() const;

  kv_tile_shape tile_shape() const { return {block_size, head_dim}; }
  // Bytes one block takes over all layers, K and V, in-tile scales included.
  std::size_t bytes_per_block() const;
  // Bytes per token (bytes_per_block / block_size), as a real number: the cost of
  // sealed blocks, without the staging window.
  double bytes_per_token() const;
  // Bytes of one f16 staging slot (one block of every sealed tensor); 0 when no
  // format is sealed.
  std::size_t staging_bytes_per_slot() const;
  bool has_sealed() const { return staging_bytes_per_slot() > 0; }
  // Bytes of the static per-head parameters (two floats per channel per static tensor).
  std::size_t static_bytes() const;
  // What one sequence of n_tokens costs per token: its blocks plus one staging
  // slot (its f16 window) when a format is sealed.
  double bytes_per_token_at(std::int64_t n_tokens) const;
  // Stored bits per K/V element, scales and padding included (window excluded).
  double bits_per_element() const;
  // "int8/token+int4/token", or per layer ranges when layers differ.
  std::string describe() const;
};

// One layer's K or V as one sequence sees it: its block table and length.
struct paged_kv_view {
  const kv_codec* codec = nullptr;
  kv_format format;
  kv_tile_shape shape;
  const std::byte* base = nullptr;
  std::size_t tile_bytes = 0;
  std::size_t head_stride = 0;  // n_blocks * tile_bytes
  std::span<const block_id> blocks;
  int n_tokens = 0;
  // [n_kv_heads] static parameters, or nullptr.
  const kv_static_params* static_params = nullptr;
  // A partly filled last block of a sealed format, staged in f16: head h's tile
  // is staged + h * staged_tile_bytes, read with staged_codec / staged_format.
  const std::byte* staged = nullptr;
  std::size_t staged_tile_bytes = 0;
  const kv_codec* staged_codec = nullptr;
  kv_format staged_format;

  const void* tile(int block_index, int head) const {
    return base + static_cast<std::size_t>(head) * head_stride +
           static_cast<std::size_t>(blocks[block_index].value) * tile_bytes;
  }
  const kv_static_params* params(int head) const { return static_params ? static_params + head : nullptr; }
  // Whether block_index is read from staging rather than from its tile.
  bool is_staged(int block_index) const {
    return staged != nullptr && block_index == (n_tokens - 1) / shape.block_size;
  }
  const void* staged_tile(int head) const { return staged + static_cast<std::size_t>(head) * staged_tile_bytes; }
};

struct kv_staging_stats {
  std::int64_t slots_mapped = 0;
  std::int64_t slots_in_use = 0;
  std::int64_t peak_slots_in_use = 0;
  std::size_t bytes_mapped = 0;
};

class kv_storage {
 public:
  // Maps (lazily zeroed) memory for n_blocks blocks and, when a format is
  // sealed, n_staging_slots staging slots (at least 1, at most n_blocks).
  static result<std::unique_ptr<kv_storage>> create(const kv_layout& layout, std::int64_t n_blocks,
                                                    std::int64_t n_staging_slots = 1);
  ~kv_storage();
  kv_storage(const kv_storage&) = delete;
  kv_storage& operator=(const kv_storage&) = delete;

  const kv_layout& layout() const { return layout_; }
  std::int64_t n_blocks() const { return n_blocks_; }
  // Every byte this storage holds: tiles, mapped staging slots, static parameters.
  std::size_t total_bytes() const;
  kv_staging_stats staging() const;

  // Stores K and V of n consecutive tokens of one sequence at positions [pos, pos + n).
  // k and v are [n][n_kv_heads][head_dim].
  // REQUIRES: blocks covers position pos + n - 1; positions of a block are
  // written in order (a block's first write starts at its first position).
  void write(int layer, std::span<const block_id> blocks, int pos, int n, const float* k, const float* v);

  paged_kv_view k_view(int layer, std::span<const block_id> blocks, int n_tokens) const;
  paged_kv_view v_view(int layer, std::span<const block_id> blocks, int n_tokens) const;

  // Copies every layer's K and V tiles of block src into dst, staged tokens
  // included (copy-on-write).
  void copy_block(block_id src, block_id dst);

  // Drops the staging slot of block b, if it has one. Call when b returns to the
  // free pool (no block table holds it any more).
  void release_block(block_id b);

 private:
  struct tensor {
    std::byte* data = nullptr;
    std::size_t size_bytes = 0;
    std::size_t tile_bytes = 0;
    const kv_codec* codec = nullptr;
    kv_format format;
    int sealed_index = -1;  // position among the sealed tensors; -1: not sealed
    std::vector<float> static_values;               // [2][n_kv_heads][head_dim]: scales, offsets
    std::vector<kv_static_params> static_params;    // [n_kv_heads]
  };
  kv_storage() = default;
  status init_tensor(tensor& t, const kv_format& fmt, int layer);
  void write_tensor(tensor& a, std::span<const block_id> blocks, int pos, int n, const float* x);
  paged_kv_view view(const tensor& a, std::span<const block_id> blocks, int n_tokens) const;

  // Staging slots.
  std::byte* slot_data(std::int32_t slot) const;
  std::byte* staged_tile(std::int32_t slot, int sealed_index, int head) const;
  std::int32_t acquire_slot(block_id b);
  void release_slot(std::int32_t slot);
  bool map_staging_chunk();

  kv_layout layout_;
  std::int64_t n_blocks_ = 0;
  std::vector<tensor> k_;  // [n_layers]
  std::vector<tensor> v_;  // [n_layers]

  int n_sealed_ = 0;                 // sealed tensors
  std::size_t staged_tile_bytes_ = 0;  // one head's f16 tile
  std::size_t slot_bytes_ = 0;
  std::int64_t slots_per_chunk_ = 0;
  std::vector<std::byte*> staging_chunks_;
  std::vector<std::int32_t> block_slot_;  // [n_blocks]: slot or -1
  std::vector<std::int32_t> slot_block_;  // [slots]: block or -1
  std::vector<std::int32_t> slot_fill_;   // [slots][n_sealed_]: tokens staged (block_size: sealed)
  std::vector<std::int32_t> free_slots_;
  std::int64_t slots_in_use_ = 0;
  std::int64_t peak_slots_in_use_ = 0;
  std::vector<float> gather_;  // write scratch: [block_size][head_dim]
};

}  // namespace pagoda
