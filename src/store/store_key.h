// Keys of the KV warehouse (persistent tiers): what names a stored block.
//
// A prefix-cache key (kv_manager's chained block key) says which tokens a block
// holds after which prefix, with the tenant and cache salt folded into its
// first block. Stored across processes and machines, a block also needs what
// gives its bytes their meaning: the model (weights and tokenizer) and the KV
// layout (formats per layer, block size, calibrated scales). The store key is
//
//   tenant  = xxh3_64("pagoda-tenant", tenant name)            (8 bytes, big-endian first)
//   entry   = xxh3_64(k_store_key_version, model fingerprint, layout fingerprint, chain key)
//
// 16 bytes: the tenant hash first, so one tenant's entries are one range (an
// erase by tenant walks only them). Every integer is hashed in little-endian
// byte order (the only order this x86-64 code runs in; a known-answer test
// pins the values). Changing what enters a key bumps k_store_key_version, so
// old entries become misses, never garbage.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kv/kv_layout.h"
#include "kv/prefix_index.h"

namespace pagoda {

inline constexpr std::uint32_t k_store_key_version = 1;

// Everything a stored block's meaning depends on besides its own key. The
// layout is that of the block's own bytes: blocks of another KV class (a
// typed segment, int4 say) have another format, so another layout and key.
struct kv_space {
  std::uint64_t model = 0;   // model_fingerprint (sched/engine_setup.h)
  std::uint64_t layout = 0;  // layout_fingerprint of the block's KV class (stored_block_ref::layout)
};

struct store_key {
  std::uint64_t tenant = 0;
  std::uint64_t entry = 0;

  // The 16 bytes as stored: both halves big-endian, so byte order sorts by tenant.
  std::array<std::byte, 16> bytes() const;
  static store_key from_bytes(const std::byte* p);
  std::string hex() const;
  friend bool operator==(const store_key&, const store_key&) = default;
  friend auto operator<=>(const store_key&, const store_key&) = default;
};

std::uint64_t tenant_hash(std::string_view tenant);
store_key make_store_key(const kv_space& space, std::string_view tenant, block_key chain_key);

// Formats, block size, shape and calibrated scales: two layouts with the same
// fingerprint store the same bytes for the same K/V.
std::uint64_t layout_fingerprint(const kv_layout& layout);

}  // namespace pagoda
