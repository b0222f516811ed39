// Cross-layer KV sharing (model/kv_share.h, kv_layout::layer_map): CLA and
// YOCO synth models, and reuse on stories260K, against a reference without
// the sharing machinery; the loader's and the layout's checks of a map.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "common/stories.h"
#include "common/synth_model.h"
#include "gguf_util.h"
#include "kv/kv_storage.h"
#include "model/kv_share.h"
#include "model/kv_share_util.h"
#include "model/llama.h"

namespace pagoda {
namespace {

using test::logits_through;

// A KV backend over an unshared storage (one KV layer per model layer) that
// plays the sharing by copying: a write to a producer's layer goes to every
// layer that reads it too, a write to a reader's layer is dropped. A plain
// forward (the identity map) over it computes what sharing means with none
// of the map's machinery: the shared K/V copied to each layer.
class copying_backend final : public test::forwarding_backend {
 public:
  copying_backend(kv_backend& inner, std::vector<int> source) : forwarding_backend(inner), source_(std::move(source)) {}
  void write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k, const float* v) override {
    if (source_[static_cast<std::size_t>(layer)] != layer) return;
    for (std::size_t l = 0; l < source_.size(); ++l)
      if (source_[l] == layer) inner_.write(static_cast<int>(l), blocks, slot, n, k, v);
  }

 private:
  std::vector<int> source_;
};

// The shared run (a storage of the shared layout) against the copying
// reference (an unshared storage), for `source`; returns the shared layout.
kv_layout expect_sharing_matches_reference(const llama_model& m, const std::vector<int>& source, const char* what) {
  const llama_hparams& hp = m.hparams();
  const kv_layout flat = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, kv_type::f32, kv_type::f32);
  auto shared_layout = share_kv_layers(flat, source, what);
  EXPECT_TRUE(shared_layout.ok()) << shared_layout.error().message();
  auto shared = *kv_storage::create(*shared_layout, 4);
  auto plain = *kv_storage::create(flat, 4);
  copying_backend reference(*plain, source);
  const std::vector<float> a = logits_through(m, *shared), b = logits_through(m, reference);
  EXPECT_LE(test::max_logit_diff(a, b), 1e-5) << what << ": shared logits part from the copying reference";
  return *shared_layout;
}

std::unique_ptr<llama_model> shared_synth(const std::string& preset, int n_layer, int cla, bool yoco) {
  synth_options o = test::f32_synth_options(preset, n_layer);
  o.cla = cla;
  o.yoco = yoco;
  return test::load_synth(o, preset + "_cla" + std::to_string(cla) + (yoco ? "_yoco" : ""));
}

TEST(kv_share, cla_and_yoco_synth_models_match_the_copying_reference) {
  for (const char* preset : {"tiny256", "tiny-qwen3"}) {  // qwen3: per-head K norms stay with the producer
    auto cla2 = shared_synth(preset, 6, 2, false);
    auto cla3 = shared_synth(preset, 6, 3, false);
    auto yoco = shared_synth(preset, 6, 0, true);
    ASSERT_TRUE(cla2 && cla3 && yoco) << preset;
    EXPECT_EQ(cla2->hparams().kv_source, cla_sources(6, 2));
    EXPECT_EQ(yoco->hparams().kv_source, yoco_sources(6));
    EXPECT_EQ(yoco->hparams().kv_source, (std::vector<int>{0, 1, 2, 3, 3, 3}));
    EXPECT_EQ(cla2->layers()[1].wk.data, nullptr) << "a reader has no K projection";
    EXPECT_NE(cla2->layers()[2].wk.data, nullptr);
    EXPECT_EQ(expect_sharing_matches_reference(*cla2, cla2->hparams().kv_source, "cla:2").n_layers, 3);
    EXPECT_EQ(expect_sharing_matches_reference(*cla3, cla3->hparams().kv_source, "cla:3").n_layers, 2);
    const kv_layout y = expect_sharing_matches_reference(*yoco, yoco->hparams().kv_source, "yoco");
    EXPECT_EQ(y.n_layers, 4);
    EXPECT_EQ(y.layer_map, (std::vector<std::int32_t>{0, 1, 2, 3, 3, 3}));
  }
}

// The same weights but the readers' K/V: the CLA file is the plain one without them.
TEST(kv_share, a_cla_file_keeps_the_plain_files_other_weights) {
  auto plain = shared_synth("tiny256", 4, 0, false);
  auto cla = shared_synth("tiny256", 4, 2, false);
  ASSERT_TRUE(plain && cla);
  const auto bytes = [](const weight_view& w) {
    return std::vector<std::byte>(static_cast<const std::byte*>(w.data),
                                  static_cast<const std::byte*>(w.data) + w.row_bytes * w.n_out);
  };
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(bytes(plain->layers()[l].wq), bytes(cla->layers()[l].wq)) << l;
    EXPECT_EQ(bytes(plain->layers()[l].w_down), bytes(cla->layers()[l].w_down)) << l;
  }
  EXPECT_EQ(bytes(plain->layers()[2].wk), bytes(cla->layers()[2].wk));
}

