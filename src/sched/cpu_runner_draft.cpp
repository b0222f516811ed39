// Model drafters in the CPU runner (spec/speculative.h): the target itself
// (self, early-exit) and a draft model (draft).
//
// A sequence whose step carries k runner drafts computes, before the step's
// forward pass, k draft passes of one token each: its last token, then each
// draft as it comes; each pass gives the next draft: the argmax, a point
// mass for a greedy request (accept_point_drafts verifies it); a sampled
// request's drafts are drawn from the draft's distribution, kept for
// rejection sampling (runner_state::draft_token, spec/rejection.h).
//
// self, early-exit: the passes run the target through the drafter's view of
// its own KV (a window with sinks, Quest's pages: the sequence's draft_view)
// and its first `layers` layers, with the output head, batched across
// sequences with the same layer count. Their K/V go to the slots the
// verification writes next (the target's own), so they are rewound
// (truncate_block) and the verification writes the target's K/V there: a
// draft's K/V never outlive its step, and what the scheduler commits is the target's.
//
// self:view=int4|int2: the passes run the target over its KV mirror, a
// cheaper copy of its K/V (cpu_runner_mirror.cpp), through their own
// llama_context whose backend is the mirror group: they read the mirror and
// write their K/V into its next slots, which are rewound after drafting the
// same way; the model's groups are not touched until the verification.
//
// draft: the draft model's KV is a KV group of its own (engine_core: same
// slots as the target's groups, its own shape). Its first pass of a step runs
// over EVERY sequence of the plan (prompt chunks, plain decode rows, the
// tokens and drafts of self/early-exit ones, the last token of drafting ones),
// so that every slot a step may commit has the draft's K/V; the verification
// never writes that group. Passes 2..k + 1 draft (the last only writes the
// last draft's K/V: all k may be accepted and committed, hence cached and
// stored). The passes' K/V of accepted drafts stay; the scheduler's
// truncation drops the rest with the target's. A sequence whose draft K/V lag
// its stored slots (draft_kv) catches up from its token history first.
#include <algorithm>
#include <map>

#include "core/assert.h"
#include "model/sampler.h"
#include "sched/cpu_runner.h"

namespace pagoda {

void cpu_runner::set_draft_model(const llama_model& model, kv_backend& kv, int group) {
  draft_ctx_ = std::make_unique<llama_context>(model, kv, ctx_.pool().size());
  draft_group_ = group;
}

status cpu_runner::draft(const step_plan& plan, step_output& out) {
  const bool any = std::any_of(plan.seqs.begin(), plan.seqs.end(), [](const scheduled_seq& q) { return q.runner_drafts; });
  if (!any && !draft_ctx_) return {};
  for (const scheduled_seq& q : plan.seqs) {
    if (!q.runner_drafts) continue;
    const runner_state::sequence* s = state_.find(q.seq);
    if (!s || !s->speculation.model_drafter() || q.tokens.size() != q.draft.size() + 1)
      return error(errc::internal, "sequence {} has runner drafts it cannot make", q.seq.value);
    if (s->speculation.drafter == "draft" && !draft_ctx_)
      return error(errc::internal, "sequence {} drafts with a draft model the runner does not have", q.seq.value);
  }
  if (any) out.drafts.assign(plan.seqs.size(), {});
  // The target's own drafts first: the draft model then writes its K/V for
  // them too (every slot a verification may commit has the draft's K/V).
  if (any) PAGODA_RETURN_IF_ERROR(draft_with_target(plan, out));
  if (draft_ctx_) PAGODA_RETURN_IF_ERROR(draft_with_model(plan, out));
  verify_tokens_.resize(plan.seqs.size());
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    const scheduled_seq& q = plan.seqs[i];
    if (!q.runner_drafts) continue;
    verify_tokens_[i].assign(q.tokens.begin(), q.tokens.begin() + 1);
    verify_tokens_[i].insert(verify_tokens_[i].end(), out.drafts[i].begin(), out.drafts[i].end());
  }
  return {};
}

void cpu_runner::take_drafts(const step_plan& plan, int n_vocab, std::span<const std::size_t> seq_of_row,
                             step_output& out) {
  const auto V = static_cast<std::size_t>(n_vocab);
  for (std::size_t r = 0; r < seq_of_row.size(); ++r) {
    std::vector<token_id>& drafts = out.drafts[seq_of_row[r]];
    runner_state::sequence& s = *state_.find(plan.seqs[seq_of_row[r]].seq);
    drafts.push_back(state_.draft_token(s, std::span<const float>(logits_).subspan(r * V, V), drafts));
  }
}

