// The router's decision (docs/router.md): which replica gets a request. A
// pure function of what the router knows, so it tests without processes.
//
// policy prefix: among the replicas that are up and not yet tried, those
// whose load is within `balance_slack` of the least loaded one are the
// candidates; the candidate holding the most leading blocks of the request
// wins (ties: the lower load, then the rotation). When no candidate holds
// even the first block, the least loaded replica gets it ("by load"), ties
// broken by the rotation so that an idle cluster spreads new prefixes.
// policy round_robin: the next replica up in turn (the benchmark's baseline).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>

#include "kv/prefix_index.h"

namespace pagoda::router {

enum class route_policy { prefix, round_robin };
enum class route_reason { prefix, load, round_robin };
const char* route_reason_name(route_reason r);

// The blocks a replica holds, as the router believes: its last summary, and
// the keys of requests the router sent there since (they will be cached once
// computed: without them, every request of a new system prompt arriving within
// a poll interval would land on a different replica).
class replica_blocks {
 public:
  bool contains(block_key k) const { return snapshot_.contains(k) || pending_.contains(k); }
  // A new summary: its keys replace the snapshot; keys routed before
  // `pending_before` are dropped from the pending set (the summary shows them
  // if the replica computed and kept them).
  template <typename Keys>
  void replace(const Keys& keys, std::uint64_t pending_before) {
    snapshot_.clear();
    for (block_key k : keys) snapshot_.emplace(k, 0);
    std::erase_if(pending_, [&](const auto& kv) { return kv.second < pending_before; });
  }
  // Keys routed here at time `now` (any monotonic unit the caller uses).
  void add_pending(std::span<const block_key> keys, std::uint64_t now);
  void clear() {
    snapshot_.clear();
    pending_.clear();
  }
  std::size_t n_snapshot() const { return snapshot_.size(); }
  std::size_t n_pending() const { return pending_.size(); }

 private:
  std::unordered_map<block_key, int> snapshot_;
  std::unordered_map<block_key, std::uint64_t> pending_;  // key -> when routed
};

// The leading keys of `keys` that `blocks` holds.
std::int32_t leading_matches(std::span<const block_key> keys, const replica_blocks& blocks);

struct replica_view {
  bool up = true;
  bool excluded = false;                    // already tried for this request
  const replica_blocks* blocks = nullptr;   // nullptr: no usable summary (routed by load only)
  std::span<const block_key> keys;          // the request's keys at this replica's block size
  int load = 0;                             // running + waiting requests
};

struct route_params {
  route_policy policy = route_policy::prefix;
  int balance_slack = 4;  // requests of load a prefix may cost over the least loaded replica
};

struct route_decision {
  std::size_t replica = 0;
  route_reason reason = route_reason::load;
  std::int32_t matched_blocks = 0;
};

// std::nullopt when no replica is up and untried. `turn` is a counter the
// caller increments per request (the rotation).
std::optional<route_decision> choose_replica(std::span<const replica_view> replicas, const route_params& params,
                                             std::uint64_t turn);

}  // namespace pagoda::router
