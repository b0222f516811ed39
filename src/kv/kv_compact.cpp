// kv_manager: what rewrites a sequence's tables in the middle or at the end:
// drop() of whole blocks, compact() (token-granular eviction, one gather per
// group) and truncate().
#include <algorithm>

#include "core/assert.h"
#include "kv/kv_manager.h"

namespace pagoda {

namespace {
std::int32_t ceil_div(std::int64_t a, std::int64_t b) { return static_cast<std::int32_t>((a + b - 1) / b); }
}  // namespace

status kv_manager::drop(seq_id seq, std::span<const std::int32_t> block_indices) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "drop: unknown sequence {}", seq.value);
  sequence& s = it->second;
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
    const auto index = static_cast<std::ptrdiff_t>(*i);
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      std::vector<block_id>& table = s.tables[g];
      if (table[static_cast<std::size_t>(index)].valid()) groups_[g]->release(table[static_cast<std::size_t>(index)]);
      table.erase(table.begin() + index);
    }
    s.block_classes.erase(s.block_classes.begin() + index);
    s.tokens.erase(s.tokens.begin() + index * bs, s.tokens.begin() + (index + 1) * bs);
    s.positions.erase(s.positions.begin() + index * bs, s.positions.begin() + (index + 1) * bs);
  }
  s.n_stored -= static_cast<std::int32_t>(order.size()) * block_size_;
  s.keys.resize(std::min(s.keys.size(), static_cast<std::size_t>(order.front())));
  s.off_chain = true;
  evict_over_quota(s.tenant);
  return ok_status();
}

// How compact() rewrites one group's table.
struct kv_manager::group_rewrite {
  std::int32_t need_from = 0;          // the first table index the next query reads (sliding window)
  std::vector<std::int32_t> replaced;  // indices that get a fresh block (must: shared or NULL; may: cached, if free)
  std::vector<std::int32_t> may;       // cached blocks only this sequence holds: fresh when free, else unhashed
  group_demand need;                   // the fresh blocks, by class, in `replaced` order
};

kv_manager::group_rewrite kv_manager::plan_rewrite(const sequence& s, std::int32_t g, const kv_compaction& c,
                                                   std::int64_t next_position) const {
  const kv_group& grp = *groups_[static_cast<std::size_t>(g)];
  const std::vector<block_id>& table = s.tables[static_cast<std::size_t>(g)];
  group_rewrite r;
  const std::int32_t n_blocks = ceil_div(c.n_slots, block_size_);
  const std::int32_t b_first = c.first / block_size_;
  if (grp.kind() != kv_group_kind::full) {
    std::vector<std::int32_t> positions(s.positions.begin(), s.positions.begin() + c.first);
    positions.insert(positions.end(), c.positions.begin(), c.positions.end());
    r.need_from = grp.first_needed_block(positions, c.n_slots / block_size_, next_position);
  }
  for (std::int32_t bi = std::max(b_first, r.need_from); bi < n_blocks; ++bi) {
    const block_id b = table[static_cast<std::size_t>(bi)];
    const std::int32_t cls = s.block_classes[static_cast<std::size_t>(bi)];
    // Rewritten blocks this sequence may not write: NULL ones (a window that
    // had let them go reads them again) and shared ones need a fresh block;
    // a cached one only it holds takes a fresh block while the pool has free
    // ones (its K/V stay cached), else it quietly leaves the index.
    if (!b.valid() || grp.ref_count(b) > 1) {
      r.replaced.push_back(bi);
      r.need.order.push_back(cls);
      r.need.d.add(cls);
    } else if (grp.is_hashed(b)) {
      r.may.push_back(bi);
    }
  }
  return r;
}

