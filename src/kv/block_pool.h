// The block pool: ids 0..n_blocks-1, reference counts, and free queues in
// LRU order. It holds no tensors (kv_storage does) and knows no sequences
// (kv_manager does); it tests alone.
//
// Block classes. The ids are split into classes, each a contiguous range:
// class 0 owns [0, n_0), class 1 owns [n_0, n_0 + n_1), and so on. A class
// stands for a KV format (class 0 the default KV type, others e.g. int4); the
// pool only knows the ranges. A block's class never changes. Every class has a
// free queue of its own and everything below (LRU order, eviction, the
// per-owner cached lists) holds WITHIN a class: take(owner, c) hands out only
// blocks of class c and evicts only cached blocks of class c. A pool built
// from one size has one class, and then everything is as it always was.
//
// Block states (every block is in exactly one):
//   used    ref > 0                (held by at least one block table)
//   cached  ref == 0, hashed       (evictable; still findable in the prefix index)
//   free    ref == 0, not hashed   (garbage, reused first)
// n_free() + n_used() + n_cached() == n_blocks() at all times, and the same
// per class.
//
// A class's free queue holds exactly its ref-0 blocks (free and cached).
// take() pops its head. Released blocks without a hash are pushed at the head,
// so they are reused before any cached block; released cached blocks are
// appended at the tail, so cached blocks leave in least-recently-released
// order. A caller that releases a whole block table in reverse order (deepest
// block first) makes the deepest block of a chain the first of that chain to be
// evicted (vLLM v1's block_pool.py does the same).
//
// Every used or cached block has an owner (a tenant). The pool keeps per-owner
// counts (all classes together) and, per owner and class, a second LRU list of
// its cached blocks so that a tenant at its quota can evict its own cache first
// (take_cached_of) without touching anyone else's. oldest_cached_of() compares
// release times across an owner's classes, so it is the owner's least recently
// released cached block of any class. Policy (quotas, who may evict what)
// lives in kv_manager.
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

// The most block classes a pool may have (KV formats are few; callers size
// per-class scratch by it).
inline constexpr std::int32_t k_max_kv_classes = 16;

class block_pool {
 public:
  struct taken {
    block_id id;
    // The block was cached: its hash is gone now and the caller must drop it
    // from the prefix index (an eviction).
    bool evicted = false;
  };

  // One class. REQUIRES: n_blocks >= 0. The queue starts as 0, 1, ..., n_blocks-1 (all free).
  explicit block_pool(std::int32_t n_blocks);
  // class_sizes[c] blocks of class c, ids in class order. Each queue starts in id order.
  // REQUIRES: 1 <= class_sizes.size() <= k_max_kv_classes, every size >= 0, the sum fits in int32.
  explicit block_pool(std::vector<std::int32_t> class_sizes);

  std::int32_t n_blocks() const { return static_cast<std::int32_t>(blocks_.size()); }
  std::int32_t n_used() const { return n_used_; }
  std::int32_t n_cached() const { return n_cached_; }
  std::int32_t n_free() const { return n_blocks() - n_used_ - n_cached_; }
  // Blocks take() can hand out now, over all classes: free + cached.
  std::int32_t n_takeable() const { return n_blocks() - n_used_; }

  // --- classes (REQUIRES for every c below: 0 <= c < n_classes()) ---
  std::int32_t n_classes() const { return static_cast<std::int32_t>(classes_.size()); }
  std::int32_t class_of(block_id b) const { return at(b).cls; }
  // The class's ids are [class_first(c), class_first(c) + class_size(c)).
  std::int32_t class_first(std::int32_t c) const { return cls_at(c).first; }
  std::int32_t class_size(std::int32_t c) const { return cls_at(c).size; }
  std::int32_t n_used_in(std::int32_t c) const { return cls_at(c).n_used; }
  std::int32_t n_cached_in(std::int32_t c) const { return cls_at(c).n_cached; }
  std::int32_t n_free_in(std::int32_t c) const { return class_size(c) - n_used_in(c) - n_cached_in(c); }
  // Blocks take(owner, c) can hand out now: the length of class c's free queue.
  std::int32_t n_takeable(std::int32_t c) const { return cls_at(c).queue.size; }

  // Used and cached blocks of owner, all classes together.
  std::int32_t n_used(tenant_id owner) const;
  std::int32_t n_cached(tenant_id owner) const;

  // Pops the head of class cls's free queue, gives it to owner with ref 1.
  // std::nullopt when that queue is empty (normal flow), whatever other classes hold.
  std::optional<taken> take(tenant_id owner, std::int32_t cls = 0);
  // Pops owner's least recently released cached block of class cls (always an
  // eviction), ref 1. std::nullopt when owner has no cached block of that class.
  std::optional<taken> take_cached_of(tenant_id owner, std::int32_t cls = 0);

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

  // Class cls's free queue, head (taken next) to tail. O(n); for tests and diagnostics.
  std::vector<block_id> free_queue(std::int32_t cls) const;
  // Every class's free queue, class 0's first.
  std::vector<block_id> free_queue() const;
  // owner's least recently released cached block of any class (with one class,
  // the one take_cached_of takes).
  std::optional<block_id> oldest_cached_of(tenant_id owner) const;
  // owner's cached blocks of class cls, least recently released first. O(n); for tests.
  std::vector<block_id> cached_of(tenant_id owner, std::int32_t cls) const;
  // The same for every class, class 0's first.
  std::vector<block_id> cached_of(tenant_id owner) const;

  // Recounts everything from scratch: class ranges, list links, queue
  // membership (exactly the ref-0 blocks of the queue's class), LRU order of
  // cached blocks, counts per state, per class and per owner. O(n_blocks).
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
    std::uint8_t cls = 0;
    tenant_id owner;
  };
  struct class_state {
    std::int32_t first = 0;
    std::int32_t size = 0;
    index_list queue;  // through queue_links_
    std::int32_t n_used = 0;
    std::int32_t n_cached = 0;
  };
  struct owner_state {
    std::int32_t n_used = 0;
    std::int32_t n_cached = 0;
  };

  const block_state& at(block_id b) const;
  block_state& at(block_id b);
  const class_state& cls_at(std::int32_t c) const;
  owner_state& owner_at(tenant_id t);
  // owner's cached list of class c: owner_cached_[owner * n_classes + c]. REQUIRES: owner_at(owner) was called.
  index_list& cached_list(tenant_id owner, std::int32_t c);
  const index_list* find_cached_list(tenant_id owner, std::int32_t c) const;
  // Takes block i out of its free queue (and its owner's cached list) and hands it to owner.
  taken claim(std::int32_t i, tenant_id owner);
  // A cached block is no longer cached (claimed, hit or dropped): out of the queue and its owner's list.
  void uncache(std::int32_t i, block_state& s);

  std::vector<block_state> blocks_;
  std::vector<links> queue_links_;  // [n_blocks]
  std::vector<links> owner_links_;  // [n_blocks]; cached blocks only
  std::vector<std::uint64_t> released_at_;  // [n_blocks]: when a cached block was released (LRU across classes)
  std::uint64_t n_releases_ = 0;
  std::vector<class_state> classes_;       // [class]
  std::vector<owner_state> owners_;        // [tenant id], grown on first use
  std::vector<index_list> owner_cached_;   // [tenant id][class]: cached blocks, through owner_links_
  std::int32_t n_used_ = 0;
  std::int32_t n_cached_ = 0;
};

}  // namespace pagoda
