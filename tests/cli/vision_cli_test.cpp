// `pagoda synth --mmproj`: the command writes, byte for byte, the mmproj and
// the text model the vision oracle was made from (tests/data/oracle/README.md,
// "Vision"), and refuses shapes that do not fit with a message naming them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "common/image_files.h"

namespace pagoda::test {
namespace {

std::vector<char> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(cli_vision, synth_writes_the_oracle_files) {
  const std::string oracle = std::string(PAGODA_SOURCE_DIR) + "/tests/data/oracle/vision/";
  const std::string mmproj = ::testing::TempDir() + "/pagoda_cli_mmproj.gguf";
  const std::string text = ::testing::TempDir() + "/pagoda_cli_mmproj_text.gguf";
  const cli_result m = run_cli("synth --preset tiny --mmproj --weight-type f32 --seed 1 -t 1 -o " + mmproj);
  ASSERT_EQ(m.exit_code, 0) << m.err;
  EXPECT_NE(m.err.find("mmproj idefics3"), std::string::npos) << m.err;
  EXPECT_NE(m.err.find("projection 128"), std::string::npos) << m.err;
  const cli_result t = run_cli("synth --preset tiny --weight-type f32 --vocab 512 --seed 1 -t 1 -o " + text);
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_TRUE(file_bytes(mmproj) == file_bytes(oracle + "mmproj-idefics3-F32.gguf"));
  EXPECT_TRUE(file_bytes(text) == file_bytes(oracle + "text-tiny-F32.gguf"));
  std::remove(mmproj.c_str());
  std::remove(text.c_str());
}

TEST(cli_vision, synth_mmproj_refuses_shapes_that_do_not_fit) {
  const cli_result r = run_cli("synth --preset tiny --mmproj --patch-size 7 -o /dev/null");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("not a multiple of the patch size 7"), std::string::npos) << r.err;
  const cli_result q = run_cli("synth --preset tiny --mmproj --weight-type bf16 -o /dev/null");
  EXPECT_NE(q.exit_code, 0);
  EXPECT_NE(q.err.find("synth writes f32, f16 or q8_0"), std::string::npos) << q.err;
}

// `run --image` and `info --mmproj` on the oracle's synthetic pair.
struct vision_files {
  std::string dir = std::string(PAGODA_SOURCE_DIR) + "/tests/data/oracle/vision/";
  std::string text = dir + "text-tiny-F32.gguf";
  std::string mmproj = dir + "mmproj-idefics3-F32.gguf";
};

// A w x h RGB gradient as a PNG file in the test's temp directory.
std::string write_gradient_png(const std::string& name, int w, int h, int seed) {
  std::vector<std::uint8_t> px(static_cast<std::size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      std::uint8_t* p = &px[(static_cast<std::size_t>(y) * w + x) * 3];
      p[0] = static_cast<std::uint8_t>(x * 4 + seed);
      p[1] = static_cast<std::uint8_t>(y * 4);
      p[2] = static_cast<std::uint8_t>((x * y + seed * 31) & 0xff);
    }
  const std::vector<std::uint8_t> png = write_png(px.data(), w, h, PNG_FORMAT_RGB);
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(png.data()), static_cast<std::streamsize>(png.size()));
  return path;
}

TEST(cli_vision, run_with_an_image) {
  const vision_files f;
  const std::string a = write_gradient_png("pagoda_cli_a.png", 64, 64, 0);
  const std::string base = "run -m " + f.text + " --mmproj " + f.mmproj + " -p " + shell_quote("hello <__media__> there") +
                           " -n 4 --temp 0 --ignore-eos --json -t 1 --image ";
  const cli_result r = run_cli(base + a);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("image_tokens"), 32) << "one 64x64 slice and the overview, 16 each";
  EXPECT_EQ(j.at("tokens").size(), 4u);
  // The image's 32 placeholders stand between the text's tokens, with its markers.
  const std::vector<int> prompt = j.at("prompt_tokens");
  EXPECT_GT(prompt.size(), 32u + 4u);
  EXPECT_EQ(std::count(prompt.begin(), prompt.end(), 0), 32);
  // The same command answers the same; another image changes the rows, not the layout.
  const cli_result again = run_cli(base + a);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(nlohmann::json::parse(again.out).at("tokens"), j.at("tokens"));
  const cli_result other = run_cli(base + write_gradient_png("pagoda_cli_b.png", 96, 80, 7));
  ASSERT_EQ(other.exit_code, 0) << other.err;
  EXPECT_EQ(nlohmann::json::parse(other.out).at("prompt_tokens"), j.at("prompt_tokens"));
  std::remove(a.c_str());
}

