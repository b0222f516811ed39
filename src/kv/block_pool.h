// The block pool: ids 0..n_blocks-1, reference counts, free blocks and the
// order in which cached blocks are evicted. It holds no tensors (kv_storage
// does) and knows no sequences (kv_manager does); it tests alone.
//
// Block classes. The ids are split into classes, each a contiguous range:
// class 0 owns [0, n_0), class 1 owns [n_0, n_0 + n_1), and so on. A class
// stands for a KV format (class 0 the default KV type, others e.g. int4); the
// pool only knows the ranges. A block's class never changes. Every class has
// queues of its own and everything below (eviction order, the eviction clock,
// the per-owner cached lists) holds WITHIN a class: take(owner, c) hands out
// only blocks of class c and evicts only cached blocks of class c. A pool
// built from one size has one class.
//
// Block states (every block is in exactly one):
//   used    ref > 0                (held by at least one block table)
//   cached  ref == 0, hashed       (evictable; still findable in the prefix index)
//   free    ref == 0, not hashed   (garbage, reused first)
// n_free() + n_used() + n_cached() == n_blocks() at all times, and the same
// per class.
//
// Eviction order (cache_eviction). take() hands out a free block if its class
// has one (the most recently freed first), else it evicts the class's
// cached block of least worth:
//   lru  the least recently released (a release is the unref to 0);
//   lfu  the least worth by core/reuse_worth.h: a block's uses (ref of a
//        hashed block: a prefix-cache hit or a fork; reset when it is taken
//        or hashed anew) give it a level, floor(log2(1 + uses)) capped at
//        k_max_level, and at release it gets the key clock + level, where the
//        class's clock is the key of the last block take() evicted. The
//        least key goes first, equal keys in release order. One-off blocks
//        (level 0) enter at the clock and leave first, so a scan of them
//        does not flush blocks that were reused; reused blocks nobody asks
//        for again fade as the clock moves past them (LFU with dynamic
//        ageing). Keys of cached blocks lie in [clock, clock + k_max_level],
//        so the class keeps one FIFO bucket per key modulo k_levels and every
//        operation is O(1) (take scans at most k_levels buckets).
// lru is lfu with every level 0: one bucket, release order.
//
// Chains. A caller that releases a whole block table deepest block first
// makes a chain's deeper blocks leave before their ancestors (vLLM v1's
// block_pool.py does the same), under both orders: every holder of a block
// holds its ancestors and releases them after it, and every hit on a block
// is a hit on its ancestors, so an ancestor's uses, level and key are at
// least its descendant's and it is released later. A root evicted before its
// descendants would leave them unreachable in the index until it is computed again.
// This holds within a class; a chain whose blocks are of several classes
// (typed prompt segments) keeps it for take() of each class, but
// next_cached_of() compares classes by worth relative to their clocks, which
// may pick an ancestor of one class before a descendant of another.
//
// Every used or cached block has an owner (a tenant). The pool keeps per-owner
// counts (all classes together) and, per owner and class, the same buckets
// of its cached blocks so that a tenant at its quota can evict its own least
// worth block first (take_cached_of) without touching anyone else's.
// next_cached_of() compares across an owner's classes by key relative to each
// class's clock, then release time. Policy (quotas, who may evict what)
// lives in kv_manager.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
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

// The order in which take() evicts cached blocks (see above; --prefix-cache-eviction).
enum class cache_eviction : std::uint8_t { lru, lfu };
const char* cache_eviction_name(cache_eviction e);
// "lru" or "lfu"; std::nullopt for anything else.
std::optional<cache_eviction> parse_cache_eviction(std::string_view name);

class block_pool {
 public:
  // lfu: worth levels 0..k_max_level; cached blocks sit in k_levels buckets per class and owner.
  static constexpr std::int32_t k_max_level = 3;
  static constexpr std::int32_t k_levels = k_max_level + 1;

  struct taken {
    block_id id;
    // The block was cached: its hash is gone now and the caller must drop it
    // from the prefix index (an eviction).
    bool evicted = false;
  };

  // One class. REQUIRES: n_blocks >= 0. The queue starts as 0, 1, ..., n_blocks-1 (all free).
  explicit block_pool(std::int32_t n_blocks, cache_eviction eviction = cache_eviction::lru);
  // class_sizes[c] blocks of class c, ids in class order. Each queue starts in id order.
  // REQUIRES: 1 <= class_sizes.size() <= k_max_kv_classes, every size >= 0, the sum fits in int32.
  explicit block_pool(std::vector<std::int32_t> class_sizes, cache_eviction eviction = cache_eviction::lru);

  cache_eviction eviction() const { return eviction_; }

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
  // Blocks take(owner, c) can hand out now: class c's free and cached blocks.
  std::int32_t n_takeable(std::int32_t c) const { return cls_at(c).free.size + cls_at(c).n_cached; }

  // Used and cached blocks of owner, all classes together.
  std::int32_t n_used(tenant_id owner) const;
  std::int32_t n_cached(tenant_id owner) const;

  // Gives the head of class cls's queue (a free block, else the cached block
  // of least worth, evicted) to owner with ref 1; under lfu evicting moves the
  // class's clock to that block's key. std::nullopt when the class has no
  // free or cached block (normal flow), whatever other classes hold.
  std::optional<taken> take(tenant_id owner, std::int32_t cls = 0);
  // Evicts owner's cached block of class cls of least worth (in the class's
  // eviction order) and gives it to owner, ref 1; the clock stays. std::nullopt
  // when owner has no cached block of that class.
  std::optional<taken> take_cached_of(tenant_id owner, std::int32_t cls = 0);

