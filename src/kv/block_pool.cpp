#include "kv/block_pool.h"

#include "core/assert.h"
#include "core/reuse_worth.h"

namespace pagoda {

namespace {
constexpr std::uint32_t k_uses_cap = reuse::uses_cap(block_pool::k_max_level);
static_assert(k_uses_cap <= UINT8_MAX, "block_state::uses is 8 bits");
}  // namespace

const char* cache_eviction_name(cache_eviction e) { return e == cache_eviction::lfu ? "lfu" : "lru"; }

std::optional<cache_eviction> parse_cache_eviction(std::string_view name) {
  if (name == "lru") return cache_eviction::lru;
  if (name == "lfu") return cache_eviction::lfu;
  return std::nullopt;
}

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

block_pool::block_pool(std::int32_t n_blocks, cache_eviction eviction)
    : block_pool(std::vector<std::int32_t>{n_blocks}, eviction) {}

block_pool::block_pool(std::vector<std::int32_t> class_sizes, cache_eviction eviction) : eviction_(eviction) {
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
  key_.resize(n, 0);
  classes_.resize(class_sizes.size());
  std::int32_t first = 0;
  for (std::size_t c = 0; c < class_sizes.size(); ++c) {
    class_state& k = classes_[c];
    k.first = first;
    k.size = class_sizes[c];
    for (std::int32_t i = first; i < first + k.size; ++i) {
      blocks_[static_cast<std::size_t>(i)].cls = static_cast<std::uint8_t>(c);
      k.free.push_back(queue_links_, i);
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

block_pool::buckets& block_pool::cached_lists(tenant_id owner, std::int32_t c) {
  return owner_cached_[static_cast<std::size_t>(owner.value) * classes_.size() + static_cast<std::size_t>(c)];
}

const block_pool::buckets* block_pool::find_cached_lists(tenant_id owner, std::int32_t c) const {
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

std::int32_t block_pool::first_cached(const buckets& b, std::int64_t clock) const {
  for (std::int64_t key = clock; key < clock + k_levels; ++key) {
    const index_list& l = b[static_cast<std::size_t>(key % k_levels)];
    if (l.head != k_nil) return l.head;
  }
  return k_nil;
}

std::int64_t block_pool::eviction_key(block_id b) const {
  const block_state& s = at(b);
  PAGODA_ASSERT(s.ref == 0 && s.hashed, "eviction_key of block {} that is not cached (ref {})", b.value, s.ref);
  return key_[static_cast<std::size_t>(b.value)];
}

void block_pool::uncache(std::int32_t i, block_state& s) {
  class_state& k = classes_[s.cls];
  const auto bucket = static_cast<std::size_t>(key_[static_cast<std::size_t>(i)] % k_levels);
  k.cached[bucket].remove(queue_links_, i);
  cached_lists(s.owner, s.cls)[bucket].remove(owner_links_, i);
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
    classes_[s.cls].free.remove(queue_links_, i);
  }
  s.ref = 1;
  s.uses = 0;
  s.owner = owner;
  ++owner_at(owner).n_used;
  ++classes_[s.cls].n_used;
  ++n_used_;
  return t;
}

std::optional<block_pool::taken> block_pool::take(tenant_id owner, std::int32_t cls) {
  (void)cls_at(cls);
  class_state& k = classes_[static_cast<std::size_t>(cls)];
  if (k.free.head != k_nil) return claim(k.free.head, owner);
  const std::int32_t i = first_cached(k.cached, k.clock);
  if (i == k_nil) return std::nullopt;
  k.clock = key_[static_cast<std::size_t>(i)];  // the clock moves to the least worth left
  return claim(i, owner);
}

std::optional<block_pool::taken> block_pool::take_cached_of(tenant_id owner, std::int32_t cls) {
  const std::int64_t clock = cls_at(cls).clock;
  owner_at(owner);
  const std::int32_t i = first_cached(cached_lists(owner, cls), clock);
  if (i == k_nil) return std::nullopt;
  return claim(i, owner);
}

void block_pool::ref(block_id b) {
  block_state& s = at(b);
  if (s.hashed) s.uses = static_cast<std::uint8_t>(reuse::add_use(s.uses, k_uses_cap));
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
    // lru: every key is the clock (0), one bucket in release order.
    const std::int64_t key =
        k.clock + (eviction_ == cache_eviction::lfu ? reuse::level(s.uses, k_max_level) : 0);
    const auto bucket = static_cast<std::size_t>(key % k_levels);
    key_[static_cast<std::size_t>(b.value)] = key;
    k.cached[bucket].push_back(queue_links_, b.value);
    cached_lists(s.owner, s.cls)[bucket].push_back(owner_links_, b.value);
    released_at_[static_cast<std::size_t>(b.value)] = ++n_releases_;
    ++o.n_cached;
    ++k.n_cached;
    ++n_cached_;
  } else {
    k.free.push_front(queue_links_, b.value);
    s.owner = tenant_id();
  }
}

void block_pool::set_hashed(block_id b) {
  block_state& s = at(b);
  PAGODA_ASSERT(s.ref > 0 && !s.hashed, "set_hashed on block {} (ref {}, hashed {})", b.value, s.ref, s.hashed);
  s.hashed = true;
  s.uses = 0;  // new contents: nobody has reused them yet
}

void block_pool::drop_hash(block_id b) {
  block_state& s = at(b);
  PAGODA_ASSERT(s.ref == 0 && s.hashed, "drop_hash on block {} that is not cached (ref {})", b.value, s.ref);
  uncache(b.value, s);
  classes_[s.cls].free.push_front(queue_links_, b.value);
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

void block_pool::append_cached(std::vector<block_id>& out, const std::vector<links>& l, const buckets& b,
                               std::int64_t clock) const {
  for (std::int64_t key = clock; key < clock + k_levels; ++key)
    append_list(out, l, b[static_cast<std::size_t>(key % k_levels)].head);
}

std::vector<block_id> block_pool::free_queue(std::int32_t cls) const {
  std::vector<block_id> out;
  const class_state& k = cls_at(cls);
  out.reserve(static_cast<std::size_t>(n_takeable(cls)));
  append_list(out, queue_links_, k.free.head);
  append_cached(out, queue_links_, k.cached, k.clock);
  return out;
}

std::vector<block_id> block_pool::free_queue() const {
  std::vector<block_id> out;
  out.reserve(static_cast<std::size_t>(n_takeable()));
  for (std::int32_t c = 0; c < n_classes(); ++c) {
    const std::vector<block_id> q = free_queue(c);
    out.insert(out.end(), q.begin(), q.end());
  }
  return out;
}

std::optional<block_id> block_pool::next_cached_of(tenant_id owner) const {
  // Worth relative to each class's clock, then release order: with one class,
  // exactly take_cached_of's choice.
  std::optional<block_id> best;
  std::int64_t best_rel = 0;
  for (std::int32_t c = 0; c < n_classes(); ++c) {
    const buckets* b = find_cached_lists(owner, c);
    if (!b) continue;
    const std::int32_t i = first_cached(*b, classes_[static_cast<std::size_t>(c)].clock);
    if (i == k_nil) continue;
    const std::int64_t rel = key_[static_cast<std::size_t>(i)] - classes_[static_cast<std::size_t>(c)].clock;
    if (!best || rel < best_rel ||
        (rel == best_rel && released_at_[static_cast<std::size_t>(i)] < released_at_[static_cast<std::size_t>(best->value)])) {
      best = block_id(i);
      best_rel = rel;
    }
  }
  return best;
}

std::vector<block_id> block_pool::cached_of(tenant_id owner, std::int32_t cls) const {
  std::vector<block_id> out;
  if (const buckets* b = find_cached_lists(owner, cls)) append_cached(out, owner_links_, *b, cls_at(cls).clock);
  return out;
}

std::vector<block_id> block_pool::cached_of(tenant_id owner) const {
  std::vector<block_id> out;
  for (std::int32_t c = 0; c < n_classes(); ++c) {
    const std::vector<block_id> l = cached_of(owner, c);
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

}  // namespace pagoda