status cpu_runner::draft_with_model(const step_plan& plan, step_output& out) {
  const int n_vocab = draft_ctx_->model().hparams().n_vocab;
  const auto g = static_cast<std::size_t>(draft_group_);
  std::vector<forward_seq> batch;
  std::vector<std::size_t> rows;  // [batch]: its plan index
  std::vector<std::vector<token_id>> first(plan.seqs.size());  // [plan.seqs]: pass 1's tokens
  std::vector<std::size_t> drafting;
  // Pass 1: every sequence, from its first slot without draft K/V.
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    const scheduled_seq& q = plan.seqs[i];
    runner_state::sequence& s = *state_.find(q.seq);
    const bool drafts = q.runner_drafts && s.speculation.drafter == "draft";
    // Known tokens: all of them, the target's own drafts (self, early-exit)
    // included; a `draft` sequence's last token only (its drafts come next).
    const std::size_t n_known = q.tokens.size() - (drafts ? q.draft.size() : 0);
    // The missing slots' tokens are the history's where slot = position = token index.
    std::int32_t from = s.draft_kv;
    for (std::int32_t j = from; j < q.n_stored; ++j)
      if (s.positions[static_cast<std::size_t>(j)] != j || static_cast<std::size_t>(j) >= s.history.size()) from = q.n_stored;
    std::vector<token_id>& t = first[i];
    t.assign(s.history.begin() + from, s.history.begin() + q.n_stored);
    if (q.runner_drafts && !drafts) {  // the last token, then the drafts the target made
      t.push_back(q.tokens.front());
      t.insert(t.end(), out.drafts[i].begin(), out.drafts[i].end());
    } else {
      t.insert(t.end(), q.tokens.begin(), q.tokens.begin() + static_cast<std::ptrdiff_t>(n_known));
    }
    forward_seq f;
    f.tokens = t;
    f.positions = std::span<const std::int32_t>(s.positions).subspan(static_cast<std::size_t>(from), t.size());
    f.n_stored = from;
    f.stored_positions = std::span<const std::int32_t>(s.positions).first(static_cast<std::size_t>(from));
    f.blocks = s.tables[g];
    batch.push_back(f);
    rows.push_back(i);
    if (drafts) drafting.push_back(i);
    s.draft_kv = q.n_stored + static_cast<std::int32_t>(n_known);
  }
  PAGODA_RETURN_IF_ERROR(draft_ctx_->forward(batch, logits_));
  {
    // Every sequence has a row; the drafting ones' rows give their first drafts.
    const auto V = static_cast<std::size_t>(n_vocab);
    std::size_t kept = 0;
    for (std::size_t r = 0; r < rows.size(); ++r)
      if (std::binary_search(drafting.begin(), drafting.end(), rows[r])) {
        if (kept != r) std::copy_n(logits_.begin() + static_cast<std::ptrdiff_t>(r * V), V, logits_.begin() + static_cast<std::ptrdiff_t>(kept * V));
        rows[kept++] = rows[r];
      }
    rows.resize(kept);
    take_drafts(plan, n_vocab, rows, out);
  }
  // Passes 2..k + 1: the drafting sequences' newest draft each. Pass k + 1
  // writes the last draft's K/V only (its logits are not used): when every
  // draft is accepted, its slot is committed (and may be cached and stored)
  // with the rest.
  std::vector<std::size_t> taking;
  for (std::size_t j = 1;; ++j) {
    batch.clear();
    rows.clear();
    taking.clear();
    for (const std::size_t i : drafting) {
      const scheduled_seq& q = plan.seqs[i];
      if (j > q.draft.size()) continue;
      runner_state::sequence& s = *state_.find(q.seq);
      forward_seq f;
      f.tokens = std::span<const token_id>(out.drafts[i]).subspan(j - 1, 1);
      f.positions = std::span<const std::int32_t>(q.positions).subspan(j, 1);
      f.n_stored = q.n_stored + static_cast<int>(j);
      f.stored_positions = std::span<const std::int32_t>(s.positions).first(static_cast<std::size_t>(f.n_stored));
      f.blocks = s.tables[g];
      batch.push_back(f);
      rows.push_back(i);
      s.draft_kv = f.n_stored + 1;
    }
    if (batch.empty()) break;
    PAGODA_RETURN_IF_ERROR(draft_ctx_->forward(batch, logits_));
    // The rows of sequences with drafts still to make give their next one.
    const auto V = static_cast<std::size_t>(n_vocab);
    std::size_t kept = 0;
    for (std::size_t r = 0; r < rows.size(); ++r)
      if (out.drafts[rows[r]].size() < plan.seqs[rows[r]].draft.size()) {
        if (kept != r) std::copy_n(logits_.begin() + static_cast<std::ptrdiff_t>(r * V), V, logits_.begin() + static_cast<std::ptrdiff_t>(kept * V));
        taking.push_back(rows[r]);
        ++kept;
      }
    take_drafts(plan, n_vocab, taking, out);
  }
  return {};
}

