#include "kv/window_slots.h"

#include "core/assert.h"

namespace pagoda {

window_slots::window_slots(std::int32_t n_blocks, std::int32_t n_slots)
    : block_slot_(static_cast<std::size_t>(n_blocks), -1),
      slot_block_(static_cast<std::size_t>(n_slots), -1),
      pinned_(static_cast<std::size_t>(n_slots), 0),
      prev_(static_cast<std::size_t>(n_slots), -1),
      next_(static_cast<std::size_t>(n_slots), -1) {
  PAGODA_ASSERT(n_blocks >= 0 && n_slots >= 0, "window slots for {} blocks, {} slots", n_blocks, n_slots);
  free_.reserve(static_cast<std::size_t>(n_slots));
  for (std::int32_t s = n_slots - 1; s >= 0; --s) free_.push_back(s);
}

void window_slots::unlink(std::int32_t slot) {
  const auto u = static_cast<std::size_t>(slot);
  if (prev_[u] >= 0) next_[static_cast<std::size_t>(prev_[u])] = next_[u];
  else head_ = next_[u];
  if (next_[u] >= 0) prev_[static_cast<std::size_t>(next_[u])] = prev_[u];
  else tail_ = prev_[u];
  prev_[u] = next_[u] = -1;
}

void window_slots::link_tail(std::int32_t slot) {
  const auto u = static_cast<std::size_t>(slot);
  prev_[u] = tail_;
  next_[u] = -1;
  if (tail_ >= 0) next_[static_cast<std::size_t>(tail_)] = slot;
  else head_ = slot;
  tail_ = slot;
}

window_slots::binding window_slots::bind(block_id b) {
  PAGODA_ASSERT(!bound(b), "block {} already holds window slot {}", b.value, slot_of(b));
  PAGODA_ASSERT(n_takeable() > 0, "all {} window slots are pinned", n_slots());
  binding out;
  if (!free_.empty()) {
    out.slot = free_.back();
    free_.pop_back();
    ++n_bound_;
  } else {
    out.slot = head_;  // the least recently retained: its block loses its windowed K/V
    unlink(out.slot);
    out.lost = block_id(slot_block_[static_cast<std::size_t>(out.slot)]);
    ++n_lost_;
    block_slot_[static_cast<std::size_t>(out.lost.value)] = -1;
  }
  slot_block_[static_cast<std::size_t>(out.slot)] = b.value;
  block_slot_[static_cast<std::size_t>(b.value)] = out.slot;
  pinned_[static_cast<std::size_t>(out.slot)] = 1;
  if (++n_pinned_ > peak_pinned_) peak_pinned_ = n_pinned_;
  return out;
}

void window_slots::retain(block_id b) {
  PAGODA_ASSERT(pinned(b), "retain: block {} holds no pinned window slot", b.value);
  const std::int32_t s = slot_of(b);
  pinned_[static_cast<std::size_t>(s)] = 0;
  --n_pinned_;
  link_tail(s);
}

void window_slots::pin(block_id b) {
  PAGODA_ASSERT(bound(b) && !pinned(b), "pin: block {} holds no retained window slot", b.value);
  const std::int32_t s = slot_of(b);
  unlink(s);
  pinned_[static_cast<std::size_t>(s)] = 1;
  if (++n_pinned_ > peak_pinned_) peak_pinned_ = n_pinned_;
}

void window_slots::unbind(block_id b) {
  const std::int32_t s = slot_of(b);
  if (s < 0) return;
  if (pinned_[static_cast<std::size_t>(s)]) {
    pinned_[static_cast<std::size_t>(s)] = 0;
    --n_pinned_;
  } else {
    unlink(s);
  }
  slot_block_[static_cast<std::size_t>(s)] = -1;
  block_slot_[static_cast<std::size_t>(b.value)] = -1;
  free_.push_back(s);
  --n_bound_;
}

status window_slots::check_invariants() const {
  std::int32_t bound_count = 0, pinned_count = 0;
  for (std::size_t s = 0; s < slot_block_.size(); ++s) {
    const std::int32_t b = slot_block_[s];
    if (b < 0) {
      if (pinned_[s]) return error(errc::internal, "window slot {} is pinned but bound to no block", s);
      continue;
    }
    ++bound_count;
    if (block_slot_[static_cast<std::size_t>(b)] != static_cast<std::int32_t>(s))
      return error(errc::internal, "window slot {} names block {}, which names slot {}", s, b,
                   block_slot_[static_cast<std::size_t>(b)]);
    if (pinned_[s]) ++pinned_count;
  }
  for (std::size_t b = 0; b < block_slot_.size(); ++b) {
    const std::int32_t s = block_slot_[b];
    if (s >= 0 && slot_block_[static_cast<std::size_t>(s)] != static_cast<std::int32_t>(b))
      return error(errc::internal, "block {} names window slot {}, which names block {}", b, s,
                   slot_block_[static_cast<std::size_t>(s)]);
  }
  std::int32_t retained = 0;
  for (std::int32_t s = head_, prev = -1; s >= 0; prev = s, s = next_[static_cast<std::size_t>(s)]) {
    if (prev_[static_cast<std::size_t>(s)] != prev || pinned_[static_cast<std::size_t>(s)] ||
        slot_block_[static_cast<std::size_t>(s)] < 0)
      return error(errc::internal, "window slot {} in the retained list is pinned, unbound or mislinked", s);
    if (++retained > n_slots()) return error(errc::internal, "the retained window slots form a cycle");
  }
  if (bound_count != n_bound_ || pinned_count != n_pinned_ || retained != bound_count - pinned_count ||
      static_cast<std::int32_t>(free_.size()) != n_slots() - bound_count)
    return error(errc::internal, "window slots: {} bound ({} counted), {} pinned ({}), {} retained, {} free of {}",
                 bound_count, n_bound_, pinned_count, n_pinned_, retained, free_.size(), n_slots());
  return ok_status();
}

}  // namespace pagoda
