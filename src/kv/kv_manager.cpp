#include "kv/kv_manager.h"

#include <algorithm>

#include "core/assert.h"
#include "kv/kv_class_rule.h"

namespace pagoda {

namespace {
std::int32_t ceil_div(std::int64_t a, std::int64_t b) { return static_cast<std::int32_t>((a + b - 1) / b); }

std::vector<kv_group_config> one_full_group(std::vector<std::int32_t> class_blocks) {
  kv_group_config g;
  g.class_blocks = std::move(class_blocks);
  return {std::move(g)};
}
}  // namespace

kv_manager::kv_manager(std::int32_t block_size, std::int32_t n_blocks, bool enable_prefix_caching)
    : kv_manager(block_size, std::vector<std::int32_t>{n_blocks}, enable_prefix_caching) {}

kv_manager::kv_manager(std::int32_t block_size, std::vector<std::int32_t> class_blocks, bool enable_prefix_caching)
    : kv_manager(block_size, one_full_group(std::move(class_blocks)), enable_prefix_caching) {}

kv_manager::kv_manager(std::int32_t block_size, std::vector<kv_group_config> groups, bool enable_prefix_caching)
    : block_size_(block_size), prefix_caching_(enable_prefix_caching) {
  PAGODA_ASSERT(block_size > 0, "block size {}", block_size);
  PAGODA_ASSERT(!groups.empty() && groups.size() <= static_cast<std::size_t>(k_max_kv_groups), "{} KV groups (1 to {})",
                groups.size(), k_max_kv_groups);
  std::int64_t first = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    PAGODA_ASSERT(groups[g].class_blocks.size() == groups[0].class_blocks.size(),
                  "KV group {} has {} classes, group 0 {}", g, groups[g].class_blocks.size(),
                  groups[0].class_blocks.size());
    groups_.push_back(make_kv_group(static_cast<std::int32_t>(g), groups[g], static_cast<std::int32_t>(first),
                                    block_size, enable_prefix_caching, *this));
    first += groups_.back()->n_blocks();
    PAGODA_ASSERT(first <= INT32_MAX, "KV groups of {} blocks in all", first);
  }
  tenant("");  // tenant 0: the default
  class_keys_.resize(static_cast<std::size_t>(n_classes()));
  for (std::size_t c = 1; c < class_keys_.size(); ++c) class_keys_[c] = "kvc=" + std::to_string(c);
}

kv_manager::~kv_manager() = default;

void kv_manager::set_class_keys(std::vector<std::string> keys) {
  PAGODA_ASSERT(seqs_.empty() && keys.size() == class_keys_.size(), "set_class_keys: {} keys for {} classes, {} sequences",
                keys.size(), class_keys_.size(), seqs_.size());
  for (std::size_t c = 1; c < keys.size(); ++c) class_keys_[c] = "kvc=" + keys[c];
}

const kv_group& kv_manager::group_of_block(block_id b) const {
  for (const auto& g : groups_)
    if (g->owns(b)) return *g;
  PAGODA_ASSERT(false, "block {} belongs to no KV group", b.value);
  return group0();
}

bool kv_manager::has_sliding_window() const {
  return std::any_of(groups_.begin(), groups_.end(),
                     [](const auto& g) { return g->kind() == kv_group_kind::sliding_window; });
}

bool kv_manager::any_group_exhausted() const {
  return std::any_of(groups_.begin(), groups_.end(), [](const auto& g) { return g->pool().n_takeable() == 0; });
}

void kv_manager::emit(kv_op op) {
  if (op_listener_) op_listener_(op);
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
  kv_group& g = group0();
  while (g.pool().n_used(t) + g.pool().n_cached(t) > *quota)
    if (!g.evict_next_cached_of(t)) break;  // only used blocks left: they shrink as sequences end
}

// --- allocation ------------------------------------------------------------------

alloc_blocker kv_manager::take_blocker(tenant_id t, const demands& d) const {
  const auto& quota = tenants_[static_cast<std::size_t>(t.value)].quota_blocks;
  if (quota && d[0].d.total > 0 && group0().pool().n_used(t) + d[0].d.total > *quota) return alloc_blocker::quota;
  for (std::size_t g = 0; g < groups_.size(); ++g)
    if (!groups_[g]->can_take(d[g].d)) return alloc_blocker::pool;
  return alloc_blocker::none;
}

