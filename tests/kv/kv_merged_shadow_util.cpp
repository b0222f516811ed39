#include <cmath>
#include <vector>

#include "kv/kv_merge.h"
#include "kv_merged_shadow.h"

namespace pagoda::test {
namespace {

constexpr int k_heads = 2, k_dim = 8, k_row = k_heads * k_dim;

// Model layers 0, 1, 2; 1 and 2 share KV layer 1, layer 2 stores merged.
kv_layout merged_layout(std::int32_t block_size, float t, int retain) {
  auto shared = share_kv_layers(kv_layout::uniform(3, k_heads, k_dim, block_size, kv_type::f32, kv_type::f32),
                                std::vector<int>{0, 1, 1}, "minicache:from=1");
  EXPECT_TRUE(shared.ok()) << shared.error().message();
  auto merged = merge_kv_layers(*shared, std::vector<int>{2}, t, retain);
  EXPECT_TRUE(merged.ok()) << merged.error().message();
  return *merged;
}

// Rows of every head of one model layer. The upper layer's direction leaves
// the lower one's by a token-dependent amount, so some tokens diverge far
// (retained) and others little (merged).
void rows(token_id token, std::int32_t position, int layer, float* k, float* v) {
  const float tok = static_cast<float>(token), pos = static_cast<float>(position);
  for (int i = 0; i < k_row; ++i) {
    const float fi = static_cast<float>(i);
    float a_k = std::sin(0.7f * tok + 0.13f * pos + fi) * static_cast<float>(1 + i % 3) + 0.05f;
    float a_v = std::cos(0.3f * tok - 0.11f * pos + fi) + 0.02f;
    if (layer == 0) {
      a_k = std::cos(1.1f * tok + 0.07f * pos + 2.0f * fi);
      a_v = std::sin(0.9f * tok + 0.05f * pos - fi);
    } else if (layer == 2) {  // turned away from layer 1 by (token % 5) steps, and rescaled
      const float turn = 0.35f * static_cast<float>(token % 5) * std::sin(fi + 0.17f * pos);
      a_k = 1.3f * a_k + turn * static_cast<float>(2 - i % 4);
      a_v = 0.8f * a_v - turn;
    }
    k[i] = a_k;
    v[i] = a_v;
  }
}

}  // namespace

merged_shadow::merged_shadow(std::int32_t block_size, std::int32_t n_blocks, int retain)
    : bs_(block_size), t_(0.6f), s_(std::move(*kv_storage::create(merged_layout(block_size, 0.6f, retain), n_blocks))) {}

void merged_shadow::write(block_id b, std::int32_t slot, token_id token, std::int32_t position) {
  float k[3][k_row], v[3][k_row];
  for (int l = 0; l < 3; ++l) rows(token, position, l, k[l], v[l]);
  const block_id table[] = {b};
  s_->write(0, table, slot, 1, k[0], v[0]);
  s_->write(1, table, slot, 1, k[1], v[1]);  // the producer, then its reader merges
  s_->merge_write(1, table, slot, 1, k[2], v[2], k[1], v[1]);
}

void merged_shadow::apply(const kv_op& op) {
  switch (op.kind) {
    case kv_op_kind::copy:
      s_->copy_block(op.src, op.block, op.n_tokens);
      break;
    case kv_op_kind::truncate:
      s_->truncate_block(op.block, op.n_tokens);
      break;
    case kv_op_kind::release:
    case kv_op_kind::evict:
      s_->release_block(op.block);
      break;
    case kv_op_kind::gather:
      s_->gather(*op.gather, nullptr);
      break;
    case kv_op_kind::cache:
      break;
  }
}

::testing::AssertionResult merged_shadow::holds(block_id b, std::span<const token_id> tokens,
                                                std::span<const std::int32_t> positions) {
  const block_id table[] = {b};
  const paged_kv_view k0 = s_->k_view(0, table, bs_), v0 = s_->v_view(0, table, bs_);
  paged_kv_view k1 = s_->k_view(1, table, bs_), v1 = s_->v_view(1, table, bs_);
  s_->attach_merge(1, k1, v1);
  if (k1.merge == nullptr || v1.merge == nullptr) return ::testing::AssertionFailure() << "no side data on the merged layer";
  auto decode = [](const paged_kv_view& view, int head, int slot, float* out) {
    view.codec_of(0)->decode(view.format_of(0), view.shape, view.params_of(0, head), view.tile(0, head), slot, 1, out);
  };
  auto differ = [](const float* x, const float* y) {
    for (int d = 0; d < k_dim; ++d)
      if (x[d] != y[d]) return true;
    return false;
  };
  const int n = static_cast<int>(tokens.size());
  for (int h = 0; h < k_heads; ++h) {
    const kv_merge_ref side = k1.merge_of(0, h);
    int n_entries = 0;
    for (int e = 0; e < side.shape.retain; ++e) {
      if (side.slot(e) < 0) continue;
      ++n_entries;
      for (int f = e + 1; f < side.shape.retain; ++f)
        if (side.slot(f) == side.slot(e))
          return ::testing::AssertionFailure() << "block " << b.value << " head " << h << ": slot " << side.slot(e) << " retained twice";
    }
    if (n_entries > side.shape.retain) return ::testing::AssertionFailure() << "too many retained";
    for (int j = 0; j < n; ++j) {
      float k[3][k_row], v[3][k_row];
      for (int l = 0; l < 3; ++l) rows(tokens[static_cast<std::size_t>(j)], positions[static_cast<std::size_t>(j)], l, k[l], v[l]);
      const std::size_t at = static_cast<std::size_t>(h) * k_dim;
      float got_k[k_dim], got_v[k_dim];
      decode(k0, h, j, got_k);
      decode(v0, h, j, got_v);
      if (differ(got_k, k[0] + at) || differ(got_v, v[0] + at))
        return ::testing::AssertionFailure() << "block " << b.value << " slot " << j << " head " << h << ": layer 0's rows";
      decode(k1, h, j, got_k);
      decode(v1, h, j, got_v);
      int e = -1;
      for (int f = 0; f < side.shape.retain; ++f)
        if (side.slot(f) == j) e = f;
      if (e >= 0) {  // retained: the lower layer's rows stored, the upper one's beside them
        ++n_retained_;
        if (differ(got_k, k[1] + at) || differ(got_v, v[1] + at))
          return ::testing::AssertionFailure() << "block " << b.value << " slot " << j << " head " << h << ": a retained token's stored rows are not layer 1's";
        if (differ(side.k(e), k[2] + at) || differ(side.v(e), v[2] + at))
          return ::testing::AssertionFailure() << "block " << b.value << " slot " << j << " head " << h << ": a retained token's side rows are not layer 2's";
        continue;
      }
      ++n_merged_;
      float want_k[k_dim], want_v[k_dim];
      const float ratio_k = kv_merge_rows(k[1] + at, k[2] + at, k_dim, t_, want_k);
      const float ratio_v = kv_merge_rows(v[1] + at, v[2] + at, k_dim, t_, want_v);
      if (differ(got_k, want_k) || differ(got_v, want_v))
        return ::testing::AssertionFailure() << "block " << b.value << " slot " << j << " head " << h << ": the stored rows are not the merge of token "
                                             << tokens[static_cast<std::size_t>(j)] << " at " << positions[static_cast<std::size_t>(j)];
      if (side.ratio_k()[j] != ratio_k || side.ratio_v()[j] != ratio_v)
        return ::testing::AssertionFailure() << "block " << b.value << " slot " << j << " head " << h << ": ratios " << side.ratio_k()[j] << ", "
                                             << side.ratio_v()[j] << " for " << ratio_k << ", " << ratio_v;
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace pagoda::test
