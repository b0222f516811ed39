// Model drafters in the CPU runner (spec/speculative.h: self, early-exit).
//
// A sequence whose step carries k runner drafts computes, before the step's
// forward pass, k draft passes of one token each: its last token, then each
// draft as it comes, through the drafter's view of its own KV (a window with
// sinks, Quest's pages: seq's draft_view) and its first `layers` layers, with
// the output head; each pass's argmax is the next draft. Draft passes of all
// such sequences with the same layer count run batched.
//
// Their K/V go to the slots the verification will write (the target's own
// next slots), so they are rewound afterwards (truncate_block) and the
// verification writes the target's K/V there: a draft's K/V never outlive
// its step, and what the scheduler commits is the target's. A draft is a
// point mass (the draft's argmax), so accept_point_drafts verifies it
// exactly, greedy or sampled.
#include <algorithm>
#include <map>

#include "core/assert.h"
#include "model/sampler.h"
#include "sched/cpu_runner.h"

namespace pagoda {

status cpu_runner::draft(const step_plan& plan, step_output& out) {
  std::map<int, std::vector<std::size_t>> by_layers;  // draft layer count (0: all) -> plan indices
  for (std::size_t i = 0; i < plan.seqs.size(); ++i)
    if (plan.seqs[i].runner_drafts) {
      const runner_state::sequence* s = state_.find(plan.seqs[i].seq);
      if (!s || !s->speculation.model_drafter())
        return error(errc::internal, "sequence {} has runner drafts but no model drafter", plan.seqs[i].seq.value);
      by_layers[s->speculation.layers].push_back(i);
    }
  if (by_layers.empty()) return {};
  out.drafts.assign(plan.seqs.size(), {});
  verify_tokens_.resize(plan.seqs.size());
  const int n_vocab = ctx_.model().hparams().n_vocab;
  const std::int32_t bs = kv_.layout().block_size;

  std::vector<forward_seq> batch;
  std::vector<std::vector<std::span<const block_id>>> tables;
  std::vector<std::size_t> in_batch;
  for (const auto& [layers, seqs] : by_layers) {
    tables.assign(seqs.size(), {});
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const runner_state::sequence& s = *state_.find(plan.seqs[seqs[b]].seq);
      tables[b].assign(s.tables.begin(), s.tables.end());
    }
    for (std::size_t j = 0;; ++j) {
      batch.clear();
      in_batch.clear();
      for (std::size_t b = 0; b < seqs.size(); ++b) {
        const scheduled_seq& q = plan.seqs[seqs[b]];
        if (j >= q.draft.size()) continue;
        runner_state::sequence& s = *state_.find(q.seq);
        PAGODA_ASSERT(s.n_rows == 0 && q.tokens.size() == q.draft.size() + 1, "a draft pass with per-row positions or a prompt");
        const std::vector<token_id>& made = out.drafts[seqs[b]];
        forward_seq f;
        f.tokens = j == 0 ? std::span<const token_id>(q.tokens).first(1) : std::span<const token_id>(made).subspan(j - 1, 1);
        f.positions = std::span<const std::int32_t>(q.positions).subspan(j, 1);
        f.n_stored = q.n_stored + static_cast<int>(j);
        f.stored_positions = std::span<const std::int32_t>(s.positions).first(static_cast<std::size_t>(f.n_stored));
        f.blocks = tables[b].front();
        f.tables = tables[b];
        f.selector = s.draft_view.get();
        batch.push_back(f);
        in_batch.push_back(seqs[b]);
      }
      if (batch.empty()) break;
      PAGODA_RETURN_IF_ERROR(ctx_.forward(batch, logits_, layers));
      for (std::size_t r = 0; r < in_batch.size(); ++r)
        out.drafts[in_batch[r]].push_back(
            argmax(std::span<const float>(logits_.data() + r * static_cast<std::size_t>(n_vocab), static_cast<std::size_t>(n_vocab))));
    }
  }

  // Rewind what the draft passes wrote; the verification writes the target's K/V there.
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    const scheduled_seq& q = plan.seqs[i];
    if (!q.runner_drafts) continue;
    runner_state::sequence& s = *state_.find(q.seq);
    const std::int32_t first = q.n_stored / bs, last = (q.n_stored + static_cast<std::int32_t>(q.draft.size()) - 1) / bs;
    for (const std::vector<block_id>& t : s.tables)
      for (std::int32_t b = first; b <= last; ++b)
        kv_.truncate_block(t[static_cast<std::size_t>(b)], b == first ? q.n_stored % bs : 0);
    if (s.draft_view) s.draft_view->on_slots_changed(q.n_stored, true);
    verify_tokens_[i].assign(q.tokens.begin(), q.tokens.begin() + 1);
    verify_tokens_[i].insert(verify_tokens_[i].end(), out.drafts[i].begin(), out.drafts[i].end());
  }
  return {};
}

}  // namespace pagoda
