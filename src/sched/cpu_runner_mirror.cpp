// The KV mirror in the CPU runner (speculative `self:view=int4|int2`,
// docs/speculative.md): a KV group of its own (engine_core) holding the
// model's K/V for every layer in a cheaper type, which the mirror views'
// draft passes read (at head_dim 128, 0.32 or 0.20 of f16's bytes).
//
// The model's forward pass never writes the mirror. Instead, after every
// step's forward pass, the slots it wrote are decoded from the model's
// groups (through their views, as attention reads them) and written into the
// mirror through its backend, which encodes them in its type. So every slot
// the step may commit (and the prefix index and the store then see) has its
// mirror K/V by the end of the step, as with a draft model's group: a mirror
// block is cached, shared, stored and loaded like any block of the pool.
// The verification's tentative slots are copied too, into held blocks, and
// the scheduler's truncation rolls them back in the mirror with the rest.
//
// runner_state::sequence::mirror_kv is how far the mirror holds the model's
// K/V; a truncation or a rollback cuts it, a fresh KV state (a preemption, a
// prefix hit) starts it at the stored slots, whose mirror blocks came with
// them. A sequence that lags (a step that failed after its forward pass)
// catches up from there, before its drafts and after the next forward pass.
#include "core/assert.h"
#include "sched/cpu_runner.h"

namespace pagoda {

void cpu_runner::set_kv_mirror(kv_backend& kv, int group) {
  mirror_ctx_ = std::make_unique<llama_context>(ctx_.model(), kv, ctx_.pool().size());
  mirror_kv_ = &kv;
  mirror_group_ = group;
}

void cpu_runner::mirror_slots(runner_state::sequence& s, std::int32_t end) {
  if (s.mirror_kv >= end) return;
  mirror_tables_.assign(s.tables.begin(), s.tables.end());
  copy_kv_slots(kv_, mirror_tables_, *mirror_kv_, s.tables[static_cast<std::size_t>(mirror_group_)], s.mirror_kv, end,
                mirror_scratch_);
  s.mirror_kv = end;
}

void cpu_runner::mirror_step(const step_plan& plan) {
  if (!mirror_kv_) return;
  for (const scheduled_seq& q : plan.seqs) {
    runner_state::sequence& s = *state_.find(q.seq);  // apply() made it
    PAGODA_ASSERT(static_cast<std::size_t>(mirror_group_) < s.tables.size(), "sequence {} has no mirror table", q.seq.value);
    mirror_slots(s, q.n_stored + static_cast<std::int32_t>(q.tokens.size()));
  }
}

}  // namespace pagoda
