#include "kv/kv_group.h"

#include <algorithm>

#include "core/assert.h"

namespace pagoda {

const char* kv_group_kind_name(kv_group_kind kind) {
  return kind == kv_group_kind::full ? "full" : "sliding_window";
}

kv_group::kv_group(std::int32_t index, const kv_group_config& config, std::int32_t first_block, std::int32_t block_size,
                   bool prefix_caching, kv_group_host& host)
    : id_(index),
      kind_(config.kind),
      window_tokens_(config.window_tokens),
      first_(first_block),
      block_size_(block_size),
      prefix_caching_(prefix_caching),
      host_(host),
      pool_(config.class_blocks, config.eviction),
      index_(block_size, pool_.n_blocks()),
      fill_(static_cast<std::size_t>(pool_.n_blocks()), 0) {
  PAGODA_ASSERT(block_size > 0 && first_block >= 0, "KV group {}: block size {}, first block {}", index, block_size,
                first_block);
  PAGODA_ASSERT(kind_ != kv_group_kind::sliding_window || window_tokens_ > 0,
                "KV group {}: a sliding window of {} tokens", index, window_tokens_);
}

std::unique_ptr<kv_group> make_kv_group(std::int32_t index, const kv_group_config& config, std::int32_t first_block,
                                        std::int32_t block_size, bool prefix_caching, kv_group_host& host) {
  if (config.kind == kv_group_kind::sliding_window)
    return std::make_unique<sliding_window_group>(index, config, first_block, block_size, prefix_caching, host);
  return std::make_unique<full_attention_group>(index, config, first_block, block_size, prefix_caching, host);
}

// --- kinds ---------------------------------------------------------------------

std::int32_t full_attention_group::longest_cached_prefix(const prefix_probe& probe, std::int32_t max_blocks) const {
  std::int32_t m = 0;
  while (m < max_blocks && static_cast<std::size_t>(m) < probe.size() && find(probe, static_cast<std::size_t>(m))) ++m;
  return m;
}

std::int32_t sliding_window_group::first_needed_block(std::span<const std::int32_t> positions, std::int32_t n_full,
                                                      std::int64_t next_position) const {
  // Block j is out of every later query's window when its last position is
  // at or below next_position - window. Positions may differ from slots (a
  // compacted or loaded sequence): go by the stored ones.
  const std::int64_t out_below = next_position - window_tokens_;
  std::int32_t n = 0;
  while (n < n_full) {
    const std::int64_t last_slot = static_cast<std::int64_t>(n + 1) * block_size_ - 1;
    const std::int64_t last_pos = positions.empty() ? last_slot : positions[static_cast<std::size_t>(last_slot)];
    if (last_pos > out_below) break;
    ++n;
  }
  return n;
}

std::int32_t sliding_window_group::longest_cached_prefix(const prefix_probe& probe, std::int32_t max_blocks) const {
  // Scan each candidate's window from its end: a block that is not cached
  // rules out every candidate whose window holds it, so the next candidate
  // ends just before it. Every block is looked up at most twice: O(blocks).
  std::int32_t m = std::min<std::int32_t>(max_blocks, static_cast<std::int32_t>(probe.size()));
  while (m > 0) {
    const std::int32_t from = first_needed_block({}, m, static_cast<std::int64_t>(m) * block_size_);
    std::int32_t j = m;
    while (j > from && find(probe, static_cast<std::size_t>(j - 1))) --j;
    if (j == from) return m;
    m = j - 1;  // block j - 1 is missing: a usable prefix ends before it
  }
  return 0;
}

// --- blocks ----------------------------------------------------------------------

void kv_group::set_fill(block_id b, std::int32_t n, bool may_lower) {
  std::int32_t& f = fill_[static_cast<std::size_t>(local(b).value)];
  if (n <= f && !may_lower) return;
  if (pool_.ref_count(local(b)) > 0) stored_tokens_in_used_ += n - f;
  f = n;
}

bool kv_group::can_take(const class_demand& d) const {
  for (std::int32_t c = 0; c < pool_.n_classes(); ++c)
    if (d.n[static_cast<std::size_t>(c)] > pool_.n_takeable(c)) return false;
  return true;
}

std::vector<block_id> kv_group::take(tenant_id t, std::span<const std::int32_t> classes, std::int32_t n_own) {
  std::vector<block_id> out;
  out.reserve(classes.size());
  for (const std::int32_t c : classes) {
    std::optional<block_pool::taken> got;
    eviction_reason why = eviction_reason::quota;
    if (n_own > 0 && (got = pool_.take_cached_of(t, c))) --n_own;
    if (!got) {
      got = pool_.take(t, c);
      why = eviction_reason::capacity;
    }
    PAGODA_ASSERT(got.has_value(), "KV group {}: class {} ran dry after can_take (taken {} of {})", id_, c,
                  out.size(), classes.size());
    if (got->evicted) forget_cached(got->id, why);
    fill_[static_cast<std::size_t>(got->id.value)] = 0;
    out.push_back(global(got->id));
  }
  peak_used_ = std::max(peak_used_, pool_.n_used());
  return out;
}

void kv_group::hold(block_id b) {
  const block_id l = local(b);
  if (pool_.ref_count(l) == 0) stored_tokens_in_used_ += fill_[static_cast<std::size_t>(l.value)];
  pool_.ref(l);
  peak_used_ = std::max(peak_used_, pool_.n_used());
}

void kv_group::release(block_id b) {
  const block_id l = local(b);
  pool_.unref(l);
  if (pool_.ref_count(l) > 0) return;
  stored_tokens_in_used_ -= fill_[static_cast<std::size_t>(l.value)];
  if (pool_.is_hashed(l)) return;
  host_.emit(kv_op{.kind = kv_op_kind::release, .block = b, .group = id_});
}

void kv_group::release_table(std::span<const block_id> table) {
  for (auto i = table.size(); i-- > 0;)
    if (table[i].valid()) release(table[i]);
}

std::optional<block_id> kv_group::find(const prefix_probe& probe, std::size_t i) const {
  if (!prefix_caching_) return std::nullopt;
  const auto tokens = probe.tokens.subspan(i * static_cast<std::size_t>(probe.block_size),
                                           static_cast<std::size_t>(probe.block_size));
  const auto hit = index_.find(probe.keys[i], probe.parents[i], tokens, probe.extras[i]);
  // A block of another tenant or class can only match through a chained collision: a miss.
  if (!hit || pool_.owner(*hit) != probe.tenant || pool_.class_of(*hit) != probe.classes[i]) return std::nullopt;
  return global(*hit);
}

bool kv_group::cache(block_id b, block_key key, block_key parent, std::span<const token_id> tokens,
                     std::string_view extras, tenant_id tenant) {
  const block_id l = local(b);
  if (!index_.insert(l, key, parent, tokens, extras)) return false;
  pool_.set_hashed(l);
  kv_op op{.kind = kv_op_kind::cache, .block = b, .key = key, .parent = parent, .group = id_};
  op.tokens.assign(tokens.begin(), tokens.end());
  op.tenant = host_.tenant_name(tenant);
  host_.emit(std::move(op));
  return true;
}

void kv_group::unhash(block_id b) {
  const block_id l = local(b);
  index_.erase(l);
  pool_.clear_hash(l);
}

std::int64_t kv_group::n_evictions() const {
  std::int64_t n = 0;
  for (const std::int64_t k : n_evictions_) n += k;
  return n;
}

void kv_group::forget_cached(block_id l, eviction_reason why) {
  const auto tokens = index_.tokens_of(l);
  kv_op op{.kind = kv_op_kind::evict, .block = global(l), .key = index_.key_of(l), .parent = index_.parent_of(l),
           .group = id_};
  op.tokens.assign(tokens.begin(), tokens.end());
  op.tenant = host_.tenant_name(pool_.owner(l));
  host_.emit(std::move(op));
  index_.erase(l);
  ++n_evictions_[static_cast<std::size_t>(why)];
}

void kv_group::drop_cached(block_id l, eviction_reason why) {
  forget_cached(l, why);
  pool_.drop_hash(l);
}

std::int32_t kv_group::evict_cached() {
  std::int32_t n = 0;
  for (const block_id l : pool_.free_queue()) {
    if (!pool_.is_hashed(l)) continue;
    drop_cached(l, eviction_reason::admin);
    ++n;
  }
  return n;
}

std::int32_t kv_group::evict_cached(tenant_id t) {
  std::int32_t n = 0;
  for (const block_id l : pool_.cached_of(t)) {
    drop_cached(l, eviction_reason::admin);
    ++n;
  }
  return n;
}

bool kv_group::evict_next_cached_of(tenant_id t) {
  const auto l = pool_.next_cached_of(t);
  if (!l) return false;
  drop_cached(*l, eviction_reason::quota);
  return true;
}

// --- invariants --------------------------------------------------------------------

status kv_group::check_invariants(std::span<const table_ref> tables) const {
  PAGODA_RETURN_IF_ERROR(pool_.check_invariants().with_context(fmt::format("KV group {} pool", id_)));
  PAGODA_RETURN_IF_ERROR(index_.check_invariants().with_context(fmt::format("KV group {} prefix index", id_)));
  const std::int32_t n = pool_.n_blocks();
  std::vector<std::int32_t> holders(static_cast<std::size_t>(n), 0);
  std::vector<std::int32_t> max_valid(static_cast<std::size_t>(n), 0);
  std::vector<std::int64_t> last_seen(static_cast<std::size_t>(n), -1);
  for (const table_ref& t : tables) {
    bool live_seen = false;
    for (std::size_t i = 0; i < t.table.size(); ++i) {
      const block_id b = t.table[i];
      if (!b.valid()) {
        if (kind_ != kv_group_kind::sliding_window || live_seen)
          return error(errc::internal, "KV group {}: sequence {} has a NULL entry at {} after a live one, or in a {} group",
                       id_, t.seq, i, kv_group_kind_name(kind_));
        continue;
      }
      live_seen = true;
      if (!owns(b)) return error(errc::internal, "KV group {}: sequence {} entry {} is block {}, not the group's", id_, t.seq, i, b.value);
      const auto l = static_cast<std::size_t>(local(b).value);
      if (last_seen[l] == t.seq) return error(errc::internal, "KV group {}: sequence {} holds block {} twice", id_, t.seq, b.value);
      last_seen[l] = t.seq;
      ++holders[l];
      if (pool_.owner(local(b)) != t.tenant)
        return error(errc::internal, "KV group {}: sequence {} of tenant {} holds block {} of tenant {}", id_, t.seq,
                     t.tenant.value, b.value, pool_.owner(local(b)).value);
      const std::int64_t valid = std::clamp<std::int64_t>(t.n_stored - static_cast<std::int64_t>(i) * block_size_, 0, block_size_);
      max_valid[l] = std::max(max_valid[l], static_cast<std::int32_t>(valid));
    }
  }
  std::int64_t stored = 0, n_hashed = 0;
  for (std::int32_t i = 0; i < n; ++i) {
    const block_id l(i);
    const auto ui = static_cast<std::size_t>(i);
    if (pool_.ref_count(l) != holders[ui])
      return error(errc::internal, "KV group {}: block {} has ref {} but {} tables hold it", id_, i + first_,
                   pool_.ref_count(l), holders[ui]);
    if (pool_.is_hashed(l) != index_.contains(l))
      return error(errc::internal, "KV group {}: block {} hashed {} but indexed {}", id_, i + first_,
                   pool_.is_hashed(l), index_.contains(l));
    if (pool_.is_hashed(l)) {
      ++n_hashed;
      if (fill_[ui] != block_size_)
        return error(errc::internal, "KV group {}: hashed block {} holds {} tokens", id_, i + first_, fill_[ui]);
    }
    if (holders[ui] > 0) {
      if (fill_[ui] < max_valid[ui])
        return error(errc::internal, "KV group {}: block {} holds {} tokens but a table reads {}", id_, i + first_,
                     fill_[ui], max_valid[ui]);
      stored += fill_[ui];
    }
  }
  if (static_cast<std::size_t>(n_hashed) != index_.size())
    return error(errc::internal, "KV group {}: {} hashed blocks but {} index entries", id_, n_hashed, index_.size());
  if (stored != stored_tokens_in_used_)
    return error(errc::internal, "KV group {}: used blocks hold {} tokens, counted {}", id_, stored,
                 stored_tokens_in_used_);
  if (peak_used_ < pool_.n_used())
    return error(errc::internal, "KV group {}: peak {} below used {}", id_, peak_used_, pool_.n_used());
  return ok_status();
}

}  // namespace pagoda
