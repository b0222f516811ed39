// The architectures beyond llama/qwen2 (model/llama.h), apart from the
// llama.cpp logit oracles (oracle_test.cpp): synth writes each of them and the
// loader reads back exactly what was written (hyper-parameters, every tensor
// in place, fused projections as views of their rows), a forward pass runs and
// is batch invariant, and a Mistral-style sliding window on `llama` does what
// a window must (checked by shift invariance, not against Pagoda itself).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <set>

#include "common/synth_model.h"
#include "model/gguf_util.h"
#include "model/gguf_writer.h"
#include "model/llama.h"
#include "model/oracle_util.h"
#include "model/synth.h"

namespace pagoda {
namespace {

using ::testing::HasSubstr;

// An F32 synth file of a preset, opened (the mapping outlives the unlinked file).
std::unique_ptr<gguf::file> synth_file(const char* preset) {
  synth_options o;
  o.preset = preset;
  o.weight_type = gguf::tensor_type::f32;
  const std::string path = ::testing::TempDir() + "/arch_file_" + preset + ".gguf";
  status st = write_synth_model(o, path);
  EXPECT_TRUE(st.ok()) << st.message();
  auto f = gguf::file::open(path);
  std::remove(path.c_str());
  EXPECT_TRUE(f.ok());
  return f.ok() ? std::move(*f) : nullptr;
}

std::unique_ptr<llama_model> synth_and_load(const synth_options& o, const std::string& name) {
  return test::load_synth(o, "arch_" + name);
}

std::vector<token_id> random_tokens(int n, int n_vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<token_id> t(n);
  for (token_id& x : t) x = 3 + static_cast<token_id>(rng() % static_cast<unsigned>(n_vocab - 3));
  return t;
}

// Every tensor of the file is used by the model: its bytes are where a view
// of the model points (a fused projection's parts at their row offsets).
void expect_views_into_file(const llama_model& m) {
  std::set<const void*> used;
  auto add = [&](const weight_view& w) { used.insert(w.data); };
  add(m.token_embd());
  if (!m.hparams().tied_output) add(m.output());
  for (const llama_layer& L : m.layers())
    for (const weight_view* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) add(*w);
  for (const gguf::tensor_info& t : m.gguf().tensors()) {
    if (t.n_dims == 1) continue;  // norms and biases are copied to floats
    EXPECT_TRUE(used.count(t.data)) << t.name << " is not read in place";
  }
}

struct arch_case {
  const char* preset;
  const char* arch;
};

class synth_arch : public ::testing::TestWithParam<arch_case> {};

// synth -> load -> the same hyper-parameters and tensors, and a forward pass
// that is finite and batch invariant (the prompt in one step gives the same
// logits, bit for bit, as token by token: windows follow stored positions).
TEST_P(synth_arch, round_trips_and_runs) {
  synth_options o;
  o.preset = GetParam().preset;
  o.weight_type = gguf::tensor_type::f32;
  const synth_shape s = *resolve_synth_shape(o);
  auto m = synth_and_load(o, s.name);
  ASSERT_TRUE(m);
  const llama_hparams& hp = m->hparams();
  EXPECT_EQ(hp.arch, GetParam().arch);
  EXPECT_EQ(hp.n_embd, s.n_embd);
  EXPECT_EQ(hp.n_layer, s.n_layer);
  EXPECT_EQ(hp.n_head, s.n_head);
  EXPECT_EQ(hp.n_head_kv, s.n_head_kv);
  EXPECT_EQ(hp.head_dim, s.head_dim);
  EXPECT_EQ(hp.n_ff, s.n_ff);
  EXPECT_EQ(hp.n_vocab, s.n_vocab);
  EXPECT_FLOAT_EQ(hp.rope_base, s.rope_base);
  EXPECT_FLOAT_EQ(hp.rms_eps, s.rms_eps);
  EXPECT_EQ(hp.qk_norm, s.qk_norm);
  EXPECT_EQ(hp.post_norms, s.post_norms);
  EXPECT_EQ(hp.sliding_window, s.sliding_window);
  EXPECT_FLOAT_EQ(hp.attn_softcap, s.attn_softcap);
  EXPECT_FLOAT_EQ(hp.final_softcap, s.final_softcap);
  const bool gemma = std::string_view(s.arch).starts_with("gemma");
  EXPECT_EQ(hp.tied_output, gemma);
  EXPECT_FLOAT_EQ(hp.embd_scale, gemma ? std::sqrt(static_cast<float>(s.n_embd)) : 1.0f);
  if (s.rope_base_swa > 0) {
    EXPECT_FLOAT_EQ(hp.rope_base_swa, s.rope_base_swa);
  }
  for (int l = 0; l < hp.n_layer; ++l) {
    const llama_layer& L = m->layers()[l];
    EXPECT_EQ(L.q_norm.size(), s.qk_norm ? static_cast<std::size_t>(s.head_dim) : 0u);
    EXPECT_EQ(L.post_attn_norm.size(), s.post_norms ? static_cast<std::size_t>(s.n_embd) : 0u);
    EXPECT_EQ(L.post_ffn_norm.size(), s.post_norms ? static_cast<std::size_t>(s.n_embd) : 0u);
    EXPECT_EQ(L.wq.n_out, static_cast<std::int64_t>(s.n_head) * s.head_dim);
    EXPECT_EQ(L.wk.n_out, static_cast<std::int64_t>(s.n_head_kv) * s.head_dim);
    EXPECT_EQ(L.w_up.n_out, s.n_ff);
    if (s.fused) {  // [Q | K | V] and [gate | up] rows of one tensor each
      const std::string p = "blk." + std::to_string(l) + ".";
      const gguf::tensor_info* qkv = m->gguf().find_tensor(p + "attn_qkv.weight");
      const gguf::tensor_info* up = m->gguf().find_tensor(p + "ffn_up.weight");
      ASSERT_TRUE(qkv && up);
      EXPECT_EQ(L.wq.data, qkv->data);
      EXPECT_EQ(static_cast<const std::byte*>(L.wk.data), static_cast<const std::byte*>(qkv->data) + L.wq.n_out * L.wq.row_bytes);
      EXPECT_EQ(static_cast<const std::byte*>(L.wv.data), static_cast<const std::byte*>(L.wk.data) + L.wk.n_out * L.wk.row_bytes);
      EXPECT_EQ(L.w_gate.data, up->data);
      EXPECT_EQ(static_cast<const std::byte*>(L.w_up.data), static_cast<const std::byte*>(up->data) + s.n_ff * L.w_gate.row_bytes);
      EXPECT_EQ(m->gguf().find_tensor(p + "ffn_gate.weight"), nullptr);
    }
  }
  if (s.sliding_window > 0) {
    // gemma2: pattern 2 (local, global, ...); tiny-gemma3: pattern 3.
    const int pattern = s.swa_pattern > 0 ? s.swa_pattern : 2;
    for (int l = 0; l < hp.n_layer; ++l) EXPECT_EQ(hp.is_swa(l), l % pattern < pattern - 1) << "layer " << l;
    EXPECT_GT(hp.n_swa_layers(), 0);
    EXPECT_LT(hp.n_swa_layers(), hp.n_layer);
  }
  expect_views_into_file(*m);

  // 3 windows' worth of tokens, so local layers drop keys.
  const std::vector<token_id> tokens = random_tokens(30, hp.n_vocab, 7);
  const std::vector<float> batched = test::run_teacher_forced(*m, tokens, static_cast<int>(tokens.size()));
  const std::vector<float> stepped = test::run_teacher_forced(*m, tokens, 1);
  ASSERT_EQ(batched.size(), tokens.size() * static_cast<std::size_t>(hp.n_vocab));
  ASSERT_EQ(stepped.size(), batched.size());
  double max_abs = 0;
  for (std::size_t i = 0; i < batched.size(); ++i) {
    ASSERT_TRUE(std::isfinite(batched[i])) << i;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(batched[i]), std::bit_cast<std::uint32_t>(stepped[i])) << i;
    max_abs = std::max(max_abs, static_cast<double>(std::fabs(batched[i])));
  }
  EXPECT_GT(max_abs, 1e-3);  // not a model of zeros
  if (hp.final_softcap > 0) {
    EXPECT_LE(max_abs, hp.final_softcap);
  }
}

INSTANTIATE_TEST_SUITE_P(presets, synth_arch,
                         ::testing::Values(arch_case{"tiny-qwen3", "qwen3"}, arch_case{"tiny-gemma2", "gemma2"},
                                           arch_case{"tiny-gemma3", "gemma3"}, arch_case{"tiny-phi3", "phi3"}),
                         [](const auto& info) {
                           std::string n = info.param.preset;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

// The real-model presets of the new architectures carry their models' keys:
// written with one layer, they load with the right parts.
TEST(synth_arch_presets, real_shapes_load_with_their_features) {
  for (const char* name : {"qwen3-8b", "gemma2-9b", "gemma3-4b", "phi3-mini", "mistral-7b-v0.1"}) {
    SCOPED_TRACE(name);
    synth_options o;
    o.preset = name;
    o.n_layer = 2;
    o.n_ff = 256;
    o.weight_type = gguf::tensor_type::q4_0;
    auto m = synth_and_load(o, name);
    ASSERT_TRUE(m);
    const llama_hparams& hp = m->hparams();
    const synth_shape& s = *find_synth_preset(name);
    EXPECT_EQ(hp.arch, s.arch);
    EXPECT_EQ(hp.head_dim, s.head_dim);
    EXPECT_EQ(hp.sliding_window, s.sliding_window);
    if (std::string_view(name) == "gemma2-9b") {
      EXPECT_FLOAT_EQ(hp.attn_softcap, 50.0f);
      EXPECT_FLOAT_EQ(hp.final_softcap, 30.0f);
      EXPECT_TRUE(hp.is_swa(0));
      EXPECT_FALSE(hp.is_swa(1));
    }
    if (std::string_view(name) == "gemma3-4b") {
      EXPECT_FLOAT_EQ(hp.rope_base_swa, 10000.0f);
      EXPECT_FLOAT_EQ(hp.final_softcap, 0.0f);
      EXPECT_TRUE(hp.is_swa(0) && hp.is_swa(1));  // pattern 6: layers 0..4 local
    }
    if (std::string_view(name) == "mistral-7b-v0.1") {
      EXPECT_EQ(hp.n_swa_layers(), hp.n_layer);
    }
  }
}

// A model from GGUF bytes that must load.
std::unique_ptr<llama_model> from_bytes(const std::vector<std::byte>& storage) {
  auto f = gguf::file::from_memory(storage);
  EXPECT_TRUE(f.ok());
  if (!f.ok()) return nullptr;
  auto m = llama_model::from_gguf(std::move(*f));
  EXPECT_TRUE(m.ok()) << m.error().message();
  return m.ok() ? std::move(*m) : nullptr;
}

// Mistral-style `llama.attention.sliding_window` W on every layer of an
// L-layer model: the last position p depends only on tokens p - L (W - 1) .. p,
// and attention depends on positions only through their differences (RoPE), so
// its logits must equal those of the same model run on just those tokens from
// position 0. Without the window they must not (the earlier tokens matter).
TEST(llama_sliding_window, last_row_depends_only_on_the_window_chain) {
  auto f = synth_file("tiny");
  ASSERT_TRUE(f);
  const int W = 6;
  const std::vector<std::byte> storage =
      test::rewrite_gguf(*f, {}, [&](gguf::writer& w) { w.add_u32("llama.attention.sliding_window", W); });
  auto windowed = from_bytes(storage);
  ASSERT_TRUE(windowed);
  auto full = llama_model::from_gguf(std::move(f));
  ASSERT_TRUE(full.ok());
  const llama_hparams& hp = windowed->hparams();
  ASSERT_EQ(hp.sliding_window, W);
  ASSERT_EQ(hp.n_swa_layers(), hp.n_layer);
  EXPECT_EQ((*full)->hparams().n_swa_layers(), 0);

  const std::vector<token_id> tokens = random_tokens(40, hp.n_vocab, 11);
  const std::size_t first = tokens.size() - 1 - static_cast<std::size_t>(hp.n_layer) * (W - 1);
  const std::span<const token_id> tail = std::span<const token_id>(tokens).subspan(first);
  auto last_row = [&](const llama_model& m, std::span<const token_id> t) {
    std::vector<float> all = test::run_teacher_forced(m, t, static_cast<int>(t.size()));
    return std::vector<float>(all.end() - hp.n_vocab, all.end());
  };
  const std::vector<float> a = last_row(*windowed, tokens), b = last_row(*windowed, tail);
  const std::vector<float> c = last_row(**full, tokens), d = last_row(**full, tail);
  double windowed_diff = 0, full_diff = 0;
  for (int i = 0; i < hp.n_vocab; ++i) {
    windowed_diff = std::max(windowed_diff, static_cast<double>(std::fabs(a[i] - b[i])));
    full_diff = std::max(full_diff, static_cast<double>(std::fabs(c[i] - d[i])));
  }
  // Float RoPE angles at positions ~40 vs ~10 round differently (~1e-5 rad).
  EXPECT_LE(windowed_diff, 1e-3);
  EXPECT_GT(full_diff, 1e-2);
  std::printf("[ window ] shifted-window difference %.2e, without the window %.2e\n", windowed_diff, full_diff);
}

TEST(arch_load_errors, are_clear) {
  auto f = synth_file("tiny-gemma2");
  ASSERT_TRUE(f);
  // A gemma2 file without its window, or with a pattern array of the wrong length.
  std::vector<std::byte> no_window = test::rewrite_gguf(*f, {"gemma2.attention.sliding_window"}, [](gguf::writer&) {});
  auto m1 = llama_model::from_gguf(std::move(*gguf::file::from_memory(no_window)));
  ASSERT_FALSE(m1.ok());
  EXPECT_THAT(m1.error().message(), HasSubstr("missing required key gemma2.attention.sliding_window"));
  std::vector<std::byte> bad_pattern = test::rewrite_gguf(*f, {}, [](gguf::writer& w) {
    w.add_array("gemma2.attention.sliding_window_pattern", std::vector<std::int32_t>{1, 0, 1});
  });
  auto m2 = llama_model::from_gguf(std::move(*gguf::file::from_memory(bad_pattern)));
  ASSERT_FALSE(m2.ok());
  EXPECT_THAT(m2.error().message(), HasSubstr("has 3 entries for 2 layers"));
  // An architecture that does not load names the ones that do.
  gguf::writer w;
  w.add_string("general.architecture", "mamba");
  std::vector<std::byte> bytes = w.to_bytes();
  auto m3 = llama_model::from_gguf(std::move(*gguf::file::from_memory(bytes)));
  ASSERT_FALSE(m3.ok());
  EXPECT_THAT(m3.error().message(), HasSubstr("architecture 'mamba' is not supported (llama, qwen2, qwen3, gemma2"));
}

}  // namespace
}  // namespace pagoda
