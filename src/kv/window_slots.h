// Window slots: where the K/V of a model's sliding-window layers live when
// those layers keep only their window (Gemma 2/3 interleave sliding-window
// and global layers; llama.cpp's iSWA cache, vLLM's hybrid allocator).
//
// A block of the pool holds block_size tokens of every GLOBAL layer. Its
// tokens' K/V for the windowed layers live in a window slot, bound to the
// block while some sequence can still see them, from a much smaller arena
// (about one window per sequence instead of one context). This class is the
// bookkeeping of that arena: no tensors. The KV manager decides bindings; the
// storage follows them (kv_op_kind::bind_window).
//
// A bound slot is PINNED (some sequence still needs its block's windowed K/V:
// kv_manager counts claims) or RETAINED (nobody needs it now, but it still
// holds its block's K/V, so a prefix-cache hit can use them again). Binding a
// slot to a new block takes a free slot first, then the least recently
// retained one, whose block loses its windowed K/V (it stays bound to nothing
// in this arena; its global layers are untouched). A slot returns to the free
// list when its block goes back to the pool or leaves the prefix cache.
#pragma once

#include <cstdint>
#include <vector>

#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

class window_slots {
 public:
  // REQUIRES: n_blocks >= 0, n_slots >= 0.
  window_slots(std::int32_t n_blocks, std::int32_t n_slots);

  std::int32_t n_slots() const { return static_cast<std::int32_t>(slot_block_.size()); }
  // The slot bound to b, or -1.
  std::int32_t slot_of(block_id b) const { return block_slot_[static_cast<std::size_t>(b.value)]; }
  bool bound(block_id b) const { return slot_of(b) >= 0; }
  bool pinned(block_id b) const { return bound(b) && pinned_[static_cast<std::size_t>(slot_of(b))]; }
  // Slots bind() can take now: free + retained.
  std::int32_t n_takeable() const { return n_slots() - n_pinned_; }
  std::int32_t n_pinned() const { return n_pinned_; }
  std::int32_t n_bound() const { return n_bound_; }
  std::int32_t peak_pinned() const { return peak_pinned_; }
  // Binds that took a retained slot (its block lost its windowed K/V).
  std::int64_t n_lost() const { return n_lost_; }

  struct binding {
    std::int32_t slot = -1;
    block_id lost;  // the block whose retained K/V the slot held, or block_id() (-1)
  };
  // Binds a slot to b, pinned. REQUIRES: !bound(b), n_takeable() > 0.
  binding bind(block_id b);
  // Pinned -> retained (the most recently retained). REQUIRES: pinned(b).
  void retain(block_id b);
  // Retained -> pinned. REQUIRES: bound(b) && !pinned(b).
  void pin(block_id b);
  // b's slot (pinned or retained) becomes free; nothing when unbound.
  void unbind(block_id b);

  // The bindings are mutual, the LRU list holds exactly the retained slots,
  // the counts add up.
  status check_invariants() const;

 private:
  void unlink(std::int32_t slot);
  void link_tail(std::int32_t slot);

  std::vector<std::int32_t> block_slot_;  // [n_blocks]: slot or -1
  std::vector<std::int32_t> slot_block_;  // [n_slots]: block or -1
  std::vector<std::uint8_t> pinned_;      // [n_slots]
  // The retained slots, least recently retained first: a doubly linked list
  // through prev_/next_ (-1 ends it).
  std::vector<std::int32_t> prev_, next_;
  std::int32_t head_ = -1, tail_ = -1;
  std::vector<std::int32_t> free_;  // free slots (a stack)
  std::int32_t n_pinned_ = 0;
  std::int32_t n_bound_ = 0;
  std::int32_t peak_pinned_ = 0;
  std::int64_t n_lost_ = 0;
};

}  // namespace pagoda
