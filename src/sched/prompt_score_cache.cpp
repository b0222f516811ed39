#include "sched/prompt_score_cache.h"

#include <algorithm>

namespace pagoda {

const std::vector<token_logprob>* prompt_score_cache::find(block_key key, block_key parent,
                                                           std::span<const token_id> tokens, int k) {
  const auto it = index_.find(key);
  if (it == index_.end()) return nullptr;
  const entry& e = *it->second;
  if (e.k < k || e.parent != parent || !std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin(), tokens.end()))
    return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return &it->second->scores;
}

void prompt_score_cache::put(block_key key, block_key parent, std::span<const token_id> tokens, int k,
                             std::vector<token_logprob> scores) {
  if (max_tokens_ < scores.size()) return;
  if (const auto it = index_.find(key); it != index_.end()) {
    if (it->second->k >= k) return;
    n_tokens_ -= it->second->scores.size();
    lru_.erase(it->second);
    index_.erase(it);
  }
  n_tokens_ += scores.size();
  lru_.push_front(entry{key, parent, std::vector<token_id>(tokens.begin(), tokens.end()), k, std::move(scores)});
  index_[key] = lru_.begin();
  while (n_tokens_ > max_tokens_) {
    const entry& old = lru_.back();
    n_tokens_ -= old.scores.size();
    index_.erase(old.key);
    lru_.pop_back();
  }
}

}  // namespace pagoda