std::vector<block_id> kv_manager::take(const sequence& s, std::int32_t g, const group_demand& d) {
  // At its quota a tenant pays with its own cached blocks first (the least
  // worth among its own of the class it needs, block_pool.h); the rest come from the head of the class's
  // queue. Own cached blocks of other classes that still keep it above its
  // quota are evicted afterwards (evict_over_quota).
  std::int32_t n_own = 0;
  if (g == 0)
    if (const auto& quota = tenants_[static_cast<std::size_t>(s.tenant.value)].quota_blocks) {
      const block_pool& p = group0().pool();
      n_own = std::clamp(p.n_used(s.tenant) + p.n_cached(s.tenant) + d.d.total - *quota, 0, d.d.total);
    }
  return groups_[static_cast<std::size_t>(g)]->take(s.tenant, d.order, n_own);
}

bool kv_manager::needs_cow(const sequence& s, std::int32_t g, std::int32_t n_new_tokens) const {
  if (n_new_tokens <= 0 || s.n_stored % block_size_ == 0) return false;
  const block_id b = s.tables[static_cast<std::size_t>(g)][static_cast<std::size_t>(s.n_stored / block_size_)];
  if (!b.valid()) return true;  // a window let it go (its slots are out of every query's window): a fresh one
  const kv_group& grp = *groups_[static_cast<std::size_t>(g)];
  return grp.ref_count(b) > 1 || grp.is_hashed(b);
}

std::int32_t kv_manager::n_appended_blocks(const sequence& s, std::int32_t n_new_tokens) const {
  const std::int32_t n_blocks = ceil_div(static_cast<std::int64_t>(s.n_stored) + n_new_tokens, block_size_);
  return std::max(0, n_blocks - static_cast<std::int32_t>(s.n_table()));
}

std::int32_t kv_manager::new_block_class(const sequence& s, std::size_t block_index) const {
  if (s.classes.empty()) return 0;
  // Slots past the stored ones take the tokens fed next: slot j holds token
  // n_fed + (j - n_stored).
  const std::int64_t first_slot = static_cast<std::int64_t>(block_index) * block_size_;
  PAGODA_ASSERT(first_slot >= s.n_stored, "block {} holds stored slots", block_index);
  return kv_rule::class_of_block(s.classes, s.n_fed + (first_slot - s.n_stored), block_size_);
}

kv_manager::demands kv_manager::demand(const sequence& s, std::int32_t n_new_tokens) const {
  PAGODA_ASSERT(n_new_tokens >= 0, "n_new_tokens {}", n_new_tokens);
  demands out;
  const std::int32_t n_appended = n_appended_blocks(s, n_new_tokens);
  std::vector<std::int32_t> appended;
  for (std::int32_t k = 0; k < n_appended; ++k) appended.push_back(new_block_class(s, s.n_table() + static_cast<std::size_t>(k)));
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    group_demand& d = out[g];
    d.cow = needs_cow(s, static_cast<std::int32_t>(g), n_new_tokens);
    // A copy is of the class of the block it replaces.
    if (d.cow) d.order.push_back(s.block_classes[static_cast<std::size_t>(s.n_stored / block_size_)]);
    d.order.insert(d.order.end(), appended.begin(), appended.end());
    if (g == 0) {
      // Side blocks the sequence lacks for its slots after this step (class 0, taken last).
      const std::int64_t n_slots = static_cast<std::int64_t>(s.n_stored) + n_new_tokens;
      const std::int64_t bytes = std::max(s.side.bytes_for(n_slots), s.side_measured);
      d.n_side = std::max<std::int32_t>(0, side_blocks_of(bytes) - static_cast<std::int32_t>(s.side_blocks.size()));
      d.order.insert(d.order.end(), static_cast<std::size_t>(d.n_side), 0);
    }
    for (const std::int32_t c : d.order) d.d.add(c);
  }
  return out;
}

std::int32_t kv_manager::side_blocks_of(std::int64_t bytes) const {
  if (side_block_bytes_ <= 0 || bytes <= 0) return 0;
  return static_cast<std::int32_t>(std::min<std::int64_t>((bytes + side_block_bytes_ - 1) / side_block_bytes_, INT32_MAX));
}

std::int32_t kv_manager::side_blocks_for(const side_charge& charge, std::int64_t n_tokens) const {
  return side_blocks_of(charge.bytes_for(n_tokens));
}

