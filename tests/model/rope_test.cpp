// RoPE scaling (model/rope.h): the angles of each kind of scaling checked
// against their definitions, rotate_keys as a pure rotation under YaRN, and
// what the loader reads or refuses (frequency factors, YaRN, old and unknown
// keys). The logits of the Llama 3.1-style and YaRN files are checked against
// llama.cpp in oracle_test.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>

#include "model/gguf_util.h"
#include "model/gguf_writer.h"
#include "model/llama.h"
#include "model/oracle_util.h"
#include "model/rope.h"
#include "model/synth.h"

namespace pagoda {
namespace {

using ::testing::HasSubstr;

// The angle of every pair at position pos (atan2 of sin, cos: exact while
// angles stay within (-pi, pi]), and the magnitude of pair 0.
std::vector<double> angles_at(const rope_angles& r, int pos, bool magnitude, double* m = nullptr) {
  std::vector<float> c(r.n_pairs()), s(r.n_pairs());
  r.at(pos, magnitude, c.data(), s.data());
  std::vector<double> out(r.n_pairs());
  for (int i = 0; i < r.n_pairs(); ++i) out[i] = std::atan2(s[i], c[i]);
  if (m) *m = std::hypot(c[0], s[0]);
  return out;
}

double frequency(double base, int i, int rope_dim) { return std::pow(base, -2.0 * i / rope_dim); }

rope_scaling_config yarn_config(float factor, int n_ctx_orig) {
  rope_scaling_config s;
  s.type = rope_scaling_type::yarn;
  s.factor = factor;
  s.n_ctx_orig = n_ctx_orig;
  s.ext_factor = 1.0f;
  return s;
}

TEST(rope_angles, unscaled_and_linear_follow_the_definition) {
  const rope_scaling_config none;
  const rope_angles plain(none, 64, 10000.0f, 1.0f), linear(none, 64, 10000.0f, 0.25f);
  double m = 0;
  const std::vector<double> a = angles_at(plain, 3, true, &m), b = angles_at(linear, 3, true);
  EXPECT_NEAR(m, 1.0, 1e-6);
  for (int i = 0; i < 32; ++i) {
    EXPECT_NEAR(a[i], 3 * frequency(10000, i, 64), 1e-5) << i;
    EXPECT_NEAR(b[i], 0.75 * frequency(10000, i, 64), 1e-5) << i;
  }
  // rope.scaling.attn_factor scales cos and sin under any type.
  rope_scaling_config attn;
  attn.attn_factor = 1.5f;
  angles_at(rope_angles(attn, 64, 10000.0f, 0.25f), 3, true, &m);
  EXPECT_NEAR(m, 1.5, 1e-6);
}

// Llama 3.1's rope_freqs: pair i's frequency divided by factor i.
TEST(rope_angles, frequency_factors_divide_each_pair) {
  rope_scaling_config s;
  for (int i = 0; i < 16; ++i) s.freq_factors.push_back(1.0f + 0.5f * i);
  const std::vector<double> a = angles_at(rope_angles(s, 32, 500000.0f, 1.0f), 2, true);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(a[i], 2 * frequency(500000, i, 32) / (1.0 + 0.5 * i), 1e-6) << i;
}

// YaRN with factor 4 over an original context of 512, base 1e6, 64 dims:
// pair i turns 512 freq_i / (2 pi) times over the original context; pairs
// turning more than beta_fast = 32 times keep their angle, those turning
// fewer than beta_slow = 1 time are interpolated (angle / 4), a ramp between.
// Correction dims 64 ln(512 / (2 pi n)) / (2 ln 1e6): 2.17 for n = 32 (floor
// 2), 10.2 for n = 1 (ceil 11). Cos and sin carry 0.1 ln 4 + 1.
TEST(rope_angles, yarn_keeps_fast_pairs_interpolates_slow_ones_and_scales_magnitude) {
  const rope_angles r(yarn_config(4.0f, 512), 64, 1e6f, 0.25f);
  double m = 0;
  const std::vector<double> a = angles_at(r, 1, true, &m);
  EXPECT_NEAR(m, 0.1 * std::log(4.0) + 1.0, 1e-6);
  EXPECT_NEAR(r.magnitude(), 0.1 * std::log(4.0) + 1.0, 1e-6);
  for (int i = 0; i < 32; ++i) {
    const double f = frequency(1e6, i, 64);
    const double ramp = 1.0 - std::clamp((i - 2.0) / (11.0 - 2.0), 0.0, 1.0);  // share of the unscaled angle
    EXPECT_NEAR(a[i], f * ramp + f / 4 * (1 - ramp), 1e-6 * f + 1e-9) << "pair " << i;
    if (i <= 2) {
      EXPECT_NEAR(a[i], f, 1e-6 * f) << "pair " << i << " keeps its angle";
    }
    if (i >= 11) {
      EXPECT_NEAR(a[i], f / 4, 1e-6 * f) << "pair " << i << " is interpolated";
    }
  }
  // Without the magnitude: the same angles, unit length.
  angles_at(r, 1, false, &m);
  EXPECT_NEAR(m, 1.0, 1e-6);
}

// rotate_keys turns stored keys by a position delta. Under YaRN the forward
// pass's keys carry the magnitude factor already, so the turn must be a pure
// rotation: turning by p then by d equals turning by p + d, and lengths stay.
TEST(rotate_keys, is_a_pure_rotation_under_yarn_and_frequency_factors) {
  llama_hparams hp;
  hp.n_layer = 1;
  hp.n_head = hp.n_head_kv = 2;
  hp.head_dim = hp.rope_dim = 64;
  hp.rope_neox = true;
  hp.rope_base = 1e6f;
  hp.rope_freq_scale = 0.25f;
  hp.rope_scaling = yarn_config(4.0f, 512);
  for (int i = 0; i < 32; ++i) hp.rope_scaling.freq_factors.push_back(1.0f + (i % 5));
  std::mt19937 rng(5);
  std::normal_distribution<float> g;
  std::vector<float> x(static_cast<std::size_t>(hp.kv_dim()));
  for (float& v : x) v = g(rng);
  auto norm = [](const std::vector<float>& v) {
    double s = 0;
    for (float e : v) s += static_cast<double>(e) * e;
    return std::sqrt(s);
  };
  std::vector<float> stepwise = x, direct = x;
  const std::int32_t p = 37, d = 250, sum = p + d;
  rotate_keys(hp, 0, stepwise.data(), 1, &p);
  rotate_keys(hp, 0, stepwise.data(), 1, &d);
  rotate_keys(hp, 0, direct.data(), 1, &sum);
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(stepwise[i], direct[i], 2e-4) << i;
  EXPECT_NEAR(norm(direct), norm(x), 1e-4 * norm(x));
}

// --- Loading -----------------------------------------------------------------

std::string oracle_gguf(const char* name) { return test::oracle_dir() + "/gguf/" + name + ".gguf"; }

std::unique_ptr<gguf::file> open_file(const std::string& path) {
  auto f = gguf::file::open(path);
  EXPECT_TRUE(f.ok()) << path;
  return f.ok() ? std::move(*f) : nullptr;
}

std::unique_ptr<gguf::file> synth_file(const char* preset) {
  synth_options o;
  o.preset = preset;
  o.weight_type = gguf::tensor_type::f32;
  o.n_threads = 1;
  const std::string path = ::testing::TempDir() + "/rope_" + preset + ".gguf";
  status st = write_synth_model(o, path);
  EXPECT_TRUE(st.ok()) << st.message();
  auto f = open_file(path);
  std::remove(path.c_str());  // the mapping outlives the file
  return f;
}

// A model from GGUF bytes, which `storage` keeps: the model reads its tensors in place.
result<std::unique_ptr<llama_model>> load_bytes(std::vector<std::byte> bytes, std::vector<std::byte>& storage) {
  storage = std::move(bytes);
  auto f = gguf::file::from_memory(storage);
  if (!f.ok()) return f.error();
  return llama_model::from_gguf(std::move(*f));
}

TEST(rope_loading, yarn_file_reads_every_parameter) {
  auto m = llama_model::load(oracle_gguf("qwen2-yarn-F32"));
  ASSERT_TRUE(m.ok()) << m.error().message();
  const llama_hparams& hp = (*m)->hparams();
  const rope_scaling_config& rs = hp.rope_scaling;
  EXPECT_EQ(rs.type, rope_scaling_type::yarn);
  EXPECT_FLOAT_EQ(rs.factor, 4.0f);
  EXPECT_FLOAT_EQ(hp.rope_freq_scale, 0.25f);
  EXPECT_EQ(rs.n_ctx_orig, 512);
  EXPECT_FLOAT_EQ(rs.ext_factor, 1.0f);
  EXPECT_FLOAT_EQ(rs.beta_fast, 32.0f);
  EXPECT_FLOAT_EQ(rs.beta_slow, 1.0f);
  EXPECT_NEAR(hp.layer_rope_angles(0).magnitude(), 0.1 * std::log(4.0) + 1.0, 1e-6);
  EXPECT_TRUE(rs.freq_factors.empty());
}

TEST(rope_loading, yarn_betas_and_attention_factor_come_from_the_file_when_present) {
  auto f = open_file(oracle_gguf("qwen2-yarn-F32"));
  ASSERT_TRUE(f);
  std::vector<std::byte> storage;
  auto m = load_bytes(test::rewrite_gguf(*f, {}, [](gguf::writer& w) {
    w.add_f32("qwen2.rope.scaling.yarn_beta_fast", 16.0f);
    w.add_f32("qwen2.rope.scaling.yarn_beta_slow", 2.0f);
    w.add_f32("qwen2.rope.scaling.attn_factor", 0.5f);
  }), storage);
  ASSERT_TRUE(m.ok()) << m.error().message();
  const llama_hparams& hp = (*m)->hparams();
  EXPECT_FLOAT_EQ(hp.rope_scaling.beta_fast, 16.0f);
  EXPECT_FLOAT_EQ(hp.rope_scaling.beta_slow, 2.0f);
  EXPECT_NEAR(hp.layer_rope_angles(0).magnitude(), 0.5 * (0.1 * std::log(4.0) + 1.0), 1e-6);
}

TEST(rope_loading, llama3_frequency_factors_are_read) {
  auto m = llama_model::load(oracle_gguf("llama-ropefreqs-F32"));
  ASSERT_TRUE(m.ok()) << m.error().message();
  const std::vector<float>& ff = (*m)->hparams().rope_scaling.freq_factors;
  ASSERT_EQ(ff.size(), 32u);
  for (float x : ff) {
    EXPECT_GE(x, 1.0f);
    EXPECT_LE(x, 8.0f);
  }
}

// The older key name of the linear factor (llama.cpp falls back to it).
TEST(rope_loading, old_linear_scale_key_is_read) {
  auto f = synth_file("tiny");
  ASSERT_TRUE(f);
  std::vector<std::byte> storage;
  auto m = load_bytes(test::rewrite_gguf(*f, {}, [](gguf::writer& w) { w.add_f32("llama.rope.scale_linear", 2.0f); }),
                      storage);
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_FLOAT_EQ((*m)->hparams().rope_freq_scale, 0.5f);
  EXPECT_EQ((*m)->hparams().rope_scaling.type, rope_scaling_type::linear);
}

// Llama and qwen2 used to load a file of any scaling type and run it
// unscaled; every architecture now refuses a type it does not compute.
TEST(rope_loading, unknown_scaling_types_are_refused_naming_the_key_and_value) {
  struct source {
    std::unique_ptr<gguf::file> file;
    const char* arch;
  };
  source sources[] = {{synth_file("tiny"), "llama"}, {open_file(oracle_gguf("qwen2-F32")), "qwen2"},
                      {synth_file("tiny-qwen3"), "qwen3"}, {synth_file("tiny-gemma3"), "gemma3"}};
  for (source& s : sources) {
    ASSERT_TRUE(s.file);
    for (const char* type : {"dynamic", "longrope", "YaRN"}) {
      const std::string key = std::string(s.arch) + ".rope.scaling.type";
      std::vector<std::byte> storage;
      auto m = load_bytes(test::rewrite_gguf(*s.file, {}, [&](gguf::writer& w) {
        w.add_string(key, type);
        w.add_f32(std::string(s.arch) + ".rope.scaling.factor", 4.0f);
      }), storage);
      ASSERT_FALSE(m.ok()) << s.arch << " " << type;
      EXPECT_THAT(m.error().message(), HasSubstr(key + " = '" + type + "'"));
      EXPECT_EQ(m.error().code(), errc::unsupported);
    }
  }
}

TEST(rope_loading, frequency_factor_tensors_llama_cpp_would_not_read_are_refused) {
  auto qwen2 = open_file(oracle_gguf("qwen2-F32"));
  ASSERT_TRUE(qwen2);
  const std::vector<float> factors(32, 2.0f);
  const std::int64_t ne[] = {32};
  auto with_tensor = [&](const gguf::file& f, const char* name, std::vector<std::byte>& storage) {
    return load_bytes(test::rewrite_gguf(f, {}, [&](gguf::writer& w) {
      w.add_tensor(name, gguf::tensor_type::f32, ne, std::as_bytes(std::span<const float>(factors)));
    }), storage);
  };
  std::vector<std::byte> s1, s2, s3, s4;
  auto m = with_tensor(*qwen2, "rope_freqs.weight", s1);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.error().message(), HasSubstr("rope_freqs.weight"));
  auto llama = synth_file("tiny256");  // head_dim 64: 32 pairs
  ASSERT_TRUE(llama);
  m = with_tensor(*llama, "rope_factors_long.weight", s2);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.error().message(), HasSubstr("rope_factors_long.weight"));
  // On llama, rope_freqs loads and changes the logits.
  auto plain = load_bytes(test::rewrite_gguf(*llama, {}, [](gguf::writer&) {}), s3);
  auto factored = with_tensor(*llama, "rope_freqs.weight", s4);
  ASSERT_TRUE(plain.ok() && factored.ok());
  const std::vector<token_id> tokens = {5, 90, 17, 300, 41, 7, 260, 99};
  const std::vector<float> a = test::run_teacher_forced(**plain, tokens, 8), b = test::run_teacher_forced(**factored, tokens, 8);
  double diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(a[i] - b[i])));
  EXPECT_GT(diff, 1e-3);
}

}  // namespace
}  // namespace pagoda
