// How KV is laid out in memory: the model's KV shape, tokens per block, the
// format of every layer's K and V, calibrated scales and optional per-block key
// summaries. Plain data, shared by the KV backend, the engine and the tools
// that size pools (bytes per block, per token, per element).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kv/kv_merge.h"
#include "pagoda/status.h"
#include "quant/kv_codec.h"
#include "quant/kv_scales.h"

namespace pagoda {

// Sealed formats stage a partly filled block in f16 (kv_backend.h).
inline kv_format kv_staged_format(kv_role role) { return default_kv_format(kv_type::f16, role); }
inline std::size_t kv_staged_tile_bytes(kv_tile_shape shape) {
  return get_kv_codec(kv_type::f16)->tile_bytes(kv_staged_format(kv_role::key), shape);
}

struct kv_layout {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;
  std::vector<kv_format> k_formats;  // [n_layers]
  std::vector<kv_format> v_formats;  // [n_layers]
  // Calibrated ranges for static_scales formats; null when none is static.
  std::shared_ptr<const kv_scales> scales;
  // Keep a key summary per sealed block (kv_backend::key_summary): per layer
  // and KV head, the per-channel min, max and mean of its keys, in f32. For
  // policies that read them (query-aware sparsity); off by default, as it
  // costs 3 x 4 bytes per key channel per block.
  bool key_summaries = false;
  // Which model layers these are, when a layout covers some of them only
  // (select_layers: a KV group's); empty means 0..n_layers-1. Two groups with
  // the same formats over other layers hold other bytes for the same tokens.
  std::vector<int> model_layers;
  // Cross-layer KV sharing (share_kv_layers): [model layer] -> the KV layer
  // it reads. Several model layers may read one KV layer, which the first of
  // them (its producer) writes; n_layers, the formats and the scales then
  // count KV layers. Empty: model layer l reads KV layer l. A KV group's
  // layout (select_layers) keeps the whole model's map: it names the sharing.
  std::vector<std::int32_t> layer_map;
  // What made the map ("cla:2", "yoco", "reuse:from=3"): two sharings with
  // one map may store different bytes. Empty without sharing.
  std::string sharing;
  // MiniCache (kv_merge.h, merge_kv_layers): [KV layer] -> the model layer
  // that stores its KV into it merged (the upper layer of a merged pair), or
  // -1; empty: nothing is merged. Each block then also holds, per merged
  // layer and KV head, the reader's side data (merge_shape()).
  std::vector<std::int32_t> merge_reader;
  float merge_t = 0.6f;  // the slerp parameter (0: the lower layer's direction)
  int merge_retain = 0;  // tokens per block and KV head kept apart unmerged

  // Every layer K and V of the given types, in their default formats.
  static kv_layout uniform(int n_layers, int n_kv_heads, int head_dim, int block_size, kv_type k_type,
                           kv_type v_type);
  // Every format valid for the shape; scales present (and of this shape) when a format is static.
  status check() const;

  kv_tile_shape tile_shape() const { return {block_size, head_dim}; }
  // Bytes one block takes over all layers, K and V, in-tile scales and key
  // summaries included.
  std::size_t bytes_per_block() const;
  // Bytes of one block's tiles alone (kv_backend::read_block's size).
  std::size_t tile_bytes_per_block() const;
  // The same for one layer (its K and V tiles, every KV head).
  std::size_t layer_tile_bytes_per_block(int layer) const;
  // Bytes of one block's key summaries (0 unless key_summaries).
  std::size_t summary_bytes_per_block() const;
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
  // The layout of some of these layers only (a KV group's, kv_group.h): their
  // formats, in this order, and their calibrated scales. REQUIRES: valid layer numbers.
  kv_layout select_layers(std::span<const int> layers) const;

  // The layer map (empty layer_map: the identity over n_layers).
  int n_model_layers() const { return layer_map.empty() ? n_layers : static_cast<int>(layer_map.size()); }
  int kv_layer_of(int model_layer) const {
    return layer_map.empty() ? model_layer : layer_map[static_cast<std::size_t>(model_layer)];
  }
  // Whether model layer l writes its KV layer (the first model layer to read it).
  bool writes_kv(int model_layer) const;
  // MiniCache: whether KV layer j holds a merged pair; whether model layer l
  // merges its KV into its KV layer (the pair's reader); the side data's shape.
  bool merged(int kv_layer) const {
    return !merge_reader.empty() && merge_reader[static_cast<std::size_t>(kv_layer)] >= 0;
  }
  bool merges_kv(int model_layer) const {
    return !merge_reader.empty() && merge_reader[static_cast<std::size_t>(kv_layer_of(model_layer))] == model_layer;
  }
  kv_merge_shape merge_shape() const { return {block_size, head_dim, merge_retain}; }
  // Bytes of one block's side data of KV layer j (0 unless merged).
  std::size_t merge_bytes_per_block(int kv_layer) const;
  // The model layer that writes KV layer j.
  int kv_producer(int kv_layer) const;
};

// The layout `per_model_layer` (one format per model layer) shared: model
// layer l reads the KV that model layer source[l] computes, source[l] <= l
// and a producer its own source. The producers' formats and scales, one KV
// layer each in model order, and the map. Errors: a source out of range or
// after its reader, a reader of a reader, a reader whose K or V format
// differs from its producer's (per-layer KV types apply to the shared KV
// layer as a whole). `sharing` names it (kv_layout::sharing).
result<kv_layout> share_kv_layers(const kv_layout& per_model_layer, std::span<const int> source, std::string sharing);

// MiniCache: `shared` (share_kv_layers' result) where each model layer in
// `readers` stores its KV merged into the KV layer it reads (kv_merge.h),
// with slerp parameter t and `retain` tokens per block and KV head kept
// apart. Errors: a reader that is not the second layer of a KV layer read by
// exactly two, t outside [0, 1], retain outside [0, block_size]. A merged
// layer may be of a sealed format (per-channel scales): the reader rewrites
// the block from its staged f16 copy, and the block is encoded once merged
// (kv_arena::merge_write).
result<kv_layout> merge_kv_layers(kv_layout shared, std::span<const int> readers, float t, int retain);

// An extra class's layout must have the default's shape (blocks of every
// class share block tables, biases and key summaries): an error naming class
// `index` and both shapes when not.
status check_kv_class_shape(const kv_layout& base, const kv_layout& c, int index);

// An extra block class of a KV storage (kv_storage.h): n_blocks blocks stored
// in their own formats. layout has the default layout's shape (n_layers,
// n_kv_heads, head_dim, block_size, key_summaries); its k_formats, v_formats
// and scales are the class's own.
struct kv_class_spec {
  kv_layout layout;
  std::int64_t n_blocks = 0;
};

}  // namespace pagoda
