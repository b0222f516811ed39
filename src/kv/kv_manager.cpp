#include "kv/kv_manager.h"

#include <algorithm>

#include "core/assert.h"

namespace pagoda {

namespace {
std::int32_t ceil_div(std::int64_t a, std::int64_t b) { return static_cast<std::int32_t>((a + b - 1) / b); }

// The extra key that names a block's KV class (classes other than 0 only).
// prefix_index.h has no name for it yet: kinds 1 and 2 are taken, 3 and 4 reserved.
constexpr auto k_kv_class_extra_key = extra_key_kind::kv_class;

// The class whose runs hold every one of n increasing positions pos(0), ...,
// pos(n - 1); 0 when one of them is outside every run or two are in runs of
// different classes. O(n + log runs).
template <typename Pos>
std::int32_t class_of_positions(std::span<const kv_class_run> runs, std::int32_t n, Pos pos) {
  if (runs.empty() || n <= 0) return 0;
  // The first run that ends after pos(0) (runs are sorted, so their ends increase).
  auto r = std::upper_bound(runs.begin(), runs.end(), pos(0),
                            [](std::int64_t p, const kv_class_run& run) { return p < run.end; });
  if (r == runs.end() || r->begin > pos(0)) return 0;
  const std::uint8_t cls = r->cls;
  for (std::int32_t i = 1; i < n; ++i) {
    const std::int64_t p = pos(i);
    while (r != runs.end() && r->end <= p) ++r;
    if (r == runs.end() || r->begin > p || r->cls != cls) return 0;
  }
  return cls;
}

// The class of prompt block i of a sequence whose slot k holds position k.
std::int32_t prompt_block_class(std::span<const kv_class_run> runs, std::size_t i, std::int32_t block_size) {
  const auto first = static_cast<std::int64_t>(i) * block_size;
  return class_of_positions(runs, block_size, [first](std::int32_t k) { return first + k; });
}

// class_keys[c]: what a block of class c carries in its key ("" for class 0).
std::string block_extras(std::string_view first_extras, std::size_t block_index, std::int32_t cls,
                         std::span<const std::string> class_keys) {
  std::string out(block_index == 0 ? first_extras : std::string_view());
  if (cls != 0) out += extra_keys().add(k_kv_class_extra_key, class_keys[static_cast<std::size_t>(cls)]).bytes();
  return out;
}

// Calls visit(i, key, parent, block tokens, extras) for the chained key of
// each of the first max_blocks full blocks of prompt, as a sequence with
// these first-block extras and class runs keys them (slot k at position k),
// until visit returns false.
template <typename Visit>
void for_each_prompt_key(std::span<const token_id> prompt, std::string_view first_extras,
                         std::span<const kv_class_run> runs, std::span<const std::string> class_keys,
                         std::int32_t block_size, std::size_t max_blocks, Visit visit) {
  const auto bs = static_cast<std::size_t>(block_size);
  block_key parent = k_root_parent_key;
  for (std::size_t i = 0; i < max_blocks && (i + 1) * bs <= prompt.size(); ++i) {
    const auto block_tokens = prompt.subspan(i * bs, bs);
    const std::string extras = block_extras(first_extras, i, prompt_block_class(runs, i, block_size), class_keys);
    const block_key key = hash_block(parent, block_tokens, extras);
    if (!visit(i, key, parent, block_tokens, std::string_view(extras))) return;
    parent = key;
  }
}
}  // namespace

kv_manager::kv_manager(std::int32_t block_size, std::int32_t n_blocks, bool enable_prefix_caching)
    : kv_manager(block_size, std::vector<std::int32_t>{n_blocks}, enable_prefix_caching) {}

kv_manager::kv_manager(std::int32_t block_size, std::vector<std::int32_t> class_blocks, bool enable_prefix_caching)
    : block_size_(block_size),
      prefix_caching_(enable_prefix_caching),
      pool_(std::move(class_blocks)),
      index_(block_size, pool_.n_blocks()),
      fill_(static_cast<std::size_t>(pool_.n_blocks()), 0) {
  PAGODA_ASSERT(block_size > 0, "block size {}", block_size);
  tenant("");  // tenant 0: the default
  class_keys_.resize(static_cast<std::size_t>(pool_.n_classes()));
  for (std::size_t c = 1; c < class_keys_.size(); ++c) class_keys_[c] = "kvc=" + std::to_string(c);
}

void kv_manager::set_class_keys(std::vector<std::string> keys) {
  PAGODA_ASSERT(seqs_.empty() && keys.size() == class_keys_.size(), "set_class_keys: {} keys for {} classes, {} sequences",
                keys.size(), class_keys_.size(), seqs_.size());
  for (std::size_t c = 1; c < keys.size(); ++c) class_keys_[c] = "kvc=" + keys[c];
}

// --- tenants -------------------------------------------------------------------

tenant_id kv_manager::tenant(std::string_view name) {
  if (const auto t = find_tenant(name)) return *t;
  const tenant_id t(static_cast<std::int32_t>(tenants_.size()));
  tenants_.push_back(tenant_state{std::string(name), std::nullopt});
  tenant_ids_.emplace(std::string(name), t);
  return t;
}

std::optional<tenant_id> kv_manager::find_tenant(std::string_view name) const {
  const auto it = tenant_ids_.find(std::string(name));
  if (it == tenant_ids_.end()) return std::nullopt;
  return it->second;
}

status kv_manager::set_tenant_quota(std::string_view name, std::optional<std::int32_t> max_blocks) {
  if (max_blocks && *max_blocks < 0) {
    return error(errc::invalid_argument, "tenant '{}': quota of {} blocks must not be negative", name, *max_blocks);
  }
  const tenant_id t = tenant(name);
  tenants_[static_cast<std::size_t>(t.value)].quota_blocks = max_blocks;
  evict_over_quota(t);
  return ok_status();
}

void kv_manager::evict_over_quota(tenant_id t) {
  const auto& quota = tenants_[static_cast<std::size_t>(t.value)].quota_blocks;
  if (!quota) return;
  while (pool_.n_used(t) + pool_.n_cached(t) > *quota) {
    const auto b = pool_.oldest_cached_of(t);
    if (!b) break;  // only used blocks left: they shrink as sequences end
    drop_cached(*b);
  }
}

// --- block accounting ----------------------------------------------------------

void kv_manager::hold(block_id b) {
  if (pool_.ref_count(b) == 0) stored_tokens_in_used_ += fill_[static_cast<std::size_t>(b.value)];
  pool_.ref(b);
}

void kv_manager::release(block_id b) {
  pool_.unref(b);
  if (pool_.ref_count(b) > 0) return;
  stored_tokens_in_used_ -= fill_[static_cast<std::size_t>(b.value)];
  if (pool_.is_hashed(b)) return;
  if (window_) window_->unbind(b);
  emit(kv_op{.kind = kv_op_kind::release, .block = b});
}

// --- window slots ----------------------------------------------------------------

void kv_manager::enable_window_slots(std::int32_t window_tokens, std::int32_t n_slots) {
  PAGODA_ASSERT(seqs_.empty() && window_tokens > 0 && n_slots > 0, "window slots: window {}, {} slots, {} sequences",
                window_tokens, n_slots, seqs_.size());
  PAGODA_ASSERT(pool_.n_classes() == 1, "window slots need a KV cache of one block class, not {}", pool_.n_classes());
  window_.emplace(pool_.n_blocks(), n_slots);
  window_tokens_ = window_tokens;
  claims_.assign(static_cast<std::size_t>(pool_.n_blocks()), 0);
}

void kv_manager::claim(block_id b) {
  if (!window_) return;
  if (claims_[static_cast<std::size_t>(b.value)]++ > 0) return;
  if (window_->bound(b)) {
    window_->pin(b);
    return;
  }
  const window_slots::binding got = window_->bind(b);
  emit(kv_op{.kind = kv_op_kind::bind_window, .block = b, .slot = got.slot});
}

void kv_manager::unclaim(block_id b) {
  if (!window_) return;
  std::int32_t& c = claims_[static_cast<std::size_t>(b.value)];
  PAGODA_ASSERT(c > 0, "unclaim of block {}, which no sequence claims", b.value);
  if (--c == 0) window_->retain(b);
}

std::int32_t kv_manager::window_start(std::int64_t next_position) const {
  // Block j's last position (j + 1) * bs - 1 is out of the window when it is
  // at or below next_position - window.
  const std::int64_t n = (next_position - window_tokens_ + 1) / block_size_;
  return static_cast<std::int32_t>(std::max<std::int64_t>(n, 0));
}

std::size_t kv_manager::usable_hits(std::span<const block_id> hits) const {
  if (!window_) return hits.size();
  // Scan each candidate's window from its end: a block without K/V rules out
  // every candidate whose window holds it, so the next one to try ends there.
  // Every block is looked at once or twice: O(hits).
  std::size_t m = hits.size();
  while (m > 0) {
    const auto from = static_cast<std::size_t>(window_start(static_cast<std::int64_t>(m) * block_size_));
    std::size_t j = m;
    while (j > from && window_->bound(hits[j - 1])) --j;
    if (j == from) return m;
    m = j - 1;  // hits[j - 1] holds nothing: a usable prefix ends before it
  }
  return 0;
}

status kv_manager::release_window(seq_id seq, std::int32_t next_position) {
  if (!window_) return ok_status();
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "release_window: unknown sequence {}", seq.value);
  sequence& s = it->second;
  const std::int64_t out_below = static_cast<std::int64_t>(next_position) - window_tokens_;
  // Positions may differ from slots (a sequence loaded from elsewhere): go by the stored ones.
  std::int32_t n = s.window_from;
  const std::int32_t n_full = s.n_stored / block_size_;
  while (n < n_full && s.positions[static_cast<std::size_t>((n + 1) * block_size_ - 1)] <= out_below) ++n;
  for (std::int32_t i = s.window_from; i < n; ++i) unclaim(s.table[static_cast<std::size_t>(i)]);
  s.window_from = n;
  return ok_status();
}

