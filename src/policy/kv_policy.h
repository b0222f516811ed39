// KV policies (DESIGN.md): which tokens a sequence keeps at all (eviction,
// merging) and which it reads in a step (sparse attention). One interface for
// all of them; the scheduler owns one policy object per sequence.
//
// Eviction. After every step that computed tokens of a sequence, the scheduler
// hands its policy an eviction_input (positions, attention statistics,
// segments) and applies the eviction_decision it returns: kept slots are
// compacted to the front of the table, emptied blocks go back to the pool.
// Decisions are per ROW, a row being one (layer, KV head): H2O and SnapKV
// choose per head. Every row keeps the same number of slots physically (the
// block table is shared by all layers and heads); a row that keeps fewer
// (PyramidKV's deeper layers, AdaKV's quieter heads) has DEAD slots at its
// front, marked by a negative position, which attention never reads. So
// memory follows the widest row, and quality each row's own budget.
//
// Rows: r = layer * n_kv_heads + kv_head.
//
// Sparse reads (quest, retrieval) do not evict: make_selector() returns a
// per-sequence kv_read_selector (attention/kv_selector.h) the forward pass asks
// per layer and head.
//
// Lossy policies (every evicting or merging one) change what later tokens
// compute, so a sequence stops registering blocks in the prefix cache once its
// policy has acted (kv_manager: off chain): no lossy block is ever served under
// a plain prefix key.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attention/attention_stats.h"
#include "attention/kv_selector.h"
#include "kv/kv_gather.h"
#include "kv/kv_side.h"
#include "pagoda/status.h"

namespace pagoda {

// `NAME[:key=value,...]`, as --kv-policy, a batch line's and a request's
// `kv_policy` spell it. "none" (or "") is full KV.
struct kv_policy_spec {
  std::string name = "none";
  std::vector<std::pair<std::string, std::string>> params;  // in the order given

  bool is_none() const { return name.empty() || name == "none"; }
  // The value of key, or nullptr.
  const std::string* find(std::string_view key) const;
  // "name:k=v,k=v" as parsed (canonical spacing).
  std::string to_string() const;
};
// Errors name the offending part ("--kv-policy h2o:budget: expected key=value").
result<kv_policy_spec> parse_kv_policy_spec(std::string_view text);

// How many tokens a budget keeps: a fraction of the tokens the sequence has
// seen so far (its context length: "0.25", "25%"), or a count ("256").
struct kv_budget {
  double fraction = 0;  // (0, 1]; used when tokens == 0
  int tokens = 0;
  // At least 1 and at most n_seen.
  int resolve(int n_seen) const;
  std::string to_string() const;
};
result<kv_budget> parse_kv_budget(std::string_view text);

// A part of the prompt with its own policy (per-segment policies): positions
// [begin, end). Generated tokens and positions outside every segment follow
// the sequence's own policy.
struct kv_segment {
  std::int32_t begin = 0;
  std::int32_t end = 0;
  kv_policy_spec policy;
};

// One sequence's KV as an eviction policy sees it, between steps.
struct eviction_input {
  int n_layers = 0;
  int n_kv_heads = 0;
  int block_size = 0;
  int n_slots = 0;   // stored KV slots (every row has this many, dead ones included)
  int n_seen = 0;    // tokens computed so far: positions 0 .. n_seen - 1 (the budget's context)
  int n_prompt = 0;  // prompt tokens
  int n_new = 0;     // tokens the last step computed: the newest n_new slots
  bool prompt_done_now = false;  // the last step computed the prompt's last token (SnapKV acts here)

  // Positions of row r's slots: positions[r * row_stride + slot]; row_stride
  // 0 when every row holds the same tokens (one row of n_slots). A negative
  // position is a dead slot (it holds nothing; dead slots lead their row).
  std::span<const std::int32_t> positions;
  std::size_t row_stride = 0;

  // Accumulated attention over the sequence's life (H2O): the softmax weight
  // each slot received, summed over the query heads of its KV head and over
  // every query token so far: totals[slot * n_rows() + r]. Empty when the
  // policy did not ask for totals.
  std::span<const float> totals;
  // The last step's statistics (SnapKV's observation window): for row r,
  // window->window_at(layer, head) holds n_window rows over window->n_kv
  // slots (== n_slots); nullptr when not asked for or not available.
  const attention_stats* window = nullptr;

  // Per-segment policies: segments of the prompt, sorted, disjoint.
  std::span<const kv_segment> segments;