status kv_manager::set_side_measured(seq_id seq, std::int64_t bytes) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "set_side_measured: unknown sequence {}", seq.value);
  it->second.side_measured = std::max<std::int64_t>(bytes, 0);
  return ok_status();
}

std::int32_t kv_manager::n_side_blocks(seq_id seq) const { return static_cast<std::int32_t>(seq_at(seq).side_blocks.size()); }

std::int32_t kv_manager::n_blocks_needed(seq_id seq, std::int32_t n_new_tokens) const {
  const demands d = demand(seq_at(seq), n_new_tokens);
  std::int32_t n = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) n += d[g].d.total;
  return n;
}

bool kv_manager::can_allocate(seq_id seq, std::int32_t n_new_tokens) const {
  return allocation_blocker(seq, n_new_tokens) == alloc_blocker::none;
}

alloc_blocker kv_manager::allocation_blocker(seq_id seq, std::int32_t n_new_tokens) const {
  const sequence& s = seq_at(seq);
  return take_blocker(s.tenant, demand(s, n_new_tokens));
}

std::uint64_t kv_manager::short_classes(seq_id seq, std::int32_t n_new_tokens) const {
  if (groups_.size() == 1 && n_classes() == 1) return 0;
  const demands d = demand(seq_at(seq), n_new_tokens);
  std::uint64_t mask = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g)
    for (std::int32_t c = 0; c < n_classes(); ++c)
      if (d[g].d.n[static_cast<std::size_t>(c)] > groups_[g]->pool().n_takeable(c))
        mask |= std::uint64_t{1} << (g * k_max_kv_classes + static_cast<std::size_t>(c));
  return mask;
}

bool kv_manager::holds_class(seq_id seq, std::uint64_t mask) const {
  const sequence& s = seq_at(seq);
  for (std::size_t g = 0; g < groups_.size(); ++g)
    for (std::size_t i = 0; i < s.n_table(); ++i)
      if (s.tables[g][i].valid() && ((mask >> (g * k_max_kv_classes + s.block_classes[i])) & 1u)) return true;
  return false;
}

block_copy kv_manager::copy_on_write(sequence& s, std::int32_t g, block_id fresh) {
  // The one non-append change of allocate(): the shared block holding the next
  // write position is swapped for a private copy before anything is written.
  // The other holders keep the original, unchanged.
  kv_group& grp = *groups_[static_cast<std::size_t>(g)];
  const auto index = static_cast<std::size_t>(s.n_stored / block_size_);
  std::vector<block_id>& table = s.tables[static_cast<std::size_t>(g)];
  const block_id src = table[index];
  const std::int32_t n_valid = s.n_stored % block_size_;
  grp.set_fill(fresh, n_valid);
  table[index] = fresh;
  if (!src.valid()) {
    // NULL in a sliding window: the kept slots are out of every query's
    // window, so nothing is copied (they are dead); the block is writable from n_valid on.
    s.window_dead_upto = std::max<std::int64_t>(s.window_dead_upto, s.positions[static_cast<std::size_t>(s.n_stored) - 1]);
    emit(kv_op{.kind = kv_op_kind::truncate, .block = fresh, .n_tokens = n_valid, .group = g});
    return block_copy{src, fresh, 0};
  }
  emit(kv_op{.kind = kv_op_kind::copy, .block = fresh, .src = src, .n_tokens = n_valid, .group = g});
  grp.release(src);  // shared: stays used by the others; cached: stays in the index
  ++n_cow_copies_;
  return block_copy{src, fresh, n_valid};
}

