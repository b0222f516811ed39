#include "sched/cpu_runner.h"

#include <algorithm>

#include "core/assert.h"
#include "store/store_key.h"

namespace pagoda {

cpu_runner::cpu_runner(const llama_model& model, kv_backend& kv, int n_threads) : kv_(kv), ctx_(model, kv, n_threads) {
  std::size_t largest = 0;
  for (int c = 0; c < kv.n_classes(); ++c) {
    class_layouts_.push_back(layout_fingerprint(kv.class_layout(c)));
    largest = std::max(largest, kv.class_layout(c).tile_bytes_per_block());
  }
  block_buf_.resize(largest);
}

std::span<std::byte> cpu_runner::read_block(block_id b) {
  const auto bytes = std::span<std::byte>(block_buf_).first(kv_.block_bytes(b));
  kv_.read_block(b, bytes);
  return bytes;
}

void cpu_runner::apply(const kv_op& op) {
  switch (op.kind) {
    case kv_op_kind::copy: kv_.copy_block(op.src, op.block, op.n_tokens); break;
    case kv_op_kind::truncate: kv_.truncate_block(op.block, op.n_tokens); break;
    case kv_op_kind::release: kv_.release_block(op.block); break;
    case kv_op_kind::bind_window: kv_.bind_window(op.block, op.slot); break;
    // Every KV class's blocks, each named with its class's layout.
    case kv_op_kind::evict:
      if (on_evict_) {
        const auto bytes = read_block(op.block);
        on_evict_(evicted_block{layout_of(op.block), op.key, op.parent, op.tenant, op.tokens, bytes});
      }
      kv_.release_block(op.block);
      break;
    case kv_op_kind::gather:
      kv_.gather(*op.gather, [this](int layer, float* k, int n, const std::int32_t* delta) {
        rotate_keys(ctx_.model().hparams(), layer, k, n, delta);
      });
      break;
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
  out.logits.clear();
  for (const kv_op& op : plan.ops) apply(op);

  out.loaded.assign(plan.loads.size(), 0);
  for (std::size_t i = 0; i < plan.loads.size(); ++i) {
    const block_load& l = plan.loads[i];
    // Bytes of another layout than the block's class would be garbage in it: not read, computed.
    if (!source_ || layout_of(l.block) != l.ref.layout) continue;
    const auto bytes = std::span<std::byte>(block_buf_).first(kv_.block_bytes(l.block));
    const int tier = source_->read(l.tenant, l.ref, bytes);
    if (tier < 0 || tier >= k_max_source_tiers) continue;
    if (kv_.write_block(l.block, bytes).ok()) out.loaded[i] = static_cast<std::uint8_t>(1 + tier);
  }

  if (plan.seqs.empty()) return;
  batch_.clear();
  out.stats.resize(plan.seqs.size());
  sparse_.assign(plan.seqs.size(), 0);
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    const scheduled_seq& q = plan.seqs[i];
    forward_seq f;
    f.tokens = q.tokens;
    f.positions = q.positions;
    f.n_stored = q.n_stored;
    f.stored_positions = q.stored_positions;
    f.blocks = q.blocks;
    f.all_logits = q.all_logits;
    if (q.stats_window >= 0) {
      f.stats = &out.stats[i];
      f.stats_window = q.stats_window;
    }
    f.row_positions = q.row_positions;
    f.row_stride = q.row_stride;
    f.selector = q.selector;
    f.sparse = &sparse_[i];
    batch_.push_back(f);
  }
  out.result = ctx_.forward(batch_, out.logits);
  out.sparse.assign(sparse_.begin(), sparse_.end());
}

}  // namespace pagoda
