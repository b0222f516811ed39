// Inside the policy module: what the eviction policies share. A row's live
// slots in position order, choosing the best-scored of them, the slack rule,
// building decisions, and the two halves every score-based policy is made of:
// a row_scorer (which tokens matter: sinks, accumulated attention, an
// observation window's votes) and a way to give rows their budgets (one budget
// for all rows, or PyramidKV/AdaKV's by layer and head).
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "policy/kv_policy.h"
#include "policy/policy_params_internal.h"

namespace pagoda::policy_detail {

// Row r's live slots, oldest position first.
struct row_slots {
  std::vector<std::int32_t> slot;
  std::vector<std::int32_t> pos;

  int size() const { return static_cast<int>(slot.size()); }
  void clear() {
    slot.clear();
    pos.clear();
  }
};

// Aborts with a message when the input's arrays do not match its shape (an
// engine bug, not bad user input).
void check_input(const eviction_input& in);
// How many live slots row r holds. Dead slots lead a row (kv_policy.h), so
// this is a binary search.
int live_count(const eviction_input& in, int r);
// Row r's live slots sorted by position.
void live_slots(const eviction_input& in, int r, row_slots& out);

// A score as it ranks: NaN as -infinity (below every number).
inline float rank_key(float score) { return score != score ? -std::numeric_limits<float>::infinity() : score; }
// Choosing among a row's candidates, which are oldest first (by position):
// higher scores first, ties to the newer (higher index), NaN lowest.
// `order`: every index of `scores`, the n best first (in no particular order
// among themselves).
void partition_best(std::span<const float> scores, int n, std::vector<int>& order);
// The indices of the n best (all of them when n >= size), in no particular order.
void top_scores(std::span<const float> scores, int n, std::vector<int>& out);
// `order` (indices of `scores`) sorted best first.
void sort_best_first(std::span<const float> scores, std::vector<int>& order);

// When a policy may act on an input.
enum class act_when : std::uint8_t {
  never,  // keep everything (SnapKV once=1 after the prompt)
  slack,  // when it frees at least `slack` slots
  now,    // whenever it frees anything (SnapKV once=1 at the prompt's end: its only chance)
};

// The slack rule: whether evicting `evicted` slots in all from `n_rows` rows
// is worth a compaction: anything at all with no slack (0, the default:
// exact budgets) and for act_when::now; else at least `slack` per row on
// average. With one budget for every row this is the widest row freeing
// `slack` slots; with budgets per layer or head it still means about one
// compaction per `slack` new tokens, however the widest row grows (an AdaKV
// head at its cap grows with the budget and frees little itself).
bool worth_evicting(act_when mode, long long evicted, int n_rows, int slack_slots);
// How many slots the rows lose in all when row r keeps keep[r] of live[r].
long long n_evicted(std::span<const int> live, std::span<const int> keep);

// Per-row keep lists (and anchors) -> an eviction_decision.
class decision_builder {
 public:
  explicit decision_builder(int n_rows) : rows_(static_cast<std::size_t>(n_rows)) {}
  // Row r's kept slots, in any order (finish sorts them).
  std::vector<std::int32_t>& row(int r) { return rows_[static_cast<std::size_t>(r)]; }
  // kv_fold::cluster: row r's anchor slots, which must also be kept; every row
  // gets the same number.
  std::vector<std::int32_t>& anchors(int r);
  // The decision; empty when no row lost a slot (`live` per row says how many
  // each row held).
  eviction_decision finish(std::span<const int> live, kv_fold fold);

