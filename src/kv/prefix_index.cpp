#include "kv/prefix_index.h"

#include <algorithm>

#include "core/assert.h"
#include "core/hash.h"

namespace pagoda {

extra_keys& extra_keys::add(extra_key_kind kind, std::string_view value) {
  const auto n = static_cast<std::uint32_t>(value.size());
  bytes_.push_back(static_cast<char>(kind));
  for (int shift = 0; shift < 32; shift += 8) bytes_.push_back(static_cast<char>((n >> shift) & 0xff));
  bytes_.append(value);
  return *this;
}

block_key hash_block(block_key parent, std::span<const token_id> tokens, std::string_view extras) {
  const auto n_tokens = static_cast<std::uint32_t>(tokens.size());
  hasher h;
  h.update_pod(parent).update_pod(n_tokens).update_span(tokens).update(extras.data(), extras.size());
  return h.digest();
}

std::string first_block_extras(std::string_view tenant, std::string_view cache_salt, bool chunk) {
  extra_keys extras;
  if (!tenant.empty()) extras.add(extra_key_kind::tenant, tenant);
  if (!cache_salt.empty()) extras.add(extra_key_kind::cache_salt, cache_salt);
  if (chunk) extras.add(extra_key_kind::chunk, "");
  return std::string(extras.bytes());
}

prefix_index::prefix_index(std::int32_t block_size, std::int32_t n_blocks)
    : block_size_(block_size),
      slots_(static_cast<std::size_t>(std::max(n_blocks, 0))),
      tokens_(static_cast<std::size_t>(std::max(n_blocks, 0)) * static_cast<std::size_t>(std::max(block_size, 0))) {
  PAGODA_ASSERT(block_size > 0 && n_blocks >= 0, "prefix index of {} blocks of {} tokens", n_blocks, block_size);
}

const prefix_index::block_slot& prefix_index::slot(block_id b) const {
  PAGODA_ASSERT(b.value >= 0 && static_cast<std::size_t>(b.value) < slots_.size(), "block {} outside index", b.value);
  return slots_[static_cast<std::size_t>(b.value)];
}

std::span<const token_id> prefix_index::slot_tokens(block_id b) const {
  return std::span<const token_id>(tokens_).subspan(
      static_cast<std::size_t>(b.value) * static_cast<std::size_t>(block_size_), static_cast<std::size_t>(block_size_));
}

std::optional<block_id> prefix_index::find(block_key key, block_key parent, std::span<const token_id> tokens,
                                           std::string_view extras) const {
  const auto it = by_key_.find(key);
  if (it == by_key_.end()) return std::nullopt;
  const block_slot& s = slot(it->second);
  if (s.parent != parent || s.extras != extras) return std::nullopt;
  const std::span<const token_id> held = slot_tokens(it->second);
  if (!std::equal(held.begin(), held.end(), tokens.begin(), tokens.end())) return std::nullopt;
  return it->second;
}

bool prefix_index::insert(block_id b, block_key key, block_key parent, std::span<const token_id> tokens,
                          std::string_view extras) {
  PAGODA_ASSERT(static_cast<std::int32_t>(tokens.size()) == block_size_, "only full blocks are keyed ({} tokens)",
                tokens.size());
  PAGODA_ASSERT(!slot(b).registered, "block {} registered twice", b.value);
  if (!by_key_.emplace(key, b).second) return false;
  ++generation_;
  block_slot& s = slots_[static_cast<std::size_t>(b.value)];
  s.registered = true;
  s.key = key;
  s.parent = parent;
  s.extras.assign(extras);
  std::copy(tokens.begin(), tokens.end(),
            tokens_.begin() + static_cast<std::ptrdiff_t>(b.value) * static_cast<std::ptrdiff_t>(block_size_));
  return true;
}

void prefix_index::erase(block_id b) {
  PAGODA_ASSERT(slot(b).registered, "erase of unregistered block {}", b.value);
  block_slot& s = slots_[static_cast<std::size_t>(b.value)];
  by_key_.erase(s.key);
  s = block_slot{};
  ++generation_;
}

block_key prefix_index::key_of(block_id b) const {
  PAGODA_ASSERT(slot(b).registered, "key_of unregistered block {}", b.value);
  return slot(b).key;
}

block_key prefix_index::parent_of(block_id b) const {
  PAGODA_ASSERT(slot(b).registered, "parent_of unregistered block {}", b.value);
  return slot(b).parent;
}

std::span<const token_id> prefix_index::tokens_of(block_id b) const {
  PAGODA_ASSERT(slot(b).registered, "tokens_of unregistered block {}", b.value);
  return slot_tokens(b);
}

status prefix_index::check_invariants() const {
  std::size_t n_registered = 0;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const block_slot& s = slots_[i];
    if (!s.registered) continue;
    ++n_registered;
    const auto it = by_key_.find(s.key);
    if (it == by_key_.end() || it->second.value != static_cast<std::int32_t>(i)) {
      return error(errc::internal, "block {} is registered under key {:016x}, which maps elsewhere", i, s.key);
    }
    if (hash_block(s.parent, slot_tokens(block_id(static_cast<std::int32_t>(i))), s.extras) != s.key) {
      return error(errc::internal, "block {} is registered under key {:016x}, not the key of its contents", i, s.key);
    }
  }
  if (n_registered != by_key_.size()) {
    return error(errc::internal, "index has {} keys for {} registered blocks", by_key_.size(), n_registered);
  }
  return ok_status();
}

}  // namespace pagoda
