// The prefix index: key of a full block -> the block that holds it.
//
// A block's key chains its whole prefix (vLLM v1's hash_block_tokens):
//   key(block i) = xxh3(parent key, n_tokens, token ids of block i, extra keys of block i)
// with parent key = k_root_parent_key for block 0. Extra keys carry what makes
// equal tokens hold different KV or belong to someone else: the tenant and the
// cache salt enter block 0, so different tenants or salts never share a block
// (and, through the chain, nothing after it), while requests without either
// share one global cache. Room is left for an adapter id (every block) and
// media hashes (the blocks that hold the media): new extra_key_kind values.
//
// Only full blocks are keyed. Each registered block stores its parent key, its
// token ids and its extra keys, and find() compares all of them, so a 64-bit
// collision between two different blocks is a miss, never wrong KV. (A wrong hit
// would need a second, undetected collision in an ancestor's chained key.)
//
// The index holds at most one entry per key and per block: if a full block's
// key is already registered by another block, the newcomer simply stays
// unregistered (block tables are append-only; its holder keeps it).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

using block_key = std::uint64_t;
// The "parent" of a sequence's first block. Fixed, so keys mean the same thing
// in every process (persistent tiers store blocks by key).
inline constexpr block_key k_root_parent_key = 0x70a60da6b10c4e75ull;

enum class extra_key_kind : std::uint8_t {
  tenant = 1,
  cache_salt = 2,
  // Reserved: adapter = 3, media = 4.
  kv_class = 5,  // a block of a KV class other than the default (kv_manager.h, "KV classes")
  chunk = 6,     // the first block of a chunk computed alone (CacheBlend reuse), not a prompt's prefix
};

// Extra keys of one block as length-prefixed bytes, so that ("ab", "c") and
// ("a", "bc") differ. Empty when a block has none.
class extra_keys {
 public:
  extra_keys& add(extra_key_kind kind, std::string_view value);
  std::string_view bytes() const { return bytes_; }
  bool empty() const { return bytes_.empty(); }

 private:
  std::string bytes_;
};

// The chained key of one full block.
block_key hash_block(block_key parent, std::span<const token_id> tokens, std::string_view extras);

// The extra keys of a sequence's first block: its tenant and cache salt (either
// may be ""), and the chunk mark of a chunk computed alone (chunk reuse).
// Everything that computes a prompt's keys outside the KV manager (the
// router, src/router) calls this, so both always agree.
std::string first_block_extras(std::string_view tenant, std::string_view cache_salt, bool chunk = false);

class prefix_index {
 public:
  // REQUIRES: block_size > 0, n_blocks >= 0; block ids registered are < n_blocks.
  prefix_index(std::int32_t block_size, std::int32_t n_blocks);

  std::int32_t block_size() const { return block_size_; }
  std::size_t size() const { return by_key_.size(); }

  // The block registered under key whose parent key, tokens and extras all
  // equal the arguments; std::nullopt on a miss or a collision.
  std::optional<block_id> find(block_key key, block_key parent, std::span<const token_id> tokens,
                               std::string_view extras) const;
  // Registers a full block. Returns false and changes nothing when key is
  // already registered (by any block).
  // REQUIRES: tokens.size() == block_size; b not registered.
  bool insert(block_id b, block_key key, block_key parent, std::span<const token_id> tokens, std::string_view extras);
  // Forgets a block (it is evicted). REQUIRES: b registered.
  void erase(block_id b);

  bool contains(block_id b) const { return slot(b).registered; }
  // Changes with every insert and erase (a summary is unchanged while it is).
  std::uint64_t generation() const { return generation_; }
  // Calls f(key) for every registered key, in no particular order.
  template <typename F>
  void for_each_key(F&& f) const {
    for (const auto& [key, b] : by_key_) f(key);
  }
  // The key b is registered under. REQUIRES: contains(b).
  block_key key_of(block_id b) const;
  // The parent key b is registered with. REQUIRES: contains(b).
  block_key parent_of(block_id b) const;
  // The token ids b is registered with. REQUIRES: contains(b).
  std::span<const token_id> tokens_of(block_id b) const;

  // The map and the per-block slots agree both ways, and every registered key is
  // the hash of the parent, tokens and extras stored with it. O(n_blocks).
  status check_invariants() const;

 private:
  struct block_slot {
    bool registered = false;
    block_key key = 0;
    block_key parent = 0;
    std::string extras;
  };
  const block_slot& slot(block_id b) const;
  std::span<const token_id> slot_tokens(block_id b) const;

  std::int32_t block_size_;
  std::uint64_t generation_ = 0;
  std::unordered_map<block_key, block_id> by_key_;
  std::vector<block_slot> slots_;  // [n_blocks]
  std::vector<token_id> tokens_;   // [n_blocks][block_size]
};

}  // namespace pagoda
