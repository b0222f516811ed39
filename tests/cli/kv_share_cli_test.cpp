// Cross-layer KV sharing through the commands: `synth --cla/--yoco` writes a
// model that declares it and `info` shows it; `run --kv-share` shares (fewer
// KV bytes per token); bad specs exit 2 naming --kv-share.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"

namespace pagoda::test {
namespace {

cli_result run_with(const std::string& extra) {
  return run_cli("run -m " + model_path() + " -p " + shell_quote("Once upon a time") + " -n 8 --temp 0 -t 1 " + extra);
}

TEST(cli_kv_share, run_shares_and_bad_specs_exit_2) {
  const cli_result plain = run_with("");
  const cli_result shared = run_with("--kv-share reuse:from=1");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(shared.exit_code, 0) << shared.err;
  // stories260K f32 KV: 5 layers x 4 KV heads x 8 x 4 B x 2 = 1280 B/token; 3 KV layers: 768.
  EXPECT_NE(plain.err.find("1.25 KiB/token"), std::string::npos) << plain.err;
  EXPECT_NE(shared.err.find("768 B/token"), std::string::npos) << shared.err;
  for (const char* bad : {"reuse", "reuse:from=6", "reuse:from=1,step=2", "minicash:from=1"}) {
    const cli_result r = run_with(std::string("--kv-share ") + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.err;
    EXPECT_NE(r.err.find("--kv-share"), std::string::npos) << r.err;
  }
}

TEST(cli_kv_share, synth_cla_and_yoco_declare_it) {
  for (const std::string flag : {"--cla 2", "--yoco"}) {
    const std::string path = ::testing::TempDir() + "/pagoda_cli_kv_share.gguf";
    ASSERT_EQ(run_cli("synth --preset tiny --layers 4 --weight-type f32 " + flag + " -o " + path).exit_code, 0);
    const cli_result info = run_cli("info -m " + path);
    ASSERT_EQ(info.exit_code, 0) << info.err;
    EXPECT_NE(info.out.find(flag == "--yoco" ? "3 KV layers for 4 layers" : "2 KV layers for 4 layers"),
              std::string::npos)
        << info.out;
    const cli_result run = run_cli("run -m " + path + " -p hello -n 4 --temp 0 -t 1");
    EXPECT_EQ(run.exit_code, 0) << run.err;
    const cli_result other = run_cli("run -m " + path + " -p hello -n 4 --kv-share reuse:from=0");
    EXPECT_EQ(other.exit_code, 2) << other.err;
    EXPECT_NE(other.err.find("declares its own KV sharing"), std::string::npos) << other.err;
    std::remove(path.c_str());
  }
  const cli_result bad = run_cli("synth --preset tiny-phi3 --cla 2 -o /dev/null");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--cla"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace pagoda::test