status cpu_runner::draft_with_target(const step_plan& plan, step_output& out) {
  // Batched by (reads the mirror, draft layer count (0: all)) -> plan indices.
  std::map<std::pair<bool, int>, std::vector<std::size_t>> batches;
  for (std::size_t i = 0; i < plan.seqs.size(); ++i)
    if (plan.seqs[i].runner_drafts) {
      runner_state::sequence& s = *state_.find(plan.seqs[i].seq);
      if (s.speculation.drafter == "draft") continue;
      const bool mirror = s.speculation.mirror() != nullptr;
      if (mirror && !mirror_ctx_)
        return error(errc::internal, "sequence {} drafts from a KV mirror the runner does not have", plan.seqs[i].seq.value);
      if (mirror) mirror_slots(s, plan.seqs[i].n_stored);  // normally there already (cpu_runner_mirror.cpp)
      batches[{mirror, s.speculation.layers}].push_back(i);
    }
  const int n_vocab = ctx_.model().hparams().n_vocab;
  const std::int32_t bs = kv_.layout().block_size;
  std::vector<forward_seq> batch;
  std::vector<std::vector<std::span<const block_id>>> tables;
  std::vector<std::size_t> rows;
  for (const auto& [key, seqs] : batches) {
    const auto [mirror, layers] = key;
    // The mirror's passes run the model over the mirror group alone (its one
    // table); the others over the model's groups, through the sequence's view.
    llama_context& ctx = mirror ? *mirror_ctx_ : ctx_;
    tables.assign(seqs.size(), {});
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const runner_state::sequence& s = *state_.find(plan.seqs[seqs[b]].seq);
      if (mirror) tables[b].assign(1, s.tables[static_cast<std::size_t>(mirror_group_)]);
      else tables[b].assign(s.tables.begin(), s.tables.end());
    }
    for (std::size_t j = 0;; ++j) {
      batch.clear();
      rows.clear();
      for (std::size_t b = 0; b < seqs.size(); ++b) {
        const scheduled_seq& q = plan.seqs[seqs[b]];
        if (j >= q.draft.size()) continue;
        runner_state::sequence& s = *state_.find(q.seq);
        const std::vector<token_id>& made = out.drafts[seqs[b]];
        forward_seq f;
        f.tokens = j == 0 ? std::span<const token_id>(q.tokens).first(1) : std::span<const token_id>(made).subspan(j - 1, 1);
        f.positions = std::span<const std::int32_t>(q.positions).subspan(j, 1);
        f.n_stored = q.n_stored + static_cast<int>(j);
        f.stored_positions = std::span<const std::int32_t>(s.positions).first(static_cast<std::size_t>(f.n_stored));
        f.blocks = tables[b].front();
        if (!mirror) f.tables = tables[b];
        if (s.n_rows > 0) {  // a per-head KV policy: the rows' own positions (apply() appended the step's)
          f.row_positions = s.rows.data();
          f.row_stride = s.row_stride;
        }
        f.selector = s.draft_view.get();
        batch.push_back(f);
        rows.push_back(seqs[b]);
      }
      if (batch.empty()) break;
      PAGODA_RETURN_IF_ERROR(ctx.forward(batch, logits_, layers));
      take_drafts(plan, n_vocab, rows, out);
    }
    // Rewind what the draft passes wrote (the mirror's slots, or the
    // model's, where the verification then writes the target's K/V).
    for (const std::size_t i : seqs) {
      const scheduled_seq& q = plan.seqs[i];
      runner_state::sequence& s = *state_.find(q.seq);
      const std::int32_t first = q.n_stored / bs, last = (q.n_stored + static_cast<std::int32_t>(q.draft.size()) - 1) / bs;
      for (std::size_t g = 0; g < s.tables.size(); ++g) {
        const bool written = mirror ? static_cast<int>(g) == mirror_group_
                                    : static_cast<int>(g) != draft_group_ && static_cast<int>(g) != mirror_group_;
        if (!written) continue;
        for (std::int32_t b = first; b <= last; ++b)
          kv_.truncate_block(s.tables[g][static_cast<std::size_t>(b)], b == first ? q.n_stored % bs : 0);
      }
      if (s.draft_view) s.draft_view->on_slots_changed(q.n_stored, true);
    }
  }
  return {};
}

}  // namespace pagoda
