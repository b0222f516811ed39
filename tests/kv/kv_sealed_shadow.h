// A sealed-format KV storage beside the KV property test's simulated tensors
// (kv_property_test.cpp): the same writes and block ops, on real int4
// (per-channel keys) tiles. A slot's K/V rows are a function of its token and
// position, so a full block's bytes can be compared with what plain decoding
// stores for the same rows. Blocks an op reopened from their codes (a
// truncate or a partial copy of a sealed block that was not held) are
// requantized by design and not compared; a verification step's rollback
// (truncate of a held block) must leave them exact.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "kv/kv_ops.h"
#include "kv/kv_storage.h"

namespace pagoda::test {

class sealed_shadow {
 public:
  sealed_shadow(std::int32_t block_size, std::int32_t n_blocks);
  // Slot `slot` of b gets the rows of (token, position); slots of a block in order.
  void write(block_id b, std::int32_t slot, token_id token, std::int32_t position);
  void hold(block_id b);
  void end_holds();
  // A block op (copy, truncate, release, evict; not gather, which the
  // scenarios with a shadow do not run), applied to the storage.
  void apply(const kv_op& op);
  // b is full: its bytes are plain decoding's for these rows, unless an op
  // reopened it from its codes (then it is not compared).
  ::testing::AssertionResult holds_plain_bytes(block_id b, std::span<const token_id> tokens,
                                               std::span<const std::int32_t> positions);
  std::int64_t n_compared() const { return n_compared_; }
  // Of those, blocks a rollback truncated while held.
  std::int64_t n_rollbacks_compared() const { return n_rollbacks_compared_; }

 private:
  static void rows(token_id token, std::int32_t position, float* k, float* v);
  std::int32_t bs_;
  std::unique_ptr<kv_storage> s_, plain_;  // plain_: one block, written whole
  std::vector<std::int32_t> written_;      // [block]: slots written
  std::vector<std::uint8_t> exact_, held_, rolled_back_;
  std::int64_t n_compared_ = 0, n_rollbacks_compared_ = 0;
};

}  // namespace pagoda::test