status kv_manager::check_window_invariants() const {
  if (!window_) return ok_status();
  PAGODA_RETURN_IF_ERROR(window_->check_invariants());
  std::vector<std::int32_t> claims(claims_.size(), 0);
  for (const auto& [id, s] : seqs_) {
    if (s.window_from < 0 || static_cast<std::size_t>(s.window_from) > s.table.size())
      return error(errc::internal, "sequence {}: window_from {} outside its {} blocks", id.value, s.window_from,
                   s.table.size());
    for (std::size_t i = static_cast<std::size_t>(s.window_from); i < s.table.size(); ++i)
      ++claims[static_cast<std::size_t>(s.table[i].value)];
  }
  for (std::size_t i = 0; i < claims.size(); ++i) {
    const block_id b(static_cast<std::int32_t>(i));
    if (claims[i] != claims_[i])
      return error(errc::internal, "block {}: {} window claims counted, {} recomputed", i, claims_[i], claims[i]);
    if ((claims[i] > 0) != window_->pinned(b))
      return error(errc::internal, "block {}: {} window claims but pinned {}", i, claims[i], window_->pinned(b));
    if (window_->bound(b) && pool_.ref_count(b) == 0 && !pool_.is_hashed(b))
      return error(errc::internal, "free block {} still holds window slot {}", i, window_->slot_of(b));
  }
  return ok_status();
}

void kv_manager::emit(kv_op op) {
  if (op_listener_) op_listener_(op);
}

void kv_manager::forget_cached(block_id b) {
  if (window_) window_->unbind(b);
  if (op_listener_) {
    const auto tokens = index_.tokens_of(b);
    kv_op op{.kind = kv_op_kind::evict, .block = b, .key = index_.key_of(b), .parent = index_.parent_of(b)};
    op.tokens.assign(tokens.begin(), tokens.end());
    op.tenant = tenant_name(pool_.owner(b));
    op_listener_(op);
  }
  index_.erase(b);
  ++n_evictions_;
}

void kv_manager::drop_cached(block_id b) {
  forget_cached(b);
  pool_.drop_hash(b);
}

alloc_blocker kv_manager::take_blocker(tenant_id t, const class_demand& d) const {
  if (d.total <= 0) return alloc_blocker::none;
  const auto& quota = tenants_[static_cast<std::size_t>(t.value)].quota_blocks;
  if (quota && pool_.n_used(t) + d.total > *quota) return alloc_blocker::quota;
  for (std::int32_t c = 0; c < pool_.n_classes(); ++c)
    if (d.n[static_cast<std::size_t>(c)] > pool_.n_takeable(c)) return alloc_blocker::pool;
  if (window_ && d.total > window_->n_takeable()) return alloc_blocker::pool;
  return alloc_blocker::none;
}

bool kv_manager::can_take(tenant_id t, const class_demand& d) const {
  return take_blocker(t, d) == alloc_blocker::none;
}

std::vector<block_id> kv_manager::take_blocks(tenant_id t, const class_demand& d,
                                              std::span<const std::int32_t> classes) {
  PAGODA_ASSERT(can_take(t, d) && classes.size() == static_cast<std::size_t>(d.total),
                "take_blocks({} of {} classes) without can_take", d.total, classes.size());
  // At its quota a tenant pays with its own cached blocks first (LRU among its
  // own of the class it needs); the rest come from the head of the class's
  // queue. Own cached blocks of other classes that still keep it above its
  // quota are evicted at the end.
  const std::int32_t n = d.total;
  std::int32_t n_own = 0;
  if (const auto& quota = tenants_[static_cast<std::size_t>(t.value)].quota_blocks) {
    const std::int32_t footprint = pool_.n_used(t) + pool_.n_cached(t);
    n_own = std::clamp(footprint + n - *quota, 0, n);
  }
  std::vector<block_id> out;
  out.reserve(static_cast<std::size_t>(n));
  for (const std::int32_t c : classes) {
    std::optional<block_pool::taken> got;
    if (n_own > 0 && (got = pool_.take_cached_of(t, c))) --n_own;
    if (!got) got = pool_.take(t, c);
    PAGODA_ASSERT(got.has_value(), "class {} ran dry after can_take (taken {} of {})", c, out.size(), n);
    if (got->evicted) forget_cached(got->id);
    fill_[static_cast<std::size_t>(got->id.value)] = 0;
    out.push_back(got->id);
  }
  evict_over_quota(t);
  note_peak();
  return out;
}

void kv_manager::note_peak() { peak_used_ = std::max(peak_used_, pool_.n_used()); }

// --- sequences -------------------------------------------------------------------

const kv_manager::sequence& kv_manager::seq_at(seq_id seq) const {
  const auto it = seqs_.find(seq);
  PAGODA_ASSERT(it != seqs_.end(), "unknown sequence {}", seq.value);
  return it->second;
}

kv_manager::sequence& kv_manager::seq_at(seq_id seq) {
  return const_cast<sequence&>(static_cast<const kv_manager*>(this)->seq_at(seq));
}

