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

block_pool::block_pool(std::int32_t n_blocks) : block_pool(std::vector<std::int32_t>{n_blocks}) {}

block_pool::block_pool(std::vector<std::int32_t> class_sizes) {
  PAGODA_ASSERT(!class_sizes.empty() && class_sizes.size() <= static_cast<std::size_t>(k_max_kv_classes),
                "block pool of {} classes (1 to {})", class_sizes.size(), k_max_kv_classes);
  std::int64_t total = 0;
  for (const std::int32_t n : class_sizes) {
    PAGODA_ASSERT(n >= 0, "block class of {} blocks", n);
    total += n;
  }
  PAGODA_ASSERT(total <= INT32_MAX, "block pool of {} blocks", total);
  const auto n = static_cast<std::size_t>(total);
  blocks_.resize(n);
  queue_links_.resize(n);
  owner_links_.resize(n);
  released_at_.resize(n, 0);
  classes_.resize(class_sizes.size());
  std::int32_t first = 0;
  for (std::size_t c = 0; c < class_sizes.size(); ++c) {
    class_state& k = classes_[c];
    k.first = first;
    k.size = class_sizes[c];
    for (std::int32_t i = first; i < first + k.size; ++i) {
      blocks_[static_cast<std::size_t>(i)].cls = static_cast<std::uint8_t>(c);
      k.queue.push_back(queue_links_, i);
    }
    first += k.size;
  }
}

const block_pool::block_state& block_pool::at(block_id b) const {
  PAGODA_ASSERT(b.value >= 0 && b.value < n_blocks(), "block {} outside pool of {}", b.value, n_blocks());
  return blocks_[static_cast<std::size_t>(b.value)];
}

block_pool::block_state& block_pool::at(block_id b) {
  return const_cast<block_state&>(static_cast<const block_pool*>(this)->at(b));
}

const block_pool::class_state& block_pool::cls_at(std::int32_t c) const {
  PAGODA_ASSERT(c >= 0 && c < n_classes(), "block class {} outside the pool's {}", c, n_classes());
  return classes_[static_cast<std::size_t>(c)];
}

block_pool::owner_state& block_pool::owner_at(tenant_id t) {
  PAGODA_ASSERT(t.valid(), "block owner must be a valid tenant");
  if (static_cast<std::size_t>(t.value) >= owners_.size()) {
    owners_.resize(static_cast<std::size_t>(t.value) + 1);
    owner_cached_.resize(owners_.size() * classes_.size());
  }
  return owners_[static_cast<std::size_t>(t.value)];
}

block_pool::index_list& block_pool::cached_list(tenant_id owner, std::int32_t c) {
  return owner_cached_[static_cast<std::size_t>(owner.value) * classes_.size() + static_cast<std::size_t>(c)];
}

const block_pool::index_list* block_pool::find_cached_list(tenant_id owner, std::int32_t c) const {
  (void)cls_at(c);
  if (!owner.valid() || static_cast<std::size_t>(owner.value) >= owners_.size()) return nullptr;
  return &owner_cached_[static_cast<std::size_t>(owner.value) * classes_.size() + static_cast<std::size_t>(c)];
}

std::int32_t block_pool::n_used(tenant_id owner) const {
  if (!owner.valid() || static_cast<std::size_t>(owner.value) >= owners_.size()) return 0;
  return owners_[static_cast<std::size_t>(owner.value)].n_used;
}

std::int32_t block_pool::n_cached(tenant_id owner) const {
  if (!owner.valid() || static_cast<std::size_t>(owner.value) >= owners_.size()) return 0;
  return owners_[static_cast<std::size_t>(owner.value)].n_cached;
}

void block_pool::uncache(std::int32_t i, block_state& s) {
  class_state& k = classes_[s.cls];
  k.queue.remove(queue_links_, i);
  cached_list(s.owner, s.cls).remove(owner_links_, i);
  --owner_at(s.owner).n_cached;
  --k.n_cached;
  --n_cached_;
}

block_pool::taken block_pool::claim(std::int32_t i, tenant_id owner) {
  block_state& s = blocks_[static_cast<std::size_t>(i)];
  PAGODA_ASSERT(s.ref == 0, "block {} taken with ref {}", i, s.ref);
  taken t{block_id(i), false};
  if (s.hashed) {
    uncache(i, s);
    s.hashed = false;
    t.evicted = true;
  } else {
    classes_[s.cls].queue.remove(queue_links_, i);
  }
  s.ref = 1;
  s.owner = owner;
  ++owner_at(owner).n_used;
  ++classes_[s.cls].n_used;
  ++n_used_;
  return t;
}

