#include "attention/kv_selector.h"

#include <algorithm>

namespace pagoda {

namespace {

// Blocks of `bs` slots that [begin, end) touches; 0 when empty.
std::int64_t blocks_of(std::int64_t begin, std::int64_t end, int bs) {
  return end > begin ? (end - 1) / bs - begin / bs + 1 : 0;
}

}  // namespace

kv_read_counts count_reads(int n_kv, int n_rows, int window_slots, int block_size, bool sparse,
                           std::span<const slot_range> ranges) {
  kv_read_counts c;
  for (int i = 0; i < n_rows; ++i) {
    const std::int64_t end = static_cast<std::int64_t>(n_kv) - (n_rows - 1 - i);
    if (end <= 0) continue;
    const std::int64_t lo = window_slots > 0 ? std::max<std::int64_t>(0, end - window_slots) : 0;
    ++c.rows;
    c.tokens_visible += end - lo;
    c.blocks_visible += blocks_of(lo, end, block_size);
    if (!sparse) {
      c.tokens_read += end - lo;
      c.blocks_read += blocks_of(lo, end, block_size);
      continue;
    }
    std::int64_t last_block = -1;  // ranges are sorted: a block two ranges share counts once
    for (const slot_range& r : ranges) {
      const std::int64_t b = std::max<std::int64_t>(r.begin, lo), e = std::min<std::int64_t>(r.end, end);
      if (e <= b) continue;
      c.tokens_read += e - b;
      const std::int64_t b0 = std::max(b / block_size, last_block + 1), b1 = (e - 1) / block_size;
      if (b1 >= b0) c.blocks_read += b1 - b0 + 1;
      last_block = std::max(last_block, b1);
    }
  }
  return c;
}

}  // namespace pagoda
