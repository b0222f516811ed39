#include "sched/cpu_runner.h"

#include <algorithm>
#include <chrono>

#include "core/assert.h"
#include "policy/kv_policy.h"
#include "store/store_key.h"

namespace pagoda {

namespace {

runner_shape shape_of(const llama_model& model, const kv_backend& kv) {
  const llama_hparams& hp = model.hparams();
  return {kv.layout().n_layers, hp.n_head_kv, hp.head_dim, kv.layout().block_size};  // KV layers (shared ones once)
}

// Drafts' K/V are tentative (step_plan.h): the blocks of their slots are
// held, so a rollback inside a sealed block restores its exact staging
// (kv_backend.h, "Tentative slots").
void hold_drafts(kv_backend& kv, runner_state& state, const step_plan& plan) {
  const int bs = kv.layout().block_size;
  for (const scheduled_seq& q : plan.seqs) {
    if (q.draft.empty()) continue;
    // After the last token; from it for a model drafter, whose draft passes
    // write its slot too and are rewound to before it (cpu_runner_draft.cpp).
    const int first = q.n_stored + (q.runner_drafts ? 0 : 1), end = q.n_stored + static_cast<int>(q.tokens.size());
    for (const std::vector<block_id>& table : state.find(q.seq)->tables)
      for (int b = first / bs; b <= (end - 1) / bs && b < static_cast<int>(table.size()); ++b)
        if (table[static_cast<std::size_t>(b)].valid()) kv.hold_staging(table[static_cast<std::size_t>(b)]);
  }
}

}  // namespace

cpu_runner::cpu_runner(const llama_model& model, kv_backend& kv, int n_threads,
                       runner_state::policy_factory make_policy)
    : kv_(kv),
      ctx_(model, kv, n_threads),
      state_(shape_of(model, kv), make_policy ? std::move(make_policy) : runner_state::policy_factory(make_kv_policy)) {
  state_.set_vocabulary([&model] { return grammar_vocabulary(model.vocab()); });
}

std::uint64_t cpu_runner::layout_of(block_id b) const {
  // One fingerprint per (group, class), computed once.
  const std::size_t at = static_cast<std::size_t>(kv_.group_of(b)) * k_max_kv_classes + static_cast<std::size_t>(kv_.block_class(b));
  if (layouts_.size() <= at) layouts_.resize(at + 1, 0);
  if (layouts_[at] == 0) layouts_[at] = layout_fingerprint(kv_.block_layout(b));
  return layouts_[at];
}

std::span<std::byte> cpu_runner::read_block(block_id b) {
  block_buf_.resize(kv_.block_bytes(b));
  kv_.read_block(b, block_buf_);
  return block_buf_;
}

void cpu_runner::apply(const kv_op& op) {
  switch (op.kind) {
    case kv_op_kind::copy: kv_.copy_block(op.src, op.block, op.n_tokens); break;
    case kv_op_kind::truncate: kv_.truncate_block(op.block, op.n_tokens); break;
    case kv_op_kind::release: kv_.release_block(op.block); break;
    // Every group's and class's blocks, each named with its layout.
    case kv_op_kind::evict:
      if (on_evict_) {
        const auto bytes = read_block(op.block);
        on_evict_(evicted_block{layout_of(op.block), op.key, op.parent, op.tenant, op.tokens, bytes});
      }
      kv_.release_block(op.block);
      break;
    case kv_op_kind::gather: {
      // A draft model's group holds its own layers and heads: a per-head
      // compaction's rows (the target's) do not number them, so it keeps row
      // 0's slots in every row (its KV only drafts), and it rotates with its own RoPE.
      const bool draft = op.gather->group == draft_group_;
      kv_gather first_row;
      if (draft && op.gather->n_rows > 1) {
        first_row = *op.gather;
        first_row.n_rows = 1;
        first_row.sources.resize(static_cast<std::size_t>(first_row.n));
        first_row.folded.resize(static_cast<std::size_t>(first_row.n_folded));
        first_row.anchors.resize(static_cast<std::size_t>(first_row.anchors_per_row));
      }
      kv_.gather(draft && op.gather->n_rows > 1 ? first_row : *op.gather,
                 [this, draft](int layer, float* k, int n, const std::int32_t* delta) {
                   // `layer` is a KV layer: its keys carry its producer's RoPE.
                   const llama_context& c = draft ? *draft_ctx_ : ctx_;
                   rotate_keys(c.model().hparams(), c.kv().layout().kv_producer(layer), k, n, delta);
                 });
      break;
    }
    case kv_op_kind::cache:
      if (on_cache_) {
        const auto bytes = read_block(op.block);
        on_cache_(cached_block{layout_of(op.block), op.key, op.parent, op.tenant, op.tokens, bytes});
      }
      break;
  }
}

void cpu_runner::execute(const step_plan& plan, step_output& out) {
  out.result = ok_status();
  for (const kv_op& op : plan.ops) apply(op);
  kv_.end_holds();  // the last step's drafts are settled: update() rolled the rejected back in these ops

  out.loaded.assign(plan.loads.size(), 0);
  for (std::size_t i = 0; i < plan.loads.size(); ++i) {
    const block_load& l = plan.loads[i];
    // Bytes of another layout than the block's would be garbage in it: not read, computed.
    if (!source_ || layout_of(l.block) != l.ref.layout) continue;
    block_buf_.resize(kv_.block_bytes(l.block));
    const auto bytes = std::span<std::byte>(block_buf_);
    const int tier = source_->read(l.tenant, l.ref, bytes);
    if (tier < 0 || tier >= k_max_source_tiers) continue;
    if (kv_.write_block(l.block, bytes).ok()) out.loaded[i] = static_cast<std::uint8_t>(1 + tier);
  }

  out.result = state_.apply(plan);
  if (out.result.ok()) hold_drafts(kv_, state_, plan);
  out.drafts.clear();
  using clock = std::chrono::steady_clock;
  const clock::time_point t0 = clock::now();
  if (out.result.ok() && !plan.seqs.empty()) out.result = draft(plan, out);
  const clock::time_point t1 = clock::now();
  // The target's own draft passes were rewound (truncate_block), which ends
  // their blocks' holds: held again for the verification's tentative slots.
  if (out.result.ok() && !out.drafts.empty()) hold_drafts(kv_, state_, plan);
  if (out.result.ok() && !plan.seqs.empty()) out.result = blend(plan);
  if (out.result.ok() && !plan.seqs.empty()) forward(plan, out);
  if (out.result.ok()) mirror_step(plan);  // the KV mirror takes the slots the step wrote (cpu_runner_mirror.cpp)
  out.draft_seconds = out.drafts.empty() && !draft_ctx_ ? 0.0 : std::chrono::duration<double>(t1 - t0).count();
  out.forward_seconds = std::chrono::duration<double>(clock::now() - t1).count();
}

void cpu_runner::forward(const step_plan& plan, step_output& out) {
  batch_.clear();
  tables_.resize(plan.seqs.size());
  out.stats.resize(plan.seqs.size());
  sparse_.assign(plan.seqs.size(), 0);
  out.reads.assign(plan.seqs.size(), kv_read_counts{});
  blend_tokens_.resize(plan.seqs.size());
  blend_slots_.resize(plan.seqs.size());
  out.reused_rows.clear();
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    const scheduled_seq& q = plan.seqs[i];
    runner_state::sequence& s = *state_.find(q.seq);  // apply() made it
    forward_seq f;
    f.tokens = q.runner_drafts ? std::span<const token_id>(verify_tokens_[i]) : std::span<const token_id>(q.tokens);
    f.positions = q.positions;
    f.n_stored = q.n_stored;
    f.stored_positions = std::span<const std::int32_t>(s.positions).first(static_cast<std::size_t>(q.n_stored));
    tables_[i].assign(s.tables.begin(), s.tables.end());
    f.blocks = tables_[i].front();
    f.tables = tables_[i];
    f.all_logits = q.every_row();  // a verification reads every row, so does scoring
    f.rows_as_steps = !q.draft.empty();                // and each row must be plain decoding's
    if (q.stats_window >= 0) {
      f.stats = &out.stats[i];
      f.stats_window = q.stats_window;
    }
    if (s.n_rows > 0) {
      f.row_positions = s.rows.data();
      f.row_stride = s.row_stride;
    }
    f.selector = s.selector.get();
    if (!q.embedded.empty()) {  // an image's rows stand in for these tokens' embeddings
      f.embeddings = q.embeddings;
      f.embedded = q.embedded;
    }
    f.see_until = q.see_until;  // bidirectional image spans
    f.sparse = &sparse_[i];
    f.reads = &out.reads[i];
    if (i < blend_rows_.size() && !blend_rows_[i].empty()) {
      // Chunk reuse: only these rows, in place; the others keep their imported K/V.
      const std::vector<std::int32_t>& rows = blend_rows_[i];
      blend_tokens_[i].clear();
      blend_slots_[i].clear();
      for (const std::int32_t r : rows) {
        blend_tokens_[i].push_back(q.tokens[static_cast<std::size_t>(r)]);
        blend_slots_[i].push_back(q.n_stored + r);
      }
      f.tokens = blend_tokens_[i];
      f.slots = blend_slots_[i];
      f.positions = {};
      f.n_stored = q.n_stored + static_cast<int>(q.tokens.size());
      f.stored_positions = std::span<const std::int32_t>(s.positions).first(static_cast<std::size_t>(f.n_stored));
      if (out.reused_rows.empty()) out.reused_rows.assign(plan.seqs.size(), 0);
      out.reused_rows[i] = static_cast<std::int32_t>(q.tokens.size() - rows.size());
    }
    batch_.push_back(f);
  }
  out.result = ctx_.forward(batch_, logits_);
  out.sparse.assign(sparse_.begin(), sparse_.end());
  if (out.result.ok()) out.result = state_.sample(plan, logits_, ctx_.model().hparams().n_vocab, out);
}

}  // namespace pagoda
