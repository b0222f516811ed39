// The greedy pair-merging loop both tokenizers share. SentencePiece BPE merges
// the adjacent pair whose joined text is the highest-scoring token; byte-level
// BPE merges the pair with the lowest merge rank. Both are "repeatedly merge the
// best adjacent pair, leftmost on ties", which this runs in O(n log n) with a
// heap of candidate pairs (stale entries are skipped when popped) instead of
// rescanning the word after every merge.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "pagoda/types.h"

namespace pagoda::detail {

// A run of the input, linked to its neighbours. A symbol merged into its left
// neighbour keeps size 0 and is skipped.
struct merge_symbol {
  std::uint32_t begin = 0;  // byte offset in the text being tokenized
  std::uint32_t size = 0;   // bytes; 0 once merged away
  std::int32_t prev = -1;
  std::int32_t next = -1;
  token_id id = k_no_token;  // the token this run is, if it is one
};

// What merging a pair would give: its priority (lower merges first) and the token.
struct merge_result {
  double priority = 0;
  token_id id = k_no_token;
};

struct merge_candidate {
  double priority;
  std::int32_t left;
  std::int32_t right;
  std::uint32_t size;  // left.size + right.size when proposed; differs once either changed
  token_id id;
};

// Reused buffers, so that a tokenizer allocates once per call, not per word.
struct merge_workspace {
  std::vector<merge_symbol> symbols;
  std::vector<merge_candidate> heap;
};

// Merges `ws.symbols` (a linked list starting at index 0) until no adjacent pair
// has a merge_result. `evaluate(left, right)` returns std::optional<merge_result>.
template <typename Evaluate>
void merge_pairs(merge_workspace& ws, Evaluate&& evaluate) {
  auto& symbols = ws.symbols;
  auto& heap = ws.heap;
  heap.clear();
  // std heaps are max-heaps: "a before b" means a has lower precedence.
  const auto lower_precedence = [](const merge_candidate& a, const merge_candidate& b) {
    return a.priority > b.priority || (a.priority == b.priority && a.left > b.left);
  };
  const auto propose = [&](std::int32_t left, std::int32_t right) {
    if (left < 0 || right < 0) return;
    const merge_symbol& l = symbols[left];
    const merge_symbol& r = symbols[right];
    const std::optional<merge_result> m = evaluate(l, r);
    if (!m) return;
    heap.push_back({m->priority, left, right, l.size + r.size, m->id});
    std::push_heap(heap.begin(), heap.end(), lower_precedence);
  };

  for (std::int32_t i = 1; i < static_cast<std::int32_t>(symbols.size()); ++i) propose(i - 1, i);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), lower_precedence);
    const merge_candidate c = heap.back();
    heap.pop_back();
    merge_symbol& l = symbols[c.left];
    merge_symbol& r = symbols[c.right];
    // Sizes only grow, so an unchanged sum means neither side changed since proposal.
    if (l.size == 0 || r.size == 0 || l.size + r.size != c.size) continue;
    l.size += r.size;
    l.id = c.id;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = c.left;
    r.size = 0;
    propose(l.prev, c.left);
    propose(c.left, l.next);
  }
}

}  // namespace pagoda::detail
