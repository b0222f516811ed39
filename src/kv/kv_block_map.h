// What every block of a KV pool holds now, as plain data: the dashboard's
// grid (server/dashboard.h), taken on the engine thread between steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kv/kv_group.h"

namespace pagoda {

class kv_manager;

struct kv_block_map {
  struct group {
    kv_group_kind kind = kv_group_kind::full;
    std::int32_t first_block = 0;
    // Per block: sequences holding it (capped at 255), whether it is in the
    // prefix cache (hashed), its owner (an index into tenants; -1 when no
    // sequence or cache holds it) and its KV class.
    std::vector<std::uint8_t> refs;
    std::vector<std::uint8_t> cached;
    std::vector<std::int32_t> owners;
    std::vector<std::uint8_t> classes;
  };
  std::int32_t block_size = 0;
  std::int64_t step = 0;              // the engine step it was taken after
  std::vector<std::string> tenants;   // owners' names ("" is the default tenant)
  std::vector<group> groups;
};

// O(blocks). step: the engine's step count, recorded in the map.
kv_block_map make_kv_block_map(const kv_manager& kv, std::int64_t step);

}  // namespace pagoda
