// Pagoda's gemma3 vision family against llama.cpp's mtmd on the same
// random-weight mmproj, tiny gemma3 text model and images
// (tests/data/oracle/README.md, "Vision", gemma3): the preprocessed pixels,
// the image embeddings, the prompt layout mtmd tokenizes, and the text
// model's logits at the image's positions (decoded non-causally, as mtmd
// does for Gemma 3) and at the tokens after it, at every SIMD level.
//
// Tolerances. The encoder's are the idefics3 oracle's (vision_oracle_test.cpp
// says why; the same ViT with ggml's fp16 GELU table); the pool, RMS norm and
// projection add float-order differences only. The logits' are those of the
// gemma architecture oracle (tests/model/oracle_test.cpp): Pagoda's gemma
// FFN evaluates GELU exactly where ggml goes through its fp16 table, which
// alone moves these logits by about 1e-3 (measured: 1.1e-3 max abs, 2.5e-4
// RMS, the same at the image's positions and at the text after it).
//   pixels      exact (a bilinear resize into the square, centred on black,
//               for image B; image A is the encoder's size and is copied).
//   embeddings  5e-4 max abs, 5e-5 RMS.
//   logits      5e-3 max abs, 1e-3 RMS.
// The mutations at the end (causal image attention, image rows scaled as
// token embeddings are, the soft-embedding norm's weight not applied or with
// Gemma's +1 added again) each fail the comparison by far.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/image_files.h"
#include "core/cpu.h"
#include "core/simd_levels.h"
#include "core/thread_pool.h"
#include "model/llama.h"
#include "vision/image_preprocess.h"
#include "vision/image_prompt.h"
#include "vision/mmproj.h"
#include "vision/vision_encoder.h"
#include "vision/vision_util.h"

