// What a runner keeps per sequence between steps, keyed by sequence id
// (step_plan.h): its copy of the block tables and stored positions, the
// per-row positions of a per-head policy, the sparse-read selector, and the
// sampler with the token history its penalties read. The plan brings it up to
// date (apply), the forward pass reads it, and the runner samples through it
// (sample). Shared by every runner (cpu_runner, the tests' fake runner), so
// that what a plan means is decided once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "attention/kv_selector.h"
#include "grammar/token_mask.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "sched/step_plan.h"

namespace pagoda {

// The model's shape, as sparse-read selectors are made for it.
struct runner_shape {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  std::int32_t block_size = 0;
};

// The vocabulary as grammars see it: every token's bytes as it continues a
// text (token_to_piece), control tokens as nothing, and the end-of-generation tokens.
std::shared_ptr<const grammar::vocabulary> grammar_vocabulary(const tokenizer& vocab);

class runner_state {
 public:
  // Makes the policy object a selector comes from (make_kv_policy; tests
  // inject their own). Null: no sequence gets a selector.
  using policy_factory = std::function<result<std::unique_ptr<kv_policy>>(const kv_policy_spec&)>;

  struct sequence {
    explicit sequence(const sampling_params& p) : params(p), smp(p) {}
    // Sampling.
    sampling_params params;
    sampler smp;
    int logprobs = -1;
    int prompt_logprobs = -1;
    std::int32_t n_prompt = 0;
    std::vector<token_id> history;  // prompt, then generated: what the penalties read
    kv_policy_spec policy;
    // KV, as of the step being executed (after apply): the step's new tokens included.
    std::vector<std::vector<block_id>> tables;  // [KV group]: the group's block table
    std::vector<std::int32_t> positions;        // [n_stored + new]: the position of every slot
    // Per-row positions (a per-head policy): rows[r * row_stride + slot] for
    // the same slots as positions; empty when every row holds `positions`.
    std::vector<std::int32_t> rows;
    std::size_t row_stride = 0;
    int n_rows = 0;
    std::unique_ptr<kv_read_selector> selector;
    // A model drafter (self, early-exit): its spec, and the view its draft
    // passes read through (null: every slot), made with the KV state.
    spec_config speculation;
    std::unique_ptr<kv_read_selector> draft_view;
    // The draft model's KV (cpu_runner::set_draft_model): its first draft_kv
    // slots hold it. A rollback cuts it to the stored slots; a fresh KV state
    // starts at them (a prefix hit brings the draft group's blocks too).
    std::int32_t draft_kv = 0;
    // The KV mirror (cpu_runner::set_kv_mirror): its first mirror_kv slots
    // hold the model's K/V, re-encoded. Cut and started over as draft_kv.
    std::int32_t mirror_kv = 0;
    // A sampled request's drafts are drawn from the draft's distribution
    // (spec/rejection.h): its sampler (a seed of its own) and, for the step
    // being executed, the distribution of each draft.
    std::unique_ptr<sampler> draft_smp;
    std::vector<token_distribution> draft_q;
    // Constrained decoding (params.grammar): where the sampled tokens have
    // brought the grammar, made at the first draw; a fork copies it.
    std::optional<grammar::token_matcher> grammar;
  };
  // The vocabulary a grammar's masks are computed against, made when the
  // first sequence with a grammar draws (cpu_runner: from the model's tokenizer).
  using vocabulary_factory = std::function<std::shared_ptr<const grammar::vocabulary>()>;

  runner_state(const runner_shape& shape, policy_factory make_policy);
  // Without one, a sequence with a grammar ends at its first draw (finish reason "grammar").
  void set_vocabulary(vocabulary_factory make) { make_vocabulary_ = std::move(make); }

  // Brings the state up to date with the plan: frees plan.finished, drops the
  // KV state of plan.preempted, then for each of plan.seqs creates it
  // (setup), starts its KV state over (fresh_kv), applies its table,
  // position, row and slot updates and appends the step's new positions.
  // Errors, for a plan that does not fit what the runner holds (a sequence
  // it does not know, positions or tables that do not add up): the step fails.
  status apply(const step_plan& plan);

  // After the forward pass: samples every sequence of the plan that samples
  // from its last row of `logits` (rows as llama_context::forward lays them
  // out, [rows][n_vocab]) into out.sampled, creating its forks first; then
  // scores the rows of score_from sequences into out.prompt_scores, hands the
  // rows of all_logits sequences to out.prompt_logits (`logits` is left in an
  // unspecified state) and fills out.selector_bytes.
  status sample(const step_plan& plan, std::vector<float>& logits, int n_vocab, step_output& out);

  // A model drafter's next draft for s from a draft pass's logits row, after
  // the step's drafts so far: the argmax for a greedy request (a point mass,
  // verified by accept_point_drafts), else a draw from the draft's
  // distribution, which is kept in s.draft_q for rejection sampling.
  token_id draft_token(sequence& s, std::span<const float> logits, std::span<const token_id> drafts_so_far);

  // The sequence's state, or nullptr.
  sequence* find(seq_id id);
  std::size_t size() const { return seqs_.size(); }

 private:
  status apply_seq(const scheduled_seq& q);
  void start_kv_over(sequence& s);
  sampled_token draw(sequence& s, seq_id id, std::span<const float> logits);
  // The sequence's grammar state, made at its first use; null (the sequence
  // cannot go on) when the runner has no vocabulary or the grammar does not compile.
  grammar::token_matcher* matcher_of(sequence& s);
  // logits with every token outside `mask` at -infinity, in masked_; empty
  // when the mask allows none.
  std::span<const float> masked(const grammar::token_mask& mask, std::span<const float> logits);
  // The token a sequence whose grammar allows nothing ends with (grammar_end set).
  sampled_token grammar_end(sequence& s, seq_id id, std::span<const float> logits);
  // The prompt tokens q scores, from its rows (the first at `first`), appended to out.prompt_scores.
  void score_prompt(const scheduled_seq& q, const float* first, std::size_t n_vocab, step_output& out);
  // `token` as drawn from logits (its logprobs as the sequence asks), appended to the history.
  sampled_token record(sequence& s, seq_id id, std::span<const float> logits, token_id token);

  runner_shape shape_;
  policy_factory make_policy_;
  std::unordered_map<seq_id, std::unique_ptr<sequence>> seqs_;
  vocabulary_factory make_vocabulary_;
  std::unique_ptr<grammar::grammar_cache> grammars_;  // made with the vocabulary, at the first grammar
  std::vector<float> masked_;                          // [n_vocab] masked()'s row
};

}  // namespace pagoda
