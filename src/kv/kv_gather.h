// Compaction of one sequence's KV slots (token-granular eviction): which slot
// each rewritten slot takes its K/V from, per (layer, KV head) row, and how
// evicted tokens are folded into the kept ones. The KV manager carries it in a
// gather op (kv_manager::compact); the backend executes it (kv_backend::gather).
//
// Rows: r = layer * n_kv_heads + kv_head, or one row for all when every row
// takes the same slots.
#pragma once

#include <cstdint>
#include <vector>

#include "pagoda/types.h"

namespace pagoda {

// How evicted tokens leave.
enum class kv_fold : std::uint8_t {
  drop,     // they are gone
  nearest,  // each is merged into the kept token of its row whose key is most similar (cosine)
  cluster,  // per row, k-means on keys groups them around the anchor slots, which take the centroids
};

struct kv_gather {
  std::int32_t group = 0;           // the KV group whose layers and tables these are (kv_manager.h)
  std::vector<block_id> src_table;  // the table sources index: the sequence's table before compaction
  std::vector<block_id> dst_table;  // its table after, covering slots [0, first + n)
  std::int32_t first = 0;           // destination slots [first, first + n) are rewritten
  std::int32_t n = 0;
  int n_rows = 1;                   // 1 (every row alike) or n_layers * n_kv_heads
  // [n_rows][n]: the source slot (in src_table) of each destination slot;
  // -1: a dead slot (it holds nothing; attention never reads it).
  std::vector<std::int32_t> sources;

  // Folding (merge policies): per row, the evicted slots (in src_table) to fold
  // into the kept ones; -1 pads a row. A merged entry's K and V are the
  // mass-weighted means of what it stands for, and its per-slot bias becomes
  // log(mass), mass = tokens it stands for (a slot without bias counts 1).
  kv_fold fold = kv_fold::drop;
  int n_folded = 0;                    // entries per row
  std::vector<std::int32_t> folded;    // [n_rows][n_folded]
  // kv_fold::cluster: destination slots (absolute) that take the centroids.
  int anchors_per_row = 0;
  std::vector<std::int32_t> anchors;   // [n_rows][anchors_per_row]

  // StreamingLLM's positions within the cache: destination slot i's key is
  // rotated by rotate[i] positions (RoPE), so it reads as if computed there.
  // Empty: keys keep their rotation. Only with n_rows == 1.
  std::vector<std::int32_t> rotate;  // [n]

  const std::int32_t* row_sources(int r) const { return sources.data() + static_cast<std::size_t>(r) * n; }
  const std::int32_t* row_folded(int r) const { return folded.data() + static_cast<std::size_t>(r) * n_folded; }
};

}  // namespace pagoda
