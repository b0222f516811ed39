// Side memory: what a sequence holds beyond its KV blocks and that grows with
// its context (a retrieval policy's ANN indexes, Quest's key bounds, the
// attention statistics H2O and SnapKV read). It is paid for in blocks of the
// same pool as the KV (kv_manager.h, "Side blocks"), so the pool's budget
// bounds KV plus side memory together and tenant quotas count both.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pagoda {

// An upper bound of a sequence's side bytes at n tokens: fixed + per_token * n.
// Contract for whoever reports one (kv_policy::side_memory, seq_policy): the
// bytes the structures hold in steady state (allocated capacity included)
// never exceed it for a sequence that has computed n tokens; transient
// scratch of a single call is not counted.
struct side_charge {
  std::int64_t fixed_bytes = 0;
  std::int64_t bytes_per_token = 0;

  bool none() const { return fixed_bytes == 0 && bytes_per_token == 0; }
  std::int64_t bytes_for(std::int64_t n_tokens) const { return fixed_bytes + bytes_per_token * std::max<std::int64_t>(n_tokens, 0); }
  side_charge& operator+=(const side_charge& o) {
    fixed_bytes += o.fixed_bytes;
    bytes_per_token += o.bytes_per_token;
    return *this;
  }
};

}  // namespace pagoda
