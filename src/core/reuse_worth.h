// What a cached entry is worth, by how often it was reused and how long ago:
// one rule for every tier that must choose what to drop, so that the memory
// tier (kv/block_pool.h, under --prefix-cache-eviction lfu) and the disk tier
// (store/disk_store.cpp, at its size cap) cannot drift apart.
//
//   worth = (1 + uses) * 2^-(periods since the last use)
//
// A use is a reuse (a prefix-cache hit, a read of a stored block), not the
// write that created the entry: something used once is worth 1 when new and
// fades, something reused 7 times is worth 8 and outranks it for three
// periods. The lowest worth goes first; equal worths go least recently used first.
//
// Ranking by worth needs no clock walk over the entries: log2(worth) =
// log2(1 + uses) + (period of the last use) - (period now), and the last
// term is common to all, so the time-free key log2(1 + uses) + (period of
// the last use) ranks the same (LFU with dynamic ageing, Arlitt et al.: a
// new entry enters at the clock and old worth fades as the clock moves on).
// Only what a period is differs between tiers:
//   disk_store   an hour of wall time since the entry's last read;
//   block_pool   a step of the pool's eviction clock (the key of the last
//                block take() evicted): the clock moves when every block
//                worth less has gone, so a scan of blocks nobody reuses
//                passes through the least-worth level and leaves reused
//                blocks alone, and reused blocks nobody asks for again fade
//                as the clock catches up with them.
// The pool keeps integer levels (floor of log2(1 + uses), capped) so that
// its entries sit in a few FIFO buckets: O(1) per operation.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace pagoda::reuse {

// log2 of the worth of an entry reused `uses` times whose last use was
// `age_periods` periods ago (age_periods >= 0).
inline double log2_worth(std::uint64_t uses, double age_periods) {
  return std::log2(1.0 + static_cast<double>(uses)) - age_periods;
}

// The worth itself: (1 + uses) halved every period since the last use.
inline double worth(std::uint64_t uses, double age_periods) { return std::exp2(log2_worth(uses, age_periods)); }

// floor(log2(1 + uses)) capped at max_level: the integer worth level of an
// entry at its last use (0 for never reused, 1 for 1-2 reuses, 2 for 3-6, ...).
constexpr std::int32_t level(std::uint32_t uses, std::int32_t max_level) {
  const auto l = static_cast<std::int32_t>(std::bit_width(static_cast<std::uint64_t>(uses) + 1)) - 1;
  return std::min(l, max_level);
}

// The fewest uses that reach max_level: counting further changes nothing.
constexpr std::uint32_t uses_cap(std::int32_t max_level) { return (std::uint32_t{1} << max_level) - 1; }

// One more use, saturating at cap.
constexpr std::uint32_t add_use(std::uint32_t uses, std::uint32_t cap) { return uses < cap ? uses + 1 : cap; }

}  // namespace pagoda::reuse
