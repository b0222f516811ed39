// Which tokens a grammar allows next: a mask over the vocabulary per match
// state, computed against every token's bytes and cached by state, so a
// state seen before (the inside of any JSON string, the place after a
// comma, ...) costs a hash lookup. A compiled grammar (its rules and its
// mask cache) is shared by every sequence with the same grammar text, and
// kept across requests by grammar_cache.
//
// The mask is computed by walking the tokens in byte order, so tokens that
// share a prefix share its matching steps, and a prefix the grammar refuses
// rules out every token that starts with it at once. That walk costs in
// proportion to the tokens the state allows (all of them inside a JSON
// string: ~0.3 s at 128K tokens), and a bounded repetition (a string's
// maxLength) makes a new state at every character. So each state first gets
// a coarse mask, the tokens whose first byte the grammar takes (256 matching
// steps): a superset of the exact mask. The runner draws from the coarse
// mask, checks the one token drawn exactly, and only when it is refused
// computes the exact mask and draws again from it (runner_state::draw). For
// greedy decoding and plain sampling that is the exact law (a refused draw
// is redrawn from the exact set, which restores each allowed token's
// probability); with top-k/top-p/min-p the cut is made over the coarse set
// first.
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "grammar/gbnf.h"
#include "grammar/matcher.h"
#include "pagoda/types.h"

namespace pagoda::grammar {

// The vocabulary as the grammar sees it: each token's bytes (what it adds to
// the text; empty for control tokens, which a grammar never allows) and the
// end-of-generation tokens (allowed where the grammar accepts).
class vocabulary {
 public:
  vocabulary(std::vector<std::string> pieces, std::vector<token_id> eog);
  std::size_t size() const { return pieces_.size(); }
  const std::string& piece(token_id t) const { return pieces_[static_cast<std::size_t>(t)]; }
  bool is_eog(token_id t) const;
  const std::vector<token_id>& eog() const { return eog_; }

 private:
  friend class compiled_grammar;
  std::vector<std::string> pieces_;
  std::vector<token_id> eog_;
  std::vector<token_id> order_;     // tokens with bytes, sorted by them
  std::vector<std::uint32_t> lcp_;  // [order_]: bytes shared with the previous token in order_
  std::array<std::vector<token_id>, 256> by_first_byte_;  // tokens with bytes, by their first byte
};

// Allowed tokens: a bitset over the vocabulary and the count of set bits.
struct token_mask {
  std::vector<std::uint64_t> bits;
  std::size_t n_allowed = 0;
  bool allowed(token_id t) const {
    return (bits[static_cast<std::size_t>(t) >> 6] >> (static_cast<std::size_t>(t) & 63)) & 1;
  }
  // REQUIRES: t < 64 x bits.size(), not yet set.
  void set(token_id t) {
    bits[static_cast<std::size_t>(t) >> 6] |= std::uint64_t{1} << (static_cast<std::size_t>(t) & 63);
    ++n_allowed;
  }
};

class compiled_grammar {
 public:
  // Masks past this many bytes are dropped and computed again as needed.
  static constexpr std::size_t k_mask_cache_bytes = 64u << 20;

  compiled_grammar(rules g, std::shared_ptr<const vocabulary> vocab);
  const rules& grammar() const { return rules_; }
  const vocabulary& vocab() const { return *vocab_; }
  const match_state& initial() const { return initial_; }

  // The tokens allowed after state s (cached by s.key()).
  const token_mask& mask(const match_state& s);
  // A superset of mask(s): the tokens whose first byte s takes, and the
  // end-of-generation tokens where s accepts (cached by s.key()).
  const token_mask& coarse_mask(const match_state& s);
  // Whether s takes token t (one token's bytes matched).
  bool allows(const match_state& s, token_id t) const;

  std::size_t n_cached_masks() const { return masks_.size(); }
  std::size_t n_computed_masks() const { return n_computed_; }

 private:
  // The end-of-generation tokens where s accepts, nothing else.
  token_mask eog_mask(const match_state& s) const;
  token_mask compute(const match_state& s) const;
  token_mask compute_coarse(const match_state& s) const;
  // The cached mask of `key`, computed by `make` when absent.
  template <class F>
  const token_mask& cached(std::unordered_map<std::string, token_mask>& cache, std::string key, F make);

  rules rules_;
  std::shared_ptr<const vocabulary> vocab_;
  match_state initial_;
  std::unordered_map<std::string, token_mask> masks_;
  std::unordered_map<std::string, token_mask> coarse_;
  std::size_t n_computed_ = 0;
};

// The state of one sequence under a compiled grammar.
class token_matcher {
 public:
  explicit token_matcher(std::shared_ptr<compiled_grammar> g) : g_(std::move(g)), state_(g_->initial()) {}
  const token_mask& mask() { return g_->mask(state_); }
  const token_mask& coarse_mask() { return g_->coarse_mask(state_); }
  bool allows(token_id t) const { return g_->allows(state_, t); }
  // Takes token t; false if the grammar refuses it (the state is then dead).
  // An end-of-generation token ends matching: accepted only where the grammar accepts.
  bool accept(token_id t);
  bool accepts() const { return state_.accepts(); }
  bool dead() const { return state_.dead(); }
  const vocabulary& vocab() const { return g_->vocab(); }
  const match_state& state() const { return state_; }

 private:
  std::shared_ptr<compiled_grammar> g_;
  match_state state_;
};

// Compiled grammars by text, least recently used dropped past k_max_grammars.
// One thread uses it (the runner's).
class grammar_cache {
 public:
  static constexpr std::size_t k_max_grammars = 16;
  explicit grammar_cache(std::shared_ptr<const vocabulary> vocab) : vocab_(std::move(vocab)) {}
  result<std::shared_ptr<compiled_grammar>> get(const std::string& text);
  std::size_t size() const { return by_text_.size(); }

 private:
  std::shared_ptr<const vocabulary> vocab_;
  std::list<std::pair<std::string, std::shared_ptr<compiled_grammar>>> lru_;  // most recent first
  std::unordered_map<std::string, decltype(lru_)::iterator> by_text_;
};

}  // namespace pagoda::grammar
