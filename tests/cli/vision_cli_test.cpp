// `pagoda synth --mmproj`: the command writes, byte for byte, the mmproj and
// the text model the vision oracle was made from (tests/data/oracle/README.md,
// "Vision"), and refuses shapes that do not fit with a message naming them.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "cli/cli_util.h"

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

}  // namespace
}  // namespace pagoda::test
