// What the engine hands to the outside about KV blocks, and takes from it:
// the eviction hook, the commit hook (write-through to persistent tiers), and
// external KV sources (the load path). Keys are kv_manager's chained block keys.
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <string_view>

#include "kv/prefix_index.h"
#include "pagoda/types.h"

namespace pagoda {

// A block leaving (evicted) or entering (cached) the prefix cache, with its bytes
// (kv_backend::read_block's), valid only during the call.
struct kv_block_bytes {
  block_key key = 0;
  block_key parent = 0;
  std::string_view tenant;           // the owner's tenant name ("" = default)
  std::span<const token_id> tokens;  // its block_size token ids
  std::span<const std::byte> bytes;
};
using evicted_block = kv_block_bytes;
using cached_block = kv_block_bytes;
// Called for each block evicted from the prefix cache, before its bytes can be reused.
using eviction_hook = std::function<void(const evicted_block&)>;
// Called for each block that entered the prefix cache (its K/V written and committed).
using commit_hook = std::function<void(const cached_block&)>;

// Somewhere KV blocks can come from instead of being computed (a disk or
// remote tier): the load path. A sequence whose prompt continues in a source
// is LOADING: its blocks are allocated, prefetch() is called, and once
// settled() the runner read()s them into the pool; then the sequence runs.
// The defaults suit a source that answers at once.
inline constexpr int k_max_source_tiers = 4;

class kv_block_source {
 public:
  virtual ~kv_block_source() = default;
  // How many of `keys`, from the first on, this source holds now.
  virtual int n_available(std::string_view tenant, std::span<const block_key> keys) = 0;
  // Starts fetching these blocks, in the background where the source can.
  virtual void prefetch(std::string_view tenant, std::span<const block_key> keys) {}
  // Whether every block of `keys` is fetched or failed, so read() answers at once.
  virtual bool settled(std::string_view tenant, std::span<const block_key> keys) { return true; }
  // The bytes stored under key (kv_backend::write_block's format) into `out`.
  // Returns the tier the block came from (0 for a source of one tier; tiers
  // are the source's own, in its lookup order, up to k_max_source_tiers), or
  // -1 when it cannot deliver (the block is then computed instead).
  virtual int read(std::string_view tenant, block_key key, std::span<std::byte> out) = 0;
};

}  // namespace pagoda