std::optional<block_pool::taken> block_pool::take(tenant_id owner, std::int32_t cls) {
  const std::int32_t i = cls_at(cls).queue.head;
  if (i == k_nil) return std::nullopt;
  return claim(i, owner);
}

std::optional<block_pool::taken> block_pool::take_cached_of(tenant_id owner, std::int32_t cls) {
  (void)cls_at(cls);
  owner_at(owner);
  const std::int32_t i = cached_list(owner, cls).head;
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
  uncache(b.value, s);
  ++owner_at(s.owner).n_used;
  ++classes_[s.cls].n_used;
  ++n_used_;
  s.ref = 1;
}

void block_pool::unref(block_id b) {
  block_state& s = at(b);
  PAGODA_ASSERT(s.ref > 0, "unref of block {} with ref {} (double free)", b.value, s.ref);
  if (--s.ref > 0) return;
  owner_state& o = owner_at(s.owner);
  class_state& k = classes_[s.cls];
  --o.n_used;
  --k.n_used;
  --n_used_;
  if (s.hashed) {
    k.queue.push_back(queue_links_, b.value);
    cached_list(s.owner, s.cls).push_back(owner_links_, b.value);
    released_at_[static_cast<std::size_t>(b.value)] = ++n_releases_;
    ++o.n_cached;
    ++k.n_cached;
    ++n_cached_;
  } else {
    k.queue.push_front(queue_links_, b.value);
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
  uncache(b.value, s);
  classes_[s.cls].queue.push_front(queue_links_, b.value);
  s.hashed = false;
  s.owner = tenant_id();
}

void block_pool::clear_hash(block_id b) {
  block_state& s = at(b);
  PAGODA_ASSERT(s.ref > 0 && s.hashed, "clear_hash on block {} (ref {}, hashed {})", b.value, s.ref, s.hashed);
  s.hashed = false;
}

namespace {

template <typename Links>
void append_list(std::vector<block_id>& out, const Links& l, std::int32_t head) {
  for (std::int32_t i = head; i != -1; i = l[static_cast<std::size_t>(i)].next) out.emplace_back(i);
}

}  // namespace

std::vector<block_id> block_pool::free_queue(std::int32_t cls) const {
  std::vector<block_id> out;
  out.reserve(static_cast<std::size_t>(cls_at(cls).queue.size));
  append_list(out, queue_links_, cls_at(cls).queue.head);
  return out;
}

std::vector<block_id> block_pool::free_queue() const {
  std::vector<block_id> out;
  out.reserve(static_cast<std::size_t>(n_takeable()));
  for (const class_state& k : classes_) append_list(out, queue_links_, k.queue.head);
  return out;
}

std::optional<block_id> block_pool::oldest_cached_of(tenant_id owner) const {
  std::optional<block_id> oldest;
  for (std::int32_t c = 0; c < n_classes(); ++c) {
    const index_list* l = find_cached_list(owner, c);
    if (!l || l->head == k_nil) continue;
    if (!oldest || released_at_[static_cast<std::size_t>(l->head)] <
                       released_at_[static_cast<std::size_t>(oldest->value)])
      oldest = block_id(l->head);
  }
  return oldest;
}

std::vector<block_id> block_pool::cached_of(tenant_id owner, std::int32_t cls) const {
  std::vector<block_id> out;
  if (const index_list* l = find_cached_list(owner, cls)) append_list(out, owner_links_, l->head);
  return out;
}

std::vector<block_id> block_pool::cached_of(tenant_id owner) const {
  std::vector<block_id> out;
  for (std::int32_t c = 0; c < n_classes(); ++c)
    if (const index_list* l = find_cached_list(owner, c)) append_list(out, owner_links_, l->head);
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
  // Class ranges tile [0, n) in class order, and every block knows its class.
  std::int32_t first = 0;
  for (std::int32_t c = 0; c < n_classes(); ++c) {
    const class_state& k = classes_[static_cast<std::size_t>(c)];
    if (k.first != first || k.size < 0) {
      return error(errc::internal, "class {} owns [{}, {}) but should start at {}", c, k.first, k.first + k.size, first);
    }
    for (std::int32_t i = k.first; i < k.first + k.size && i < n; ++i) {
      if (blocks_[static_cast<std::size_t>(i)].cls != c) {
        return error(errc::internal, "block {} of class {} says class {}", i, c, blocks_[static_cast<std::size_t>(i)].cls);
      }
    }
    first += k.size;
  }
  if (first != n) return error(errc::internal, "classes own {} blocks of {}", first, n);

  // Each class's queue: its free blocks, then its cached ones in release order.
  std::vector<std::uint8_t> in_queue(static_cast<std::size_t>(n), 0);
  for (std::int32_t c = 0; c < n_classes(); ++c) {
    const class_state& k = classes_[static_cast<std::size_t>(c)];
    bool ok_members = true;
    std::uint64_t last_release = 0;
    bool seen_cached = false;
    const std::int32_t n_queue = walk_list(queue_links_, k.queue.head, k.queue.tail, n, [&](std::int32_t i) {
      const block_state& s = blocks_[static_cast<std::size_t>(i)];
      ++in_queue[static_cast<std::size_t>(i)];
      const std::uint64_t at = released_at_[static_cast<std::size_t>(i)];
      ok_members = ok_members && s.cls == c && (s.hashed ? at > last_release : !seen_cached);
      if (s.hashed) last_release = at;
      seen_cached = seen_cached || s.hashed;
    });
    if (n_queue < 0 || n_queue != k.queue.size) {
      return error(errc::internal, "class {}: free queue links are broken (walked {}, size {})", c, n_queue,
                   k.queue.size);
    }
    if (!ok_members) {
      return error(errc::internal, "class {}: free queue holds another class's block or is out of LRU order", c);
    }
  }

  std::int32_t used = 0, cached = 0;
  std::vector<std::int32_t> used_of(owners_.size(), 0), cached_of_owner(owners_.size(), 0);
  std::vector<std::int32_t> used_in(classes_.size(), 0), cached_in(classes_.size(), 0);
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
        ++used_in[s.cls];
      } else {
        ++cached;
        ++cached_of_owner[static_cast<std::size_t>(s.owner.value)];
        ++cached_in[s.cls];
      }
    }
  }
  if (used != n_used_ || cached != n_cached_) {
    return error(errc::internal, "counted {} used and {} cached, pool says {} and {}", used, cached, n_used_,
                 n_cached_);
  }
  for (std::size_t c = 0; c < classes_.size(); ++c) {
    const class_state& k = classes_[c];
    if (used_in[c] != k.n_used || cached_in[c] != k.n_cached || k.queue.size != k.size - k.n_used) {
      return error(errc::internal, "class {}: counted {} used and {} cached, pool says {} and {} ({} in its queue)", c,
                   used_in[c], cached_in[c], k.n_used, k.n_cached, k.queue.size);
    }
  }
  if (n_used_ + n_cached_ + n_free() != n || n_takeable() != n_free() + n_cached_) {
    return error(errc::internal, "free {} + used {} + cached {} != total {}", n_free(), n_used_, n_cached_, n);
  }
  if (owner_cached_.size() != owners_.size() * classes_.size()) {
    return error(errc::internal, "{} per-owner cached lists for {} owners", owner_cached_.size(), owners_.size());
  }
  for (std::size_t t = 0; t < owners_.size(); ++t) {
    const owner_state& o = owners_[t];
    std::int32_t n_cached_lists = 0;
    for (std::size_t c = 0; c < classes_.size(); ++c) {
      const index_list& l = owner_cached_[t * classes_.size() + c];
      bool ok_members = true;
      std::uint64_t last_release = 0;
      const std::int32_t n_list = walk_list(owner_links_, l.head, l.tail, n, [&](std::int32_t i) {
        const block_state& s = blocks_[static_cast<std::size_t>(i)];
        const std::uint64_t at = released_at_[static_cast<std::size_t>(i)];
        ok_members = ok_members && s.ref == 0 && s.hashed && s.owner.value == static_cast<std::int32_t>(t) &&
                     s.cls == c && at > last_release;
        last_release = at;
      });
      if (n_list < 0 || n_list != l.size || !ok_members) {
        return error(errc::internal, "tenant {}: cached list of class {} is broken", t, c);
      }
      n_cached_lists += l.size;
    }
    if (o.n_used != used_of[t] || o.n_cached != cached_of_owner[t] || n_cached_lists != o.n_cached) {
      return error(errc::internal, "tenant {}: counted {} used and {} cached, pool says {} and {} ({} listed)", t,
                   used_of[t], cached_of_owner[t], o.n_used, o.n_cached, n_cached_lists);
    }
  }
  return ok_status();
}

}  // namespace pagoda