 private:
  std::vector<std::vector<std::int32_t>> rows_;
  std::vector<std::vector<std::int32_t>> anchors_;
};

// Which tokens a score-based policy keeps first.
class row_scorer {
 public:
  virtual ~row_scorer() = default;
  virtual kv_policy_needs needs() const = 0;
  virtual act_when when(const eviction_input& in) const { return act_when::slack; }
  // Whether the input carries the statistics scoring needs. False: the policy
  // keeps everything this time. A statistic of the wrong shape aborts.
  virtual bool ready(const eviction_input& in) const { return true; }
  // How many of a row's newest live tokens are kept whatever their scores,
  // when the row keeps `target` (1 <= target; the result is <= target).
  virtual int protected_newest(const eviction_input& in, int target) const = 0;
  // The query rows that vote (SnapKV's observation window): a chunked prompt's
  // last chunk holds at least this many (prompt_chunking::min_last).
  virtual int observation_rows() const { return 0; }
  // Scores of row r's candidates (its live slots without the protected
  // newest, oldest first): out[i] for cands[i], higher kept first.
  virtual void score(const eviction_input& in, int r, const row_slots& cands, std::vector<float>& out) const = 0;
};

// Row r keeps its protected newest plus the best-scored candidates, `target`
// in all (at most its live slots). Appends the kept slots to `keep`; the
// `n_anchors` lowest-ranked of the score-chosen ones (the "highest-scoring
// evicted" of a budget n_anchors smaller) also go to `anchors`.
struct row_choice {
  row_slots live;
  row_slots cands;
  std::vector<float> scores;
  std::vector<int> picked;
  std::vector<std::uint8_t> chosen;
};
void choose_row(const row_scorer& scorer, const eviction_input& in, int r, int target, int n_anchors,
                row_choice& work, std::vector<std::int32_t>& keep, std::vector<std::int32_t>* anchors);

// The base of every eviction policy here: evict() runs the slack rule around
// the policy's decide(). The segmented policy drives the same three steps
// over each part itself, which is why they are public.
// What every eviction policy reads besides its own parameters: `slack`
// (default 0: exact budgets) and `chunk` (the prompt's chunk under eviction;
// -1: by the budget, 0: off).
struct eviction_common {
  int slack = 0;
  int chunk = -1;
};
status read_eviction_common(param_reader& params, eviction_common& out);

// The default prompt chunk under eviction: the budget at the prompt's end,
// at most this many tokens (a chunk of a few hundred rows keeps the forward
// pass's matrix products efficient), rounded up to whole blocks.
inline constexpr int k_default_prompt_chunk = 256;

class eviction_policy : public kv_policy {
 public:
  eviction_policy(kv_policy_spec spec, eviction_common common) : spec_(std::move(spec)), common_(common) {}

  const kv_policy_spec& spec() const override { return spec_; }
  bool lossy() const override { return true; }
  eviction_decision evict(const eviction_input& in) final;
  prompt_chunking prompt_chunks(int n_prompt, int block_size) const override;

  virtual act_when when(const eviction_input& in) const = 0;
  // Per row, what the row keeps if the policy acts now, as far as it is known
  // before scoring, given each row's live slots (`live`): the gate that
  // skips deciding when the rows would not lose `slack` slots on average. Exact for every policy but AdaKV, whose per-head
  // counts follow the scores; there it is the row's live slots less the
  // layer's excess shared evenly by its heads (exact when the scores kept
  // their order since the last compaction). The exact width is checked again
  // on the decision.
  virtual void min_keep(const eviction_input& in, std::span<const int> live, std::span<int> out) const = 0;
  // The slots to keep ignoring slack; empty when nothing would go or the
  // statistics are missing.
  virtual eviction_decision decide(const eviction_input& in) const = 0;
  virtual kv_fold fold() const { return kv_fold::drop; }
  virtual bool repositions() const { return false; }
  // How many tokens the widest row keeps once n_seen tokens are computed (a
  // prompt's chunks are sized from it).
  virtual int kept_at(int n_seen) const = 0;
  // The query rows its final choice reads (prompt_chunking::min_last).
  virtual int observation_rows() const { return 0; }
  // The `slack` parameter (0: exact budgets).
  int slack() const { return common_.slack; }

 private:
  kv_policy_spec spec_;
  eviction_common common_;
};

// An eviction policy whose choice rests on a row_scorer (all but segmented).
class scored_policy : public eviction_policy {
 public:
  scored_policy(kv_policy_spec spec, eviction_common common, std::unique_ptr<row_scorer> scorer)
      : eviction_policy(std::move(spec), common), scorer_(std::move(scorer)) {}
  kv_policy_needs needs() const override { return scorer_->needs(); }
  act_when when(const eviction_input& in) const override { return scorer_->when(in); }
  int observation_rows() const override { return scorer_->observation_rows(); }

 protected:
  std::unique_ptr<row_scorer> scorer_;
};

// The base policies a pyramid may stand on, parsed from a spec's parameters
// (h2o: recent; snapkv: window, kernel, once).
result<std::unique_ptr<row_scorer>> make_h2o_scorer(param_reader& params);
result<std::unique_ptr<row_scorer>> make_snapkv_scorer(param_reader& params);
std::unique_ptr<row_scorer> make_window_scorer(int sinks);

// PyramidKV's budgets: per layer (per row of that layer), falling linearly
// with depth so that first / last == ratio, summing to n_layers * target,
// each within [lo, hi]; where a bound cuts, the others make up the difference
// as far as the bounds allow. Rounding keeps the sum exact.
std::vector<int> pyramid_layer_budgets(int n_layers, int target, double ratio, int lo, int hi);
// The first-to-last layer budget ratio pyramid uses when none is given: 4
// (PyramidKV's) from 32 layers on, flatter for shallower models.
double pyramid_default_ratio(int n_layers);

}  // namespace pagoda::policy_detail