std::string kv_manager::extras_of(const sequence& s, std::size_t block_index) const {
  // Tenant and salt key block 0 only; the chain carries them to every later
  // block. The class keys each block of a class other than 0.
  return block_extras(s.first_extras, block_index, pool_.n_classes() == 1 ? 0 : pool_.class_of(s.table[block_index]),
                      class_keys_);
}

block_key kv_manager::chain_key(const sequence& s, std::size_t block_index, block_key parent,
                                std::string_view extras) const {
  const auto tokens = std::span<const token_id>(s.tokens).subspan(block_index * static_cast<std::size_t>(block_size_),
                                                                   static_cast<std::size_t>(block_size_));
  return hash_block(parent, tokens, extras);
}

std::string kv_manager::first_block_extras(const sequence_options& options) {
  extra_keys extras;
  if (!options.tenant.empty()) extras.add(extra_key_kind::tenant, options.tenant);
  if (!options.cache_salt.empty()) extras.add(extra_key_kind::cache_salt, options.cache_salt);
  return std::string(extras.bytes());
}

status kv_manager::check_class_runs(std::span<const kv_class_run> runs, std::size_t n_prompt) const {
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const kv_class_run& r = runs[i];
    if (r.cls >= pool_.n_classes())
      return error(errc::invalid_argument, "KV class run {}: class {}, but the KV cache has classes 0 to {}", i, r.cls,
                   pool_.n_classes() - 1);
    if (r.begin < 0 || r.end <= r.begin || static_cast<std::size_t>(r.end) > n_prompt)
      return error(errc::invalid_argument, "KV class run {}: positions [{}, {}) are not a non-empty range of the {}-token prompt",
                   i, r.begin, r.end, n_prompt);
    if (i > 0 && r.begin < runs[i - 1].end)
      return error(errc::invalid_argument, "KV class run {} (from position {}) overlaps or precedes run {} (to {})", i,
                   r.begin, i - 1, runs[i - 1].end);
  }
  return ok_status();
}

std::vector<block_key> kv_manager::prompt_keys(std::span<const token_id> prompt, const sequence_options& options) const {
  std::vector<block_key> keys;
  for_each_prompt_key(prompt, first_block_extras(options), options.classes, class_keys_, block_size_, prompt.size(),
                      [&](std::size_t, block_key key, block_key, std::span<const token_id>, std::string_view) {
                        keys.push_back(key);
                        return true;
                      });
  return keys;
}

std::vector<std::int32_t> kv_manager::prompt_block_classes(std::span<const token_id> prompt,
                                                           const sequence_options& options) const {
  std::vector<std::int32_t> classes(prompt.size() / static_cast<std::size_t>(block_size_));
  for (std::size_t i = 0; i < classes.size(); ++i) classes[i] = prompt_block_class(options.classes, i, block_size_);
  return classes;
}

std::vector<block_id> kv_manager::match_prefix(std::span<const token_id> tokens, std::string_view first_extras,
                                               std::span<const kv_class_run> runs, tenant_id t,
                                               std::size_t max_blocks) const {
  std::vector<block_id> hits;
  if (!prefix_caching_) return hits;
  for_each_prompt_key(tokens, first_extras, runs, class_keys_, block_size_, max_blocks,
                      [&](std::size_t i, block_key key, block_key parent, std::span<const token_id> block_tokens,
                          std::string_view extras) {
                        const auto hit = index_.find(key, parent, block_tokens, extras);
                        // A block of another tenant or class can only match through a chained collision: a miss.
                        if (!hit || pool_.owner(*hit) != t ||
                            (pool_.n_classes() > 1 && pool_.class_of(*hit) != prompt_block_class(runs, i, block_size_)))
                          return false;
                        hits.push_back(*hit);
                        return true;
                      });
  return hits;
}

std::int32_t kv_manager::n_cached_prompt_blocks(std::span<const token_id> prompt, const sequence_options& options) const {
  if (prompt.empty() || !options.lookup || !check_class_runs(options.classes, prompt.size()).ok()) return 0;
  const auto t = find_tenant(options.tenant);
  if (!t) return 0;  // a tenant never seen holds nothing
  const std::size_t n_reusable = (prompt.size() - 1) / static_cast<std::size_t>(block_size_);
  return static_cast<std::int32_t>(
      usable_hits(match_prefix(prompt, first_block_extras(options), options.classes, *t, n_reusable)));
}

result<std::int32_t> kv_manager::add_sequence(seq_id seq, std::span<const token_id> prompt,
                                              const sequence_options& options) {
  if (contains(seq)) return error(errc::invalid_argument, "sequence {} already exists", seq.value);
  if (prompt.empty()) return error(errc::invalid_argument, "sequence {}: empty prompt", seq.value);
  PAGODA_RETURN_IF_ERROR(check_class_runs(options.classes, prompt.size()).with_context(fmt::format("sequence {}", seq.value)));

  sequence s;
  s.tenant = tenant(options.tenant);
  s.first_extras = first_block_extras(options);
  s.classes.assign(options.classes.begin(), options.classes.end());
  s.tokens.assign(prompt.begin(), prompt.end());

  if (prefix_caching_) {
    // The last prompt token is always computed (its logits start generation).
    const std::size_t n_reusable =
        options.lookup ? (prompt.size() - 1) / static_cast<std::size_t>(block_size_) : std::size_t{0};
    std::vector<block_id> hits = match_prefix(prompt, s.first_extras, s.classes, s.tenant, n_reusable);
    hits.resize(usable_hits(hits));
    for (const block_id b : hits) {
      hold(b);
      s.table.push_back(b);
      s.keys.push_back(index_.key_of(b));
    }
    s.n_stored = static_cast<std::int32_t>(s.table.size()) * block_size_;
    if (window_) {
      s.window_from = window_start(s.n_stored);
      for (std::size_t i = static_cast<std::size_t>(s.window_from); i < s.table.size(); ++i) claim(s.table[i]);
    }
    n_query_tokens_ += static_cast<std::int64_t>(prompt.size());
    n_hit_tokens_ += s.n_stored;
    n_query_blocks_ += static_cast<std::int64_t>(n_reusable);
    n_hit_blocks_ += static_cast<std::int64_t>(s.table.size());
  }
  // Cached blocks were computed at the positions of their slots.
  s.positions.resize(static_cast<std::size_t>(s.n_stored));
  for (std::int32_t i = 0; i < s.n_stored; ++i) s.positions[static_cast<std::size_t>(i)] = i;
  const std::int32_t n_cached = s.n_stored;
  seqs_.emplace(seq, std::move(s));
  note_peak();
  return n_cached;
}

bool kv_manager::needs_cow(const sequence& s, std::int32_t n_new_tokens) const {
  if (n_new_tokens <= 0 || s.n_stored % block_size_ == 0) return false;
  const block_id b = s.table[static_cast<std::size_t>(s.n_stored / block_size_)];
  return pool_.ref_count(b) > 1 || pool_.is_hashed(b);
}

std::int32_t kv_manager::n_appended_blocks(const sequence& s, std::int32_t n_new_tokens) const {
  const std::int32_t n_blocks = ceil_div(static_cast<std::int64_t>(s.n_stored) + n_new_tokens, block_size_);
  return std::max(0, n_blocks - static_cast<std::int32_t>(s.table.size()));
}

