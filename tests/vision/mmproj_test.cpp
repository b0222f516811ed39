// Loading mmproj files: what `pagoda synth --mmproj` writes loads with the
// hyperparameters it was given, and every bad file (a missing or extra tensor,
// a wrong shape, another family, a text model, a truncated file) or a width
// that does not match the text model is a clear error, never a crash.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/thread_pool.h"
#include "model/synth.h"
#include "vision/image_preprocess.h"
#include "vision/mmproj.h"
#include "vision/mmproj_synth.h"
#include "vision/vision_encoder.h"

namespace pagoda::vision {
namespace {

class MmprojFiles : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("pagoda_mmproj_" + std::to_string(::getpid()) + "_" + testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes a file with these options and reads its bytes back.
  std::vector<std::byte> bytes_of(const mmproj_synth_options& o) {
    const std::string path = (dir_ / "m.gguf").string();
    const status st = write_synth_mmproj(o, path);
    EXPECT_TRUE(st.ok()) << st.message();
    std::ifstream in(path, std::ios::binary);
    const std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::byte> out(raw.size());
    std::memcpy(out.data(), raw.data(), raw.size());
    return out;
  }

  // Loads the bytes; returns the error (ok_status when it loaded).
  static status load_error(std::span<const std::byte> bytes) {
    auto f = gguf::file::from_memory(bytes);
    if (!f.ok()) return f.error();
    auto m = mmproj::load(std::move(*f));
    return m.ok() ? ok_status() : m.error();
  }

  // Replaces the first occurrence of `from` at or after `anchor` by `to` (same length).
  static void patch(std::vector<std::byte>& bytes, std::string_view anchor, std::string_view from, std::string_view to) {
    ASSERT_EQ(from.size(), to.size());
    const std::string_view all(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    const std::size_t at = all.find(from, all.find(anchor));
    ASSERT_NE(at, std::string_view::npos) << from;
    std::memcpy(bytes.data() + at, to.data(), to.size());
  }

  // Sets the u32 value of metadata key `key` (after the key and its type word).
  static void set_u32(std::vector<std::byte>& bytes, std::string_view key, std::uint32_t v) {
    const std::string_view all(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    const std::size_t at = all.find(key);
    ASSERT_NE(at, std::string_view::npos) << key;
    std::memcpy(bytes.data() + at + key.size() + 4, &v, 4);
  }

  std::filesystem::path dir_;
};

TEST_F(MmprojFiles, SynthFileLoadsWithItsHyperparameters) {
  mmproj_synth_options o;
  o.projection_dim = 96;
  o.n_layer = 3;
  const std::vector<std::byte> bytes = bytes_of(o);
  auto f = gguf::file::from_memory(bytes);
  ASSERT_TRUE(f.ok());
  auto m = mmproj::load(std::move(*f));
  ASSERT_TRUE(m.ok()) << m.error().message();
  const vision_hparams& hp = (*m)->hparams();
  EXPECT_EQ(hp.image_size, 64);
  EXPECT_EQ(hp.patch_size, 8);
  EXPECT_EQ(hp.n_embd, 64);
  EXPECT_EQ(hp.n_head, 2);
  EXPECT_EQ(hp.n_ff, 128);
  EXPECT_EQ(hp.n_layer, 3);
  EXPECT_EQ(hp.projection_dim, 96);
  EXPECT_EQ(hp.scale_factor, 2);
  EXPECT_EQ(hp.longest_edge, 64);
  EXPECT_FLOAT_EQ(hp.eps, 1e-6f);
  EXPECT_FLOAT_EQ(hp.image_mean[2], 0.41f);
  EXPECT_FLOAT_EQ(hp.image_std[0], 0.27f);
  EXPECT_EQ(hp.n_output_tokens(), 16);
  EXPECT_EQ((*m)->blocks().size(), 3u);
  EXPECT_TRUE((*m)->check_text_model(96).ok());
}

TEST_F(MmprojFiles, SynthBytesDoNotDependOnThreads) {
  mmproj_synth_options o;
  o.n_threads = 1;
  const std::vector<std::byte> one = bytes_of(o);
  o.n_threads = 3;
  EXPECT_TRUE(bytes_of(o) == one);
  o.seed = 43;
  EXPECT_FALSE(bytes_of(o) == one);
}

TEST_F(MmprojFiles, WidthThatDoesNotMatchTheTextModelIsRefused) {
  mmproj_synth_options o;
  o.projection_dim = 96;
  const std::vector<std::byte> bytes = bytes_of(o);
  auto m = mmproj::load(std::move(*gguf::file::from_memory(bytes)));
  ASSERT_TRUE(m.ok());
  const status st = (*m)->check_text_model(128);
  EXPECT_EQ(st.code(), errc::invalid_argument);
  EXPECT_NE(st.message().find("does not match the model"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("96"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("128"), std::string::npos) << st.message();
}

TEST_F(MmprojFiles, MissingTensorIsNamed) {
  mmproj_synth_options o;
  o.omit_tensor = "v.post_ln.bias";
  const status st = load_error(bytes_of(o));
  EXPECT_EQ(st.code(), errc::corrupt);
  EXPECT_NE(st.message().find("missing tensor v.post_ln.bias"), std::string::npos) << st.message();
}

TEST_F(MmprojFiles, TensorOfAnotherLayoutIsRefusedByName) {
  mmproj_synth_options o;
  o.extra_tensor = "v.pre_ln.weight";
  const status st = load_error(bytes_of(o));
  EXPECT_EQ(st.code(), errc::unsupported);
  EXPECT_NE(st.message().find("v.pre_ln.weight"), std::string::npos) << st.message();
}

TEST_F(MmprojFiles, WrongShapeIsNamed) {
  // The metadata gives a feed-forward width the tensors do not have.
  mmproj_synth_options o;
  o.n_ff = 160;
  std::vector<std::byte> bytes = bytes_of(o);
  set_u32(bytes, "clip.vision.feed_forward_length", 192);  // 160 -> 192
  const status st = load_error(bytes);
  EXPECT_EQ(st.code(), errc::corrupt);
  EXPECT_NE(st.message().find("v.blk.0.ffn_up.weight has shape [64, 160, 1, 1], expected [64, 192]"),
            std::string::npos)
      << st.message();
}

TEST_F(MmprojFiles, OtherFamiliesAndActivationsAreRefused) {
  std::vector<std::byte> bytes = bytes_of({});
  patch(bytes, "clip.projector_type", "idefics3", "gemma3xx");
  status st = load_error(bytes);
  EXPECT_EQ(st.code(), errc::unsupported);
  EXPECT_NE(st.message().find("projector type 'gemma3xx' is not implemented"), std::string::npos) << st.message();

  bytes = bytes_of({});
  patch(bytes, "clip.use_gelu", "clip.use_gelu", "clip.use_xxxx");  // no GELU key: llama.cpp's quick GELU
  st = load_error(bytes);
  EXPECT_EQ(st.code(), errc::unsupported);
  EXPECT_NE(st.message().find("quick GELU"), std::string::npos) << st.message();
}

TEST_F(MmprojFiles, TextModelGivenAsMmprojIsRefused) {
  synth_options o;
  o.preset = "tiny";
  o.weight_type = gguf::tensor_type::f32;
  o.n_threads = 1;
  const std::string path = (dir_ / "text.gguf").string();
  ASSERT_TRUE(write_synth_model(o, path).ok());
  auto m = mmproj::open(path);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().code(), errc::invalid_argument);
  EXPECT_NE(m.error().message().find("not an mmproj file"), std::string::npos) << m.error().message();
  EXPECT_NE(m.error().message().find(path), std::string::npos) << m.error().message();
}

TEST_F(MmprojFiles, TruncatedFilesGiveErrorsAtEveryLength) {
  const std::vector<std::byte> bytes = bytes_of({});
  // Every cut in the header and a spread of cuts in the data.
  for (std::size_t n = 0; n < bytes.size(); n += (n < 4096 ? 1 : 997)) {
    const status st = load_error(std::span(bytes).first(n));
    EXPECT_FALSE(st.ok()) << "cut at " << n;
  }
  EXPECT_TRUE(load_error(bytes).ok());
}

TEST_F(MmprojFiles, SynthRefusesShapesThatDoNotFit) {
  mmproj_synth_options o;
  o.patch_size = 7;
  EXPECT_EQ(validate(o).code(), errc::invalid_argument);
  o = {};
  o.scale_factor = 3;  // 8 patches per side
  EXPECT_EQ(validate(o).code(), errc::invalid_argument);
  o = {};
  o.n_ff = o.n_embd;
  EXPECT_NE(validate(o).message().find("swapped"), std::string::npos);
  o = {};
  o.weight_type = gguf::tensor_type::q4_k;
  EXPECT_EQ(validate(o).code(), errc::invalid_argument);
}

TEST_F(MmprojFiles, EncoderRefusesImagesThatDoNotFit) {
  const std::vector<std::byte> bytes = bytes_of({});
  auto m = mmproj::load(std::move(*gguf::file::from_memory(bytes)));
  ASSERT_TRUE(m.ok());
  thread_pool pool(1);
  vision_encoder enc(**m, pool);
  std::vector<float> out(16 * 128);
  std::vector<float> px(3 * 64 * 64);
  EXPECT_TRUE(enc.encode(px, 64, 64, out).ok());
  std::vector<float> small(3 * 32 * 32);
  EXPECT_EQ(enc.encode(small, 32, 32, out).code(), errc::invalid_argument);   // positions for 64x64 only
  EXPECT_EQ(enc.encode(px, 60, 60, out).code(), errc::invalid_argument);      // not a multiple of the patch
  EXPECT_EQ(enc.encode(px, 64, 64, std::span(out).first(10)).code(), errc::invalid_argument);
  EXPECT_EQ(enc.encode(std::span(px).first(10), 64, 64, out).code(), errc::invalid_argument);

  // Preprocessing: a malformed image.
  EXPECT_EQ(preprocess(rgb_image{2, 2, std::vector<std::uint8_t>(5)}, (*m)->hparams()).error().code(),
            errc::invalid_argument);
  EXPECT_EQ(preprocess(rgb_image{0, 2, {}}, (*m)->hparams()).error().code(), errc::invalid_argument);
}

// The encoder splits its norms, softmax rows, GELU and bias adds over the
// pool's threads; each item is computed whole by one thread, so any number of
// threads gives the same bits as one.
TEST_F(MmprojFiles, EmbeddingsDoNotDependOnThreads) {
  const std::vector<std::byte> bytes = bytes_of({});
  auto m = mmproj::load(std::move(*gguf::file::from_memory(bytes)));
  ASSERT_TRUE(m.ok());
  std::vector<float> px(3 * 64 * 64);
  for (std::size_t i = 0; i < px.size(); ++i) px[i] = std::sin(0.37f * static_cast<float>(i)) * 1.7f;
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 2, 3}) {
    thread_pool pool(threads);
    vision_encoder enc(**m, pool);
    std::vector<float> out(16 * 128);
    ASSERT_TRUE(enc.encode(px, 64, 64, out).ok());
    outs.push_back(std::move(out));
  }
  EXPECT_EQ(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(outs[0].data(), outs[2].data(), outs[0].size() * sizeof(float)), 0);
  EXPECT_GT(*std::max_element(outs[0].begin(), outs[0].end()), 0.0f);  // not all zeros
}

// gelu_ggml reads a table; its definition is the fp16 rounding of the exact
// GELU of the fp16 rounding of x (exact past +-10), checked on every fp16
// value and on floats between them.
TEST(GeluGgml, IsTheFp16RoundingOfTheExactGelu) {
  const auto reference = [](float x) {
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    return fp16_to_f32(f32_to_fp16(gelu_exact(fp16_to_f32(f32_to_fp16(x)))));
  };
  int checked = 0;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float x = fp16_to_f32(static_cast<fp16_t>(h));
    if (std::isnan(x)) continue;
    for (float v : {x, std::nextafter(x, 0.0f), x * 1.0003f}) {
      const float got = gelu_ggml(v), want = reference(v);
      ASSERT_TRUE(got == want || (std::isnan(got) && std::isnan(want))) << v << ": " << got << " vs " << want;
      ++checked;
    }
  }
  EXPECT_GT(checked, 190000);
  EXPECT_NEAR(gelu_ggml(1.0f), 0.8412f, 1e-3f);  // the GELU itself, not only its rounding
  EXPECT_EQ(gelu_ggml(-20.0f), 0.0f);
  EXPECT_EQ(gelu_ggml(12.5f), 12.5f);
}

mmproj_synth_options gemma3_options() {
  mmproj_synth_options o;
  o.projector = projector_kind::gemma3;
  return o;
}

TEST_F(MmprojFiles, Gemma3SynthFileLoads) {
  mmproj_synth_options o = gemma3_options();
  o.projection_dim = 96;
  const std::vector<std::byte> bytes = bytes_of(o);
  auto m = mmproj::load(std::move(*gguf::file::from_memory(bytes)));
  ASSERT_TRUE(m.ok()) << m.error().message();
  const vision_hparams& hp = (*m)->hparams();
  EXPECT_EQ(hp.projector, projector_kind::gemma3);
  EXPECT_EQ(hp.scale_factor, 2);  // written: not llama.cpp's default 4
  EXPECT_EQ(hp.n_output_tokens(), 16);
  EXPECT_EQ(hp.projection_dim, 96);
  // The projection is the file's [n_embd][projection_dim] transposed.
  const weight_view w = (*m)->projector();
  EXPECT_EQ(w.n_in, 64);
  EXPECT_EQ(w.n_out, 96);
  EXPECT_NE((*m)->soft_emb_norm(), nullptr);
  auto f = gguf::file::from_memory(bytes);
  const gguf::tensor_info* t = (*f)->find_tensor("mm.input_projection.weight");
  ASSERT_NE(t, nullptr);
  const auto* file_rows = reinterpret_cast<const float*>(t->data);  // [n_embd][projection_dim]
  const auto* ours = static_cast<const float*>(w.data);        // [projection_dim][n_embd]
  EXPECT_EQ(ours[5 * 64 + 7], file_rows[7 * 96 + 5]);
  EXPECT_EQ(ours[95 * 64 + 63], file_rows[63 * 96 + 95]);
  // Pool 4 (llama.cpp's default, key absent) gives 2x2 = 4 tokens of 64x64.
  o.scale_factor = 4;
  auto m4 = mmproj::load(std::move(*gguf::file::from_memory(bytes_of(o))));
  ASSERT_TRUE(m4.ok()) << m4.error().message();
  EXPECT_EQ((*m4)->hparams().scale_factor, 4);
  EXPECT_EQ((*m4)->hparams().n_output_tokens(), 4);
}

TEST_F(MmprojFiles, Gemma3MissingExtraAndMisshapedTensorsAreNamed) {
  mmproj_synth_options o = gemma3_options();
  o.omit_tensor = "mm.soft_emb_norm.weight";
  status st = load_error(bytes_of(o));
  EXPECT_EQ(st.code(), errc::corrupt);
  EXPECT_NE(st.message().find("missing tensor mm.soft_emb_norm.weight"), std::string::npos) << st.message();

  o = gemma3_options();
  o.omit_tensor = "mm.input_projection.weight";
  st = load_error(bytes_of(o));
  EXPECT_NE(st.message().find("missing tensor mm.input_projection.weight"), std::string::npos) << st.message();

  // idefics3's projector in a gemma3 file is another family's part.
  o = gemma3_options();
  o.extra_tensor = "mm.model.fc.weight";
  st = load_error(bytes_of(o));
  EXPECT_EQ(st.code(), errc::unsupported);
  EXPECT_NE(st.message().find("mm.model.fc.weight is not part of the gemma3 layout"), std::string::npos)
      << st.message();

  // A projection width in the metadata that the tensor does not have.
  o = gemma3_options();
  o.projection_dim = 96;
  std::vector<std::byte> bytes = bytes_of(o);
  set_u32(bytes, "clip.vision.projection_dim", 128);
  st = load_error(bytes);
  EXPECT_EQ(st.code(), errc::corrupt);
  EXPECT_NE(st.message().find("mm.input_projection.weight has shape [96, 64, 1, 1], expected [128, 64]"),
            std::string::npos)
      << st.message();
}

TEST_F(MmprojFiles, Gemma3WrongKeysAreRefused) {
  // A pool kernel that does not divide the 8 patches per side.
  mmproj_synth_options o = gemma3_options();
  std::vector<std::byte> bytes = bytes_of(o);
  set_u32(bytes, "clip.vision.projector.scale_factor", 3);
  status st = load_error(bytes);
  EXPECT_EQ(st.code(), errc::corrupt);
  EXPECT_NE(st.message().find("average-pool kernel 3"), std::string::npos) << st.message();

  // No layer-norm epsilon: the soft-embedding norm's eps is the file's.
  bytes = bytes_of(gemma3_options());
  patch(bytes, "clip.vision.attention.layer_norm_epsilon", "layer_norm_epsilon", "layer_norm_epsilom");
  st = load_error(bytes);
  EXPECT_EQ(st.code(), errc::corrupt);
  EXPECT_NE(st.message().find("layer_norm_epsilon"), std::string::npos) << st.message();

  // A quantized projection: llama.cpp's converter writes it F16 (read) or F32.
  o = gemma3_options();
  o.weight_type = gguf::tensor_type::q8_0;
  o.n_embd = 64;
  o.n_ff = 96;
  o.projection_dim = 128;
  bytes = bytes_of(o);
  auto m = mmproj::load(std::move(*gguf::file::from_memory(bytes)));
  ASSERT_TRUE(m.ok()) << m.error().message();  // F16 projection beside q8_0 blocks
  EXPECT_EQ((*m)->projector().type, gguf::tensor_type::f16);
}

TEST(Idefics3Preprocess, RefinedSizeAsLlamaCpp) {
  // calc_size_preserved_ratio: scale to the longest edge, round each side up to image_size.
  EXPECT_EQ(idefics3_refined_size(64, 64, 64, 64), (std::array<int, 2>{64, 64}));
  EXPECT_EQ(idefics3_refined_size(96, 80, 64, 64), (std::array<int, 2>{64, 64}));
  EXPECT_EQ(idefics3_refined_size(96, 80, 64, 128), (std::array<int, 2>{128, 128}));
  EXPECT_EQ(idefics3_refined_size(200, 50, 64, 256), (std::array<int, 2>{256, 64}));
  EXPECT_EQ(idefics3_refined_size(1000, 700, 512, 2048), (std::array<int, 2>{2048, 1536}));
}

}  // namespace
}  // namespace pagoda::vision
