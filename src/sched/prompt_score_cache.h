// Prompt scores kept by prefix-cache block, so that a request asking for
// prompt logprobs (request::prompt_logprobs) can take a prefix-cache hit.
//
// A hit skips computing the cached positions, and with them the logits rows
// that score the tokens after them. So the scheduler keeps, for each full
// prompt block a scoring request computed, the scores of the prompt tokens
// that block holds: block b's are those of tokens [b * block_size,
// (b + 1) * block_size) (block 0's first is a placeholder: the first prompt
// token has none), each computed from the row of the token before it.
// Everything a block's scores depend on is in its chained key (the tokens up
// to its end, tenant, salt, KV classes). A scoring request then takes at most
// m cached KV blocks, where blocks 0 .. m (one more) have scores here: the
// first computed token's predecessor, the hit's last token, is scored by
// block m's entry. Entries are verified against the block's parent key and
// tokens (as the prefix index verifies its hits), hold at least the number of
// alternatives asked, and go least recently used first past a bound on the
// tokens held.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "kv/prefix_index.h"
#include "pagoda/events.h"
#include "pagoda/types.h"

namespace pagoda {

class prompt_score_cache {
 public:
  explicit prompt_score_cache(std::size_t max_tokens) : max_tokens_(max_tokens) {}

  // The scores of the block `key` (whose parent key and tokens are given)
  // with at least k alternatives each, or nullptr. A hit is the most recently used.
  const std::vector<token_logprob>* find(block_key key, block_key parent, std::span<const token_id> tokens, int k);
  // Keeps a block's scores (one per token of the block, k alternatives
  // each), replacing an entry of fewer alternatives; drops the least
  // recently used past the bound.
  void put(block_key key, block_key parent, std::span<const token_id> tokens, int k, std::vector<token_logprob> scores);

  std::size_t n_blocks() const { return index_.size(); }
  std::size_t n_tokens() const { return n_tokens_; }

 private:
  struct entry {
    block_key key;
    block_key parent;
    std::vector<token_id> tokens;
    int k;
    std::vector<token_logprob> scores;
  };
  std::size_t max_tokens_;
  std::size_t n_tokens_ = 0;
  std::list<entry> lru_;  // most recently used first
  std::unordered_map<block_key, std::list<entry>::iterator> index_;
};

}  // namespace pagoda
