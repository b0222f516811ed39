// An image file to a prompt part (vision/image_prompt.h): mtmd's idefics3
// layout, each chunk's rows the encoder's, the content hash of bytes and mmproj.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/image_files.h"
#include "core/thread_pool.h"
#include "model/llama.h"
#include "vision/image_prompt.h"
#include "vision/vision_encoder.h"
#include "vision/vision_util.h"

namespace pagoda::vision {
namespace {

std::vector<std::uint8_t> png_of(const rgb_image& img) {
  return test::write_png(img.rgb.data(), img.nx, img.ny, PNG_FORMAT_RGB);
}

struct files {
  std::unique_ptr<mmproj> proj;
  std::unique_ptr<llama_model> text;
};

files load() {
  files f;
  auto m = mmproj::open(test::vision_dir() + "/mmproj-idefics3-F32.gguf");
  EXPECT_TRUE(m.ok()) << m.error().message();
  auto t = llama_model::load(test::vision_dir() + "/text-tiny-F32.gguf");
  EXPECT_TRUE(t.ok()) << t.error().message();
  if (m.ok()) f.proj = std::move(*m);
  if (t.ok()) f.text = std::move(*t);
  return f;
}

TEST(image_prompt, idefics3_layout_is_mtmds) {
  const files f = load();
  ASSERT_TRUE(f.proj && f.text);
  const tokenizer& vocab = f.text->vocab();
  const image_part p = idefics3_layout(vocab, 2, 3, 16);
  ASSERT_EQ(p.spans.size(), 7u) << "six slices and the overview";
  EXPECT_EQ(p.n_image_tokens(), 7 * 16);
  // Each slice follows its "<fake_token_around_image><row_y_col_x>" text; rows end with "\n" but the last.
  std::vector<token_id> want;
  const auto text = [&](const std::string& s) {
    const std::vector<token_id> ids = vocab.encode(s, false, true);
    want.insert(want.end(), ids.begin(), ids.end());
  };
  // mtmd's lookup_token: one token whose text is the marker's (this synthetic
  // vocabulary has "\n" as one; the others are tokenized).
  const auto marker = [&](const std::string& s) {
    for (token_id id = 0; id < vocab.n_vocab(); ++id)
      if (vocab.token_to_piece(id, true) == s) return want.push_back(id);
    text(s);
  };
  const auto image = [&] { want.insert(want.end(), 16, token_id{0}); };
  for (int y = 1; y <= 2; ++y) {
    for (int x = 1; x <= 3; ++x) {
      text("<fake_token_around_image><row_" + std::to_string(y) + "_col_" + std::to_string(x) + ">");
      image();
    }
    if (y == 1) marker("\n");
  }
  marker("\n\n");
  marker("<fake_token_around_image>");
  marker("<global-img>");
  image();
  marker("<fake_token_around_image>");
  EXPECT_EQ(p.tokens, want);
  for (const image_span& s : p.spans)
    for (int j = 0; j < s.n_tokens; ++j) EXPECT_EQ(p.tokens[static_cast<std::size_t>(s.begin + j)], 0);
}

TEST(image_prompt, a_png_becomes_the_encoders_rows_with_a_content_hash) {
  const files f = load();
  ASSERT_TRUE(f.proj && f.text);
  const rgb_image a = test::read_ppm(test::vision_dir() + "/image-a-64x64.ppm");
  const rgb_image b = test::read_ppm(test::vision_dir() + "/image-b-96x80.ppm");
  thread_pool pool(1);
  auto part = make_image_part(png_of(a), *f.proj, f.text->vocab(), f.text->hparams().n_embd, pool);
  ASSERT_TRUE(part.ok()) << part.error().message();
  EXPECT_EQ(part->n_rows, 1);
  EXPECT_EQ(part->n_cols, 1);
  ASSERT_EQ(part->spans.size(), 2u);
  // The rows are the encoder's of the preprocessed chunks (PNG decoding is exact).
  const std::vector<planar_image> chunks = *preprocess(a, f.proj->hparams());
  vision_encoder enc(*f.proj, pool);
  for (std::size_t i = 0; i < 2; ++i) {
    std::vector<float> want(16 * 128);
    ASSERT_TRUE(enc.encode(chunks[i].data, chunks[i].nx, chunks[i].ny, want).ok());
    EXPECT_EQ(part->spans[i].embeddings, want) << i;
    EXPECT_EQ(part->spans[i].n_tokens, 16);
  }
  EXPECT_NE(part->spans[0].content_hash, part->spans[1].content_hash) << "chunks differ";
  // The same bytes give the same hashes; another image, or another mmproj, others.
  auto again = make_image_part(png_of(a), *f.proj, f.text->vocab(), f.text->hparams().n_embd, pool);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->spans[0].content_hash, part->spans[0].content_hash);
  auto other = make_image_part(png_of(b), *f.proj, f.text->vocab(), f.text->hparams().n_embd, pool);
  ASSERT_TRUE(other.ok()) << other.error().message();
  EXPECT_NE(other->spans[0].content_hash, part->spans[0].content_hash);
  const std::vector<std::uint8_t> bytes = png_of(a);
  EXPECT_NE(image_content_hash(bytes, f.proj->fingerprint(), 0), image_content_hash(bytes, f.proj->fingerprint() + 1, 0));
}

TEST(image_prompt, bad_input_is_a_clear_error) {
  const files f = load();
  ASSERT_TRUE(f.proj && f.text);
  thread_pool pool(1);
  std::vector<std::uint8_t> png = png_of(test::read_ppm(test::vision_dir() + "/image-a-64x64.ppm"));
  png.resize(png.size() / 2);
  auto truncated = make_image_part(png, *f.proj, f.text->vocab(), f.text->hparams().n_embd, pool);
  ASSERT_FALSE(truncated.ok());
  EXPECT_EQ(truncated.error().code(), errc::invalid_argument) << truncated.error().message();
  auto mismatch = make_image_part(png_of(test::read_ppm(test::vision_dir() + "/image-a-64x64.ppm")), *f.proj,
                                  f.text->vocab(), 64, pool);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.error().message().find("does not match the model"), std::string::npos)
      << mismatch.error().message();
}

}  // namespace
}  // namespace pagoda::vision