  int n_rows() const { return n_layers * n_kv_heads; }
  const std::int32_t* row_positions(int r) const { return positions.data() + static_cast<std::size_t>(r) * row_stride; }
  bool is_dead(int r, int slot) const { return row_positions(r)[slot] < 0; }
};

// How evicted tokens leave: kv_fold (kv/kv_gather.h): drop, nearest, cluster.

// What an eviction policy decided for one sequence: per row, the slots it
// keeps, ascending, from the live slots of that row. An empty decision keeps
// everything. Rows may keep different counts (dead slots, see the top).
struct eviction_decision {
  int n_rows = 0;
  int width = 0;                    // entries per row in `keep` (the widest row)
  std::vector<std::int32_t> keep;   // [n_rows][width]: row r's first count[r] are valid
  std::vector<std::int32_t> count;  // [n_rows]
  kv_fold fold = kv_fold::drop;
  // kv_fold::cluster: per row, `anchors_per_row` evicted slots whose entries
  // become the cluster centroids (they keep their positions); they are also
  // listed in `keep`. [n_rows][anchors_per_row].
  int anchors_per_row = 0;
  std::vector<std::int32_t> anchors;
  // Uniform decisions only (StreamingLLM's positions within the cache): the
  // kept slots take positions 0 .. n_kept - 1, their keys re-rotated by RoPE
  // to match, and the sequence's next token continues at n_kept. Otherwise
  // every kept token keeps the position it was computed at.
  bool reposition = false;

  bool empty() const { return n_rows == 0; }
  std::span<const std::int32_t> row(int r) const {
    return std::span<const std::int32_t>(keep).subspan(static_cast<std::size_t>(r) * width,
                                                       static_cast<std::size_t>(count[static_cast<std::size_t>(r)]));
  }
  // Every row keeps the same slots.
  bool uniform() const;
};

// How the engine computes a prompt longer than an evicting policy keeps
// (chunked prefill under eviction, docs/policies.md): in steps of at most
// `chunk` tokens with the policy acting between them, so that the sequence
// never holds much more than its budget plus one chunk; the last step computes
// at least `min_last` tokens (SnapKV's observation window: its final choice
// sees the prompt's last tokens). chunk 0: no limit (the step budget's).
struct prompt_chunking {
  int chunk = 0;
  int min_last = 0;
};

// What the engine must collect for a policy.
struct kv_policy_needs {
  bool totals = false;      // accumulated attention (eviction_input::totals)
  int window_rows = -1;     // >= 0: the last step's last window_rows query rows (eviction_input::window)
  bool key_summaries = false;  // per-block key min/max/mean (kv_layout::key_summaries)
};

class kv_policy {
 public:
  virtual ~kv_policy() = default;
  virtual const kv_policy_spec& spec() const = 0;
  virtual kv_policy_needs needs() const { return {}; }
  // Whether applying it changes the KV cache (evicts or merges).
  virtual bool lossy() const { return false; }
  // Called after each step that computed tokens of the sequence. Returns the
  // slots to keep, or an empty decision to keep them all. A policy evicts
  // whenever its rows are over budget (exact budgets), or, with a `slack`
  // parameter, only when they would lose at least `slack` slots each on
  // average (fewer compactions, up to `slack` tokens over budget).
  virtual eviction_decision evict(const eviction_input& in) { return {}; }
  // How a prompt of n_prompt tokens is computed (prompt_chunking above): a
  // chunk only when the prompt is longer than the policy keeps of it plus one
  // chunk. Default: whole (a policy that evicts nothing gains nothing).
  virtual prompt_chunking prompt_chunks(int n_prompt, int block_size) const { return {}; }
  // Sparse reads: one selector for one sequence, or nullptr.
  virtual std::unique_ptr<kv_read_selector> make_selector(int n_layers, int n_kv_heads, int head_dim) { return nullptr; }
  // Side memory (kv/kv_side.h): an upper bound of what the policy's per-sequence
  // structures (its selector) hold for a sequence of n KV slots, which the
  // scheduler charges against the KV pool and the tenant's quota in blocks
  // (kv_manager.h, "Side blocks"). The statistics the engine collects for it
  // (needs()) are seq_policy's to count. Default: nothing beyond the KV; a
  // selector that holds more is still paid for by what it reports
  // (kv_read_selector::memory_bytes), one step late.
  virtual side_charge side_memory(int n_layers, int n_kv_heads, int head_dim) const { return {}; }
};

// One policy object for one sequence. Errors: an unknown name ("unknown KV
// policy 'x'; known: none, window, ..."), an unknown or bad parameter.
result<std::unique_ptr<kv_policy>> make_kv_policy(const kv_policy_spec& spec);
// Validates a spec without keeping the object (request parsing).
status check_kv_policy(const kv_policy_spec& spec);
// The names make_kv_policy knows, for messages and --help.
std::vector<std::string> kv_policy_names();

// Per-segment policies: one policy object for a sequence whose prompt has
// segments. Each row's live slots are split by position into the segments and
// the rest (generated tokens, positions outside every segment, which follow
// `base`); each part is decided by its own policy with budgets relative to the
// part's length, and the kept slots are merged. A "none" segment keeps
// everything. The segments are taken here, at construction (the input's
// `segments` are not read). Slack applies once, to the merged decision (the
// base spec's `slack`, else none). Errors: unsorted or overlapping
// segments, an empty one, a bad spec, `window:positions=cache` anywhere
// (positions cannot restart inside a part), a segment whose policy does not
// evict (sparse reads stay whole-sequence), and evicting parts that fold
// differently (`merge` with `h2o`: one decision has one kv_fold).
// No segments: the same as make_kv_policy(base).
result<std::unique_ptr<kv_policy>> make_segmented_policy(const kv_policy_spec& base,
                                                         std::span<const kv_segment> segments);

}  // namespace pagoda
