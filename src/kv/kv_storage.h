// The tensors behind the block pool: per layer, one arena of K tiles and one of
// V tiles, indexed by block id. A block holds block_size tokens of every layer.
// Tile address: arena(layer, K|V) + (block * n_kv_heads + head) * tile_bytes.
//
// The model never sees block ids allocated or freed here: it writes K/V through
// write_token and reads through paged_kv_view (DESIGN.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "pagoda/status.h"
#include "pagoda/types.h"
#include "quant/kv_codec.h"

namespace pagoda {

struct kv_layout {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;
  std::vector<kv_format> k_formats;  // [n_layers]
  std::vector<kv_format> v_formats;  // [n_layers]

  // Every layer K and V of the given types.
  static kv_layout uniform(int n_layers, int n_kv_heads, int head_dim, int block_size, kv_type k_type,
                           kv_type v_type);
  // Bytes one block takes over all layers, K and V, scales included.
  std::size_t bytes_per_block() const;
  // Bytes per token (bytes_per_block / block_size), as a real number.
  double bytes_per_token() const;
};

// One layer's K or V as one sequence sees it: its block table and length.
struct paged_kv_view {
  const kv_codec* codec = nullptr;
  kv_format format;
  kv_tile_shape shape;
  const std::byte* base = nullptr;
  std::size_t tile_bytes = 0;
  std::size_t block_stride = 0;  // n_kv_heads * tile_bytes
  std::span<const block_id> blocks;
  int n_tokens = 0;

  const void* tile(int block_index, int head) const {
    return base + static_cast<std::size_t>(blocks[block_index].value) * block_stride +
           static_cast<std::size_t>(head) * tile_bytes;
  }
};

class kv_storage {
 public:
  // Maps (lazily zeroed) memory for n_blocks blocks.
  static result<std::unique_ptr<kv_storage>> create(const kv_layout& layout, std::int64_t n_blocks);
  ~kv_storage();
  kv_storage(const kv_storage&) = delete;
  kv_storage& operator=(const kv_storage&) = delete;

  const kv_layout& layout() const { return layout_; }
  std::int64_t n_blocks() const { return n_blocks_; }
  std::size_t total_bytes() const;

  // Stores K and V of n consecutive tokens of one sequence at positions [pos, pos + n).
  // k and v are [n][n_kv_heads][head_dim].
  // REQUIRES: blocks covers position pos + n - 1.
  void write(int layer, std::span<const block_id> blocks, int pos, int n, const float* k, const float* v);

  paged_kv_view k_view(int layer, std::span<const block_id> blocks, int n_tokens) const;
  paged_kv_view v_view(int layer, std::span<const block_id> blocks, int n_tokens) const;

  // Copies every layer's K and V tiles of block src into dst (copy-on-write).
  void copy_block(block_id src, block_id dst);

 private:
  struct arena {
    std::byte* data = nullptr;
    std::size_t size_bytes = 0;
    std::size_t tile_bytes = 0;
    const kv_codec* codec = nullptr;
    kv_format format;
  };
  kv_storage() = default;
  void write_tensor(const arena& a, std::span<const block_id> blocks, int pos, int n, const float* x);
  paged_kv_view view(const arena& a, std::span<const block_id> blocks, int n_tokens) const;

  kv_layout layout_;
  std::int64_t n_blocks_ = 0;
  std::vector<arena> k_;  // [n_layers]
  std::vector<arena> v_;  // [n_layers]
};

}  // namespace pagoda
