// The CPU runner: executes step plans with the Llama forward pass over a KV
// backend (kv_storage). The seam a GPU runner would plug into is model_runner
// (step_plan.h); nothing else in the engine knows which runner it has.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "kv/kv_backend.h"
#include "model/llama.h"
#include "sched/step_plan.h"

namespace pagoda {

class cpu_runner final : public model_runner {
 public:
  // REQUIRES: model and kv outlive the runner; kv's layout matches the model.
  cpu_runner(const llama_model& model, kv_backend& kv, int n_threads);

  // The eviction hook (step_plan.h): called for each evicted block, with its
  // bytes, while the plan's ops run, before anything can overwrite it.
  void set_eviction_hook(eviction_hook hook) { on_evict_ = std::move(hook); }
  // The commit hook: called for each block that entered the prefix cache, with
  // its bytes, at the start of the next step (before anything can evict it).
  void set_commit_hook(commit_hook hook) { on_cache_ = std::move(hook); }
  // Where loads read from; nullptr: every load fails (the blocks are computed).
  void set_kv_source(kv_block_source* source) { source_ = source; }
  // [KV class]: layout_fingerprint of the class's layout, the layout hooks
  // name and loads must match (stored_block_ref::layout).
  std::span<const std::uint64_t> class_layouts() const { return class_layouts_; }

  void execute(const step_plan& plan, step_output& out) override;

  const llama_context& context() const { return ctx_; }

 private:
  void apply(const kv_op& op);
  // Block b's bytes, in block_buf_ (valid until the next call).
  std::span<std::byte> read_block(block_id b);
  std::uint64_t layout_of(block_id b) const { return class_layouts_[static_cast<std::size_t>(kv_.block_class(b))]; }

  kv_backend& kv_;
  llama_context ctx_;
  eviction_hook on_evict_;
  commit_hook on_cache_;
  kv_block_source* source_ = nullptr;
  std::vector<std::uint64_t> class_layouts_;  // [class], computed once
  std::vector<std::byte> block_buf_;  // one block's bytes, of the largest class
  std::vector<forward_seq> batch_;
  std::deque<bool> sparse_;  // [plan.seqs]: forward_seq::sparse targets (a deque: addressable bools)
};

}  // namespace pagoda