void kv_manager::apply_rewrite(sequence& s, std::int32_t g, group_rewrite& r, const kv_compaction& c) {
  kv_group& grp = *groups_[static_cast<std::size_t>(g)];
  std::vector<block_id>& table = s.tables[static_cast<std::size_t>(g)];
  const std::int32_t bs = block_size_;
  const std::int32_t n_rewritten = c.n_slots - c.first;
  const std::int32_t n_blocks = ceil_div(c.n_slots, bs);
  const std::int32_t b_first = c.first / bs;
  for (const std::int32_t bi : r.may) {
    const block_id b = table[static_cast<std::size_t>(bi)];
    const std::int32_t cls = grp.class_of(b);
    group_demand more = r.need;
    more.d.add(cls);
    demands probe{};
    probe[static_cast<std::size_t>(g)] = more;
    const bool quota_ok = g != 0 || take_blocker(s.tenant, probe) != alloc_blocker::quota;
    if (r.need.d.n[static_cast<std::size_t>(cls)] < grp.pool().n_free_in(cls) && grp.can_take(more.d) && quota_ok) {
      r.need = more;
      r.need.order.push_back(cls);
      r.replaced.push_back(bi);
    } else {
      // No longer shareable. Not an eviction: the block stays with this
      // sequence (the commit hook saw its bytes when it entered the cache).
      grp.unhash(b);
    }
  }

  // Slots whose sources this group let go are dead: remember how far back they reach.
  std::size_t n_null = 0;
  while (n_null < table.size() && !table[n_null].valid()) ++n_null;
  if (n_null > 0)
    s.window_dead_upto = std::max<std::int64_t>(s.window_dead_upto, s.positions[n_null * static_cast<std::size_t>(bs) - 1]);

  auto gather = std::make_shared<kv_gather>(*c.gather);
  kv_gather& gt = *gather;
  gt.group = g;
  gt.src_table = table;
  const std::vector<block_id> old_table = table;
  const std::vector<block_id> fresh = take(s, g, r.need);
  for (std::size_t i = 0; i < r.replaced.size(); ++i) table[static_cast<std::size_t>(r.replaced[i])] = fresh[i];
  table.resize(static_cast<std::size_t>(n_blocks));
  for (std::int32_t bi = 0; bi < std::min(r.need_from, n_blocks); ++bi) table[static_cast<std::size_t>(bi)] = block_id();

  // The slots this group rewrites: [first, n_slots), less what a sliding
  // window no longer reads; a fresh first block is rewritten whole (its kept
  // leading slots take themselves, no copy op, which would stage a sealed
  // block's tokens for nothing).
  std::int32_t first = std::max(c.first, r.need_from * bs);
  std::int32_t lead = 0;
  if (first == c.first && c.first % bs != 0 &&
      std::find(r.replaced.begin(), r.replaced.end(), b_first) != r.replaced.end())
    lead = c.first % bs;
  const std::int32_t skip = first - c.first;  // rewritten slots this group does not hold
  const std::int32_t n = c.n_slots - first;
  std::vector<std::int32_t> sources;
  sources.reserve(static_cast<std::size_t>(gt.n_rows) * (n + lead));
  const auto live_source = [&](std::int32_t slot) {
    return slot >= 0 && old_table[static_cast<std::size_t>(slot / bs)].valid() ? slot : -1;
  };
  for (int row = 0; row < gt.n_rows; ++row) {
    for (std::int32_t slot = c.first - lead; slot < c.first; ++slot) sources.push_back(live_source(slot));
    const std::int32_t* src = c.gather->sources.data() + static_cast<std::size_t>(row) * n_rewritten + skip;
    for (std::int32_t i = 0; i < n; ++i) sources.push_back(live_source(src[i]));
  }
  gt.sources = std::move(sources);
  // Folded entries a window no longer holds are gone: each row keeps its
  // others first, -1 padding after (kv_gather's layout).
  for (int row = 0; row < gt.n_rows; ++row) {
    const auto begin = gt.folded.begin() + static_cast<std::ptrdiff_t>(row) * gt.n_folded;
    std::transform(begin, begin + gt.n_folded, begin, live_source);
    std::stable_partition(begin, begin + gt.n_folded, [](std::int32_t f) { return f >= 0; });
  }
  if (!gt.rotate.empty()) {
    gt.rotate.erase(gt.rotate.begin(), gt.rotate.begin() + skip);
    gt.rotate.insert(gt.rotate.begin(), static_cast<std::size_t>(lead), 0);
  }
  gt.dst_table = table;
  gt.first = first - lead;
  gt.n = n + lead;
  if (gt.n > 0) emit(kv_op{.kind = kv_op_kind::gather, .gather = gather, .group = g});

  // Fill of the blocks that stay: full up to the last, which holds what is left.
  for (std::int32_t bi = std::max(b_first, r.need_from); bi < n_blocks; ++bi)
    grp.set_fill(table[static_cast<std::size_t>(bi)], std::min(bs, c.n_slots - bi * bs), /*may_lower=*/true);
  // Then the blocks that left: replaced ones (their other holders or the cache
  // keep them), NULLed ones and everything past the new end, deepest first.
  for (auto bi = old_table.size(); bi-- > 0;) {
    const block_id b = old_table[bi];
    if (b.valid() && (bi >= table.size() || table[bi] != b)) grp.release(b);
  }
}

