#include "grammar/token_mask.h"

#include <algorithm>
#include <bit>

namespace pagoda::grammar {

vocabulary::vocabulary(std::vector<std::string> pieces, std::vector<token_id> eog)
    : pieces_(std::move(pieces)), eog_(std::move(eog)) {
  for (std::size_t t = 0; t < pieces_.size(); ++t)
    if (!pieces_[t].empty() && !is_eog(static_cast<token_id>(t))) order_.push_back(static_cast<token_id>(t));
  std::sort(order_.begin(), order_.end(), [&](token_id a, token_id b) { return piece(a) < piece(b); });
  for (const token_id t : order_) by_first_byte_[static_cast<std::uint8_t>(piece(t)[0])].push_back(t);
  lcp_.resize(order_.size(), 0);
  for (std::size_t i = 1; i < order_.size(); ++i) {
    const std::string& a = piece(order_[i - 1]);
    const std::string& b = piece(order_[i]);
    const auto m = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
    lcp_[i] = static_cast<std::uint32_t>(m.first - a.begin());
  }
}

bool vocabulary::is_eog(token_id t) const { return std::find(eog_.begin(), eog_.end(), t) != eog_.end(); }

compiled_grammar::compiled_grammar(rules g, std::shared_ptr<const vocabulary> vocab)
    : rules_(std::move(g)), vocab_(std::move(vocab)), initial_(initial_state(rules_)) {}

token_mask compiled_grammar::eog_mask(const match_state& s) const {
  const vocabulary& v = *vocab_;
  token_mask m;
  m.bits.assign((v.size() + 63) / 64, 0);
  if (s.accepts())
    for (const token_id t : v.eog_)
      if (static_cast<std::size_t>(t) < v.size()) m.set(t);
  return m;
}

token_mask compiled_grammar::compute(const match_state& s) const {
  const vocabulary& v = *vocab_;
  token_mask m = eog_mask(s);
  if (s.dead()) return m;
  // states[d]: the state after the first d bytes of the current token;
  // states[0, alive] hold for the current token's prefix.
  std::vector<match_state> states(1, s);
  std::size_t alive = 0;
  for (std::size_t i = 0; i < v.order_.size(); ++i) {
    const std::string& p = v.pieces_[static_cast<std::size_t>(v.order_[i])];
    const std::size_t shared = v.lcp_[i];
    if (i > 0 && shared > alive) continue;  // starts with a prefix the grammar refused
    alive = std::min(alive, shared);
    if (states.size() < p.size() + 1) states.resize(p.size() + 1);
    bool ok = true;
    while (alive < p.size()) {
      if (!advance_byte(rules_, states[alive], static_cast<std::uint8_t>(p[alive]), states[alive + 1])) {
        ok = false;
        break;
      }
      ++alive;
    }
    if (ok) m.set(v.order_[i]);
  }
  return m;
}

token_mask compiled_grammar::compute_coarse(const match_state& s) const {
  const vocabulary& v = *vocab_;
  token_mask m = eog_mask(s);
  match_state next;
  for (int b = 0; b < 256; ++b)
    if (!v.by_first_byte_[static_cast<std::size_t>(b)].empty() && advance_byte(rules_, s, static_cast<std::uint8_t>(b), next))
      for (const token_id t : v.by_first_byte_[static_cast<std::size_t>(b)]) m.set(t);
  return m;
}

template <class F>
const token_mask& compiled_grammar::cached(std::unordered_map<std::string, token_mask>& cache, std::string key, F make) {
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  const std::size_t each = (vocab_->size() + 63) / 64 * sizeof(std::uint64_t) + key.size();
  if ((cache.size() + 1) * each > k_mask_cache_bytes / 2) cache.clear();
  return cache.emplace(std::move(key), make()).first->second;
}

const token_mask& compiled_grammar::mask(const match_state& s) {
  return cached(masks_, s.key(), [&] {
    ++n_computed_;
    return compute(s);
  });
}

const token_mask& compiled_grammar::coarse_mask(const match_state& s) {
  return cached(coarse_, s.key(), [&] { return compute_coarse(s); });
}

bool compiled_grammar::allows(const match_state& s, token_id t) const {
  if (t < 0 || static_cast<std::size_t>(t) >= vocab_->size()) return false;
  if (vocab_->is_eog(t)) return s.accepts();
  const std::string& p = vocab_->piece(t);
  if (p.empty()) return false;
  match_state x = s;
  return advance(rules_, x, p);
}

bool token_matcher::accept(token_id t) {
  const vocabulary& v = g_->vocab();
  if (v.is_eog(t)) {
    const bool ok = state_.accepts();
    state_ = {};  // matching ends
    return ok;
  }
  if (t < 0 || static_cast<std::size_t>(t) >= v.size() || v.piece(t).empty() ||
      !advance(g_->grammar(), state_, v.piece(t))) {
    state_ = {};
    return false;
  }
  return true;
}

result<std::shared_ptr<compiled_grammar>> grammar_cache::get(const std::string& text) {
  if (const auto it = by_text_.find(text); it != by_text_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second);
    return lru_.front().second;
  }
  PAGODA_ASSIGN_OR_RETURN(rules g, parse_gbnf(text));
  auto compiled = std::make_shared<compiled_grammar>(std::move(g), vocab_);
  lru_.emplace_front(text, compiled);
  by_text_[text] = lru_.begin();
  if (lru_.size() > k_max_grammars) {
    by_text_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return compiled;
}

}  // namespace pagoda::grammar