std::int32_t kv_manager::new_block_class(const sequence& s, std::size_t block_index) const {
  if (s.classes.empty()) return 0;
  // Appended blocks lie past the stored slots: their positions continue
  // consecutively from the last stored one (slot i at i when nothing is stored).
  const std::int64_t last = s.n_stored > 0 ? s.positions[static_cast<std::size_t>(s.n_stored) - 1] : -1;
  const std::int64_t first = last + 1 + static_cast<std::int64_t>(block_index) * block_size_ - s.n_stored;
  PAGODA_ASSERT(static_cast<std::int64_t>(block_index) * block_size_ >= s.n_stored, "block {} holds stored slots",
                block_index);
  return class_of_positions(s.classes, block_size_, [first](std::int32_t k) { return first + k; });
}

kv_manager::class_demand kv_manager::demand(const sequence& s, std::int32_t n_new_tokens,
                                            std::vector<std::int32_t>* order) const {
  PAGODA_ASSERT(n_new_tokens >= 0, "n_new_tokens {}", n_new_tokens);
  class_demand d;
  const auto put = [&](std::int32_t c) {
    d.add(c);
    if (order) order->push_back(c);
  };
  const bool cow = needs_cow(s, n_new_tokens);
  const std::int32_t n_appended = n_appended_blocks(s, n_new_tokens);
  if (s.classes.empty()) {  // then every block of s is of class 0, a copy's source too
    d.add(0, n_appended + (cow ? 1 : 0));
    if (order) order->assign(static_cast<std::size_t>(d.total), 0);
    return d;
  }
  // A copy is of the class of the block it replaces.
  if (cow) put(pool_.class_of(s.table[static_cast<std::size_t>(s.n_stored / block_size_)]));
  for (std::int32_t k = 0; k < n_appended; ++k) put(new_block_class(s, s.table.size() + static_cast<std::size_t>(k)));
  return d;
}

std::int32_t kv_manager::n_blocks_needed(seq_id seq, std::int32_t n_new_tokens) const {
  return demand(seq_at(seq), n_new_tokens).total;
}

bool kv_manager::can_allocate(seq_id seq, std::int32_t n_new_tokens) const {
  const sequence& s = seq_at(seq);
  return can_take(s.tenant, demand(s, n_new_tokens));
}

alloc_blocker kv_manager::allocation_blocker(seq_id seq, std::int32_t n_new_tokens) const {
  const sequence& s = seq_at(seq);
  return take_blocker(s.tenant, demand(s, n_new_tokens));
}

std::uint32_t kv_manager::short_classes(seq_id seq, std::int32_t n_new_tokens) const {
  if (pool_.n_classes() == 1) return 0;
  const class_demand d = demand(seq_at(seq), n_new_tokens);
  std::uint32_t mask = 0;
  for (std::int32_t c = 0; c < pool_.n_classes(); ++c)
    if (d.n[static_cast<std::size_t>(c)] > pool_.n_takeable(c)) mask |= 1u << c;
  return mask;
}

bool kv_manager::holds_class(seq_id seq, std::uint32_t mask) const {
  const sequence& s = seq_at(seq);
  return std::any_of(s.table.begin(), s.table.end(), [&](block_id b) { return (mask >> pool_.class_of(b)) & 1u; });
}

std::optional<allocation> kv_manager::allocate(seq_id seq, std::int32_t n_new_tokens) {
  sequence& s = seq_at(seq);
  class_order_.clear();
  const class_demand d = demand(s, n_new_tokens, &class_order_);
  if (d.total == 0) return allocation{};  // the slots exist (no copy either: it would take a block)
  if (!can_take(s.tenant, d)) return std::nullopt;
  const bool cow = needs_cow(s, n_new_tokens);
  const std::vector<block_id> fresh = take_blocks(s.tenant, d, class_order_);

  allocation a;
  std::size_t next = 0;
  if (cow) {
    // The one non-append change to a table: the shared block holding the next
    // write position is swapped for a private copy before anything is written.
    // The other holders keep the original, unchanged.
    const auto index = static_cast<std::size_t>(s.n_stored / block_size_);
    const block_id src = s.table[index];
    const block_id dst = fresh[next++];
    const std::int32_t n_valid = s.n_stored % block_size_;
    claim(dst);  // bound before the copy fills it
    a.copies.push_back(block_copy{src, dst, n_valid});
    emit(kv_op{.kind = kv_op_kind::copy, .block = dst, .src = src, .n_tokens = n_valid});
    fill_[static_cast<std::size_t>(dst.value)] = n_valid;
    stored_tokens_in_used_ += n_valid;
    s.table[index] = dst;
    if (window_) {
      PAGODA_ASSERT(static_cast<std::int32_t>(index) >= s.window_from, "copy-on-write of block {} out of the window", index);
      unclaim(src);
    }
    release(src);  // shared: stays used by the others; cached: stays in the index
    ++n_cow_copies_;
  }
  for (; next < fresh.size(); ++next) {
    s.table.push_back(fresh[next]);
    claim(fresh[next]);
  }
  a.n_new_blocks = static_cast<std::int32_t>(fresh.size()) - (cow ? 1 : 0);
  return a;
}

status kv_manager::commit(seq_id seq, std::span<const token_id> tokens) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "commit: unknown sequence {}", seq.value);
  const sequence& s = it->second;
  const std::int32_t first = s.positions.empty() ? 0 : s.positions.back() + 1;
  std::vector<std::int32_t> positions(tokens.size());
  for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = first + static_cast<std::int32_t>(i);
  return commit(seq, tokens, positions);
}