std::optional<allocation> kv_manager::allocate(seq_id seq, std::int32_t n_new_tokens) {
  sequence& s = seq_at(seq);
  const demands d = demand(s, n_new_tokens);
  bool any = false;
  for (std::size_t g = 0; g < groups_.size(); ++g) any = any || d[g].d.total > 0;
  if (!any) return allocation{};  // the slots exist (no copy either: it would take a block)
  if (take_blocker(s.tenant, d) != alloc_blocker::none) return std::nullopt;
  allocation a;
  const std::int32_t n_appended = n_appended_blocks(s, n_new_tokens);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const std::vector<block_id> fresh = take(s, static_cast<std::int32_t>(g), d[g]);
    std::size_t next = 0;
    if (d[g].cow) {
      const block_copy c = copy_on_write(s, static_cast<std::int32_t>(g), fresh[next++]);
      if (c.src.valid()) a.copies.push_back(c);
    }
    const std::size_t kv_end = fresh.size() - static_cast<std::size_t>(d[g].n_side);
    for (; next < kv_end; ++next) s.tables[g].push_back(fresh[next]);
    for (; next < fresh.size(); ++next) s.side_blocks.push_back(fresh[next]);
  }
  for (std::int32_t k = 0; k < n_appended; ++k)
    s.block_classes.push_back(static_cast<std::uint8_t>(new_block_class(s, s.block_classes.size())));
  evict_over_quota(s.tenant);
  a.n_new_blocks = n_appended;
  return a;
}

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
  return kv_rule::block_extras(s.first_extras, block_index, s.block_classes[block_index], class_keys_);
}

block_key kv_manager::chain_key(const sequence& s, std::size_t block_index, block_key parent,
                                std::string_view extras) const {
  const auto tokens = std::span<const token_id>(s.tokens).subspan(block_index * static_cast<std::size_t>(block_size_),
                                                                   static_cast<std::size_t>(block_size_));
  return hash_block(parent, tokens, extras);
}

std::string kv_manager::first_block_extras(const sequence_options& options) {
  return pagoda::first_block_extras(options.tenant, options.cache_salt, options.chunk);
}

status kv_manager::check_class_runs(std::span<const kv_class_run> runs, std::size_t n_prompt) const {
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const kv_class_run& r = runs[i];
    if (r.cls >= n_classes())
      return error(errc::invalid_argument, "KV class run {}: class {}, but the KV cache has classes 0 to {}", i, r.cls,
                   n_classes() - 1);
    if (r.begin < 0 || r.end <= r.begin || static_cast<std::size_t>(r.end) > n_prompt)
      return error(errc::invalid_argument, "KV class run {}: positions [{}, {}) are not a non-empty range of the {}-token prompt",
                   i, r.begin, r.end, n_prompt);
    if (i > 0 && r.begin < runs[i - 1].end)
      return error(errc::invalid_argument, "KV class run {} (from position {}) overlaps or precedes run {} (to {})", i,
                   r.begin, i - 1, runs[i - 1].end);
  }
  return ok_status();
}

kv_manager::probe_data kv_manager::probe_of(std::span<const token_id> prompt, std::string_view first_extras,
                                            std::span<const kv_class_run> runs, std::size_t max_blocks) const {
  probe_data p;
  const auto bs = static_cast<std::size_t>(block_size_);
  block_key parent = k_root_parent_key;
  for (std::size_t i = 0; i < max_blocks && (i + 1) * bs <= prompt.size(); ++i) {
    const std::int32_t cls = kv_rule::prompt_block_class(runs, i, block_size_);
    std::string extras = kv_rule::block_extras(first_extras, i, cls, class_keys_);
    const block_key key = hash_block(parent, prompt.subspan(i * bs, bs), extras);
    p.keys.push_back(key);
    p.parents.push_back(parent);
    p.extras.push_back(std::move(extras));
    p.classes.push_back(static_cast<std::uint8_t>(cls));
    parent = key;
  }
  return p;
}

std::int32_t kv_manager::longest_cached_prefix(const prefix_probe& probe, std::int32_t max_blocks) const {
  // Each group answers at most what it was asked; a full group accepts any
  // shorter prefix, a sliding window may not, so ask again until all agree.
  std::int32_t m = std::min<std::int32_t>(max_blocks, static_cast<std::int32_t>(probe.size()));
  for (bool changed = true; changed && m > 0;) {
    changed = false;
    for (const auto& g : groups_) {
      const std::int32_t got = g->longest_cached_prefix(probe, m);
      if (got < m) {
        m = got;
        changed = true;
      }
    }
  }
  return m;
}

std::vector<block_key> kv_manager::prompt_keys(std::span<const token_id> prompt, const sequence_options& options) const {
  return probe_of(prompt, first_block_extras(options), options.classes, prompt.size()).keys;
}

std::vector<std::int32_t> kv_manager::prompt_block_classes(std::span<const token_id> prompt,
                                                           const sequence_options& options) const {
  std::vector<std::int32_t> classes(prompt.size() / static_cast<std::size_t>(block_size_));
  for (std::size_t i = 0; i < classes.size(); ++i) classes[i] = kv_rule::prompt_block_class(options.classes, i, block_size_);
  return classes;
}