namespace pagoda::vision {
namespace {

constexpr double k_embd_tol = 5e-4;
constexpr double k_embd_rms_tol = 5e-5;
constexpr double k_logit_tol = 5e-3;
constexpr double k_logit_rms_tol = 1e-3;

std::string path_of(const std::string& name) { return test::vision_dir() + "/" + name; }

struct reference {
  int n_embd = 0;
  int n_vocab = 0;
  int n_tokens = 0;  // of the image
  std::vector<token_id> prompt, after;
  bool non_causal = false;
  nlohmann::json layout;
  std::vector<float> pixels, embd, logits;
};

reference load_reference(const std::string& image) {
  reference r;
  const std::string stem = path_of("ref-gemma3-" + image);
  std::ifstream in(stem + ".json");
  const nlohmann::json j = nlohmann::json::parse(in);
  r.n_embd = j.at("n_embd");
  r.n_vocab = j.at("n_vocab");
  EXPECT_EQ(j.at("chunks").size(), 1u) << "gemma3: one chunk per image";
  r.n_tokens = j.at("chunks")[0].at("n_tokens");
  for (int id : j.at("prompt")) r.prompt.push_back(id);
  for (int id : j.at("after")) r.after.push_back(id);
  r.non_causal = j.at("non_causal");
  r.layout = j.at("layout");
  r.pixels = test::read_f32(stem + ".pixels.f32");
  r.embd = test::read_f32(stem + ".embd.f32");
  r.logits = test::read_f32(stem + ".logits.f32");
  return r;
}

using test::compare;
using test::diff;

std::vector<float> encode(const mmproj& m, const planar_image& img) {
  thread_pool pool(2);
  vision_encoder enc(m, pool);
  std::vector<float> e(static_cast<std::size_t>(enc.n_output_tokens(img.nx, img.ny)) * m.hparams().projection_dim);
  const status st = enc.encode(img.data, img.nx, img.ny, e);
  EXPECT_TRUE(st.ok()) << st.message();
  return e;
}

std::unique_ptr<mmproj> open_mmproj() {
  auto m = mmproj::open(path_of("mmproj-gemma3-F32.gguf"));
  EXPECT_TRUE(m.ok()) << m.error().message();
  return m.ok() ? std::move(*m) : nullptr;
}

std::unique_ptr<llama_model> open_text() {
  auto t = llama_model::load(path_of("text-gemma3-F32.gguf"));
  EXPECT_TRUE(t.ok()) << t.error().message();
  return t.ok() ? std::move(*t) : nullptr;
}

class Gemma3Oracle : public testing::TestWithParam<simd_level> {};

TEST_P(Gemma3Oracle, PixelsAndEmbeddingsMatchLlamaCpp) {
  test::simd_level_guard guard;
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const auto m = open_mmproj();
  ASSERT_TRUE(m);
  ASSERT_EQ(m->hparams().projector, projector_kind::gemma3);
  for (const std::string image_name : {"a-64x64", "b-96x80"}) {
    SCOPED_TRACE(image_name);
    const reference ref = load_reference(image_name);
    auto chunks = preprocess(test::read_ppm(path_of("image-" + image_name + ".ppm")), m->hparams());
    ASSERT_TRUE(chunks.ok()) << chunks.error().message();
    ASSERT_EQ(chunks->size(), 1u);
    EXPECT_EQ(compare((*chunks)[0].data, ref.pixels).max_abs, 0.0) << "preprocessing is exact";
    const std::vector<float> embd = encode(*m, (*chunks)[0]);
    EXPECT_EQ(static_cast<int>(embd.size()), ref.n_tokens * ref.n_embd);
    test::expect_close(embd, ref.embd, k_embd_tol, k_embd_rms_tol,
                       "gemma3 image " + image_name + " " + simd_level_name(GetParam()) + " embeddings");
  }
}

TEST_P(Gemma3Oracle, LogitsAtAndAfterTheImageMatchLlamaCpp) {
  test::simd_level_guard guard;
  PAGODA_USE_SIMD_LEVEL(GetParam());
  const auto m = open_mmproj();
  const auto text = open_text();
  ASSERT_TRUE(m && text);
  ASSERT_TRUE(m->check_text_model(text->hparams().n_embd).ok());
  const reference ref = load_reference("a-64x64");
  ASSERT_TRUE(ref.non_causal) << "mtmd decodes Gemma 3's images non-causally";
  auto chunks = preprocess(test::read_ppm(path_of("image-a-64x64.ppm")), m->hparams());
  ASSERT_TRUE(chunks.ok()) << chunks.error().message();
  const std::vector<float> image = encode(*m, (*chunks)[0]);
  const std::vector<float> logits =
      test::logits_after_embeddings(*text, ref.prompt, image, 1, /*bidirectional=*/true, ref.after);
  ASSERT_EQ(logits.size(), static_cast<std::size_t>(ref.n_tokens + static_cast<int>(ref.after.size())) * ref.n_vocab);
  test::expect_close(logits, ref.logits, k_logit_tol, k_logit_rms_tol,
                     std::string("gemma3 ") + simd_level_name(GetParam()) + " logits at and after the image");
}

INSTANTIATE_TEST_SUITE_P(All, Gemma3Oracle, testing::ValuesIn(test::simd_levels_under_test()), test::level_param_name);

// mtmd's tokenization of the marker alone: "<start_of_image>" tokenized, the
// image chunk, "<end_of_image>" tokenized; Pagoda's gemma3 layout gives the
// same ids around one bidirectional span of the same size.
TEST(Gemma3Layout, TokensAreMtmds) {
  const auto m = open_mmproj();
  const auto text = open_text();
  ASSERT_TRUE(m && text);
  const reference ref = load_reference("a-64x64");
  const image_part part = gemma3_layout(text->vocab(), m->hparams().n_output_tokens());
  ASSERT_EQ(part.spans.size(), 1u);
  EXPECT_TRUE(part.spans[0].bidirectional);
  EXPECT_EQ(part.spans[0].n_tokens, ref.n_tokens);
  std::vector<token_id> expect_before, expect_after;
  ASSERT_EQ(ref.layout.size(), 3u) << ref.layout.dump();
  for (int id : ref.layout[0]) expect_before.push_back(id);
  EXPECT_EQ(ref.layout[1], "image:" + std::to_string(ref.n_tokens));
  for (int id : ref.layout[2]) expect_after.push_back(id);
  const auto begin = static_cast<std::size_t>(part.spans[0].begin);
  EXPECT_EQ(std::vector<token_id>(part.tokens.begin(), part.tokens.begin() + static_cast<std::ptrdiff_t>(begin)),
            expect_before);
  EXPECT_EQ(std::vector<token_id>(part.tokens.begin() + static_cast<std::ptrdiff_t>(begin) + ref.n_tokens,
                                  part.tokens.end()),
            expect_after);
}

// The whole way (make_image_part, the one entry point) from a PNG of image
// B: the gemma3 layout, one bidirectional span whose rows are llama.cpp's
// embeddings of the image (within the bounds), a content hash.
TEST(Gemma3Layout, MakeImagePartGivesTheFamilysPart) {
  const auto m = open_mmproj();
  const auto text = open_text();
  ASSERT_TRUE(m && text);
  const reference ref = load_reference("b-96x80");
  const rgb_image img = test::read_ppm(path_of("image-b-96x80.ppm"));
  const std::vector<std::uint8_t> png = test::write_png(img.rgb.data(), img.nx, img.ny, PNG_FORMAT_RGB);
  thread_pool pool(1);
  auto part = make_image_part(png, *m, text->vocab(), text->hparams().n_embd, pool);
  ASSERT_TRUE(part.ok()) << part.error().message();
  const image_part layout = gemma3_layout(text->vocab(), ref.n_tokens);
  EXPECT_EQ(part->tokens, layout.tokens);
  ASSERT_EQ(part->spans.size(), 1u);
  EXPECT_TRUE(part->spans[0].bidirectional);
  EXPECT_EQ(part->spans[0].begin, layout.spans[0].begin);
  EXPECT_NE(part->spans[0].content_hash, 0u);
  const diff d = compare(part->spans[0].embeddings, ref.embd);
  EXPECT_LE(d.max_abs, k_embd_tol);
  // A text model of another width is refused with both widths named.
  auto mismatch = make_image_part(png, *m, text->vocab(), 96, pool);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.error().message().find("96"), std::string::npos) << mismatch.error().message();
}

// Hand-made mistakes, each far outside the bounds.
TEST(Gemma3OracleMutations, EachMutationFailsTheComparison) {
  const auto m = open_mmproj();
  const auto text = open_text();
  ASSERT_TRUE(m && text);
  const reference ref = load_reference("a-64x64");
  const planar_image px = (*preprocess(test::read_ppm(path_of("image-a-64x64.ppm")), m->hparams()))[0];
  const std::vector<float> image = encode(*m, px);

  // Causal attention over the image's rows (mtmd decodes them non-causally).
  const diff causal = compare(test::logits_after_embeddings(*text, ref.prompt, image, 1, false, ref.after), ref.logits);
  EXPECT_GT(causal.max_abs, 100 * k_logit_tol);
  // The image's rows scaled by sqrt(n_embd) as Gemma's token embeddings are.
  std::vector<float> scaled = image;
  const float s = std::sqrt(static_cast<float>(text->hparams().n_embd));
  for (float& v : scaled) v *= s;
  const diff scale = compare(test::logits_after_embeddings(*text, ref.prompt, scaled, 1, true, ref.after), ref.logits);
  EXPECT_GT(scale.max_abs, 100 * k_logit_tol);

  // The soft-embedding norm's weight not applied (all 1), or Gemma's +1 added again.
  std::vector<std::byte> bytes;
  const auto with_norm = [&](float add, bool replace) {
    std::ifstream in(path_of("mmproj-gemma3-F32.gguf"), std::ios::binary);
    const std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    bytes.resize(raw.size());
    std::memcpy(bytes.data(), raw.data(), raw.size());
    auto f = gguf::file::from_memory(bytes);
    EXPECT_TRUE(f.ok());
    const gguf::tensor_info* t = (*f)->find_tensor("mm.soft_emb_norm.weight");
    EXPECT_NE(t, nullptr);
    auto* w = reinterpret_cast<float*>(bytes.data() + (t->data - bytes.data()));
    for (std::int64_t i = 0; i < t->n_elements(); ++i) w[i] = replace ? add : w[i] + add;
    auto mm = mmproj::load(std::move(*gguf::file::from_memory(bytes)));
    EXPECT_TRUE(mm.ok());
    return compare(encode(**mm, px), ref.embd).max_abs;
  };
  const double no_weight = with_norm(1.0f, true);
  EXPECT_GT(no_weight, 100 * k_embd_tol);
  const double plus_one = with_norm(1.0f, false);
  EXPECT_GT(plus_one, 100 * k_embd_tol);
  std::printf("[ vision ] gemma3 mutations: causal image attention %.3g, image rows scaled %.3g (logits); norm "
              "weight not applied %.3g, +1 again %.3g (embeddings)\n",
              causal.max_abs, scale.max_abs, no_weight, plus_one);
}

}  // namespace
}  // namespace pagoda::vision
