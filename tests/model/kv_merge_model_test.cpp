// MiniCache (kv/kv_merge.h, --kv-share minicache) in the forward pass, the
// KV arena and the attention kernels, against a reference that has none of
// that machinery: an unshared storage where a merged pair's lower layer
// holds the merged rows and its upper layer the rows it restores from them
// (ratio times the merged row, or its own where retained), read by a plain
// forward pass. And retaining every token equals the unshared model.
#include <cmath>
#include <map>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/stories.h"
#include "kv/kv_storage.h"
#include "model/kv_share_util.h"
#include "model/llama.h"

namespace pagoda {
namespace {

using test::logits_through;

// Plays MiniCache on an unshared storage. A write to a pair's lower layer
// stores its rows and keeps them; a write to its upper layer merges each
// token (kv_merge_token, the same rule the arena follows) and writes the
// merged rows to the lower layer and the restored ones to the upper layer.
class merging_backend final : public test::forwarding_backend {
 public:
  merging_backend(kv_backend& inner, std::vector<int> readers, float t, int retain)
      : forwarding_backend(inner), readers_(std::move(readers)), t_(t), shape_{inner.layout().block_size, inner.layout().head_dim, retain} {}
  void write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k, const float* v) override {
    const int H = layout().n_kv_heads, hd = layout().head_dim, bs = layout().block_size;
    const std::size_t row = static_cast<std::size_t>(H) * hd;
    if (!is_reader(layer)) {
      inner_.write(layer, blocks, slot, n, k, v);
      if (is_reader(layer + 1))
        for (int i = 0; i < n; ++i) {
          lower_k_[{layer, slot + i}].assign(k + i * row, k + (i + 1) * row);
          lower_v_[{layer, slot + i}].assign(v + i * row, v + (i + 1) * row);
        }
      return;
    }
    std::vector<float> sk(3 * hd), sv(3 * hd);
    for (int i = 0; i < n; ++i) {
      const int p = slot + i, b = blocks[static_cast<std::size_t>(p / bs)].value;
      std::vector<float> own_k(k + i * row, k + (i + 1) * row), own_v(v + i * row, v + (i + 1) * row);
      const int lower = layer - 1;
      const std::vector<float> a_k = lower_k_[{lower, p}], a_v = lower_v_[{lower, p}];
      std::vector<int> touched = {p};
      for (int h = 0; h < H; ++h) {
        std::vector<float>& side = side_[{layer, b, h}];
        side.resize(shape_.head_floats(), 0.0f);
        const kv_merge_head mh{side.data(), shape_};
        kv_merge_write writes[2];
        const std::size_t at = static_cast<std::size_t>(h) * hd;
        kv_merge_token(mh, p % bs, {a_k.data() + at, a_v.data() + at, own_k.data() + at, own_v.data() + at}, t_,
                       sk.data(), sv.data(), writes, [&](int s, float* ko, float* vo) {
                         const int q = (p / bs) * bs + s;
                         std::copy_n(lower_k_[{lower, q}].data() + at, hd, ko);
                         std::copy_n(lower_v_[{lower, q}].data() + at, hd, vo);
                       });
        for (const kv_merge_write& w : writes) {
          if (w.slot < 0) continue;
          const int q = (p / bs) * bs + w.slot;
          std::copy_n(w.k, hd, lower_k_[{lower, q}].data() + at);
          std::copy_n(w.v, hd, lower_v_[{lower, q}].data() + at);
          if (q != p) touched.push_back(q);
        }
      }
      for (const int q : touched) {  // both layers' rows of every slot that changed
        std::vector<float> up_k(row), up_v(row);
        for (int h = 0; h < H; ++h) {
          const kv_merge_head mh{side_[{layer, b, h}].data(), shape_};
          const std::size_t at = static_cast<std::size_t>(h) * hd;
          const int e = mh.find(q % bs);
          for (int d = 0; d < hd; ++d) {
            up_k[at + d] = e >= 0 ? mh.k(e)[d] : mh.ratio_k()[q % bs] * lower_k_[{lower, q}][at + d];
            up_v[at + d] = e >= 0 ? mh.v(e)[d] : mh.ratio_v()[q % bs] * lower_v_[{lower, q}][at + d];
          }
        }
        inner_.write(lower, blocks, q, 1, lower_k_[{lower, q}].data(), lower_v_[{lower, q}].data());
        inner_.write(layer, blocks, q, 1, up_k.data(), up_v.data());
      }
    }
  }

 private:
  bool is_reader(int layer) const { return std::find(readers_.begin(), readers_.end(), layer) != readers_.end(); }
  std::vector<int> readers_;
  float t_;
  kv_merge_shape shape_;
  std::map<std::pair<int, int>, std::vector<float>> lower_k_, lower_v_;  // [(lower layer, slot)]: its rows as stored
  std::map<std::tuple<int, int, int>, std::vector<float>> side_;        // [(upper layer, block, head)]
};

struct merged_setup {
  kv_layout flat, merged;
  std::vector<int> readers;
};

merged_setup minicache(const llama_model& m, int from, float t, int retain, kv_type type = kv_type::f32) {
  const llama_hparams& hp = m.hparams();
  merged_setup s;
  s.flat = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, type, type);
  std::vector<int> source(static_cast<std::size_t>(hp.n_layer));
  for (int l = 0; l < hp.n_layer; ++l) {
    const bool reader = l >= from && (l - from) % 2 == 1;
    source[static_cast<std::size_t>(l)] = reader ? l - 1 : l;
    if (reader) s.readers.push_back(l);
  }
  auto shared = share_kv_layers(s.flat, source, "minicache");
  EXPECT_TRUE(shared.ok()) << shared.error().message();
  auto merged = merge_kv_layers(*shared, s.readers, t, retain);
  EXPECT_TRUE(merged.ok()) << merged.error().message();
  s.merged = *merged;
  return s;
}

