// block_pool::check_invariants: everything recounted from scratch (block_pool.h).
#include "core/reuse_worth.h"
#include "kv/block_pool.h"

namespace pagoda {

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

status block_pool::check_buckets(const buckets& b, const std::vector<links>& l, std::int32_t c, tenant_id owner,
                                 std::int32_t& n_listed, std::vector<std::uint8_t>* in_queue) const {
  // Each bucket: cached blocks of class c (and owner, for an owner's) whose
  // key maps to it, within [clock, clock + k_max_level] (the clock itself
  // under lru), in release order.
  const std::int64_t clock = classes_[static_cast<std::size_t>(c)].clock;
  const std::int64_t max_key = eviction_ == cache_eviction::lfu ? clock + k_max_level : clock;
  n_listed = 0;
  for (std::int32_t j = 0; j < k_levels; ++j) {
    const index_list& list = b[static_cast<std::size_t>(j)];
    bool ok = true;
    std::uint64_t last_release = 0;
    const std::int32_t n = walk_list(l, list.head, list.tail, n_blocks(), [&](std::int32_t i) {
      const block_state& s = blocks_[static_cast<std::size_t>(i)];
      const std::int64_t key = key_[static_cast<std::size_t>(i)];
      const std::uint64_t at = released_at_[static_cast<std::size_t>(i)];
      if (in_queue) ++(*in_queue)[static_cast<std::size_t>(i)];
      ok = ok && s.ref == 0 && s.hashed && s.cls == c && (!owner.valid() || s.owner == owner) && key >= clock &&
           key <= max_key && key % k_levels == j && at > last_release;
      last_release = at;
    });
    if (n < 0 || n != list.size)
      return error(errc::internal, "class {}: cached bucket {} links are broken (walked {}, size {})", c, j, n, list.size);
    if (!ok)
      return error(errc::internal,
                   "class {}: cached bucket {} holds a block that is not cached, of another class or owner, "
                   "keyed outside [{}, {}] or for another bucket, or out of release order",
                   c, j, clock, max_key);
    n_listed += n;
  }
  return ok_status();
}

status block_pool::check_class_lists(std::int32_t c, std::vector<std::uint8_t>& in_queue) const {
  const class_state& k = classes_[static_cast<std::size_t>(c)];
  bool ok = true;
  const std::int32_t n_free_listed = walk_list(queue_links_, k.free.head, k.free.tail, n_blocks(), [&](std::int32_t i) {
    const block_state& s = blocks_[static_cast<std::size_t>(i)];
    ++in_queue[static_cast<std::size_t>(i)];
    ok = ok && s.cls == c && s.ref == 0 && !s.hashed;
  });
  if (n_free_listed < 0 || n_free_listed != k.free.size)
    return error(errc::internal, "class {}: free list links are broken (walked {}, size {})", c, n_free_listed,
                 k.free.size);
  if (!ok) return error(errc::internal, "class {}: free list holds a block that is not a free one of the class", c);
  std::int32_t n_cached_listed = 0;
  PAGODA_RETURN_IF_ERROR(check_buckets(k.cached, queue_links_, c, tenant_id(), n_cached_listed, &in_queue));
  if (n_cached_listed != k.n_cached)
    return error(errc::internal, "class {}: {} blocks in its cached buckets, {} cached", c, n_cached_listed, k.n_cached);
  return ok_status();
}

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
    if (eviction_ == cache_eviction::lru && k.clock != 0)
      return error(errc::internal, "class {}: eviction clock {} under lru", c, k.clock);
  }
  if (first != n) return error(errc::internal, "classes own {} blocks of {}", first, n);

  // Each class's lists: free blocks, then cached ones by key.
  std::vector<std::uint8_t> in_queue(static_cast<std::size_t>(n), 0);
  for (std::int32_t c = 0; c < n_classes(); ++c) PAGODA_RETURN_IF_ERROR(check_class_lists(c, in_queue));

  std::int32_t used = 0, cached = 0;
  std::vector<std::int32_t> used_of(owners_.size(), 0), cached_of_owner(owners_.size(), 0);
  std::vector<std::int32_t> used_in(classes_.size(), 0), cached_in(classes_.size(), 0);
  for (std::int32_t i = 0; i < n; ++i) {
    const block_state& s = blocks_[static_cast<std::size_t>(i)];
    if (s.ref < 0) return error(errc::internal, "block {} has ref {}", i, s.ref);
    if (s.uses > reuse::uses_cap(k_max_level)) return error(errc::internal, "block {} counts {} uses", i, s.uses);
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
    if (used_in[c] != k.n_used || cached_in[c] != k.n_cached || k.free.size + k.n_cached != k.size - k.n_used) {
      return error(errc::internal, "class {}: counted {} used and {} cached, pool says {} and {} ({} free listed)", c,
                   used_in[c], cached_in[c], k.n_used, k.n_cached, k.free.size);
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
      std::int32_t n_listed = 0;
      PAGODA_RETURN_IF_ERROR(check_buckets(owner_cached_[t * classes_.size() + c], owner_links_,
                                           static_cast<std::int32_t>(c), tenant_id(static_cast<std::int32_t>(t)),
                                           n_listed, nullptr)
                                 .with_context(fmt::format("tenant {}", t)));
      n_cached_lists += n_listed;
    }
    if (o.n_used != used_of[t] || o.n_cached != cached_of_owner[t] || n_cached_lists != o.n_cached) {
      return error(errc::internal, "tenant {}: counted {} used and {} cached, pool says {} and {} ({} listed)", t,
                   used_of[t], cached_of_owner[t], o.n_used, o.n_cached, n_cached_lists);
    }
  }
  return ok_status();
}

}  // namespace pagoda
