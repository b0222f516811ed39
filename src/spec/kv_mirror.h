// The KV mirror of speculative `self:view=int4|int2` (docs/speculative.md):
// the model's K/V kept a second time, in a cheaper KV type, in a KV group of
// its own that the draft passes read. What fills it: a copy of slots from
// the cache, decoded as attention reads them and re-encoded by the mirror's
// backend in its formats.
#pragma once

#include <span>
#include <vector>

#include "kv/kv_backend.h"

namespace pagoda {

// Reusable buffers of copy_kv_slots.
struct kv_copy_scratch {
  std::vector<float> k, v;  // [slots][n_kv_heads][head_dim]
  std::vector<float> row;   // [block_size][head_dim]: one head's slots of one block
};

// Slots [from, end) of one sequence, every layer's K and V, from `src` (layer
// l read through src_tables[src.layer_group(l)]) into `dst` (its table
// dst_table), which encodes them in its own formats.
// REQUIRES: both backends of one shape (layers, KV heads, head_dim, block
// size); src holds the slots; dst's blocks were written up to `from` (the
// write order of kv_backend::write).
void copy_kv_slots(const kv_backend& src, std::span<const std::span<const block_id>> src_tables, kv_backend& dst,
                   std::span<const block_id> dst_table, int from, int end, kv_copy_scratch& scratch);

}  // namespace pagoda