status kv_manager::commit(seq_id seq, std::span<const token_id> tokens, std::span<const std::int32_t> positions) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "commit: unknown sequence {}", seq.value);
  sequence& s = it->second;
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (positions.size() != tokens.size()) {
    return error(errc::invalid_argument, "commit: sequence {}: {} tokens but {} positions", seq.value, n,
                 positions.size());
  }
  if (n == 0) return ok_status();
  const std::int64_t n_slots = static_cast<std::int64_t>(s.table.size()) * block_size_;
  if (s.n_stored + n > n_slots) {
    return error(errc::out_of_range, "commit: sequence {} stores {} tokens in {} slots; allocate first", seq.value,
                 s.n_stored + n, n_slots);
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t slot = s.n_stored + i;
    if (slot < static_cast<std::int64_t>(s.tokens.size()) && s.tokens[static_cast<std::size_t>(slot)] != tokens[i]) {
      return error(errc::invalid_argument, "commit: sequence {} slot {} holds token {}, not {}", seq.value, slot,
                   s.tokens[static_cast<std::size_t>(slot)], tokens[i]);
    }
    const std::int32_t prev = i > 0 ? positions[i - 1] : (s.positions.empty() ? -1 : s.positions.back());
    if (positions[i] <= prev) {
      return error(errc::invalid_argument, "commit: sequence {} slot {}: position {} does not follow {}", seq.value,
                   slot, positions[i], prev);
    }
  }
  const std::int32_t first_block = s.n_stored / block_size_;
  const std::int32_t last_block = static_cast<std::int32_t>((s.n_stored + n - 1) / block_size_);
  for (std::int32_t bi = first_block; bi <= last_block; ++bi) {
    const block_id b = s.table[static_cast<std::size_t>(bi)];
    if (pool_.ref_count(b) != 1 || pool_.is_hashed(b)) {
      return error(errc::internal,
                   "commit: sequence {} wrote into block {} held by {} tables, cached {} (allocate skipped)", seq.value,
                   b.value, pool_.ref_count(b), pool_.is_hashed(b));
    }
  }

  for (std::int64_t i = 0; i < n; ++i) {
    if (s.n_stored + i >= static_cast<std::int64_t>(s.tokens.size())) s.tokens.push_back(tokens[i]);
  }
  s.positions.insert(s.positions.end(), positions.begin(), positions.end());
  s.n_stored += static_cast<std::int32_t>(n);
  for (std::int32_t bi = first_block; bi <= last_block; ++bi) {
    const std::int32_t filled = std::min(block_size_, s.n_stored - bi * block_size_);
    std::int32_t& fill = fill_[static_cast<std::size_t>(s.table[static_cast<std::size_t>(bi)].value)];
    if (filled > fill) {
      stored_tokens_in_used_ += filled - fill;
      fill = filled;
    }
  }
  if (prefix_caching_ && !s.off_chain) {
    const auto n_full = static_cast<std::size_t>(s.n_stored / block_size_);
    for (std::size_t i = s.keys.size(); i < n_full && !s.off_chain; ++i) {
      const auto first = i * static_cast<std::size_t>(block_size_);
      for (std::size_t j = first; j < first + static_cast<std::size_t>(block_size_); ++j)
        if (s.positions[j] != static_cast<std::int32_t>(j)) s.off_chain = true;
      if (s.off_chain) break;
      const block_key parent = i == 0 ? k_root_parent_key : s.keys[i - 1];
      const std::string extras = extras_of(s, i);
      const block_key key = chain_key(s, i, parent, extras);
      s.keys.push_back(key);
      const auto block_tokens = std::span<const token_id>(s.tokens).subspan(i * static_cast<std::size_t>(block_size_),
                                                                             static_cast<std::size_t>(block_size_));
      // Window slots: an idle cached block under this key whose windowed K/V
      // were taken gives its key to ours, which has them; else a prefix hit
      // would stop at it for good.
      if (window_ && window_->bound(s.table[i]) && !index_.contains(s.table[i])) {
        if (const auto old = index_.find(key, parent, block_tokens, extras);
            old && *old != s.table[i] && pool_.ref_count(*old) == 0 && !window_->bound(*old))
          drop_cached(*old);
      }
      // Already cached by another block: keep ours (tables are append-only), register nothing.
      if (!index_.insert(s.table[i], key, parent, block_tokens, extras)) continue;
      pool_.set_hashed(s.table[i]);
      if (op_listener_) {
        kv_op op{.kind = kv_op_kind::cache, .block = s.table[i], .key = key, .parent = parent};
        op.tokens.assign(block_tokens.begin(), block_tokens.end());
        op.tenant = tenant_name(s.tenant);
        op_listener_(op);
      }
    }
  }
  return ok_status();
}

status kv_manager::drop(seq_id seq, std::span<const std::int32_t> block_indices) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "drop: unknown sequence {}", seq.value);
  sequence& s = it->second;
  if (window_)
    return error(errc::unsupported,
                 "drop: sequence {}: dropping blocks is not available while sliding-window layers keep only their window",
                 seq.value);
  const std::int32_t n_full = s.n_stored / block_size_;
  std::vector<std::int32_t> order(block_indices.begin(), block_indices.end());
  std::sort(order.begin(), order.end());
  for (std::size_t i = 0; i < order.size(); ++i) {
    if (order[i] < 0 || order[i] >= n_full) {
      return error(errc::invalid_argument, "drop: sequence {}: block index {} is not one of its {} full blocks",
                   seq.value, order[i], n_full);
    }
    if (i > 0 && order[i] == order[i - 1])
      return error(errc::invalid_argument, "drop: sequence {}: block index {} given twice", seq.value, order[i]);
  }
  if (order.empty()) return ok_status();
  // Deepest first, as free_sequence: the tail of a cached chain leaves first.
  const auto bs = static_cast<std::ptrdiff_t>(block_size_);
  for (auto i = order.rbegin(); i != order.rend(); ++i) {
    const auto index = static_cast<std::size_t>(*i);
    release(s.table[index]);
    s.table.erase(s.table.begin() + static_cast<std::ptrdiff_t>(index));
    s.tokens.erase(s.tokens.begin() + *i * bs, s.tokens.begin() + (*i + 1) * bs);
    s.positions.erase(s.positions.begin() + *i * bs, s.positions.begin() + (*i + 1) * bs);
  }
  s.n_stored -= static_cast<std::int32_t>(order.size()) * block_size_;
  s.keys.resize(std::min(s.keys.size(), static_cast<std::size_t>(order.front())));
  s.off_chain = true;
  evict_over_quota(s.tenant);
  return ok_status();
}

status kv_manager::compact(seq_id seq, kv_compaction c) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "compact: unknown sequence {}", seq.value);
  sequence& s = it->second;
  if (window_)
    return error(errc::unsupported,
                 "compact: sequence {}: token-granular eviction is not available while sliding-window layers keep "
                 "only their window",
                 seq.value);
  PAGODA_RETURN_IF_ERROR(check_compaction(s, c));
  const std::int32_t bs = block_size_;
  const std::int32_t n_rewritten = c.n_slots - c.first;
  if (n_rewritten == 0) {  // only the tail goes: a truncation
    s.off_chain = true;
    return truncate(seq, c.n_slots);
  }
  const std::int32_t n_blocks = ceil_div(c.n_slots, bs);
  const std::int32_t b_first = c.first / bs;

  // Rewritten blocks this sequence may not write: shared ones need a fresh
  // copy; a cached one only it holds takes a fresh block while the pool has
  // free ones (its K/V stay cached), else it quietly leaves the index.
  // A replacement is of the class of the block it replaces.
  std::vector<std::int32_t> must, may;
  class_demand need;
  for (std::int32_t bi = b_first; bi < n_blocks; ++bi) {
    const block_id b = s.table[static_cast<std::size_t>(bi)];
    if (pool_.ref_count(b) > 1) {
      must.push_back(bi);
      need.add(pool_.class_of(b));
    } else if (pool_.is_hashed(b)) {
      may.push_back(bi);
    }
  }
  if (!can_take(s.tenant, need))
    return error(errc::resource_exhausted, "compact: sequence {} needs {} fresh blocks for copies of shared blocks",
                 seq.value, need.total);
  std::vector<std::int32_t> replaced(must);
  for (const std::int32_t bi : may) {
    const block_id b = s.table[static_cast<std::size_t>(bi)];
    const std::int32_t cls = pool_.class_of(b);
    class_demand more = need;
    more.add(cls);
    if (need.n[static_cast<std::size_t>(cls)] < pool_.n_free_in(cls) && can_take(s.tenant, more)) {
      need = more;
      replaced.push_back(bi);
    } else {
      // No longer shareable. Not an eviction: the block stays with this
      // sequence (the commit hook saw its bytes when it entered the cache).
      index_.erase(b);
      pool_.clear_hash(b);
    }
  }

  auto g = c.gather;
  g->src_table = s.table;
  std::vector<block_id> old_table = s.table;
  std::vector<std::int32_t> classes;
  for (const std::int32_t bi : replaced) classes.push_back(pool_.class_of(s.table[static_cast<std::size_t>(bi)]));
  const std::vector<block_id> fresh = take_blocks(s.tenant, need, classes);
  for (std::size_t i = 0; i < replaced.size(); ++i) {
    const auto bi = static_cast<std::size_t>(replaced[i]);
    s.table[bi] = fresh[i];
  }
  // A fresh first block is rewritten whole: its kept leading slots join the
  // gather as slots that take themselves (no copy op, which would stage a
  // sealed block's tokens for nothing).
  if (c.first % bs != 0 && std::find(replaced.begin(), replaced.end(), b_first) != replaced.end()) {
    const std::int32_t lead = c.first % bs, from = c.first - lead;
    std::vector<std::int32_t> sources;
    for (int r = 0; r < g->n_rows; ++r) {
      for (std::int32_t slot = from; slot < c.first; ++slot) sources.push_back(slot);
      sources.insert(sources.end(), g->sources.begin() + static_cast<std::ptrdiff_t>(r) * n_rewritten,
                     g->sources.begin() + static_cast<std::ptrdiff_t>(r + 1) * n_rewritten);
    }
    g->sources = std::move(sources);
    if (!g->rotate.empty()) g->rotate.insert(g->rotate.begin(), static_cast<std::size_t>(lead), 0);
    c.tokens.insert(c.tokens.begin(), s.tokens.begin() + from, s.tokens.begin() + c.first);
    c.positions.insert(c.positions.begin(), s.positions.begin() + from, s.positions.begin() + c.first);
    c.first = from;
  }
  s.table.resize(static_cast<std::size_t>(n_blocks));
  g->dst_table = s.table;
  g->first = c.first;
  g->n = c.n_slots - c.first;
  emit(kv_op{.kind = kv_op_kind::gather, .gather = g});

  // Fill of the blocks that stay: full up to the last, which holds what is left.
  for (std::int32_t bi = b_first; bi < n_blocks; ++bi) {
    std::int32_t& fill = fill_[static_cast<std::size_t>(s.table[static_cast<std::size_t>(bi)].value)];
    const std::int32_t want = std::min(bs, c.n_slots - bi * bs);
    stored_tokens_in_used_ += want - fill;
    fill = want;
  }
  // Then the blocks that left: replaced ones (their other holders or the cache
  // keep them) and everything past the new end, deepest first.
  for (auto bi = old_table.size(); bi-- > 0;) {
    const block_id b = old_table[bi];
    const bool gone = bi >= static_cast<std::size_t>(n_blocks) ||
                      std::find(replaced.begin(), replaced.end(), static_cast<std::int32_t>(bi)) != replaced.end();
    if (gone) release(b);
  }

  s.tokens.erase(s.tokens.begin() + c.first, s.tokens.begin() + s.n_stored);
  s.tokens.insert(s.tokens.begin() + c.first, c.tokens.begin(), c.tokens.end());
  s.positions.resize(static_cast<std::size_t>(c.first));
  s.positions.insert(s.positions.end(), c.positions.begin(), c.positions.end());
  s.n_stored = c.n_slots;
  s.keys.resize(std::min(s.keys.size(), static_cast<std::size_t>(c.first / bs)));
  s.off_chain = true;
  evict_over_quota(s.tenant);
  return ok_status();
}

