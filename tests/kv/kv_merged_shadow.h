// A MiniCache KV storage (kv/kv_merge.h) beside the KV property test's
// simulated tensors (kv_property_test.cpp): the same writes and block ops,
// compactions included, on real f32 tiles of three model layers, the upper
// two stored merged in one KV layer with their side data. A slot's rows in
// each layer are a function of its token, position, layer and head, so what
// a block holds can be checked exactly: model layer 0 reads its own rows; at
// every slot of the merged KV layer, per head, either the token is retained
// (the stored row is the lower layer's, and the upper layer's own rows sit
// in a side entry) or it is merged (the stored row is kv_merge_rows of the
// two, the side ratios are the upper layer's magnitude over the lower's).
// Retained entries are distinct and at most `retain` per block and head.
// So copy-on-write, truncation, release, eviction and compaction never lose,
// mix up or leave stale side data under a slot a table reads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include <gtest/gtest.h>

#include "kv/kv_ops.h"
#include "kv/kv_storage.h"

namespace pagoda::test {

class merged_shadow {
 public:
  merged_shadow(std::int32_t block_size, std::int32_t n_blocks, int retain);
  // Slot `slot` of b gets the rows of (token, position) in each layer, the
  // upper layer merged as the forward pass stores it.
  void write(block_id b, std::int32_t slot, token_id token, std::int32_t position);
  // A block op (copy, truncate, release, evict, gather), applied to the storage.
  void apply(const kv_op& op);
  // Slots [0, tokens.size()) of b hold those tokens at those positions.
  ::testing::AssertionResult holds(block_id b, std::span<const token_id> tokens, std::span<const std::int32_t> positions);
  std::int64_t n_retained_checked() const { return n_retained_; }
  std::int64_t n_merged_checked() const { return n_merged_; }

 private:
  std::int32_t bs_;
  float t_;
  std::unique_ptr<kv_storage> s_;
  std::int64_t n_retained_ = 0, n_merged_ = 0;
};

}  // namespace pagoda::test
