// Chunk reuse in the runner (CacheBlend; scheduler_chunks.cpp, step_plan.h
// scheduled_seq::reused). A step over prompt tokens some of which hold K/V
// imported from chunks computed alone recomputes only some of them:
//   - every token that is not imported, and the step's last (its logits);
//   - of the imported ones, the `recompute` fraction whose K and V deviate
//     most from their values in context at the selection layer. To know
//     that deviation, the layers before it run over every token of the step
//     first, and the selection layer computes only its K/V (a forward pass
//     of those layers alone, kv_only), which also leaves the K/V of those
//     layers exact for every token;
// then the step's forward pass runs those tokens in place through every
// layer (forward_seq::slots): each reads the imported K/V of the tokens not
// recomputed and the recomputed K/V of those before it.
//
// recompute >= 1 recomputes every token (a plain prefill of the step, the
// imports overwritten); recompute <= 0 skips the selection pass.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/assert.h"
#include "sched/cpu_runner.h"

namespace pagoda {

namespace {

// The model layer whose K/V deviation selects the tokens recomputed:
// CacheBlend's choice, the second layer (the first's K/V hardly depend on
// context). Its K/V layer is read.
int selection_layer(int n_layers) { return std::min(1, n_layers - 1); }

// K then V of head 0.. of the given slots of KV layer `layer`: out[slot][2][n_kv_heads][head_dim].
void read_slots(const kv_backend& kv, int layer, std::span<const block_id> table, int n_slots,
                std::span<const std::int32_t> slots, std::vector<float>& out) {
  const kv_layout& lay = kv.layout();
  const int hd = lay.head_dim, nh = lay.n_kv_heads, bs = lay.block_size;
  const std::size_t per_slot = 2 * static_cast<std::size_t>(nh) * hd;
  out.assign(slots.size() * per_slot, 0.0f);
  const paged_kv_view views[2] = {kv.k_view(layer, table, n_slots), kv.v_view(layer, table, n_slots)};
  for (std::size_t i = 0; i < slots.size(); ++i)
    for (int role = 0; role < 2; ++role) {
      const paged_kv_view& v = views[role];
      const int b = slots[i] / bs, t = slots[i] % bs;
      for (int h = 0; h < nh; ++h)
        v.codec_of(b)->decode(v.format_of(b), v.shape, v.params_of(b, h), v.tile(b, h), t, 1,
                              out.data() + i * per_slot + (static_cast<std::size_t>(role) * nh + h) * hd);
    }
}

}  // namespace

status cpu_runner::blend(const step_plan& plan) {
  blend_rows_.resize(plan.seqs.size());
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    const scheduled_seq& q = plan.seqs[i];
    std::vector<std::int32_t>& rows = blend_rows_[i];
    rows.clear();
    if (q.reused.empty() || q.recompute >= 1.0f) continue;  // every row computed
    const int n = static_cast<int>(q.tokens.size());
    if (q.reused.size() != q.tokens.size() || q.every_row())
      return error(errc::internal, "sequence {}: a reused-chunk mask that does not fit its step", q.seq.value);
    runner_state::sequence& s = *state_.find(q.seq);
    std::vector<std::int32_t> imported;  // rows
    for (int j = 0; j < n; ++j)
      if (q.reused[static_cast<std::size_t>(j)] && j != n - 1) imported.push_back(j);
      else rows.push_back(j);
    const int n_pick = static_cast<int>(std::ceil(static_cast<double>(q.recompute) * static_cast<double>(imported.size())));
    if (n_pick > 0) {
      // The deviation: imported K/V at the selection layer against their values in context.
      const int model_layer = selection_layer(ctx_.model().hparams().n_layer);
      const int kvl = kv_.layout().kv_layer_of(model_layer);
      const std::span<const block_id> table = s.tables.front();
      const int n_slots = q.n_stored + n;
      std::vector<std::int32_t> slots(imported.size());
      for (std::size_t j = 0; j < imported.size(); ++j) slots[j] = q.n_stored + imported[j];
      read_slots(kv_, kvl, table, n_slots, slots, blend_before_);
      forward_seq f;
      f.tokens = q.tokens;
      f.positions = q.positions;
      f.n_stored = q.n_stored;
      f.stored_positions = std::span<const std::int32_t>(s.positions).first(static_cast<std::size_t>(q.n_stored));
      f.blocks = table;
      tables_.resize(1);
      tables_[0].assign(s.tables.begin(), s.tables.end());
      f.tables = tables_[0];
      PAGODA_RETURN_IF_ERROR(ctx_.forward(std::span<const forward_seq>(&f, 1), logits_, model_layer + 1, /*kv_only=*/true));
      read_slots(kv_, kvl, table, n_slots, slots, blend_after_);
      const std::size_t per_slot = blend_before_.size() / std::max<std::size_t>(slots.size(), 1);
      std::vector<double> dev(imported.size(), 0.0);
      for (std::size_t j = 0; j < imported.size(); ++j)
        for (std::size_t e = 0; e < per_slot; ++e) {
          const double d = static_cast<double>(blend_after_[j * per_slot + e]) - blend_before_[j * per_slot + e];
          dev[j] += d * d;
        }
      std::vector<std::size_t> order(imported.size());
      std::iota(order.begin(), order.end(), std::size_t{0});
      // Largest deviation first; ties by row, so that the choice is deterministic.
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return dev[a] > dev[b]; });
      for (int j = 0; j < n_pick && j < static_cast<int>(order.size()); ++j) rows.push_back(imported[order[static_cast<std::size_t>(j)]]);
      std::sort(rows.begin(), rows.end());
    }
    if (static_cast<int>(rows.size()) == n) rows.clear();  // all of them: a plain step
  }
  return {};
}

}  // namespace pagoda
