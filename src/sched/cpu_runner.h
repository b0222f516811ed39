// The CPU runner: executes step plans with the Llama forward pass over a KV
// backend (kv_storage), and samples. The seam a GPU runner would plug into is
// model_runner (step_plan.h); nothing else in the engine knows which runner
// it has. Per-sequence state (tables, positions, selectors, samplers) lives in
// runner_state, keyed by sequence id.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <vector>

#include "kv/kv_backend.h"
#include "model/llama.h"
#include "sched/runner_state.h"
#include "sched/step_plan.h"
#include "spec/kv_mirror.h"

namespace pagoda {

class cpu_runner final : public model_runner {
 public:
  // REQUIRES: model and kv outlive the runner; kv's layout matches the model.
  // make_policy makes the policy objects sparse-read selectors come from
  // (null: make_kv_policy).
  cpu_runner(const llama_model& model, kv_backend& kv, int n_threads, runner_state::policy_factory make_policy = {});

  void set_eviction_hook(eviction_hook hook) override { on_evict_ = std::move(hook); }
  void set_commit_hook(commit_hook hook) override { on_cache_ = std::move(hook); }
  void set_kv_source(kv_block_source* source) override { source_ = source; }

  void execute(const step_plan& plan, step_output& out) override;

  const llama_context& context() const { return ctx_; }

  // The draft model (speculative `draft`) and its KV: KV group `group` of
  // the runner's backend, seen through `kv` (a kv_group_backend). Every step
  // then also runs the draft model over every sequence's tokens, so that its
  // KV holds what the target's does. REQUIRES: both outlive the runner.
  void set_draft_model(const llama_model& model, kv_backend& kv, int group);
  // The KV mirror (speculative `self:view=int4|int2`): KV group `group` of
  // the runner's backend, the model's layers in a cheaper type, seen through
  // `kv` (a kv_group_backend). Every step then copies the slots it wrote
  // into the mirror (cpu_runner_mirror.cpp), and mirror-view drafts read and
  // tentatively write it. REQUIRES: kv outlives the runner.
  void set_kv_mirror(kv_backend& kv, int group);

 private:
  void apply(const kv_op& op);
  // Block b's bytes, in block_buf_ (valid until the next call).
  std::span<std::byte> read_block(block_id b);
  // layout_fingerprint of what b's bytes are (its group's layers in its class's formats).
  std::uint64_t layout_of(block_id b) const;
  void forward(const step_plan& plan, step_output& out);
  // The draft passes of the step's runner_drafts sequences (model drafters,
  // cpu_runner_draft.cpp): fills out.drafts and verify_tokens_, and rewinds
  // the draft passes' K/V writes so that the verification writes its own.
  status draft(const step_plan& plan, step_output& out);
  status draft_with_model(const step_plan& plan, step_output& out);   // the draft model: every sequence, drafts of `draft` ones
  status draft_with_target(const step_plan& plan, step_output& out);  // self, early-exit
  // The mirror (cpu_runner_mirror.cpp): slots [s.mirror_kv, end) of s copied
  // from the model's groups into the mirror group; then s.mirror_kv = end.
  void mirror_slots(runner_state::sequence& s, std::int32_t end);
  // After the step's forward pass: every sequence's written slots.
  void mirror_step(const step_plan& plan);
  // Appends a draft per row of logits_ to out.drafts[seq_of_row[row]] (runner_state::draft_token).
  void take_drafts(const step_plan& plan, int n_vocab, std::span<const std::size_t> seq_of_row, step_output& out);
  // Chunk reuse (cpu_runner_blend.cpp): for each sequence of the plan whose
  // step holds imported chunk tokens, the rows its forward pass recomputes
  // (blend_rows_[i]; empty: every row), after running the layers up to the
  // selection layer over all of them.
  status blend(const step_plan& plan);

  kv_backend& kv_;
  llama_context ctx_;
  runner_state state_;
  eviction_hook on_evict_;
  commit_hook on_cache_;
  kv_block_source* source_ = nullptr;
  mutable std::vector<std::uint64_t> layouts_;  // [group * k_max_kv_classes + class]: fingerprints, 0 until computed
  std::vector<std::byte> block_buf_;  // one block's bytes
  std::vector<forward_seq> batch_;
  std::vector<std::vector<std::span<const block_id>>> tables_;  // [plan.seqs][group]: forward_seq::tables
  std::vector<float> logits_;  // the forward pass's rows
  std::unique_ptr<llama_context> draft_ctx_;  // the draft model's, over its group (set_draft_model)
  int draft_group_ = -1;
  std::unique_ptr<llama_context> mirror_ctx_;  // the model's, over the mirror group (set_kv_mirror)
  kv_backend* mirror_kv_ = nullptr;
  int mirror_group_ = -1;
  kv_copy_scratch mirror_scratch_;
  std::vector<std::span<const block_id>> mirror_tables_;  // a copied sequence's tables, by group
  std::vector<std::vector<token_id>> verify_tokens_;  // [plan.seqs]: a runner_drafts sequence's tokens, drafts filled in
  std::deque<bool> sparse_;  // [plan.seqs]: forward_seq::sparse targets (a deque: addressable bools)
  std::vector<std::vector<std::int32_t>> blend_rows_;  // [plan.seqs]: rows recomputed (blend()); empty: all
  std::vector<std::vector<token_id>> blend_tokens_;    // [plan.seqs]: their tokens
  std::vector<std::vector<std::int32_t>> blend_slots_; // [plan.seqs]: their slots
  std::vector<float> blend_before_, blend_after_;      // K/V at the selection layer, imported and in context
};

}  // namespace pagoda
