// What the KV manager tells the owner of the tensors (block ops), and the
// plain data its calls take and return. Shared by the coordinator
// (kv_manager.h) and its groups (kv_group.h).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kv/block_pool.h"
#include "kv/kv_gather.h"
#include "kv/prefix_index.h"
#include "pagoda/types.h"

namespace pagoda {

// Positions [begin, end) of a prompt whose KV should be of block class cls
// (kv_manager.h, "KV classes"). Runs of one prompt are sorted and do not
// overlap; 0 <= begin < end <= the prompt's length; cls < n_classes().
struct kv_class_run {
  std::int32_t begin = 0;
  std::int32_t end = 0;
  std::uint8_t cls = 0;
};

// Copy the first n_tokens token slots of src into dst, every layer of their
// group, K and V. src and dst are of the same group and class.
struct block_copy {
  block_id src;
  block_id dst;
  std::int32_t n_tokens = 0;
};

// A block operation the tensors must perform (kv_manager.h, "Block ops").
// Block ids are global: each KV group owns a contiguous range of them
// (kv_manager::group_of), so an op names its group through its block.
enum class kv_op_kind : std::uint8_t {
  copy,      // copy the first n_tokens slots of src into block (copy-on-write)
  truncate,  // slots [n_tokens, block_size) of block become writable again
  release,   // block returned to the free pool without a prefix key (drop per-block state)
  evict,     // block left the prefix cache; key/parent/tokens say what it held
  cache,     // block entered the prefix cache (its K/V are written): key/parent/tokens
  gather,    // slots of one group's table are rewritten from other slots (compact()): `gather` says how
};
struct kv_op {
  kv_op_kind kind = kv_op_kind::copy;
  block_id block;
  block_id src;                // copy only
  std::int32_t n_tokens = 0;   // copy: slots copied; truncate: slots kept
  block_key key = 0;             // evict, cache
  block_key parent = 0;          // evict, cache
  std::vector<token_id> tokens;  // evict, cache: the block's token ids
  std::string tenant;            // evict, cache: its owner's tenant name
  std::shared_ptr<const kv_gather> gather;  // gather only: tables of one group
  std::int32_t group = 0;                   // the KV group of block (and of a gather's tables)
};

// What compact() does to one sequence: it keeps n_slots slots, of which
// [0, first) stay as they are and [first, n_slots) are rewritten (the gather
// says from which slots of the table before compaction).
struct kv_compaction {
  std::int32_t first = 0;
  std::int32_t n_slots = 0;
  std::vector<token_id> tokens;          // [n_slots - first]: the token of each rewritten slot
  std::vector<std::int32_t> positions;   // [n_slots - first]: increasing, after positions[first - 1]
  std::shared_ptr<kv_gather> gather;     // rows and folding; compact() fills in each group's tables and range
  // Where the sequence's next query sits: a sliding window keeps only what it
  // reads. -1: right after the last kept position (never later than the truth,
  // so the window keeps at least what it must).
  std::int64_t next_position = -1;
};

// Why allocate() could not supply blocks.
enum class alloc_blocker : std::uint8_t { none, pool, quota };

// What allocate() did. The caller performs every copy before writing into dst.
struct allocation {
  std::int32_t n_new_blocks = 0;   // table entries appended (per group: every group's table grows alike)
  std::vector<block_copy> copies;  // copy-on-write, at most one per group per call
};

// Blocks to take from one group, per class.
struct class_demand {
  std::array<std::int32_t, k_max_kv_classes> n{};  // [class]
  std::int32_t total = 0;
  void add(std::int32_t cls, std::int32_t k = 1) {
    n[static_cast<std::size_t>(cls)] += k;
    total += k;
  }
};

}  // namespace pagoda