std::int32_t kv_manager::n_cached_prompt_blocks(std::span<const token_id> prompt, const sequence_options& options) const {
  if (prompt.empty() || !options.lookup || !prefix_caching_ || !check_class_runs(options.classes, prompt.size()).ok())
    return 0;
  const auto t = find_tenant(options.tenant);
  if (!t) return 0;  // a tenant never seen holds nothing
  const std::size_t n_reusable = std::min((prompt.size() - 1) / static_cast<std::size_t>(block_size_),
                                          static_cast<std::size_t>(std::max(options.max_lookup_blocks, 0)));
  const probe_data p = probe_of(prompt, first_block_extras(options), options.classes, n_reusable);
  const prefix_probe probe{prompt, p.keys, p.parents, p.extras, p.classes, *t, block_size_};
  return longest_cached_prefix(probe, static_cast<std::int32_t>(n_reusable));
}

result<std::int32_t> kv_manager::add_sequence(seq_id seq, std::span<const token_id> prompt,
                                              const sequence_options& options) {
  if (contains(seq)) return error(errc::invalid_argument, "sequence {} already exists", seq.value);
  if (prompt.empty()) return error(errc::invalid_argument, "sequence {}: empty prompt", seq.value);
  PAGODA_RETURN_IF_ERROR(check_class_runs(options.classes, prompt.size()).with_context(fmt::format("sequence {}", seq.value)));

  sequence s;
  s.tenant = tenant(options.tenant);
  s.first_extras = first_block_extras(options);
  s.side = options.side;
  s.classes.assign(options.classes.begin(), options.classes.end());
  s.tokens.assign(prompt.begin(), prompt.end());

  if (prefix_caching_) {
    // The last prompt token is always computed (its logits start generation).
    const std::size_t n_reusable =
        options.lookup ? std::min((prompt.size() - 1) / static_cast<std::size_t>(block_size_),
                                  static_cast<std::size_t>(std::max(options.max_lookup_blocks, 0)))
                       : std::size_t{0};
    const probe_data p = probe_of(prompt, s.first_extras, s.classes, n_reusable);
    const prefix_probe probe{prompt, p.keys, p.parents, p.extras, p.classes, s.tenant, block_size_};
    const std::int32_t m = longest_cached_prefix(probe, static_cast<std::int32_t>(n_reusable));
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      kv_group& grp = *groups_[g];
      const std::int32_t from = grp.first_needed_block({}, m, static_cast<std::int64_t>(m) * block_size_);
      s.tables[g].assign(static_cast<std::size_t>(from), block_id());
      for (std::int32_t i = from; i < m; ++i) {
        const auto b = grp.find(probe, static_cast<std::size_t>(i));
        PAGODA_ASSERT(b.has_value(), "group {}: block {} of the prefix it agreed to serve is gone", g, i);
        grp.hold(*b);
        s.tables[g].push_back(*b);
      }
    }
    s.keys.assign(p.keys.begin(), p.keys.begin() + m);
    s.block_classes.assign(p.classes.begin(), p.classes.begin() + m);
    s.n_stored = m * block_size_;
    n_query_tokens_ += static_cast<std::int64_t>(prompt.size());
    n_hit_tokens_ += s.n_stored;
    n_query_blocks_ += static_cast<std::int64_t>(n_reusable);
    n_hit_blocks_ += m;
  }
  // Cached blocks were computed at the positions of their slots.
  s.positions.resize(static_cast<std::size_t>(s.n_stored));
  for (std::int32_t i = 0; i < s.n_stored; ++i) s.positions[static_cast<std::size_t>(i)] = i;
  s.n_fed = s.n_stored;
  const std::int32_t n_cached = s.n_stored;
  seqs_.emplace(seq, std::move(s));
  return n_cached;
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
  const std::int64_t n_slots = static_cast<std::int64_t>(s.n_table()) * block_size_;
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
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const kv_group& grp = *groups_[g];
    for (std::int32_t bi = first_block; bi <= last_block; ++bi) {
      const block_id b = s.tables[g][static_cast<std::size_t>(bi)];
      if (!b.valid()) continue;  // a sliding window's NULL partial block is refilled by allocate()
      if (grp.ref_count(b) != 1 || grp.is_hashed(b)) {
        return error(errc::internal,
                     "commit: sequence {} wrote into block {} held by {} tables, cached {} (allocate skipped)",
                     seq.value, b.value, grp.ref_count(b), grp.is_hashed(b));
      }
    }
  }

  for (std::int64_t i = 0; i < n; ++i) {
    if (s.n_stored + i >= static_cast<std::int64_t>(s.tokens.size())) s.tokens.push_back(tokens[i]);
  }
  s.positions.insert(s.positions.end(), positions.begin(), positions.end());
  s.n_stored += static_cast<std::int32_t>(n);
  s.n_fed += n;
  for (std::size_t g = 0; g < groups_.size(); ++g)
    for (std::int32_t bi = first_block; bi <= last_block; ++bi) {
      const block_id b = s.tables[g][static_cast<std::size_t>(bi)];
      if (b.valid()) groups_[g]->set_fill(b, std::min(block_size_, s.n_stored - bi * block_size_));
    }
  if (!prefix_caching_ || s.off_chain) return ok_status();
  const auto n_full = static_cast<std::size_t>(s.n_stored / block_size_);
  for (std::size_t i = s.keys.size(); i < n_full; ++i) {
    const auto first = i * static_cast<std::size_t>(block_size_);
    for (std::size_t j = first; j < first + static_cast<std::size_t>(block_size_); ++j)
      if (s.positions[j] != static_cast<std::int32_t>(j)) s.off_chain = true;
    if (s.off_chain) break;
    const block_key parent = i == 0 ? k_root_parent_key : s.keys[i - 1];
    const std::string extras = extras_of(s, i);
    const block_key key = chain_key(s, i, parent, extras);
    s.keys.push_back(key);
    const auto block_tokens = std::span<const token_id>(s.tokens).subspan(first, static_cast<std::size_t>(block_size_));
    // Already cached by another block: keep ours (tables are append-only), register nothing.
    for (std::size_t g = 0; g < groups_.size(); ++g)
      if (const block_id b = s.tables[g][i]; b.valid()) groups_[g]->cache(b, key, parent, block_tokens, extras, s.tenant);
  }
  return ok_status();
}

