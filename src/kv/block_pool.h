// The block pool: ids 0..n_blocks-1, reference counts, and one free queue in
// LRU order. It holds no tensors (kv_storage does) and knows no sequences
// (kv_manager does); it tests alone.
//
// Block states (every block is in exactly one):
//   used    ref > 0                (held by at least one block table)
//   cached  ref == 0, hashed       (evictable; still findable in the prefix index)
//   free    ref == 0, not hashed   (garbage, reused first)
// n_free() + n_used() + n_cached() == n_blocks() at all times.
//
// The free queue holds exactly the ref-0 blocks (free and cached). take() pops
// its head. Released blocks without a hash are pushed at the head, so they are
// reused before any cached block; released cached blocks are appended at the
// tail, so cached blocks leave in least-recently-released order. A caller that
// releases a whole block table in reverse order (deepest block first) makes the
// deepest block of a chain the first of that chain to be evicted (vLLM v1's
// block_pool.py does the same).
//
// Every used or cached block has an owner (a tenant). The pool keeps per-owner
// counts and, per owner, a second LRU list of its cached blocks so that a tenant
// at its quota can evict its own cache first (take_cached_of) without touching
// anyone else's. Policy (quotas, who may evict what) lives in kv_manager.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

struct tenant_id_tag {};
// A tenant as the KV manager numbers it: 0 is the default (global) tenant.
using tenant_id = strong_id<tenant_id_tag, std::int32_t>;

class block_pool {
 public:
  struct taken {
    block_id id;
    // The block was cached: its hash is gone now and the caller must drop it
    // from the prefix index (an eviction).
    bool evicted = false;
  };

  // REQUIRES: n_blocks >= 0. The queue starts as 0, 1, ..., n_blocks-1 (all free).
  explicit block_pool(std::int32_t n_blocks);

  std::int32_t n_blocks() const { return static_cast<std::int32_t>(blocks_.size()); }
  std::int32_t n_used() const { return n_used_; }
  std::int32_t n_cached() const { return n_cached_; }
  std::int32_t n_free() const { return n_blocks() - n_used_ - n_cached_; }
  // Blocks take() can hand out now: free + cached (the length of the free queue).
  std::int32_t n_takeable() const { return queue_.size; }

  std::int32_t n_used(tenant_id owner) const;
  std::int32_t n_cached(tenant_id owner) const;

  // Pops the head of the free queue, gives it to owner with ref 1.
  // std::nullopt when the queue is empty (normal flow).
  std::optional<taken> take(tenant_id owner);
  // Pops owner's least recently released cached block (always an eviction), ref 1.
  // std::nullopt when owner has no cached block.
  std::optional<taken> take_cached_of(tenant_id owner);

  // One more holder. A ref-0 block leaves the free queue (a prefix-cache hit).
  // REQUIRES: the block is used, or cached (a free block holds nothing to share).
  void ref(block_id b);
  // One holder fewer. At ref 0 the block enters the free queue: at the tail if
  // hashed (cached), at the head otherwise.
  // REQUIRES: ref_count(b) > 0.
  void unref(block_id b);

  // The block now holds a full block registered in the prefix index.
  // REQUIRES: ref_count(b) > 0 and not yet hashed.
  void set_hashed(block_id b);
  // Evicts a cached block in place: it loses its hash and moves to the head of the
  // queue as a free block. The caller drops it from the prefix index.
  // REQUIRES: cached (ref 0, hashed).
  void drop_hash(block_id b);
  // A used block leaves the prefix index (its holder is about to rewrite it).
  // The caller drops it from the prefix index. REQUIRES: ref_count(b) > 0, hashed.
  void clear_hash(block_id b);

  std::int32_t ref_count(block_id b) const { return at(b).ref; }
  bool is_hashed(block_id b) const { return at(b).hashed; }
  bool in_free_queue(block_id b) const { return at(b).ref == 0; }
  // Owner of a used or cached block; invalid for a free block.
  tenant_id owner(block_id b) const { return at(b).owner; }

  // The free queue, head (taken next) to tail. O(n); for tests and diagnostics.
  std::vector<block_id> free_queue() const;
  // owner's least recently released cached block (the one take_cached_of takes).
  std::optional<block_id> oldest_cached_of(tenant_id owner) const;
  // owner's cached blocks, least recently released first. O(n); for tests.
  std::vector<block_id> cached_of(tenant_id owner) const;

  // Recounts everything from scratch: list links, queue membership (exactly the
  // ref-0 blocks), counts per state and per owner. O(n_blocks).
  status check_invariants() const;

 private:
  static constexpr std::int32_t k_nil = -1;

  struct links {
    std::int32_t prev = k_nil;
    std::int32_t next = k_nil;
  };
  // A doubly linked list threaded through a vector<links> indexed by block id:
  // O(1) push at either end and removal from the middle, no allocation.
  struct index_list {
    std::int32_t head = k_nil;
    std::int32_t tail = k_nil;
    std::int32_t size = 0;
    void push_front(std::vector<links>& l, std::int32_t i);
    void push_back(std::vector<links>& l, std::int32_t i);
    void remove(std::vector<links>& l, std::int32_t i);
  };
  struct block_state {
    std::int32_t ref = 0;
    bool hashed = false;
    tenant_id owner;
  };
  struct owner_state {
    std::int32_t n_used = 0;
    index_list cached;  // through owner_links_
  };

  const block_state& at(block_id b) const;
  block_state& at(block_id b);
  owner_state& owner_at(tenant_id t);
  // Takes block i out of the free queue (and its owner's cached list) and hands it to owner.
  taken claim(std::int32_t i, tenant_id owner);

  std::vector<block_state> blocks_;
  std::vector<links> queue_links_;  // [n_blocks]
  std::vector<links> owner_links_;  // [n_blocks]; cached blocks only
  index_list queue_;
  std::vector<owner_state> owners_;  // [tenant id], grown on first use
  std::int32_t n_used_ = 0;
  std::int32_t n_cached_ = 0;
};

}  // namespace pagoda