status kv_manager::check_compaction(const sequence& s, const kv_compaction& c) const {
  const std::int32_t n = c.n_slots - c.first;
  if (c.first < 0 || n < 0 || c.n_slots > s.n_stored)
    return error(errc::invalid_argument, "compact: slots [{}, {}) outside the {} stored", c.first, c.n_slots, s.n_stored);
  if (c.tokens.size() != static_cast<std::size_t>(n) || c.positions.size() != static_cast<std::size_t>(n))
    return error(errc::invalid_argument, "compact: {} rewritten slots but {} tokens and {} positions", n,
                 c.tokens.size(), c.positions.size());
  for (std::int32_t i = 0; i < n; ++i) {
    const std::int32_t prev = i > 0 ? c.positions[static_cast<std::size_t>(i) - 1]
                                    : (c.first > 0 ? s.positions[static_cast<std::size_t>(c.first) - 1] : INT32_MIN);
    if (c.positions[static_cast<std::size_t>(i)] <= prev)
      return error(errc::invalid_argument, "compact: position {} of slot {} does not follow {}",
                   c.positions[static_cast<std::size_t>(i)], c.first + i, prev);
  }
  if (!c.gather) return error(errc::invalid_argument, "compact: no gather");
  const kv_gather& g = *c.gather;
  if (g.n_rows < 1 || g.sources.size() != static_cast<std::size_t>(g.n_rows) * n ||
      g.folded.size() != static_cast<std::size_t>(g.n_rows) * g.n_folded ||
      g.anchors.size() != static_cast<std::size_t>(g.n_rows) * g.anchors_per_row ||
      (!g.rotate.empty() && (g.rotate.size() != static_cast<std::size_t>(n) || g.n_rows != 1)))
    return error(errc::invalid_argument, "compact: the gather's arrays do not match {} rows of {} slots", g.n_rows, n);
  const auto in_range = [&](std::int32_t slot) { return slot >= -1 && slot < s.n_stored; };
  if (!std::all_of(g.sources.begin(), g.sources.end(), in_range) ||
      !std::all_of(g.folded.begin(), g.folded.end(), in_range))
    return error(errc::invalid_argument, "compact: a source slot outside the {} stored", s.n_stored);
  if (!std::all_of(g.anchors.begin(), g.anchors.end(), [&](std::int32_t a) { return a >= c.first && a < c.n_slots; }))
    return error(errc::invalid_argument, "compact: an anchor outside the rewritten slots");
  return ok_status();
}

status kv_manager::truncate(seq_id seq, std::int32_t n_slots) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "truncate: unknown sequence {}", seq.value);
  sequence& s = it->second;
  if (n_slots < 0 || n_slots > s.n_stored) {
    return error(errc::out_of_range, "truncate: sequence {} stores {} slots; cannot keep {}", seq.value, s.n_stored,
                 n_slots);
  }
  if (window_ && s.window_from > 0) {
    // The next query (at the position after the last kept slot) must see no
    // block this sequence already stopped claiming.
    const std::int64_t next = n_slots > 0 ? s.positions[static_cast<std::size_t>(n_slots) - 1] + 1 : 0;
    const std::int32_t last_released = s.window_from * block_size_ - 1;  // its slot
    if (last_released >= n_slots || s.positions[static_cast<std::size_t>(last_released)] > next - window_tokens_)
      return error(errc::out_of_range,
                   "truncate: sequence {}: keeping {} slots would need sliding-window K/V it has already given up",
                   seq.value, n_slots);
  }
  const auto n_blocks = static_cast<std::size_t>(ceil_div(n_slots, block_size_));
  while (s.table.size() > n_blocks) {
    if (static_cast<std::int32_t>(s.table.size()) - 1 >= s.window_from) unclaim(s.table.back());
    release(s.table.back());
    s.table.pop_back();
  }
  s.window_from = std::min(s.window_from, static_cast<std::int32_t>(s.table.size()));
  s.tokens.resize(static_cast<std::size_t>(n_slots));
  s.positions.resize(static_cast<std::size_t>(n_slots));
  s.n_stored = n_slots;
  s.keys.resize(std::min(s.keys.size(), static_cast<std::size_t>(n_slots / block_size_)));
  const std::int32_t n_kept = n_slots % block_size_;
  if (n_kept > 0) {
    const block_id last = s.table.back();
    // Shared or cached: left intact for its other readers; the next allocate copies it.
    if (pool_.ref_count(last) == 1 && !pool_.is_hashed(last)) {
      std::int32_t& fill = fill_[static_cast<std::size_t>(last.value)];
      if (fill > n_kept) {
        stored_tokens_in_used_ -= fill - n_kept;
        fill = n_kept;
      }
      emit(kv_op{.kind = kv_op_kind::truncate, .block = last, .n_tokens = n_kept});
    }
  }
  evict_over_quota(s.tenant);
  return ok_status();
}

