#include "router/route_choice.h"

#include <algorithm>
#include <climits>

namespace pagoda::router {

const char* route_reason_name(route_reason r) {
  switch (r) {
    case route_reason::prefix: return "prefix";
    case route_reason::load: return "load";
    case route_reason::round_robin: return "round_robin";
  }
  return "?";
}

void replica_blocks::add_pending(std::span<const block_key> keys, std::uint64_t now) {
  // Bounded: a router that sees only new prefixes must not grow without end
  // between two summaries (the oldest go first: they are in the next summary).
  constexpr std::size_t k_max_pending = 1u << 18;
  if (pending_.size() + keys.size() > k_max_pending) pending_.clear();
  for (block_key k : keys) pending_[k] = now;
}

std::int32_t leading_matches(std::span<const block_key> keys, const replica_blocks& blocks) {
  std::int32_t n = 0;
  while (static_cast<std::size_t>(n) < keys.size() && blocks.contains(keys[static_cast<std::size_t>(n)])) ++n;
  return n;
}

std::optional<route_decision> choose_replica(std::span<const replica_view> replicas, const route_params& params,
                                             std::uint64_t turn) {
  const std::size_t n = replicas.size();
  auto eligible = [&](std::size_t i) { return replicas[i].up && !replicas[i].excluded; };
  // Visit replicas starting at the rotation, so that ties go round.
  auto order = [&](std::size_t k) { return (static_cast<std::size_t>(turn) + k) % n; };
  if (n == 0) return std::nullopt;
  if (params.policy == route_policy::round_robin) {
    for (std::size_t k = 0; k < n; ++k)
      if (eligible(order(k))) return route_decision{order(k), route_reason::round_robin, 0};
    return std::nullopt;
  }
  int min_load = INT_MAX;
  for (std::size_t i = 0; i < n; ++i)
    if (eligible(i)) min_load = std::min(min_load, replicas[i].load);
  if (min_load == INT_MAX) return std::nullopt;

  std::optional<route_decision> best;
  int best_load = INT_MAX;
  std::optional<std::size_t> least;
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = order(k);
    if (!eligible(i)) continue;
    const replica_view& r = replicas[i];
    if (!least || r.load < replicas[*least].load) least = i;
    if (r.load > min_load + params.balance_slack || !r.blocks) continue;
    const std::int32_t m = leading_matches(r.keys, *r.blocks);
    if (m == 0) continue;
    if (!best || m > best->matched_blocks || (m == best->matched_blocks && r.load < best_load)) {
      best = route_decision{i, route_reason::prefix, m};
      best_load = r.load;
    }
  }
  if (best) return best;
  return route_decision{*least, route_reason::load, 0};
}

}  // namespace pagoda::router
