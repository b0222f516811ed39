// kv_manager: whether a request could ever run, and the invariants recomputed from scratch.
#include <algorithm>

#include "core/assert.h"
#include "kv/kv_class_rule.h"
#include "kv/kv_manager.h"

namespace pagoda {

namespace {
std::int64_t ceil_div64(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }
}  // namespace

status kv_manager::check_request_fits(std::int32_t n_prompt_tokens, std::int32_t n_max_new_tokens,
                                      std::string_view tenant, std::int32_t n_completions,
                                      std::span<const kv_class_run> classes, const side_charge& side) const {
  if (n_prompt_tokens <= 0 || n_max_new_tokens < 0 || n_completions <= 0) {
    return error(errc::invalid_argument, "request of {} prompt tokens, {} new tokens, {} completions", n_prompt_tokens,
                 n_max_new_tokens, n_completions);
  }
  PAGODA_RETURN_IF_ERROR(check_class_runs(classes, static_cast<std::size_t>(n_prompt_tokens)));
  const std::int64_t n_total = static_cast<std::int64_t>(n_prompt_tokens) + n_max_new_tokens;
  const std::int64_t per_seq = ceil_div64(n_total, block_size_);
  const std::int64_t shared = n_prompt_tokens / block_size_;
  for (const auto& g : groups_) {
    // A sliding window holds, per sequence, the blocks its window reaches
    // into, a step's new blocks and its open block, at most.
    std::int64_t held = per_seq;
    if (g->kind() == kv_group_kind::sliding_window) {
      const std::int64_t step = std::min<std::int64_t>(max_step_tokens_, n_total);
      held = std::min(per_seq, ceil_div64(g->window_tokens(), block_size_) + ceil_div64(step, block_size_) + 2);
    }
    // Side memory: each completion's own side blocks, in group 0 (kv_manager.h, "Side blocks").
    const std::int64_t n_side = g->id() == 0 ? static_cast<std::int64_t>(n_completions) * side_blocks_for(side, n_total) : 0;
    const std::int64_t n_needed = held + (n_completions - 1) * (held - std::min(shared, held)) + n_side;
    const std::string which = groups_.size() == 1 ? "" : fmt::format(" (group {}, {})", g->id(), kv_group_kind_name(g->kind()));
    const std::string side_part =
        n_side == 0 ? "" : fmt::format(", {} of them for the KV policy's side memory ({} bytes a block)", n_side, side_block_bytes_);
    if (n_needed > g->n_blocks()) {
      return error(errc::resource_exhausted,
                   "request needs {} KV blocks{} ({} prompt + {} new tokens x {} completions, {} tokens a block{}) but "
                   "the KV cache holds {} blocks; shorten the prompt, lower max_tokens{} or enlarge the KV cache",
                   n_needed, which, n_prompt_tokens, n_max_new_tokens, n_completions, block_size_, side_part,
                   g->n_blocks(), n_side == 0 ? "" : ", choose a lighter KV policy");
    }
    if (n_classes() > 1 && g->kind() == kv_group_kind::full) {
      // Each class against its own blocks: the shared full prompt blocks once,
      // every other block once per completion.
      std::array<std::int64_t, k_max_kv_classes> per_class{};
      for (std::int64_t i = 0; i < per_seq; ++i) {
        const std::int32_t c = kv_rule::prompt_block_class(classes, static_cast<std::size_t>(i), block_size_);
        per_class[static_cast<std::size_t>(c)] += i < shared ? 1 : n_completions;
      }
      per_class[0] += n_side;  // side blocks are of class 0
      for (std::int32_t c = 0; c < n_classes(); ++c) {
        if (per_class[static_cast<std::size_t>(c)] > g->pool().class_size(c)) {
          return error(errc::resource_exhausted,
                       "request needs {} KV blocks of class {}{} ({} prompt + {} new tokens x {} completions, {} "
                       "tokens a block{}) but the KV cache holds {} blocks of class {}; {}",
                       per_class[static_cast<std::size_t>(c)], c, which, n_prompt_tokens, n_max_new_tokens,
                       n_completions, block_size_, c == 0 ? side_part : "", g->pool().class_size(c), c,
                       c == 0 ? "shorten the prompt outside its KV class runs, lower max_tokens or enlarge KV class 0"
                              : "shorten the prompt's runs of that class or enlarge the class");
        }
      }
    }
    if (g->id() != 0) continue;
    if (const auto t = find_tenant(tenant)) {
      const auto& quota = tenants_[static_cast<std::size_t>(t->value)].quota_blocks;
      if (quota && n_needed > *quota) {
        return error(errc::resource_exhausted,
                     "request needs {} KV blocks ({} prompt + {} new tokens x {} completions{}) but tenant '{}' may "
                     "hold {} blocks",
                     n_needed, n_prompt_tokens, n_max_new_tokens, n_completions, side_part, tenant, *quota);
      }
    }
  }
  return ok_status();
}

status kv_manager::check_sequence(seq_id id, const sequence& s) const {
  if (s.n_stored < 0 || static_cast<std::size_t>(s.n_stored) > s.tokens.size() ||
      static_cast<std::int64_t>(s.n_stored) > static_cast<std::int64_t>(s.n_table()) * block_size_ ||
      s.n_fed < s.n_stored) {
    return error(errc::internal, "sequence {}: {} stored tokens, {} known, {} blocks, {} fed", id.value, s.n_stored,
                 s.tokens.size(), s.n_table(), s.n_fed);
  }
  for (std::size_t g = 0; g < k_max_kv_groups; ++g) {
    const std::size_t want = g < groups_.size() ? s.n_table() : 0;
    if (s.tables[g].size() != want)
      return error(errc::internal, "sequence {}: group {}'s table holds {} entries, not {}", id.value, g,
                   s.tables[g].size(), want);
  }
  for (std::size_t g = 0; g < groups_.size(); ++g)
    for (std::size_t i = 0; i < s.n_table(); ++i)
      if (const block_id b = s.tables[g][i]; b.valid() && groups_[g]->class_of(b) != s.block_classes[i])
        return error(errc::internal, "sequence {}: group {}'s block {} at index {} is of class {}, the index of {}",
                     id.value, g, b.value, i, groups_[g]->class_of(b), s.block_classes[i]);
  PAGODA_RETURN_IF_ERROR(check_class_runs(s.classes, SIZE_MAX).with_context(fmt::format("sequence {}", id.value)));
  if (s.classes.empty() && std::any_of(s.block_classes.begin(), s.block_classes.end(), [](std::uint8_t c) { return c != 0; }))
    return error(errc::internal, "sequence {} without KV class runs holds blocks of another class", id.value);
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
    if (s.keys[i] != chain_key(s, i, parent, extras_of(s, i)))
      return error(errc::internal, "sequence {}: key of block {} does not chain", id.value, i);
    parent = s.keys[i];
    // A keyed block holds slot k at position k: its class is the one the runs give its index.
    if (s.block_classes[i] != kv_rule::prompt_block_class(s.classes, i, block_size_))
      return error(errc::internal, "sequence {}: keyed index {} is of class {}, its runs say {}", id.value, i,
                   s.block_classes[i], kv_rule::prompt_block_class(s.classes, i, block_size_));
    // A hashed block in a table holds exactly this sequence's block there.
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const block_id b = s.tables[g][i];
      if (b.valid() && groups_[g]->is_hashed(b) && groups_[g]->index().key_of(block_id(b.value - groups_[g]->first_block())) != s.keys[i])
        return error(errc::internal, "sequence {}: block {} of group {} is indexed under another key", id.value, b.value, g);
    }
  }
  return ok_status();
}

status kv_manager::check_invariants() const {
  std::vector<std::vector<kv_group::table_ref>> tables(groups_.size());
  for (const auto& [id, s] : seqs_) {
    PAGODA_RETURN_IF_ERROR(check_sequence(id, s));
    for (std::size_t g = 0; g < groups_.size(); ++g)
      tables[g].push_back(kv_group::table_ref{id.value, s.tenant, s.tables[g], s.n_stored});
    // Side blocks: held like a table entry, never written.
    tables[0].push_back(kv_group::table_ref{id.value, s.tenant, s.side_blocks, 0});
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) PAGODA_RETURN_IF_ERROR(groups_[g]->check_invariants(tables[g]));
  const block_pool& p = group0().pool();
  for (std::size_t t = 0; t < tenants_.size(); ++t) {
    const tenant_id id(static_cast<std::int32_t>(t));
    const auto& quota = tenants_[t].quota_blocks;
    if (quota && p.n_cached(id) > 0 && p.n_used(id) + p.n_cached(id) > *quota) {
      return error(errc::internal, "tenant '{}' holds {} used + {} cached blocks over its quota of {}", tenants_[t].name,
                   p.n_used(id), p.n_cached(id), *quota);
    }
  }
  return ok_status();
}

}  // namespace pagoda