status kv_manager::fork(seq_id parent, seq_id child) {
  const auto it = seqs_.find(parent);
  if (it == seqs_.end()) return error(errc::not_found, "fork: unknown parent sequence {}", parent.value);
  if (contains(child)) return error(errc::invalid_argument, "fork: child sequence {} already exists", child.value);
  const sequence& p = it->second;
  if (static_cast<std::int32_t>(p.table.size()) != ceil_div(p.n_stored, block_size_)) {
    return error(errc::invalid_argument,
                 "fork: parent sequence {} holds {} blocks for {} stored tokens; fork between commit and allocate",
                 parent.value, p.table.size(), p.n_stored);
  }
  sequence c = p;
  for (std::size_t i = 0; i < c.table.size(); ++i) {
    hold(c.table[i]);
    if (static_cast<std::int32_t>(i) >= c.window_from) claim(c.table[i]);
  }
  seqs_.emplace(child, std::move(c));
  return ok_status();
}

status kv_manager::free_sequence(seq_id seq) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "free: unknown sequence {}", seq.value);
  // Deepest first: released cached blocks are appended to the queue's tail in
  // this order, so the tail end of a chain is evicted before its head.
  const std::vector<block_id>& table = it->second.table;
  for (auto i = table.size(); i-- > 0;) {
    if (static_cast<std::int32_t>(i) >= it->second.window_from) unclaim(table[i]);
    release(table[i]);
  }
  const tenant_id t = it->second.tenant;
  seqs_.erase(it);
  // A tenant above a lowered quota keeps no cache until it is back under it.
  evict_over_quota(t);
  return ok_status();
}

status kv_manager::preempt_sequence(seq_id seq) {
  PAGODA_RETURN_IF_ERROR(free_sequence(seq));
  ++n_preemptions_;
  return ok_status();
}

std::span<const block_id> kv_manager::block_table(seq_id seq) const { return seq_at(seq).table; }
std::int32_t kv_manager::n_stored_tokens(seq_id seq) const { return seq_at(seq).n_stored; }
std::span<const token_id> kv_manager::tokens(seq_id seq) const { return seq_at(seq).tokens; }
std::span<const std::int32_t> kv_manager::positions(seq_id seq) const { return seq_at(seq).positions; }
tenant_id kv_manager::tenant_of(seq_id seq) const { return seq_at(seq).tenant; }

// --- pool-level helpers -----------------------------------------------------------

status kv_manager::check_request_fits(std::int32_t n_prompt_tokens, std::int32_t n_max_new_tokens,
                                      std::string_view tenant, std::int32_t n_completions,
                                      std::span<const kv_class_run> classes) const {
  if (n_prompt_tokens <= 0 || n_max_new_tokens < 0 || n_completions <= 0) {
    return error(errc::invalid_argument, "request of {} prompt tokens, {} new tokens, {} completions", n_prompt_tokens,
                 n_max_new_tokens, n_completions);
  }
  PAGODA_RETURN_IF_ERROR(check_class_runs(classes, static_cast<std::size_t>(n_prompt_tokens)));
  const std::int64_t n_total = static_cast<std::int64_t>(n_prompt_tokens) + n_max_new_tokens;
  const std::int64_t per_seq = ceil_div(n_total, block_size_);
  const std::int64_t shared = n_prompt_tokens / block_size_;
  const std::int64_t n_needed = per_seq + (n_completions - 1) * (per_seq - shared);
  if (n_needed > n_blocks()) {
    return error(errc::resource_exhausted,
                 "request needs {} KV blocks ({} prompt + {} new tokens x {} completions, {} tokens a block) but the "
                 "KV cache holds {} blocks; shorten the prompt, lower max_tokens or enlarge the KV cache",
                 n_needed, n_prompt_tokens, n_max_new_tokens, n_completions, block_size_, n_blocks());
  }
  if (pool_.n_classes() > 1) {
    // Each class against its own blocks: the shared full prompt blocks once,
    // every other block once per completion.
    std::array<std::int64_t, k_max_kv_classes> per_class{};
    for (std::int64_t i = 0; i < per_seq; ++i) {
      const std::int32_t c = prompt_block_class(classes, static_cast<std::size_t>(i), block_size_);
      per_class[static_cast<std::size_t>(c)] += i < shared ? 1 : n_completions;
    }
    for (std::int32_t c = 0; c < pool_.n_classes(); ++c) {
      if (per_class[static_cast<std::size_t>(c)] > pool_.class_size(c)) {
        return error(errc::resource_exhausted,
                     "request needs {} KV blocks of class {} ({} prompt + {} new tokens x {} completions, {} tokens a "
                     "block) but the KV cache holds {} blocks of class {}; {}",
                     per_class[static_cast<std::size_t>(c)], c, n_prompt_tokens, n_max_new_tokens, n_completions,
                     block_size_, pool_.class_size(c), c,
                     c == 0 ? "shorten the prompt outside its KV class runs, lower max_tokens or enlarge KV class 0"
                            : "shorten the prompt's runs of that class or enlarge the class");
      }
    }
  }
  if (const auto t = find_tenant(tenant)) {
    const auto& quota = tenants_[static_cast<std::size_t>(t->value)].quota_blocks;
    if (quota && n_needed > *quota) {
      return error(errc::resource_exhausted,
                   "request needs {} KV blocks ({} prompt + {} new tokens x {} completions) but tenant '{}' may hold "
                   "{} blocks",
                   n_needed, n_prompt_tokens, n_max_new_tokens, n_completions, tenant, *quota);
    }
  }
  return ok_status();
}

std::int32_t kv_manager::evict_cached_blocks() {
  std::int32_t n = 0;
  for (const block_id b : pool_.free_queue()) {
    if (!pool_.is_hashed(b)) continue;
    drop_cached(b);
    ++n;
  }
  return n;
}

std::int32_t kv_manager::evict_cached_blocks(std::string_view tenant) {
  const std::optional<tenant_id> t = find_tenant(tenant);
  if (!t) return 0;
  std::int32_t n = 0;
  for (const block_id b : pool_.cached_of(*t)) {
    drop_cached(b);
    ++n;
  }
  return n;
}

kv_metrics kv_manager::metrics() const {
  kv_metrics m;
  m.block_size_tokens = block_size_;
  m.n_blocks_total = pool_.n_blocks();
  m.n_blocks_used = pool_.n_used();
  m.n_blocks_cached = pool_.n_cached();
  m.n_blocks_free = pool_.n_free();
  m.n_blocks_used_peak = peak_used_;
  m.n_stored_tokens = stored_tokens_in_used_;
  m.n_sequences = static_cast<std::int32_t>(seqs_.size());
  m.n_prefix_query_tokens = n_query_tokens_;
  m.n_prefix_hit_tokens = n_hit_tokens_;
  m.n_prefix_query_blocks = n_query_blocks_;
  m.n_prefix_hit_blocks = n_hit_blocks_;
  m.n_evictions = n_evictions_;
  m.n_preemptions = n_preemptions_;
  m.n_cow_copies = n_cow_copies_;
  if (window_) {
    m.n_window_slots = window_->n_slots();
    m.n_window_slots_pinned = window_->n_pinned();
    m.n_window_slots_bound = window_->n_bound();
    m.n_window_slots_pinned_peak = window_->peak_pinned();
    m.n_window_kv_lost = window_->n_lost();
  }
  m.classes.reserve(static_cast<std::size_t>(pool_.n_classes()));
  for (std::int32_t c = 0; c < pool_.n_classes(); ++c)
    m.classes.push_back(kv_class_usage{pool_.class_size(c), pool_.n_used_in(c), pool_.n_cached_in(c), pool_.n_free_in(c)});
  m.tenants.reserve(tenants_.size());
  for (std::size_t i = 0; i < tenants_.size(); ++i) {
    const tenant_id t(static_cast<std::int32_t>(i));
    m.tenants.push_back(tenant_kv_usage{tenants_[i].name, pool_.n_used(t), pool_.n_cached(t), tenants_[i].quota_blocks});
  }
  return m;
}