status kv_manager::compact(seq_id seq, kv_compaction c) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return error(errc::not_found, "compact: unknown sequence {}", seq.value);
  sequence& s = it->second;
  PAGODA_RETURN_IF_ERROR(check_compaction(s, c));
  if (c.n_slots == c.first) {  // only the tail goes (tokens that stay fed: no rollback)
    shrink(s, c.n_slots);
    s.off_chain = true;
    evict_over_quota(s.tenant);
    return ok_status();
  }
  // The next query comes after the last kept position, or later (a sliding
  // window told nothing keeps a little more than it must until release_window).
  const std::int64_t next_position =
      std::max<std::int64_t>(c.next_position, static_cast<std::int64_t>(c.positions.back()) + 1);
  std::array<group_rewrite, k_max_kv_groups> plans;
  demands must{};
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    plans[g] = plan_rewrite(s, static_cast<std::int32_t>(g), c, next_position);
    must[g] = plans[g].need;
  }
  if (take_blocker(s.tenant, must) != alloc_blocker::none) {
    std::int32_t n = 0;
    for (std::size_t g = 0; g < groups_.size(); ++g) n += must[g].d.total;
    return error(errc::resource_exhausted, "compact: sequence {} needs {} fresh blocks for copies of shared blocks",
                 seq.value, n);
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) apply_rewrite(s, static_cast<std::int32_t>(g), plans[g], c);
  s.block_classes.resize(static_cast<std::size_t>(ceil_div(c.n_slots, block_size_)));
  s.tokens.erase(s.tokens.begin() + c.first, s.tokens.begin() + s.n_stored);
  s.tokens.insert(s.tokens.begin() + c.first, c.tokens.begin(), c.tokens.end());
  s.positions.resize(static_cast<std::size_t>(c.first));
  s.positions.insert(s.positions.end(), c.positions.begin(), c.positions.end());
  s.n_stored = c.n_slots;
  s.keys.resize(std::min(s.keys.size(), static_cast<std::size_t>(c.first / block_size_)));
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
  if (!g.rotate.empty() && has_sliding_window())
    return error(errc::unsupported,
                 "compact: renumbering positions (positions=cache) would bring tokens the sliding-window layers "
                 "already let go back into their window; keep positions, or keep every position (--swa-full)");
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
  const auto n_blocks = static_cast<std::size_t>(ceil_div(n_slots, block_size_));
  // A sliding window must not have freed what the next query after the kept
  // slots (at the position after the last one) reads.
  const std::int64_t next = n_slots > 0 ? s.positions[static_cast<std::size_t>(n_slots) - 1] + 1 : 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const kv_group& grp = *groups_[g];
    if (grp.kind() != kv_group_kind::sliding_window) continue;
    const std::vector<block_id>& table = s.tables[g];
    std::size_t n_null = 0;
    while (n_null < table.size() && !table[n_null].valid()) ++n_null;
    const auto need = static_cast<std::size_t>(grp.first_needed_block(s.positions, n_slots / block_size_, next));
    // The first kept slot the next query sees: none of them may be a dead one.
    const auto first_seen = static_cast<std::size_t>(
        std::upper_bound(s.positions.begin(), s.positions.begin() + n_slots, next - grp.window_tokens()) -
        s.positions.begin());
    const bool dead_seen = first_seen < static_cast<std::size_t>(n_slots) && s.positions[first_seen] <= s.window_dead_upto;
    if (std::min(n_null, n_blocks) > need || dead_seen)
      return error(errc::out_of_range,
                   "truncate: sequence {}: keeping {} slots would need sliding-window K/V it has already given up",
                   seq.value, n_slots);
  }
  const std::int32_t n_dropped = s.n_stored - n_slots;
  shrink(s, n_slots);
  s.n_fed -= n_dropped;  // rolled back: fed again later
  evict_over_quota(s.tenant);
  return ok_status();
}

void kv_manager::shrink(sequence& s, std::int32_t n_slots) {
  const auto n_blocks = static_cast<std::size_t>(ceil_div(n_slots, block_size_));
  const std::int32_t n_kept = n_slots % block_size_;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    kv_group& grp = *groups_[g];
    std::vector<block_id>& table = s.tables[g];
    grp.release_table(std::span<const block_id>(table).subspan(std::min(n_blocks, table.size())));
    table.resize(std::min(n_blocks, table.size()));
    if (n_kept == 0) continue;
    const block_id last = table.back();
    // Shared or cached: left intact for its other readers; the next allocate
    // copies it. NULL (a window that no longer reads it): the next allocate
    // takes a fresh block.
    if (last.valid() && grp.ref_count(last) == 1 && !grp.is_hashed(last)) {
      grp.set_fill(last, std::min(grp.fill(last), n_kept), /*may_lower=*/true);
      emit(kv_op{.kind = kv_op_kind::truncate, .block = last, .n_tokens = n_kept, .group = static_cast<std::int32_t>(g)});
    }
  }
  s.block_classes.resize(std::min(n_blocks, s.block_classes.size()));
  s.tokens.resize(static_cast<std::size_t>(n_slots));
  s.positions.resize(static_cast<std::size_t>(n_slots));
  s.n_stored = n_slots;
  s.keys.resize(std::min(s.keys.size(), static_cast<std::size_t>(n_slots / block_size_)));
}

}  // namespace pagoda