TEST(kv_merge_model, stories_matches_the_merging_reference_from_every_layer) {
  const llama_model& m = test::stories();
  const int n = m.hparams().n_layer;
  for (int from = 0; from < n - 1; ++from)
    for (int retain : {0, 1, 5}) {
      const merged_setup s = minicache(m, from, 0.6f, retain);
      auto merged = *kv_storage::create(s.merged, 4);
      auto plain = *kv_storage::create(s.flat, 4);
      merging_backend reference(*plain, s.readers, 0.6f, retain);
      const std::vector<float> a = logits_through(m, *merged), b = logits_through(m, reference);
      EXPECT_LE(test::max_logit_diff(a, b), 2e-5) << "from=" << from << " retain=" << retain;
      // And merging changes the logits (the comparison checks something).
      auto u = *kv_storage::create(s.flat, 4);
      EXPECT_GT(test::max_logit_diff(a, logits_through(m, *u)), 1e-3) << "from=" << from << " retain=" << retain;
    }
}

// Every token retained: the lower layer stores its own rows and the upper
// layer reads its own, so the model computes what it computes unshared.
TEST(kv_merge_model, retaining_every_token_is_the_unshared_model) {
  const llama_model& m = test::stories();
  for (int from : {0, 1, 3}) {
    const merged_setup s = minicache(m, from, 0.6f, 16);
    auto merged = *kv_storage::create(s.merged, 4);
    auto plain = *kv_storage::create(s.flat, 4);
    EXPECT_LE(test::max_logit_diff(logits_through(m, *merged), logits_through(m, *plain)), 2e-5) << "from=" << from;
  }
}

// A quantized type: the arena decodes a displaced token's stored row through
// the codec, as the reference decodes its own copy, so the merged run stays
// within a small multiple of the codec's own error. Per-token types (int8)
// and sealed ones (int4 and int2 with per-channel key scales: the reader
// merges from the staged f16 copy the producer's write keeps, or from the
// step's rows when the block was written whole, and the block is encoded once
// merged) alike. logits_through writes a whole block, a partial one, then
// fills it a token at a time: both paths.
TEST(kv_merge_model, quantized_kv_per_token_and_sealed) {
  const llama_model& m = test::stories();
  const merged_setup f = minicache(m, 1, 0.6f, 2);
  auto exact = *kv_storage::create(f.merged, 4);
  auto plain32 = *kv_storage::create(f.flat, 4);
  const std::vector<float> exact_logits = logits_through(m, *exact), plain32_logits = logits_through(m, *plain32);
  // int8 against f32 merged, no further than int8 against f32 unmerged (3x: a
  // displaced token is merged from its int8 row, and the reader's ratio scales
  // the rounding of the merged row).
  for (const kv_type type : {kv_type::int8, kv_type::int4, kv_type::int2}) {
    const merged_setup s = minicache(m, 1, 0.6f, 2, type);
    auto merged = *kv_storage::create(s.merged, 4, 2);
    auto plain = *kv_storage::create(s.flat, 4, 2);
    EXPECT_EQ(merged->layout().has_sealed(), type != kv_type::int8) << kv_type_name(type);
    const double codec = test::max_logit_diff(logits_through(m, *plain), plain32_logits);
    const double merged_codec = test::max_logit_diff(logits_through(m, *merged), exact_logits);
    EXPECT_GT(codec, 0) << kv_type_name(type);
    ::testing::Test::RecordProperty(std::string(kv_type_name(type)) + "_codec", std::to_string(codec));
    ::testing::Test::RecordProperty(std::string(kv_type_name(type)) + "_merged", std::to_string(merged_codec));
    EXPECT_LE(merged_codec, 3 * codec) << kv_type_name(type) << " merged KV strays: " << merged_codec << " against " << codec;
    // Every staging slot is given back once the blocks are merged and sealed.
    EXPECT_EQ(merged->staging().slots_in_use, plain->staging().slots_in_use) << kv_type_name(type);
  }
  const llama_hparams& hp = m.hparams();
  // Not a pair's upper layer; t out of range; too many retained.
  auto f16 = share_kv_layers(kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, kv_type::f16, kv_type::f16),
                             std::vector<int>{0, 0, 2, 3, 4}, "minicache");
  ASSERT_TRUE(f16.ok());
  EXPECT_FALSE(merge_kv_layers(*f16, std::vector<int>{2}, 0.6f, 1).ok());
  EXPECT_FALSE(merge_kv_layers(*f16, std::vector<int>{1}, 1.5f, 1).ok());
  EXPECT_FALSE(merge_kv_layers(*f16, std::vector<int>{1}, 0.6f, 17).ok());
  auto ok = merge_kv_layers(*f16, std::vector<int>{1}, 0.6f, 1);
  ASSERT_TRUE(ok.ok()) << ok.error().message();
  // Bytes: one KV layer fewer, plus the reader's side data.
  EXPECT_EQ(ok->merge_bytes_per_block(0), sizeof(float) * hp.n_head_kv * (2 * 16 + 1 * (2 + 2 * hp.head_dim)));
  EXPECT_EQ(ok->tile_bytes_per_block(), f16->tile_bytes_per_block() + ok->merge_bytes_per_block(0));
}

}  // namespace
}  // namespace pagoda