  // One more holder. A hashed block counts a use (its worth under lfu); a
  // ref-0 one leaves the queues (a prefix-cache hit).
  // REQUIRES: the block is used, or cached (a free block holds nothing to share).
  void ref(block_id b);
  // One holder fewer. At ref 0 a hashed block is cached (keyed by its worth
  // now, behind the blocks of its key), an unhashed one freed (taken first).
  // REQUIRES: ref_count(b) > 0.
  void unref(block_id b);

  // The block now holds a full block registered in the prefix index; its uses start at 0.
  // REQUIRES: ref_count(b) > 0 and not yet hashed.
  void set_hashed(block_id b);
  // Evicts a cached block in place: it loses its hash and becomes the class's
  // next free block. The caller drops it from the prefix index.
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
  // Uses counted since the block was hashed (capped where they stop mattering).
  std::int32_t uses(block_id b) const { return at(b).uses; }
  // lfu: the key a cached block was released with (see above); 0 under lru.
  // REQUIRES: cached.
  std::int64_t eviction_key(block_id b) const;
  // Class cls's eviction clock (always 0 under lru).
  std::int64_t clock(std::int32_t cls) const { return cls_at(cls).clock; }

  // Class cls's queue in the order take() hands it out: free blocks, then
  // cached ones by key and release. O(n); for tests and diagnostics.
  std::vector<block_id> free_queue(std::int32_t cls) const;
  // Every class's queue, class 0's first.
  std::vector<block_id> free_queue() const;
  // owner's cached block of least worth of any class: the least key relative
  // to its class's clock, then the least recently released (with one class,
  // the one take_cached_of takes).
  std::optional<block_id> next_cached_of(tenant_id owner) const;
  // owner's cached blocks of class cls in eviction order. O(n); for tests.
  std::vector<block_id> cached_of(tenant_id owner, std::int32_t cls) const;
  // The same for every class, class 0's first.
  std::vector<block_id> cached_of(tenant_id owner) const;

  // Recounts everything from scratch: class ranges, list links, queue
  // membership (exactly the ref-0 blocks of the queue's class, free and
  // cached apart), each cached block in the bucket of its key, keys within
  // [clock, clock + k_max_level] (equal to the clock under lru), release
  // order within a bucket, uses within their cap, counts per state, per
  // class and per owner. O(n_blocks).
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
  using buckets = std::array<index_list, k_levels>;  // [key % k_levels], each in release order
  struct block_state {
    std::int32_t ref = 0;
    bool hashed = false;
    std::uint8_t cls = 0;
    std::uint8_t uses = 0;  // since hashed, capped at reuse::uses_cap(k_max_level)
    tenant_id owner;
  };
  struct class_state {
    std::int32_t first = 0;
    std::int32_t size = 0;
    index_list free;   // unhashed ref-0 blocks, taken from the head; through queue_links_
    buckets cached;    // cached blocks; through queue_links_
    std::int64_t clock = 0;  // lfu: the key of the last block take() evicted
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
  // owner's cached buckets of class c: owner_cached_[owner * n_classes + c]. REQUIRES: owner_at(owner) was called.
  buckets& cached_lists(tenant_id owner, std::int32_t c);
  const buckets* find_cached_lists(tenant_id owner, std::int32_t c) const;
  // The first block of the least non-empty bucket from the class's clock on; k_nil when all are empty.
  std::int32_t first_cached(const buckets& b, std::int64_t clock) const;
  // Appends the buckets' blocks in eviction order (keys from clock on).
  void append_cached(std::vector<block_id>& out, const std::vector<links>& l, const buckets& b,
                     std::int64_t clock) const;
  // check_invariants of one class's lists (counting each block listed in in_queue), and of
  // cached buckets of class c (an owner's when owner is valid; n_listed: their blocks).
  status check_class_lists(std::int32_t c, std::vector<std::uint8_t>& in_queue) const;
  status check_buckets(const buckets& b, const std::vector<links>& l, std::int32_t c, tenant_id owner,
                       std::int32_t& n_listed, std::vector<std::uint8_t>* in_queue) const;
  // Takes block i out of its free queue (and its owner's cached list) and hands it to owner.
  taken claim(std::int32_t i, tenant_id owner);
  // A cached block is no longer cached (claimed, hit or dropped): out of the queue and its owner's list.
  void uncache(std::int32_t i, block_state& s);

  std::vector<block_state> blocks_;
  std::vector<links> queue_links_;  // [n_blocks]
  std::vector<links> owner_links_;  // [n_blocks]; cached blocks only
  std::vector<std::uint64_t> released_at_;  // [n_blocks]: when a cached block was released (order within a key)
  std::vector<std::int64_t> key_;           // [n_blocks]: a cached block's key (lfu)
  std::uint64_t n_releases_ = 0;
  cache_eviction eviction_ = cache_eviction::lru;
  std::vector<class_state> classes_;       // [class]
  std::vector<owner_state> owners_;        // [tenant id], grown on first use
  std::vector<buckets> owner_cached_;      // [tenant id][class]: cached blocks, through owner_links_
  std::int32_t n_used_ = 0;
  std::int32_t n_cached_ = 0;
};

}  // namespace pagoda