TEST(cli_vision, run_refuses_bad_images_and_mismatched_files) {
  const vision_files f;
  const std::string junk = ::testing::TempDir() + "/pagoda_cli_junk.png";
  std::ofstream(junk, std::ios::binary) << "\x89PNG\r\n\x1a\n but not really";
  const cli_result bad = run_cli("run -m " + f.text + " --mmproj " + f.mmproj + " --image " + junk + " -p hi -n 1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--image " + junk), std::string::npos) << bad.err;
  const std::string a = write_gradient_png("pagoda_cli_c.png", 64, 64, 1);
  // stories260K's embeddings are 64 wide; the mmproj projects to 128.
  const cli_result mismatch = run_cli("run -m " + model_path() + " --mmproj " + f.mmproj + " --image " + a + " -p hi -n 1");
  EXPECT_NE(mismatch.exit_code, 0);
  EXPECT_NE(mismatch.err.find("does not match the model"), std::string::npos) << mismatch.err;
  // More image tokens than the context holds.
  const cli_result small = run_cli("run -m " + f.text + " --mmproj " + f.mmproj + " --image " + a + " -p hi -n 1 -c 24");
  EXPECT_NE(small.exit_code, 0);
  EXPECT_NE(small.err.find("32 of them the image's"), std::string::npos) << small.err;
  // --image needs --mmproj.
  const cli_result alone = run_cli("run -m " + f.text + " --image " + a + " -p hi -n 1");
  EXPECT_NE(alone.exit_code, 0);
  EXPECT_NE(alone.err.find("--mmproj"), std::string::npos) << alone.err;
  std::remove(junk.c_str());
  std::remove(a.c_str());
}

// `serve --mmproj` checks the pair before it takes a pool or a port: an
// mmproj of another width, or not an mmproj at all, stops it with the flag named.
TEST(cli_vision, serve_refuses_an_mmproj_that_does_not_match) {
  const vision_files f;
  const cli_result mismatch = run_cli("serve -m " + model_path() + " --mmproj " + f.mmproj + " --no-kv-store --port 0");
  EXPECT_NE(mismatch.exit_code, 0);
  EXPECT_NE(mismatch.err.find("--mmproj " + f.mmproj + ": the mmproj does not match the model"), std::string::npos)
      << mismatch.err;
  const cli_result text = run_cli("serve -m " + f.text + " --mmproj " + f.text + " --no-kv-store --port 0");
  EXPECT_NE(text.exit_code, 0);
  EXPECT_NE(text.err.find("--mmproj " + f.text), std::string::npos) << text.err;
}

TEST(cli_vision, info_describes_the_vision_tower) {
  const vision_files f;
  const cli_result r = run_cli("info -m " + f.text + " --mmproj " + f.mmproj + " --kv-image-type int8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("image 64, patch 8 (8x8 patches), 2 layers, width 64"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("16 per 64x64 chunk"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("32 image tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--kv-image-type"), std::string::npos) << r.out;
  const cli_result mismatch = run_cli("info -m " + model_path() + " --mmproj " + f.mmproj);
  EXPECT_NE(mismatch.exit_code, 0);
  EXPECT_NE(mismatch.err.find("does not match the model"), std::string::npos) << mismatch.err;
}

// gemma3: synth writes the oracle's pair byte for byte; info describes the
// tower and its one bidirectional span; run answers with the image in the
// prompt (16 image tokens between the markers).
TEST(cli_vision, gemma3_synth_info_and_run) {
  const std::string oracle = std::string(PAGODA_SOURCE_DIR) + "/tests/data/oracle/vision/";
  const std::string mmproj = ::testing::TempDir() + "/pagoda_cli_gemma3_mmproj.gguf";
  const std::string text = ::testing::TempDir() + "/pagoda_cli_gemma3_text.gguf";
  const cli_result m = run_cli("synth --preset tiny-gemma3 --ffn 128 --mmproj --projector gemma3 --weight-type f32 "
                               "--seed 1 -t 1 -o " + mmproj);
  ASSERT_EQ(m.exit_code, 0) << m.err;
  EXPECT_NE(m.err.find("mmproj gemma3"), std::string::npos) << m.err;
  EXPECT_NE(m.err.find("average pool 2"), std::string::npos) << m.err;
  const cli_result t =
      run_cli("synth --preset tiny-gemma3 --weight-type f32 --vocab 512 --ffn 128 --seed 1 -t 1 -o " + text);
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_TRUE(file_bytes(mmproj) == file_bytes(oracle + "mmproj-gemma3-F32.gguf"));
  EXPECT_TRUE(file_bytes(text) == file_bytes(oracle + "text-gemma3-F32.gguf"));
  std::remove(mmproj.c_str());
  std::remove(text.c_str());
  const cli_result bad = run_cli("synth --preset tiny-gemma3 --mmproj --projector llava -o /dev/null");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--projector llava"), std::string::npos) << bad.err;

  const std::string g_text = oracle + "text-gemma3-F32.gguf", g_mmproj = oracle + "mmproj-gemma3-F32.gguf";
  const cli_result info = run_cli("info -m " + g_text + " --mmproj " + g_mmproj);
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_NE(info.out.find("gemma3 (SigLIP ViT, average pool, RMS norm and projection x2)"), std::string::npos)
      << info.out;
  EXPECT_NE(info.out.find("16 per image"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("attended both ways"), std::string::npos) << info.out;

  const std::string a = write_gradient_png("pagoda_cli_g.png", 96, 80, 3);
  const cli_result r = run_cli("run -m " + g_text + " --mmproj " + g_mmproj + " -p " + shell_quote("look <__media__> now") +
                               " -n 4 --temp 0 --ignore-eos --json -t 1 --image " + a);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("image_tokens"), 16);
  EXPECT_EQ(j.at("tokens").size(), 4u);
  const std::vector<int> prompt = j.at("prompt_tokens");
  EXPECT_EQ(std::count(prompt.begin(), prompt.end(), 0), 16);
  std::remove(a.c_str());
}

}  // namespace
}  // namespace pagoda::test
