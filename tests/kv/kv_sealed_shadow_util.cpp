#include <cmath>

#include "kv_sealed_shadow.h"

namespace pagoda::test {
namespace {

constexpr int k_dim = 8;  // one layer, one KV head

kv_layout shadow_layout(std::int32_t block_size) {
  return kv_layout::uniform(1, 1, k_dim, block_size, kv_type::int4, kv_type::int4);
}

}  // namespace

sealed_shadow::sealed_shadow(std::int32_t block_size, std::int32_t n_blocks)
    : bs_(block_size),
      s_(std::move(*kv_storage::create(shadow_layout(block_size), n_blocks, n_blocks))),
      plain_(std::move(*kv_storage::create(shadow_layout(block_size), 1, 1))),
      written_(static_cast<std::size_t>(n_blocks), 0),
      exact_(static_cast<std::size_t>(n_blocks), 1),
      held_(static_cast<std::size_t>(n_blocks), 0),
      rolled_back_(static_cast<std::size_t>(n_blocks), 0) {}

void sealed_shadow::rows(token_id token, std::int32_t position, float* k, float* v) {
  for (int d = 0; d < k_dim; ++d) {
    k[d] = std::sin(0.7f * static_cast<float>(token) + 0.13f * static_cast<float>(position) + static_cast<float>(d)) *
           static_cast<float>(1 + d % 3);
    v[d] = std::cos(0.3f * static_cast<float>(token) - 0.11f * static_cast<float>(position) + static_cast<float>(d));
  }
}

void sealed_shadow::write(block_id b, std::int32_t slot, token_id token, std::int32_t position) {
  const auto i = static_cast<std::size_t>(b.value);
  if (slot == 0) {  // a new owner's first write
    exact_[i] = 1;
    rolled_back_[i] = 0;
  } else if (slot < written_[i]) {
    // Rewritten below its fill without a truncate op: kv_manager::shrink
    // leaves a shared last block to its other holders, and when they are
    // gone before the next allocate, it is written in place. Rewound here
    // as a truncate would (from the codes when it was sealed).
    if (written_[i] == bs_) exact_[i] = 0;
    s_->truncate_block(b, slot);
  }
  float k[k_dim], v[k_dim];
  rows(token, position, k, v);
  const block_id table[] = {b};
  s_->write(0, table, slot, 1, k, v);
  written_[i] = slot + 1;
}

void sealed_shadow::hold(block_id b) {
  held_[static_cast<std::size_t>(b.value)] = 1;
  s_->hold_staging(b);
}

void sealed_shadow::end_holds() {
  std::fill(held_.begin(), held_.end(), 0);
  s_->end_holds();
}

void sealed_shadow::apply(const kv_op& op) {
  const auto i = static_cast<std::size_t>(op.block.value);
  switch (op.kind) {
    case kv_op_kind::copy: {
      const auto src = static_cast<std::size_t>(op.src.value);
      const bool reopened = op.n_tokens < bs_ && written_[src] == bs_ && !held_[src];
      exact_[i] = exact_[src] && !reopened;
      rolled_back_[i] = rolled_back_[src];
      written_[i] = op.n_tokens;
      s_->copy_block(op.src, op.block, op.n_tokens);
      break;
    }
    case kv_op_kind::truncate:
      if (written_[i] == bs_) {
        if (held_[i]) rolled_back_[i] = 1;
        else exact_[i] = 0;
      }
      held_[i] = 0;
      written_[i] = op.n_tokens;
      s_->truncate_block(op.block, op.n_tokens);
      break;
    case kv_op_kind::release:
    case kv_op_kind::evict:
      written_[i] = 0;
      exact_[i] = 1;
      held_[i] = 0;
      rolled_back_[i] = 0;
      s_->release_block(op.block);
      break;
    case kv_op_kind::gather:
      ADD_FAILURE() << "a gather beside the sealed shadow";
      break;
    case kv_op_kind::cache:
      break;
  }
}

::testing::AssertionResult sealed_shadow::holds_plain_bytes(block_id b, std::span<const token_id> tokens,
                                                            std::span<const std::int32_t> positions) {
  const auto i = static_cast<std::size_t>(b.value);
  if (written_[i] != bs_) return ::testing::AssertionFailure() << "block " << b.value << " is not full";
  if (!exact_[i]) return ::testing::AssertionSuccess();
  std::vector<float> k(static_cast<std::size_t>(bs_) * k_dim), v(k.size());
  for (std::int32_t j = 0; j < bs_; ++j)
    rows(tokens[static_cast<std::size_t>(j)], positions[static_cast<std::size_t>(j)], &k[static_cast<std::size_t>(j) * k_dim],
         &v[static_cast<std::size_t>(j) * k_dim]);
  const block_id one[] = {block_id(0)};
  plain_->write(0, one, 0, bs_, k.data(), v.data());
  std::vector<std::byte> want(plain_->block_bytes(block_id(0))), got(s_->block_bytes(b));
  plain_->read_block(block_id(0), want);
  s_->read_block(b, got);
  ++n_compared_;
  if (rolled_back_[i]) ++n_rollbacks_compared_;
  if (want != got)
    return ::testing::AssertionFailure() << "block " << b.value << " holds other bytes than plain decoding stores"
                                         << (rolled_back_[i] ? " (after a rollback inside it)" : "");
  return ::testing::AssertionSuccess();
}

}  // namespace pagoda::test
