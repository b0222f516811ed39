// A minimal block allocator for the single-user CLI paths (run, perplexity):
// block tables over the pool, no sharing, no eviction. Serving and batching go
// through the KV manager (src/kv) instead.
#pragma once

#include <span>
#include <unordered_map>
#include <vector>

#include "kv/kv_storage.h"

namespace pagoda::cli {

class simple_kv {
 public:
  explicit simple_kv(const kv_storage& storage);

  // Ensures sequence `seq` has KV slots for its first n_tokens tokens.
  // Returns false, changing nothing, when the pool has too few free blocks.
  bool reserve(int seq, int n_tokens);
  std::span<const block_id> table(int seq) const;
  void release(int seq);
  std::size_t blocks_used() const { return used_; }
  std::size_t peak_blocks_used() const { return peak_; }

 private:
  int block_size_;
  std::vector<block_id> free_;
  std::unordered_map<int, std::vector<block_id>> tables_;
  std::size_t used_ = 0;
  std::size_t peak_ = 0;
};

}  // namespace pagoda::cli