// --- invariants -------------------------------------------------------------------

status kv_manager::check_invariants() const {
  PAGODA_RETURN_IF_ERROR(pool_.check_invariants().with_context("block pool"));
  PAGODA_RETURN_IF_ERROR(index_.check_invariants().with_context("prefix index"));
  const std::int32_t n = pool_.n_blocks();
  if (pool_.n_free() + pool_.n_used() + pool_.n_cached() != n) {
    return error(errc::internal, "free {} + used {} + cached {} != total {}", pool_.n_free(), pool_.n_used(),
                 pool_.n_cached(), n);
  }

  std::vector<std::int32_t> holders(static_cast<std::size_t>(n), 0);
  std::vector<std::int32_t> max_valid(static_cast<std::size_t>(n), 0);
  std::vector<std::int32_t> last_seen(static_cast<std::size_t>(n), -1);
  std::int32_t seq_number = 0;
  for (const auto& [id, s] : seqs_) {
    ++seq_number;
    if (s.n_stored < 0 || static_cast<std::size_t>(s.n_stored) > s.tokens.size() ||
        static_cast<std::int64_t>(s.n_stored) > static_cast<std::int64_t>(s.table.size()) * block_size_) {
      return error(errc::internal, "sequence {}: {} stored tokens, {} known, {} blocks", id.value, s.n_stored,
                   s.tokens.size(), s.table.size());
    }
    for (std::size_t i = 0; i < s.table.size(); ++i) {
      const block_id b = s.table[i];
      if (b.value < 0 || b.value >= n) return error(errc::internal, "sequence {}: table entry {} is {}", id.value, i, b.value);
      auto& seen = last_seen[static_cast<std::size_t>(b.value)];
      if (seen == seq_number) return error(errc::internal, "sequence {} holds block {} twice", id.value, b.value);
      seen = seq_number;
      ++holders[static_cast<std::size_t>(b.value)];
      if (pool_.owner(b) != s.tenant) {
        return error(errc::internal, "sequence {} of tenant {} holds block {} of tenant {}", id.value, s.tenant.value,
                     b.value, pool_.owner(b).value);
      }
      const std::int64_t valid = std::clamp<std::int64_t>(s.n_stored - static_cast<std::int64_t>(i) * block_size_, 0,
                                                          block_size_);
      auto& mv = max_valid[static_cast<std::size_t>(b.value)];
      mv = std::max(mv, static_cast<std::int32_t>(valid));
    }
    PAGODA_RETURN_IF_ERROR(check_class_runs(s.classes, SIZE_MAX).with_context(fmt::format("sequence {}", id.value)));
    if (s.classes.empty()) {
      for (const block_id b : s.table)
        if (pool_.class_of(b) != 0)
          return error(errc::internal, "sequence {} without KV class runs holds block {} of class {}", id.value,
                       b.value, pool_.class_of(b));
    }
    const std::size_t n_full = static_cast<std::size_t>(s.n_stored / block_size_);
    const bool keys_ok = !prefix_caching_ ? s.keys.empty() : s.off_chain ? s.keys.size() <= n_full : s.keys.size() == n_full;
    if (!keys_ok) {
      return error(errc::internal, "sequence {}: {} block keys for {} full blocks (off chain {})", id.value,
                   s.keys.size(), n_full, s.off_chain);
    }
    if (s.positions.size() != static_cast<std::size_t>(s.n_stored))
      return error(errc::internal, "sequence {}: {} positions for {} slots", id.value, s.positions.size(), s.n_stored);
    for (std::size_t i = 1; i < s.positions.size(); ++i)
      if (s.positions[i] <= s.positions[i - 1])
        return error(errc::internal, "sequence {}: position {} at slot {} after {}", id.value, s.positions[i], i,
                     s.positions[i - 1]);
    block_key parent = k_root_parent_key;
    for (std::size_t i = 0; i < s.keys.size(); ++i) {
      if (s.keys[i] != chain_key(s, i, parent, extras_of(s, i))) {
        return error(errc::internal, "sequence {}: key of block {} does not chain", id.value, i);
      }
      parent = s.keys[i];
      // A keyed block holds slot k at position k: its class is the one the runs give its index.
      const block_id b = s.table[i];
      if (pool_.class_of(b) != prompt_block_class(s.classes, i, block_size_)) {
        return error(errc::internal, "sequence {}: keyed block {} at index {} is of class {}, its runs say {}", id.value,
                     b.value, i, pool_.class_of(b), prompt_block_class(s.classes, i, block_size_));
      }
      // A hashed block in a table holds exactly this sequence's block there.
      if (pool_.is_hashed(b) && index_.key_of(b) != s.keys[i]) {
        return error(errc::internal, "sequence {}: block {} is indexed under another key", id.value, b.value);
      }
    }
  }

  std::int64_t stored = 0;
  std::int64_t n_hashed = 0;
  for (std::int32_t i = 0; i < n; ++i) {
    const block_id b(i);
    const auto ui = static_cast<std::size_t>(i);
    if (pool_.ref_count(b) != holders[ui]) {
      return error(errc::internal, "block {} has ref {} but {} tables hold it", i, pool_.ref_count(b), holders[ui]);
    }
    if (pool_.is_hashed(b) != index_.contains(b)) {
      return error(errc::internal, "block {}: hashed {} but indexed {}", i, pool_.is_hashed(b), index_.contains(b));
    }
    if (pool_.is_hashed(b)) {
      ++n_hashed;
      if (fill_[ui] != block_size_) return error(errc::internal, "hashed block {} holds {} tokens", i, fill_[ui]);
    }
    if (holders[ui] > 0) {
      if (fill_[ui] < max_valid[ui]) {
        return error(errc::internal, "block {} holds {} tokens but a table reads {}", i, fill_[ui], max_valid[ui]);
      }
      stored += fill_[ui];
    }
  }
  if (static_cast<std::size_t>(n_hashed) != index_.size()) {
    return error(errc::internal, "{} hashed blocks but {} index entries", n_hashed, index_.size());
  }
  if (stored != stored_tokens_in_used_) {
    return error(errc::internal, "used blocks hold {} tokens, counted {}", stored, stored_tokens_in_used_);
  }
  for (std::size_t t = 0; t < tenants_.size(); ++t) {
    const tenant_id id(static_cast<std::int32_t>(t));
    const auto& quota = tenants_[t].quota_blocks;
    if (quota && pool_.n_cached(id) > 0 && pool_.n_used(id) + pool_.n_cached(id) > *quota) {
      return error(errc::internal, "tenant '{}' holds {} used + {} cached blocks over its quota of {}", tenants_[t].name,
                   pool_.n_used(id), pool_.n_cached(id), *quota);
    }
  }
  if (peak_used_ < pool_.n_used()) return error(errc::internal, "peak {} below used {}", peak_used_, pool_.n_used());
  return check_window_invariants();
}

}  // namespace pagoda
