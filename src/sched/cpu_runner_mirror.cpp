// The KV mirror in the CPU runner (speculative `self:view=int4|int2`,
// docs/speculative.md): a KV group of its own (engine_core) holding the
// model's K/V for every layer in a cheaper type, which the mirror views'
// draft passes read (a quarter or an eighth of the bytes of f16).
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
#include <algorithm>

#include "attention/gather_attention.h"
#include "core/assert.h"
#include "sched/cpu_runner.h"

namespace pagoda {

void cpu_runner::set_kv_mirror(kv_backend& kv, int group) {
  mirror_ctx_ = std::make_unique<llama_context>(ctx_.model(), kv, ctx_.pool().size());
  mirror_kv_ = &kv;
  mirror_group_ = group;
}

void cpu_runner::mirror_slots(runner_state::sequence& s, std::int32_t end) {
  const std::int32_t from = s.mirror_kv;
  if (from >= end) return;
  const kv_layout& l = kv_.layout();
  const int bs = l.block_size, hd = l.head_dim, heads = l.n_kv_heads;
  const auto n = static_cast<std::size_t>(end - from);
  const std::size_t row = static_cast<std::size_t>(heads) * static_cast<std::size_t>(hd);
  mirror_k_.resize(n * row);
  mirror_v_.resize(n * row);
  mirror_row_.resize(static_cast<std::size_t>(bs) * static_cast<std::size_t>(hd));
  const std::span<const block_id> mirror_table = s.tables[static_cast<std::size_t>(mirror_group_)];
  for (int layer = 0; layer < l.n_layers; ++layer) {
    const std::span<const block_id> table = s.tables[static_cast<std::size_t>(kv_.layer_group(layer))];
    const paged_kv_view views[2] = {kv_.k_view(layer, table, end), kv_.v_view(layer, table, end)};
    std::vector<float>* outs[2] = {&mirror_k_, &mirror_v_};
    for (int kv = 0; kv < 2; ++kv)
      for (std::int32_t at = from; at < end;) {
        const int run = std::min(end - at, bs - at % bs);  // one block at a time (decode_kv_rows)
        for (int h = 0; h < heads; ++h) {
          decode_kv_rows(views[kv], h, at, run, mirror_row_.data());
          for (int t = 0; t < run; ++t)
            std::copy_n(mirror_row_.data() + static_cast<std::size_t>(t) * hd, hd,
                        outs[kv]->data() + static_cast<std::size_t>(at - from + t) * row + static_cast<std::size_t>(h) * hd);
        }
        at += run;
      }
    mirror_kv_->write(layer, mirror_table, from, static_cast<int>(n), mirror_k_.data(), mirror_v_.data());
  }
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
