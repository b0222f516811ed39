// A snapshot of the KV manager's state and counters, readable at any time
// (kv_manager::metrics()). Plain data: the server renders it as Prometheus
// text, `pagoda batch` as its summary.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pagoda {

// Why a cached block left a prefix index (kv_manager.h).
enum class eviction_reason : std::uint8_t {
  capacity,  // an allocation needed the block (the pool had no free one of its class)
  quota,     // its tenant, at or above its quota, paid with its own cache
  admin,     // dropped on request: the whole prefix cache reset, or a tenant's KV erased
};
inline constexpr std::size_t k_n_eviction_reasons = 3;
// "capacity", "quota", "admin" (Prometheus label values).
const char* eviction_reason_name(eviction_reason r);

struct tenant_kv_usage {
  std::string name;  // "" is the default (global) tenant
  std::int32_t n_used_blocks = 0;
  std::int32_t n_cached_blocks = 0;
  std::optional<std::int32_t> quota_blocks;  // std::nullopt: no quota
  std::int32_t n_side_blocks = 0;  // of n_used_blocks: held for side memory (kv_manager.h, "Side blocks")
};

// One KV group (kv_group.h): its kind, its blocks and what they hold.
// n_used + n_cached + n_free == n_blocks.
struct kv_group_usage {
  std::string kind;            // "full" or "sliding_window"
  std::int32_t window_tokens = 0;
  std::int32_t n_blocks = 0;
  std::int32_t n_used = 0;
  std::int32_t n_cached = 0;
  std::int32_t n_free = 0;
  std::int32_t n_used_peak = 0;
  std::int64_t n_stored_tokens = 0;
  std::int64_t n_evictions = 0;
  std::int64_t n_freed_out_of_window = 0;  // blocks a sliding window let go (still cached while the pool allows)
};

// One block class of the pool (kv_manager.h, "KV classes"):
// n_used + n_cached + n_free == n_blocks.
struct kv_class_usage {
  std::int32_t n_blocks = 0;
  std::int32_t n_used = 0;
  std::int32_t n_cached = 0;
  std::int32_t n_free = 0;
};

struct kv_metrics {
  std::int32_t block_size_tokens = 0;

  // Block states of group 0 (the main group; every group in `groups`), all
  // classes together; n_blocks_used + n_blocks_cached + n_blocks_free == n_blocks_total.
  std::int32_t n_blocks_total = 0;
  std::int32_t n_blocks_used = 0;    // ref > 0
  std::int32_t n_blocks_cached = 0;  // ref 0, still in the prefix index (evictable)
  std::int32_t n_blocks_free = 0;    // ref 0, nothing cached
  std::int32_t n_blocks_used_peak = 0;

  // Tokens whose K/V are stored in used blocks; a block shared by several
  // sequences counts once.
  std::int64_t n_stored_tokens = 0;
  std::int32_t n_sequences = 0;

  // Counters since construction.
  std::int64_t n_prefix_query_tokens = 0;  // prompt tokens looked up
  std::int64_t n_prefix_hit_tokens = 0;    // of those, served from the cache
  std::int64_t n_prefix_query_blocks = 0;  // full prompt blocks that could have come from the cache
  std::int64_t n_prefix_hit_blocks = 0;    // of those, found in it
  std::int64_t n_evictions = 0;            // cached blocks dropped from the indexes (every group)
  std::array<std::int64_t, k_n_eviction_reasons> n_evictions_by_reason{};  // [eviction_reason]: sums to n_evictions
  std::int64_t n_preemptions = 0;
  std::int64_t n_cow_copies = 0;

  // Side memory (kv_manager.h, "Side blocks"): group-0 blocks the sequences
  // hold for it (part of n_blocks_used), the bytes one such block stands for
  // (0: side memory is not charged), the sequences' bounds at their stored
  // tokens and what their side structures last reported holding.
  std::int32_t n_side_blocks = 0;
  std::int64_t side_block_bytes = 0;
  std::int64_t side_bound_bytes = 0;
  std::int64_t side_measured_bytes = 0;

  std::vector<kv_group_usage> groups;    // by group, always filled ([0] is the totals' group)
  std::vector<tenant_kv_usage> tenants;  // by tenant id
  // Group 0 by class, always filled: one entry per block class ([0] the
  // default KV type; a single-class pool has one, equal to the totals). Sums to the totals.
  std::vector<kv_class_usage> classes;

  // n_blocks_used / n_blocks_total (0 for an empty pool).
  double usage() const;
  // 1 - stored tokens / token slots of used blocks (0 with no used block).
  double fragmentation() const;
  // hit tokens / query tokens (0 before any query).
  double prefix_hit_ratio() const;
};

// One line for logs and summaries:
// "kv: 12/64 blocks used (18.8%), 3 cached, peak 20, frag 4.2%, prefix hits 128/512 (25.0%), ..."
std::string format_kv_metrics(const kv_metrics& m);

}  // namespace pagoda