// Reuse on a trained model: its readers have K/V projections, which the
// shared run never computes (and the copying reference drops).
TEST(kv_share, reuse_on_stories_matches_the_copying_reference) {
  const llama_model& m = test::stories();
  const int n = m.hparams().n_layer;
  for (int from = 0; from < n - 1; ++from) {
    std::vector<int> source(static_cast<std::size_t>(n));
    for (int l = 0; l < n; ++l) source[static_cast<std::size_t>(l)] = l >= from && (l - from) % 2 == 1 ? l - 1 : l;
    const kv_layout shared = expect_sharing_matches_reference(m, source, "reuse");
    EXPECT_EQ(shared.n_layers, n - (n - from) / 2) << from;
    // And sharing changes the logits (the comparison above checks something).
    auto s = *kv_storage::create(shared, 4);
    auto u = *kv_storage::create(kv_layout::uniform(n, m.hparams().n_head_kv, m.hparams().head_dim, 16, kv_type::f32, kv_type::f32), 4);
    EXPECT_GT(test::max_logit_diff(logits_through(m, *s), logits_through(m, *u)), 1e-3) << "reuse:from=" << from << " computes what the unshared model does";
  }
}

// A declared map is checked in full: a malformed one would run with other logits.
TEST(kv_share, the_loader_refuses_a_malformed_declaration) {
  const synth_options o = test::f32_synth_options("tiny256", 4);
  const std::string path = ::testing::TempDir() + "/kv_share_plain.gguf";
  ASSERT_TRUE(write_synth_model(o, path).ok());
  auto src = gguf::file::open(path);
  std::remove(path.c_str());
  ASSERT_TRUE(src.ok());
  struct bad {
    std::vector<std::int32_t> source;
    std::vector<std::string_view> drop;  // tensors dropped (a reader's K/V)
    const char* says;
  };
  const std::vector<std::string_view> reader_kv = {"blk.1.attn_k.weight", "blk.1.attn_v.weight"};
  const std::vector<bad> cases = {
      {{0, 0, 2, 2}, {}, "has no K/V projections of its own"},  // the readers still carry attn_k
      {{0, 2, 2, 3}, reader_kv, "reads layer 2's KV; a layer reads its own or an earlier"},
      {{0, 0, 1, 3}, reader_kv, "which reads layer 0's KV itself"},
      {{0, 0, 2}, reader_kv, "3 entries for a model of 4 layers"},
      {{0, -1, 2, 3}, reader_kv, "reads layer -1"},
  };
  for (const bad& c : cases) {
    std::vector<std::byte> bytes = test::rewrite_gguf(**src, {}, [&](gguf::writer& w) { w.add_array(k_kv_source_key, c.source); });
    auto f = gguf::file::from_memory(bytes);
    ASSERT_TRUE(f.ok());
    std::vector<std::byte> dropped;  // then without the reader's K/V tensors
    if (!c.drop.empty()) {
      dropped = test::rewrite_gguf(**f, {c.drop[0], c.drop[1]}, [](gguf::writer&) {});
      f = gguf::file::from_memory(dropped);
      ASSERT_TRUE(f.ok());
    }
    auto m = llama_model::from_gguf(std::move(*f));
    ASSERT_FALSE(m.ok()) << c.says;
    EXPECT_NE(m.error().message().find(c.says), std::string::npos) << m.error().message();
  }
  // The right declaration on the same file, readers' K/V dropped: loads, and shares.
  std::vector<std::byte> ok_bytes = test::rewrite_gguf(**src, {reader_kv[0], reader_kv[1]}, [](gguf::writer& w) {
    w.add_array(k_kv_source_key, std::vector<std::int32_t>{0, 0, 2, 3});
  });
  auto f = gguf::file::from_memory(ok_bytes);
  ASSERT_TRUE(f.ok());
  auto m = llama_model::from_gguf(std::move(*f));
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ((*m)->hparams().kv_source, (std::vector<int>{0, 0, 2, 3}));
}

TEST(kv_share, a_layout_map_is_checked) {
  kv_layout flat = kv_layout::uniform(4, 2, 32, 16, kv_type::int8, kv_type::int8);
  flat.k_formats[1] = default_kv_format(kv_type::f16, kv_role::key);
  const std::vector<int> src = {0, 0, 2, 2};
  auto mixed = share_kv_layers(flat, src, "reuse:from=0");
  ASSERT_FALSE(mixed.ok());
  EXPECT_NE(mixed.error().message().find("their KV types differ"), std::string::npos) << mixed.error().message();
  flat.k_formats[1] = flat.k_formats[0];
  auto ok = share_kv_layers(flat, src, "reuse:from=0");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->n_layers, 2);
  EXPECT_EQ(ok->n_model_layers(), 4);
  EXPECT_TRUE(ok->check().ok());
  EXPECT_TRUE(ok->writes_kv(0));
  EXPECT_FALSE(ok->writes_kv(1));
  EXPECT_TRUE(ok->writes_kv(2));
  EXPECT_EQ(ok->kv_producer(1), 2);
  EXPECT_NEAR(ok->bytes_per_token(), flat.bytes_per_token() / 2, 1e-9);
  kv_layout broken = *ok;
  broken.layer_map = {0, 2, 1, 1};
  EXPECT_FALSE(broken.check().ok());
  // Nothing shared: the same layout, no map.
  auto none = share_kv_layers(flat, std::vector<int>{0, 1, 2, 3}, "reuse:from=4");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->layer_map.empty());
  EXPECT_TRUE(none->sharing.empty());
  EXPECT_EQ(none->n_layers, 4);
}

}  // namespace
}  // namespace pagoda
