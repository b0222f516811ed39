#include "kv/block_pool.h"

#include "core/assert.h"

namespace pagoda {

void block_pool::index_list::push_front(std::vector<links>& l, std::int32_t i) {
  l[i].prev = k_nil;
  l[i].next = head;
  if (head != k_nil) {
    l[head].prev = i;
  } else {
    tail = i;
  }
  head = i;
  ++size;
}

void block_pool::index_list::push_back(std::vector<links>& l, std::int32_t i) {
  l[i].next = k_nil;
  l[i].prev = tail;
  if (tail != k_nil) {
    l[tail].next = i;
  } else {
    head = i;
  }
  tail = i;
  ++size;
}

void block_pool::index_list::remove(std::vector<links>& l, std::int32_t i) {
  const links li = l[i];
  if (li.prev != k_nil) {
    l[li.prev].next = li.next;
  } else {
    head = li.next;
  }
  if (li.next != k_nil) {
    l[li.next].prev = li.prev;
  } else {
    tail = li.prev;
  }
  l[i] = links{};
  --size;
}

block_pool::block_pool(std::int32_t n_blocks)
    : blocks_(static_cast<std::size_t>(n_blocks)),
      queue_links_(static_cast<std::size_t>(n_blocks)),
      owner_links_(static_cast<std::size_t>(n_blocks)) {
  PAGODA_ASSERT(n_blocks >= 0, "block pool of {} blocks", n_blocks);
  for (std::int32_t i = 0; i < n_blocks; ++i) queue_.push_back(queue_links_, i);
}

const block_pool::block_state& block_pool::at(block_id b) const {
  PAGODA_ASSERT(b.value >= 0 && b.value < n_blocks(), "block {} outside pool of {}", b.value, n_blocks());
  return blocks_[static_cast<std::size_t>(b.value)];
}

block_pool::block_state& block_pool::at(block_id b) {
  return const_cast<block_state&>(static_cast<const block_pool*>(this)->at(b));
}

block_pool::owner_state& block_pool::owner_at(tenant_id t) {
  PAGODA_ASSERT(t.valid(), "block owner must be a valid tenant");
  if (static_cast<std::size_t>(t.value) >= owners_.size()) owners_.resize(static_cast<std::size_t>(t.value) + 1);
  return owners_[static_cast<std::size_t>(t.value)];
}

std::int32_t block_pool::n_used(tenant_id owner) const {
  if (!owner.valid() || static_cast<std::size_t>(owner.value) >= owners_.size()) return 0;
  return owners_[static_cast<std::size_t>(owner.value)].n_used;
}

std::int32_t block_pool::n_cached(tenant_id owner) const {
  if (!owner.valid() || static_cast<std::size_t>(owner.value) >= owners_.size()) return 0;
  return owners_[static_cast<std::size_t>(owner.value)].cached.size;
}

block_pool::taken block_pool::claim(std::int32_t i, tenant_id owner) {
  block_state& s = blocks_[static_cast<std::size_t>(i)];
  PAGODA_ASSERT(s.ref == 0, "block {} taken with ref {}", i, s.ref);
  queue_.remove(queue_links_, i);
  taken t{block_id(i), false};
  if (s.hashed) {
    owner_at(s.owner).cached.remove(owner_links_, i);
    --n_cached_;
    s.hashed = false;
    t.evicted = true;
  }
  s.ref = 1;
  s.owner = owner;
  ++owner_at(owner).n_used;
  ++n_used_;
  return t;
}

std::optional<block_pool::taken> block_pool::take(tenant_id owner) {
  if (queue_.head == k_nil) return std::nullopt;
  return claim(queue_.head, owner);
}

std::optional<block_pool::taken> block_pool::take_cached_of(tenant_id owner) {
  const std::int32_t i = owner_at(owner).cached.head;
  if (i == k_nil) return std::nullopt;
  return claim(i, owner);
}

void block_pool::ref(block_id b) {
  block_state& s = at(b);
  if (s.ref > 0) {
    ++s.ref;
    return;
  }
  PAGODA_ASSERT(s.hashed, "ref on free block {}: a free block holds nothing to share", b.value);
  // A cache hit: the block leaves the queue and its owner's cached list, as it is.
  queue_.remove(queue_links_, b.value);
  owner_at(s.owner).cached.remove(owner_links_, b.value);
  --n_cached_;
  ++owner_at(s.owner).n_used;
  ++n_used_;
  s.ref = 1;
}

void block_pool::unref(block_id b) {
  block_state& s = at(b);
  PAGODA_ASSERT(s.ref > 0, "unref of block {} with ref {} (double free)", b.value, s.ref);
  if (--s.ref > 0) return;
  owner_state& o = owner_at(s.owner);
  --o.n_used;
  --n_used_;
  if (s.hashed) {
    queue_.push_back(queue_links_, b.value);
    o.cached.push_back(owner_links_, b.value);
    ++n_cached_;
  } else {
    queue_.push_front(queue_links_, b.value);
    s.owner = tenant_id();
  }
}

void block_pool::set_hashed(block_id b) {
  block_state& s = at(b);
  PAGODA_ASSERT(s.ref > 0 && !s.hashed, "set_hashed on block {} (ref {}, hashed {})", b.value, s.ref, s.hashed);
  s.hashed = true;
}

void block_pool::drop_hash(block_id b) {
  block_state& s = at(b);
  PAGODA_ASSERT(s.ref == 0 && s.hashed, "drop_hash on block {} that is not cached (ref {})", b.value, s.ref);
  owner_at(s.owner).cached.remove(owner_links_, b.value);
  queue_.remove(queue_links_, b.value);
  queue_.push_front(queue_links_, b.value);
  s.hashed = false;
  s.owner = tenant_id();
  --n_cached_;
}

void block_pool::clear_hash(block_id b) {
  block_state& s = at(b);
  PAGODA_ASSERT(s.ref > 0 && s.hashed, "clear_hash on block {} (ref {}, hashed {})", b.value, s.ref, s.hashed);
  s.hashed = false;
}

std::vector<block_id> block_pool::free_queue() const {
  std::vector<block_id> out;
  out.reserve(static_cast<std::size_t>(queue_.size));
  for (std::int32_t i = queue_.head; i != k_nil; i = queue_links_[static_cast<std::size_t>(i)].next) {
    out.emplace_back(i);
  }
  return out;
}

std::optional<block_id> block_pool::oldest_cached_of(tenant_id owner) const {
  if (!owner.valid() || static_cast<std::size_t>(owner.value) >= owners_.size()) return std::nullopt;
  const std::int32_t i = owners_[static_cast<std::size_t>(owner.value)].cached.head;
  if (i == k_nil) return std::nullopt;
  return block_id(i);
}

std::vector<block_id> block_pool::cached_of(tenant_id owner) const {
  std::vector<block_id> out;
  if (!owner.valid() || static_cast<std::size_t>(owner.value) >= owners_.size()) return out;
  const index_list& l = owners_[static_cast<std::size_t>(owner.value)].cached;
  for (std::int32_t i = l.head; i != k_nil; i = owner_links_[static_cast<std::size_t>(i)].next) out.emplace_back(i);
  return out;
}

namespace {

// Walks one list forwards, checking back links and that it ends where it says.
// Calls visit(i) for each element; returns the number of elements or -1 if broken.
template <typename Links, typename Visit>
std::int32_t walk_list(const Links& l, std::int32_t head, std::int32_t tail, std::int32_t limit, Visit visit) {
  std::int32_t n = 0;
  std::int32_t prev = -1;
  for (std::int32_t i = head; i != -1; i = l[static_cast<std::size_t>(i)].next) {
    if (i < 0 || static_cast<std::size_t>(i) >= l.size() || n > limit) return -1;
    if (l[static_cast<std::size_t>(i)].prev != prev) return -1;
    visit(i);
    prev = i;
    ++n;
  }
  return prev == tail ? n : -1;
}

}  // namespace

status block_pool::check_invariants() const {
  const std::int32_t n = n_blocks();
  std::vector<std::uint8_t> in_queue(static_cast<std::size_t>(n), 0);
  const std::int32_t n_queue = walk_list(queue_links_, queue_.head, queue_.tail, n,
                                         [&](std::int32_t i) { ++in_queue[static_cast<std::size_t>(i)]; });
  if (n_queue < 0 || n_queue != queue_.size) {
    return error(errc::internal, "free queue links are broken (walked {}, size {})", n_queue, queue_.size);
  }
  std::int32_t used = 0, cached = 0;
  std::vector<std::int32_t> used_of(owners_.size(), 0), cached_of_owner(owners_.size(), 0);
  for (std::int32_t i = 0; i < n; ++i) {
    const block_state& s = blocks_[static_cast<std::size_t>(i)];
    if (s.ref < 0) return error(errc::internal, "block {} has ref {}", i, s.ref);
    if ((s.ref == 0) != (in_queue[static_cast<std::size_t>(i)] == 1)) {
      return error(errc::internal, "block {} with ref {} is {} the free queue", i, s.ref,
                   in_queue[static_cast<std::size_t>(i)] ? "in" : "not in");
    }
    if (s.ref > 0 || s.hashed) {
      if (!s.owner.valid() || static_cast<std::size_t>(s.owner.value) >= owners_.size()) {
        return error(errc::internal, "block {} (ref {}) has no owner", i, s.ref);
      }
      if (s.ref > 0) {
        ++used;
        ++used_of[static_cast<std::size_t>(s.owner.value)];
      } else {
        ++cached;
        ++cached_of_owner[static_cast<std::size_t>(s.owner.value)];
      }
    }
  }
  if (used != n_used_ || cached != n_cached_) {
    return error(errc::internal, "counted {} used and {} cached, pool says {} and {}", used, cached, n_used_,
                 n_cached_);
  }
  if (n_used_ + n_cached_ + n_free() != n || n_queue != n_free() + n_cached_) {
    return error(errc::internal, "free {} + used {} + cached {} != total {}", n_free(), n_used_, n_cached_, n);
  }
  for (std::size_t t = 0; t < owners_.size(); ++t) {
    const owner_state& o = owners_[t];
    bool ok_members = true;
    const std::int32_t n_list = walk_list(owner_links_, o.cached.head, o.cached.tail, n, [&](std::int32_t i) {
      const block_state& s = blocks_[static_cast<std::size_t>(i)];
      ok_members = ok_members && s.ref == 0 && s.hashed && s.owner.value == static_cast<std::int32_t>(t);
    });
    if (n_list < 0 || n_list != o.cached.size || !ok_members) {
      return error(errc::internal, "tenant {}: cached list is broken", t);
    }
    if (o.n_used != used_of[t] || o.cached.size != cached_of_owner[t]) {
      return error(errc::internal, "tenant {}: counted {} used and {} cached, pool says {} and {}", t, used_of[t],
                   cached_of_owner[t], o.n_used, o.cached.size);
    }
  }
  return ok_status();
}

}  // namespace pagoda
