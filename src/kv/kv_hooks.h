// What the engine hands to the outside about KV blocks, and takes from it:
// the eviction hook, the commit hook (write-through to persistent tiers), and
// external KV sources (the load path). Keys are kv_manager's chained block keys;
// bytes are always named with the layout they are in (blocks of another KV
// class have another format), as layout_fingerprint (store/store_key.h) gives it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>

#include "kv/prefix_index.h"
#include "pagoda/types.h"

namespace pagoda {

// A block leaving (evicted) or entering (cached) the prefix cache, with its bytes
// (kv_backend::read_block's), valid only during the call.
struct kv_block_bytes {
  std::uint64_t layout = 0;          // layout_fingerprint of the layout `bytes` are in (the block's KV class)
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

// A block as a source holds it: its chained key and the layout its bytes must
// be in (the layout of the KV class the block gets in the pool). Two blocks of
// the same tokens in two layouts are two entries.
struct stored_block_ref {
  std::uint64_t layout = 0;  // layout_fingerprint
  block_key key = 0;
  friend bool operator==(const stored_block_ref&, const stored_block_ref&) = default;
};

// n_available's answer when it does not know yet (a remote tier's lookup is
// in flight): the caller leaves the request waiting as it is and asks again
// at a later step, when the answer is ready (or the tier counts as holding nothing).
inline constexpr int k_source_pending = -1;

// Somewhere KV blocks can come from instead of being computed (a disk or
// remote tier): the load path. A sequence whose prompt continues in a source
// is LOADING: its blocks are allocated, prefetch() is called, and once
// settled() the runner read()s them into the pool; then the sequence runs.
//
// Threads: every call comes from the engine thread and must answer from
// memory, never waiting on a disk, a network or a lock held across either
// (the warehouse does its I/O on threads of its own). The defaults suit a
// source that answers at once.
inline constexpr int k_max_source_tiers = 4;

class kv_block_source {
 public:
  virtual ~kv_block_source() = default;
  // How many of `refs`, from the first on, this source holds now; or
  // k_source_pending when that is not known yet (ask again at the next step).
  virtual int n_available(std::string_view tenant, std::span<const stored_block_ref> refs) = 0;
  // Starts fetching these blocks, in the background where the source can, and
  // holds them until release(). A source may refuse (memory): the blocks are
  // then misses at read() and computed instead.
  virtual void prefetch(std::string_view tenant, std::span<const stored_block_ref> refs) {}
  // Whether every block of `refs` is fetched or failed, so read() answers at once.
  virtual bool settled(std::string_view tenant, std::span<const stored_block_ref> refs) { return true; }
  // The bytes stored under ref (kv_backend::write_block's format, of ref.layout)
  // into `out`. Returns the tier the block came from (0 for a source of one
  // tier; tiers are the source's own, in its lookup order, up to
  // k_max_source_tiers), or -1 when it cannot deliver now (the block is then
  // computed instead): a source never fetches here what was not prefetched.
  virtual int read(std::string_view tenant, const stored_block_ref& ref, std::span<std::byte> out) = 0;
  // The loading sequence that prefetched `refs` no longer needs them (loaded,
  // preempted, aborted or failed): one release() per prefetch(), of the same refs.
  virtual void release(std::string_view tenant, std::span<const stored_block_ref> refs) {}
};

}  // namespace pagoda
