// Speculative decoding (docs/speculative.md): a drafter proposes up to k
// tokens after a sequence's last one; the target computes the last token and
// the k drafts in one forward pass (k + 1 logits rows), and the runner keeps
// the drafts the target agrees with plus the target's own next token.
//
// This module holds what does not depend on the scheduler: the spec a request
// or the server names ("ngram:k=5,n=3", parsed as --kv-policy's NAME:k=v),
// the drafter interface, the per-sequence adaptive k and the acceptance rule.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

// k: the most draft tokens a verification step carries (and where the
// adaptive k starts); the drafter's own parameters beside it.
inline constexpr int k_max_draft_tokens = 15;
// A draft token the runner has yet to make (scheduled_seq::runner_drafts).
inline constexpr token_id k_runner_draft = -1;

// What a model drafter's forward passes read (self, early-exit): every KV
// slot, a window with attention sinks, Quest's top pages, or a copy of the
// KV in int4 or int2 that the engine keeps beside the cache (its *mirror*,
// a KV group of its own: engine_core.h).
enum class draft_view : std::uint8_t { full, window, quest, int4, int2 };

// The KV type (as --kv-cache-dtype names it) a mirror view reads, or nullptr
// for the views that read the cache itself.
const char* mirror_kv_type(draft_view view);

struct spec_config {
  std::string drafter = "none";  // "none": no speculation
  int k = 4;                     // [1, k_max_draft_tokens]
  // ngram: the sequence's last tokens matched earlier, up to n of them; no
  // proposal from a match shorter than min_n (ngram_drafter.cpp).
  int n = 3;
  int min_n = 2;  // clamped to n when n = 1
  // self and early-exit: the target model drafts, reading `view` of its own
  // KV through its first `layers` layers (0: all of them) and its output head.
  draft_view view = draft_view::full;
  int layers = 0;
  int sinks = 64;        // view=window: the first `sinks` slots ...
  int window = 1024;     // ... and the newest `window` slots
  double budget = 0.125; // view=quest: the fraction of blocks read
  bool enabled() const { return drafter != "none"; }
  // The runner drafts (with a model), not the scheduler (from token ids):
  // the target itself (self, early-exit) or the engine's draft model (draft).
  bool model_drafter() const { return drafter == "self" || drafter == "early-exit" || drafter == "draft"; }
  // The KV type of the mirror this drafter reads (view=int4, int2), or nullptr.
  const char* mirror() const { return drafter == "self" || drafter == "early-exit" ? mirror_kv_type(view) : nullptr; }
  std::string to_string() const;
};

// "none", "ngram", "ngram:k=5,n=3". Errors name the drafter and the parameter
// ("ngram: k=0: expected an integer in [1, 15]"); the caller adds where the
// text came from ("--speculative", "speculative").
result<spec_config> parse_spec_config(std::string_view text);

// The Quest policy spec a view=quest drafter reads through ("quest:budget=F").
std::string quest_view_spec(const spec_config& config);

// Proposes draft tokens from a sequence's verified tokens. Stateless across
// calls (what it needs it reads from `tokens`), so one drafter serves every
// sequence; later drafters (a draft model, the target reading its own
// compressed KV, early exit) implement the same interface.
class drafter {
 public:
  virtual ~drafter() = default;
  virtual const char* name() const = 0;
  // At most k tokens to follow tokens (prompt: the first n_prompt); empty: no guess.
  virtual std::vector<token_id> propose(std::span<const token_id> tokens, int n_prompt, int k) const = 0;
};

std::unique_ptr<drafter> make_drafter(const spec_config& config);

// k per sequence from its recent acceptance: an exponentially weighted mean of
// the accepted drafts per step; the next k is one more than that mean (the
// step is cheap to extend when drafts keep being accepted), in [1, k_max].
class adaptive_k {
 public:
  explicit adaptive_k(int k_max) : k_max_(k_max), mean_(k_max) {}
  int next() const;
  void observe(int n_proposed, int n_accepted);
  int k_max() const { return k_max_; }

 private:
  int k_max_;
  double mean_;  // starts optimistic: the first step drafts k_max
};

// A sequence's speculation: its drafter, its adaptive k, and the drafts
// planned for the step being executed (empty between steps).
struct spec_sequence {
  explicit spec_sequence(const spec_config& c) : config(c), drafts(make_drafter(c)), k(c.k) {}
  spec_config config;
  std::unique_ptr<drafter> drafts;
  adaptive_k k;
  std::vector<token_id> planned;
};

// The acceptance rule for drafts proposed as single tokens (a point-mass
// draft distribution, as the n-gram drafter's): row i of the target is drawn
// from with `draw(i)` (the target's own sampler: argmax when greedy); the
// drawn token is emitted, and the next row is read only while it equals
// drafts[i]. Returns the emitted tokens: 1 + the number of accepted drafts.
//
// Exact: for a point mass on d, rejection sampling accepts d with probability
// min(1, p(d) / 1) = p(d) and otherwise draws from p with d removed and
// renormalised; drawing t ~ p and accepting when t == d is that same law
// (P(emit d) = p(d), P(emit x != d) = p(x)). Greedy, it emits exactly the
// tokens plain decoding does.
std::vector<token_id> accept_point_drafts(std::span<const token_id> drafts, const std::function<token_id(int row)>& draw);

}  // namespace pagoda
