// pagoda info on the architectures with sliding-window layers: KV bytes per
// token per layer type, and the block's parts (tests/data/oracle's gemma2 and
// gemma3 files: 2 KV heads of 64 and 1 KV head of 64, window 32); and on a
// mixture of experts (qwen3moe): its experts, and a KV cache as qwen3's.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"

namespace pagoda::test {
namespace {

TEST(cli_info, kv_bytes_per_layer_type_for_gemma2) {
  auto r = run_cli("info --kv-cache-dtype f16 -m " + data_path("oracle/gguf/gemma2-F32.gguf"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("architecture:    gemma2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("attention soft-cap 4, final soft-cap 3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("sliding window of 32 on 1 of 2 layers"), std::string::npos) << r.out;
  // f16 K+V: 2 x 2 heads x 64 x 2 bytes = 512 per token per layer; layer 0
  // local, layer 1 global. At 32K tokens the global layer needs 16 MiB, the
  // local one its window of 32 tokens, 16 KiB.
  EXPECT_NE(r.out.find("global                          1          512.0          512.0              16.00 MiB"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("sliding (window 32)             1          512.0          512.0              16.00 KiB"),
            std::string::npos)
      << r.out;
}

TEST(cli_info, gemma3_two_rope_bases_and_layer_types) {
  auto r = run_cli("info --kv-cache-dtype f16 -m " + data_path("oracle/gguf/gemma3-F32.gguf"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("base 1e+06, 64 dims, neox; base 10000 on sliding-window layers"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("per-head Q/K RMSNorm"), std::string::npos) << r.out;
  // 1 KV head: 256 bytes per token per layer; layers 0 and 1 local.
  EXPECT_NE(r.out.find("sliding (window 32)             2          256.0          512.0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("global                          1          256.0          256.0"), std::string::npos) << r.out;
}

// The RoPE scaling in effect: YaRN's parameters (qwen2-yarn: factor 4 over
// 512 positions, llama.cpp's betas, magnitude 0.1 ln 4 + 1 = 1.139) and Llama
// 3.1-style frequency factors (drawn in [1, 8]).
TEST(cli_info, rope_scaling_in_effect) {
  auto yarn = run_cli("info -m " + data_path("oracle/gguf/qwen2-yarn-F32.gguf"));
  ASSERT_EQ(yarn.exit_code, 0) << yarn.err;
  EXPECT_NE(yarn.out.find("rope:            base 1e+06, 64 dims, neox, YaRN x4 over an original context of 512 "
                          "(beta fast 32, slow 1; cos/sin x 1.139)"),
            std::string::npos)
      << yarn.out;
  auto factors = run_cli("info -m " + data_path("oracle/gguf/llama-ropefreqs-F32.gguf"));
  ASSERT_EQ(factors.exit_code, 0) << factors.err;
  EXPECT_NE(factors.out.find("rope:            base 500000, 64 dims, normal, frequency factors 1."), std::string::npos)
      << factors.out;
  EXPECT_NE(factors.out.find(" (rope_freqs)\n"), std::string::npos) << factors.out;
}

TEST(cli_info, llama_has_only_global_layers) {
  auto r = run_cli("info -m " + data_path("oracle/gguf/synth-llama-Q4_K_M.gguf"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("KV per token by layer type"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("sliding (window"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace pagoda::test

namespace pagoda::test {
namespace {

// run on gemma2 (window 32) past several windows: the sliding layer keeps its
// window in a window group by default, every position with --swa-full; the
// greedy tokens are the same, and the KV used is smaller. A KV policy works
// on the window group too.
TEST(cli_run, a_window_group_by_default_and_swa_full_agree) {
  const std::string args = " -m " + data_path("oracle/gguf/gemma2-F32.gguf") +
                           " -p " + shell_quote("Once upon a time") + " -n 150 --temp 0 --ignore-eos --json -t 1 -c 256 --max-num-batched-tokens 64";
  auto a = run_cli("run" + args);
  auto b = run_cli("run" + args + " --swa-full");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  EXPECT_EQ(ja["tokens"].size(), 150u);
  EXPECT_EQ(ja["tokens"], jb["tokens"]);
  EXPECT_GT(ja["kv"]["window_blocks"].get<int>(), 0);
  EXPECT_EQ(jb["kv"]["window_blocks"].get<int>(), 0);
  EXPECT_LT(ja["kv"]["bytes_used"].get<double>(), jb["kv"]["bytes_used"].get<double>());
  // A default KV policy evicts in both groups, with the same tokens as with every position kept.
  auto p = run_cli("run" + args + " --kv-policy h2o:budget=64");
  auto q = run_cli("run" + args + " --kv-policy h2o:budget=64 --swa-full");
  ASSERT_EQ(p.exit_code, 0) << p.err;
  ASSERT_EQ(q.exit_code, 0) << q.err;
  EXPECT_GT(nlohmann::json::parse(p.out)["kv"]["window_blocks"].get<int>(), 0);
  EXPECT_EQ(nlohmann::json::parse(p.out)["tokens"], nlohmann::json::parse(q.out)["tokens"]);
}

}  // namespace
}  // namespace pagoda::test

namespace pagoda::test {
namespace {

// A mixture of experts (the qwen3moe oracle file: 8 experts of 128, 2 per
// token): info names its experts and the parameters a token computes with
// (2 layers x 6 idle experts x 3 matrices of 256 x 128 fewer), and its KV is
// qwen3's (2 layers x 2 KV heads x 64, f16: 512 bytes per token per layer,
// every layer global).
TEST(cli_info, qwen3moe_shows_its_experts_and_a_plain_kv_cache) {
  auto r = run_cli("info --kv-cache-dtype f16 -m " + data_path("oracle/gguf/qwen3moe-F32.gguf"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("architecture:    qwen3moe"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("feed-forward:    8 experts of 128, 2 per token (SwiGLU; softmax router, top-2 weights "
                       "renormalised)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("parameters:      2364928 (1185280 active per token)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("per-head Q/K RMSNorm"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("global                          2          512.0         1024.0              32.00 MiB"),
            std::string::npos)
      << r.out;
}

}  // namespace
}  // namespace pagoda::test