status kv_manager::fork(seq_id parent, seq_id child) {
  const auto it = seqs_.find(parent);
  if (it == seqs_.end()) return error(errc::not_found, "fork: unknown parent sequence {}", parent.value);
  if (contains(child)) return error(errc::invalid_argument, "fork: child sequence {} already exists", child.value);
  const sequence& p = it->second;
  if (static_cast<std::int32_t>(p.n_table()) != ceil_div(p.n_stored, block_size_)) {
    return error(errc::invalid_argument,
                 "fork: parent sequence {} holds {} blocks for {} stored tokens; fork between commit and allocate",
                 parent.value, p.n_table(), p.n_stored);
  }
  sequence c = p;
  // Its side structures start new (seq_policy::fork): it takes its own side blocks.
  c.side_blocks.clear();
  c.side_measured = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g)
    for (const block_id b : c.tables[g])
      if (b.valid()) groups_[g]->hold(b);
  seqs_.emplace(child, std::move(c));
  return ok_status();
}

status kv_manager::free_sequence(seq_id seq) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "free: unknown sequence {}", seq.value);
  // Deepest first: released cached blocks enter the eviction order in this
  // order, so the tail end of a chain is evicted before its head (block_pool.h, "Chains").
  for (std::size_t g = 0; g < groups_.size(); ++g) groups_[g]->release_table(it->second.tables[g]);
  for (const block_id b : it->second.side_blocks) group0().release(b);
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

result<std::int32_t> kv_manager::release_window(seq_id seq, std::int64_t next_position) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "release_window: unknown sequence {}", seq.value);
  sequence& s = it->second;
  std::int32_t n_freed = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    kv_group& grp = *groups_[g];
    if (grp.kind() == kv_group_kind::full) continue;
    const std::int32_t need = grp.first_needed_block(s.positions, s.n_stored / block_size_, next_position);
    std::int32_t freed = 0;
    for (std::int32_t i = need; i-- > 0;) {  // deepest first, as free_sequence
      block_id& b = s.tables[g][static_cast<std::size_t>(i)];
      if (!b.valid()) break;  // NULL entries are a prefix
      grp.release(b);
      b = block_id();
      ++freed;
    }
    grp.count_freed_out_of_window(freed);
    n_freed += freed;
  }
  if (n_freed > 0) evict_over_quota(s.tenant);  // a tenant over its quota keeps no cache
  return n_freed;
}

