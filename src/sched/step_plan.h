// The data between the scheduler and a runner (DESIGN.md): the scheduler plans
// a step (step_plan), a runner executes it (step_output), and the scheduler
// commits what was computed (scheduler::update). Plain data: ids, tokens,
// positions, block ids, counts and specs, never a pointer or a view into the
// scheduler's objects, so any runner (the CPU one today, a GPU one or one in
// another process later) can execute a plan, and tests can fake one.
//
// Per-sequence state lives on both sides (vLLM v1's SchedulerOutput and
// CachedRequestState). The scheduler keeps what deciding needs (the KV
// manager's tables and positions, the policy's statistics); the runner keeps,
// keyed by sequence id, what executing needs (runner_state.h): its copy of
// the block tables and stored positions, the per-row positions of a per-head
// policy, the sparse-read selector, the sampler and the token history its
// penalties read. A sequence is sent in full once (seq_setup, fresh_kv), then
// as deltas: appended or replaced table entries, positions from the first
// that changed, rows only when a compaction rewrote them, slot changes for
// the selector. step_plan::finished frees a sequence's state.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attention/attention_stats.h"
#include "attention/kv_selector.h"
#include "kv/kv_hooks.h"
#include "kv/kv_ops.h"
#include "pagoda/events.h"
#include "pagoda/request.h"
#include "pagoda/status.h"
#include "pagoda/types.h"
#include "policy/kv_policy.h"
#include "spec/speculative.h"

namespace pagoda {

// What a runner keeps for a sequence it has not seen before.
struct seq_setup {
  sampling_params sampling;        // with the sequence's own seed (completion i of a request: seed + i)
  int logprobs = -1;               // request::logprobs: -1 none; k >= 0 the chosen token's and the k most likely
  int prompt_logprobs = -1;        // request::prompt_logprobs: -1 none; k >= 0 prompt tokens scored with the k most likely
  std::vector<token_id> tokens;    // the sequence's tokens (the prompt): the history its penalties read
  std::int32_t n_prompt = 0;       // of which the prompt
  kv_policy_spec policy;           // its sparse-read selector comes from this policy ("none": none)
  spec_config speculation;         // a model drafter (self, early-exit): the runner drafts with it
};

// A completion forked from a sequence at its first sample (n > 1): it draws
// its first token from the sequence's last logits row with its own seed and
// starts from the sequence's tokens; its KV state comes with its first run.
struct seq_fork {
  seq_id seq;
  std::uint64_t seed = 0;
};

// Brings the runner's copy of one KV group's block table in line with the
// KV manager's: entries [0, n_null) become NULL (a sliding window let them
// go), then the copy is cut to `from` entries and `entries` appended (new
// blocks; a copy-on-write, a compaction, a drop or a truncation replace from
// the first entry they changed).
struct table_update {
  std::int32_t group = 0;
  std::int32_t n_null = 0;
  std::int32_t from = 0;
  std::vector<block_id> entries;
};

// Slots of a sequence changed between steps: its selector forgets what it
// knew of slots >= n_slots (kept, a rollback) or of every slot (not kept,
// a compaction or a drop): kv_read_selector::on_slots_changed.
struct slot_change {
  std::int32_t n_slots = 0;
  bool kept = false;
};

// One sequence's share of a step: compute K/V (and logits) of `tokens`.
struct scheduled_seq {
  seq_id seq;
  std::vector<token_id> tokens;          // new tokens; their K/V go to KV slots n_stored ..
  std::vector<std::int32_t> positions;   // [tokens]: their positions
  std::int32_t n_stored = 0;             // KV slots stored before this step
  bool all_logits = false;               // the step's logits rows come back (prompt scoring): one per new token
  // >= 0: the step's rows are scored (seq_setup::prompt_logprobs): tokens[0]
  // is the sequence's token score_from, and row j scores the prompt token
  // score_from + j + 1 when there is one (step_output::prompt_scores).
  std::int32_t score_from = -1;
  int stats_window = -1;                 // >= 0: collect attention statistics, this many window rows
  // The step computes the sequence's last token: the runner samples the next
  // one (and its forks' first ones, forks first).
  bool sample = false;
  std::vector<seq_fork> forks;
  std::int32_t n_tokens = 0;             // the sequence's tokens before this step samples (a truncation cuts the history to it)
  // Speculative decoding (spec/speculative.h): the last draft.size() of
  // `tokens` are draft tokens, not yet verified. The runner computes a logits
  // row for every token and samples row by row while the drawn token equals
  // the next draft (accept_point_drafts): 1 + accepted tokens come back.
  // Their K/V are written tentatively; update() commits the verified prefix
  // and truncates the rest. Never with forks or all_logits.
  std::vector<token_id> draft;
  // The drafts are the runner's to make (a model drafter, seq_setup::speculation):
  // draft and the last draft.size() of `tokens` are placeholders
  // (k_runner_draft), and out.drafts[i] brings the tokens the runner drafted
  // and verified in their place.
  bool runner_drafts = false;
  // Chunk reuse (CacheBlend): [tokens] 1 where the token's K/V were imported
  // from a chunk computed alone (a gather op of this plan or an earlier one
  // wrote them); empty: none. The runner recomputes the other tokens, the
  // step's last token, and `recompute` of the imported ones: those whose K/V
  // deviate most from their recomputed values at an early layer (every layer
  // up to it is recomputed for all tokens of the step). Never with drafts or
  // all_logits (the scheduler refuses the combinations, scheduler_chunks.cpp).
  std::vector<std::uint8_t> reused;
  float recompute = 1.0f;
  // Images (request::images): [tokens] 1 where a row of `embeddings` stands
  // in for the token's embedding; empty: none in this step. The rows travel
  // with each step that computes them (a preempted sequence's recompute
  // brings them again): the runner keeps nothing of an image.
  std::vector<std::uint8_t> embedded;
  std::vector<float> embeddings;  // [tokens][n_embd] (zeros where not embedded)
  // Bidirectional image spans (image_span::bidirectional): [tokens] the last
  // position each token sees (a span's token: the span's last; others: its
  // own); empty: every token causal. The step holds the rest of each such span.
  std::vector<std::int32_t> see_until;

