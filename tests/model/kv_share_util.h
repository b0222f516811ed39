// Cross-layer KV sharing tests' common run (kv_share_test.cpp,
// kv_merge_model_test.cpp): a fixed prompt through a KV backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "kv/kv_backend.h"
#include "model/llama.h"

namespace pagoda::test {

// A KV backend that hands every call to `inner`: the sharing references
// (kv_share_test.cpp, kv_merge_model_test.cpp) override write() only.
class forwarding_backend : public kv_backend {
 public:
  explicit forwarding_backend(kv_backend& inner) : inner_(inner) {}
  const kv_layout& layout() const override { return inner_.layout(); }
  std::int64_t n_blocks() const override { return inner_.n_blocks(); }
  paged_kv_view k_view(int layer, std::span<const block_id> blocks, int n_slots) const override {
    return inner_.k_view(layer, blocks, n_slots);
  }
  paged_kv_view v_view(int layer, std::span<const block_id> blocks, int n_slots) const override {
    return inner_.v_view(layer, blocks, n_slots);
  }
  void copy_block(block_id src, block_id dst, int n_tokens) override { inner_.copy_block(src, dst, n_tokens); }
  void truncate_block(block_id b, int n_tokens) override { inner_.truncate_block(b, n_tokens); }
  void release_block(block_id b) override { inner_.release_block(b); }
  void read_block(block_id b, std::span<std::byte> out) const override { inner_.read_block(b, out); }
  status write_block(block_id b, std::span<const std::byte> in) override { return inner_.write_block(b, in); }
  std::optional<key_summary> key_summary_of(block_id b, int layer, int head) const override {
    return inner_.key_summary_of(b, layer, head);
  }
  void gather(const kv_gather& g, const key_rotation& rotate) override { inner_.gather(g, rotate); }

 protected:
  kv_backend& inner_;
};

// Every row's logits of a prompt of 40 tokens computed in a chunk of 24 and
// then 16 one-token steps, through `kv`.
inline std::vector<float> logits_through(const llama_model& m, kv_backend& kv) {
  llama_context ctx(m, kv, 1);
  std::vector<token_id> tokens;
  for (int i = 0; i < 40; ++i) tokens.push_back(static_cast<token_id>(3 + (i * 37) % (m.hparams().n_vocab - 3)));
  std::vector<block_id> table;
  for (int b = 0; b < 4; ++b) table.push_back(block_id(b));
  std::vector<float> all, logits;
  for (int at = 0; at < 40;) {
    const int n = at == 0 ? 24 : 1;
    forward_seq s;
    s.tokens = std::span<const token_id>(tokens).subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(n));
    s.n_stored = at;
    s.blocks = table;
    s.all_logits = true;
    const status st = ctx.forward({&s, 1}, logits);
    EXPECT_TRUE(st.ok()) << st.message();
    all.insert(all.end(), logits.begin(), logits.end());
    at += n;
  }
  return all;
}

// The largest absolute difference of two runs' logits.
inline double max_logit_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) worst = std::max(worst, std::abs(double(a[i]) - b[i]));
  return worst;
}

}  // namespace pagoda::test