std::span<const block_id> kv_manager::block_table(seq_id seq, std::int32_t g) const {
  return seq_at(seq).tables[static_cast<std::size_t>(g)];
}
std::int32_t kv_manager::n_stored_tokens(seq_id seq) const { return seq_at(seq).n_stored; }
std::span<const token_id> kv_manager::tokens(seq_id seq) const { return seq_at(seq).tokens; }
std::span<const std::int32_t> kv_manager::positions(seq_id seq) const { return seq_at(seq).positions; }
tenant_id kv_manager::tenant_of(seq_id seq) const { return seq_at(seq).tenant; }

// --- pool-level helpers -----------------------------------------------------------

std::int32_t kv_manager::evict_cached_blocks() {
  std::int32_t n = 0;
  for (const auto& g : groups_) n += g->evict_cached();
  return n;
}

std::int32_t kv_manager::evict_cached_blocks(std::string_view tenant) {
  const std::optional<tenant_id> t = find_tenant(tenant);
  if (!t) return 0;
  std::int32_t n = 0;
  for (const auto& g : groups_) n += g->evict_cached(*t);
  return n;
}

void kv_manager::reset_peak() {
  for (const auto& g : groups_) g->reset_peak();
}

kv_metrics kv_manager::metrics() const {
  kv_metrics m;
  const kv_group& g0 = group0();
  const block_pool& p = g0.pool();
  m.block_size_tokens = block_size_;
  m.n_blocks_total = p.n_blocks();
  m.n_blocks_used = p.n_used();
  m.n_blocks_cached = p.n_cached();
  m.n_blocks_free = p.n_free();
  m.n_blocks_used_peak = g0.peak_used();
  m.n_stored_tokens = g0.stored_tokens_in_used();
  m.n_sequences = static_cast<std::int32_t>(seqs_.size());
  m.n_prefix_query_tokens = n_query_tokens_;
  m.n_prefix_hit_tokens = n_hit_tokens_;
  m.n_prefix_query_blocks = n_query_blocks_;
  m.n_prefix_hit_blocks = n_hit_blocks_;
  m.n_preemptions = n_preemptions_;
  m.n_cow_copies = n_cow_copies_;
  for (const auto& g : groups_) {
    m.n_evictions += g->n_evictions();
    for (std::size_t r = 0; r < k_n_eviction_reasons; ++r)
      m.n_evictions_by_reason[r] += g->n_evictions(static_cast<eviction_reason>(r));
    const block_pool& gp = g->pool();
    m.groups.push_back(kv_group_usage{kv_group_kind_name(g->kind()), g->window_tokens(), gp.n_blocks(), gp.n_used(),
                                      gp.n_cached(), gp.n_free(), g->peak_used(), g->stored_tokens_in_used(),
                                      g->n_evictions(), g->n_freed_out_of_window()});
  }
  m.classes.reserve(static_cast<std::size_t>(p.n_classes()));
  for (std::int32_t c = 0; c < p.n_classes(); ++c)
    m.classes.push_back(kv_class_usage{p.class_size(c), p.n_used_in(c), p.n_cached_in(c), p.n_free_in(c)});
  m.tenants.reserve(tenants_.size());
  for (std::size_t i = 0; i < tenants_.size(); ++i) {
    const tenant_id t(static_cast<std::int32_t>(i));
    m.tenants.push_back(tenant_kv_usage{tenants_[i].name, p.n_used(t), p.n_cached(t), tenants_[i].quota_blocks});
  }
  for (const auto& [id, s] : seqs_) {
    const auto n_side = static_cast<std::int32_t>(s.side_blocks.size());
    m.n_side_blocks += n_side;
    m.tenants[static_cast<std::size_t>(s.tenant.value)].n_side_blocks += n_side;
    m.side_bound_bytes += s.side.none() ? 0 : s.side.bytes_for(s.n_stored);
    m.side_measured_bytes += s.side_measured;
  }
  m.side_block_bytes = side_block_bytes_;
  return m;
}

}  // namespace pagoda