  // Whether the forward pass computes a logits row for every token (else the last one's only).
  bool every_row() const { return all_logits || score_from >= 0 || !draft.empty(); }
  // The prompt tokens the step scores (score_from >= 0), of a prompt of n_prompt tokens.
  std::size_t n_scored(std::int32_t n_prompt) const {
    if (score_from < 0) return 0;
    const std::int64_t n = std::min<std::int64_t>(static_cast<std::int64_t>(tokens.size()), n_prompt - 1 - score_from);
    return n > 0 ? static_cast<std::size_t>(n) : 0;
  }

  // --- the runner's per-sequence state (runner_state.h) -------------------------
  std::optional<seq_setup> setup;        // the first time the runner sees the sequence
  // Its KV state starts over (its first run, after a preemption, a fork's
  // first run): empty tables, positions and rows, a new selector; the
  // updates below then send everything.
  bool fresh_kv = false;
  std::vector<table_update> tables;      // the groups whose table changed since the sequence's last run
  // Stored positions: the runner keeps its first keep_positions and appends
  // stored_positions, n_stored in all, then the step's own `positions`.
  std::int32_t keep_positions = 0;
  std::vector<std::int32_t> stored_positions;  // [n_stored - keep_positions]
  // A per-head policy's rows after a compaction rewrote them (row r = layer *
  // n_kv_heads + head): [n_rows][n_stored] positions, dead slots negative.
  // Empty: the runner's rows stand (cut to n_stored), or there are none.
  std::vector<std::int32_t> rows;
  std::vector<slot_change> slot_changes; // in order, since the sequence's last run
};

// Fill `block` from an external KV source with the block stored under `ref`
// (its key and the layout of the class `block` is of), for `tenant`.
struct block_load {
  seq_id seq;
  block_id block;
  stored_block_ref ref;
  std::string tenant;
  std::int32_t index = 0;  // which of the sequence's loaded blocks (every group has one per index, or NULL)
};

struct step_plan {
  std::vector<kv_op> ops;             // first, in order: evictions, copies, truncations, releases
  std::vector<block_load> loads;      // then these
  std::vector<scheduled_seq> seqs;    // then one forward pass over these
  std::vector<seq_id> finished;       // sequences gone (finished, aborted, failed): the runner frees their state
  std::vector<seq_id> preempted;      // their KV state goes (tables, positions, rows, selector); sampling state stays
  bool empty() const {
    return ops.empty() && loads.empty() && seqs.empty() && finished.empty() && preempted.empty();
  }
};

// A token the runner sampled.
struct sampled_token {
  seq_id seq;
  token_id token = -1;
  std::optional<token_logprob> logprob;  // when the sequence asked for logprobs (sampler::log_prob, top_log_probs)
  // The sequence's grammar allowed no token (sampling_params::grammar): it
  // ends here with finish reason "grammar"; `token` is an end-of-generation token.
  bool grammar_end = false;
};

struct step_output {
  // Not ok: the step failed part way; nothing of it may be committed.
  status result;
  // For each sequence of the plan that samples, in plan order: its forks'
  // first tokens, in fork order, then its own (1 + accepted[i] of them for a
  // sequence with drafts: the accepted drafts, then the target's next token).
  std::vector<sampled_token> sampled;
  std::vector<std::int32_t> accepted;   // [plan.seqs]: drafts accepted (0 without drafts); empty when no seq has any
  // [plan.seqs]: for a runner_drafts sequence the draft.size() tokens the
  // runner drafted (and verified, in place of the placeholders); else empty.
  // Empty when no sequence has runner drafts.
  std::vector<std::vector<token_id>> drafts;
  // Seconds the runner spent in model drafters' draft passes and in the
  // step's forward pass (speculative decoding's metrics: draft and verification time).
  double draft_seconds = 0;
  double forward_seconds = 0;
  // The logits rows of all_logits sequences, in plan order: [rows][n_vocab].
  std::vector<float> prompt_logits;
  // The scores of the sequences with score_from >= 0, in plan order, each
  // sequence's n_scored() of them: its prompt tokens score_from + 1 .. in order.
  std::vector<token_logprob> prompt_scores;
  std::vector<std::uint8_t> loaded;     // [plan.loads]: 0 not filled, else 1 + the source tier it came from
  std::vector<attention_stats> stats;   // [plan.seqs]; meaningful where stats_window >= 0
  std::vector<std::uint8_t> sparse;     // [plan.seqs]: 1 when a selector chose a sparse read for any of its tokens
  std::vector<kv_read_counts> reads;    // [plan.seqs]: what its attention read (empty: not counted)
  std::vector<std::int64_t> selector_bytes;  // [plan.seqs]: the memory of its selector after the step
  // [plan.seqs]: its selector's index kind ("" without one) and sampled recall so far.
  std::vector<std::string_view> index_names;
  std::vector<index_recall> recall;
  std::vector<std::int32_t> reused_rows;     // [plan.seqs]: imported tokens not recomputed (empty: none anywhere)
};

// Executes plans. Implementations: cpu_runner; fakes in tests.
class model_runner {
 public:
  virtual ~model_runner() = default;
  // Applies plan.finished and plan.preempted, performs plan.ops, then
  // plan.loads, then the forward pass of plan.seqs and their samples, and
  // fills `out` (out.result says whether it all happened).
  virtual void execute(const step_plan& plan, step_output& out) = 0;

  // Block hooks (kv_hooks.h). The eviction hook: called for each evicted
  // block, with its bytes, while the plan's ops run, before anything can
  // overwrite it. The commit hook: called for each block that entered the
  // prefix cache, with its bytes, when the op that says so runs (the next
  // step, before anything can evict it). The source: where loads read from;
  // nullptr: every load fails (the blocks are computed).
  virtual void set_eviction_hook(eviction_hook hook) = 0;
  virtual void set_commit_hook(commit_hook hook) = 0;
  virtual void set_kv_source(kv_block_source* source) = 0;
};

// A runner in front of another (failure injection, instrumentation): it
// forwards everything; a subclass overrides what it changes.
class runner_wrapper : public model_runner {
 public:
  explicit runner_wrapper(std::unique_ptr<model_runner> inner) : inner_(std::move(inner)) {}
  void execute(const step_plan& plan, step_output& out) override { inner_->execute(plan, out); }
  void set_eviction_hook(eviction_hook hook) override { inner_->set_eviction_hook(std::move(hook)); }
  void set_commit_hook(commit_hook hook) override { inner_->set_commit_hook(std::move(hook)); }
  void set_kv_source(kv_block_source* source) override { inner_->set_kv_source(source); }

 protected:
  model_runner& inner() { return *inner_; }

 private:
  std::unique_ptr<model_runner> inner_;
};

}  // namespace pagoda
