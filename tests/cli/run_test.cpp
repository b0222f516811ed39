// End-to-end checks of pagoda run / tokenize / perplexity / info against the
// independent references in tests/data.
#include <cmath>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "common/temp_files.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

TEST(cli_run, greedy_json_reproduces_reference_ids) {
  std::ifstream in(data_path("reference/once_upon_a_time.greedy.json"));
  json ref = json::parse(in);
  auto r = run_cli("run -m " + model_path() + " -p 'Once upon a time' -n 200 --temp 0 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["prompt_tokens"], ref["prompt_tokens_with_bos"]);
  auto got = j["tokens"].get<std::vector<int>>();
  auto want = ref["generated_tokens"].get<std::vector<int>>();
  ASSERT_GE(got.size(), want.size());
  got.resize(want.size());
  EXPECT_EQ(got, want);
  EXPECT_TRUE(j["text"].get<std::string>().starts_with(", there was"));
  EXPECT_GT(j["timings"]["generation_tokens_per_s"].get<double>(), 0);
  EXPECT_EQ(j["kv"]["bytes_per_token"].get<double>(), 1280.0);
}

TEST(cli_run, text_goes_to_stdout_and_stats_to_stderr) {
  auto r = run_cli("run -m " + model_path() + " -p 'Once upon a time' -n 30 --temp 0.8 --seed 3");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.starts_with("Once upon a time")) << r.out;
  EXPECT_GT(r.out.size(), std::string("Once upon a time").size() + 20);
  EXPECT_NE(r.err.find("tok/s"), std::string::npos);
  EXPECT_NE(r.err.find("KV"), std::string::npos);
  EXPECT_EQ(r.out.find("tok/s"), std::string::npos);
  // Same seed, same text; another seed, (almost surely) another text.
  auto again = run_cli("run -m " + model_path() + " -p 'Once upon a time' -n 30 --temp 0.8 --seed 3");
  EXPECT_EQ(again.out, r.out);
  auto other = run_cli("run -m " + model_path() + " -p 'Once upon a time' -n 30 --temp 0.8 --seed 4");
  EXPECT_NE(other.out, r.out);
}

TEST(cli_run, f16_cache_and_block_size_options) {
  auto r = run_cli("run -m " + model_path() + " -p 'Once upon a time' -n 20 --temp 0 --json --kv-cache-dtype f16 --block-size 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["kv"]["type_k"], "f16");
  EXPECT_EQ(j["kv"]["block_size"], 8);
  EXPECT_EQ(j["kv"]["bytes_per_token"].get<double>(), 640.0);
}

// --kv-huge-pages: the same greedy tokens, and one line on stderr saying what
// the pool got (a warning where the kernel gave fewer huge pages). (The
// README's test checks that every engine command takes the flag.)
TEST(cli_run, kv_huge_pages_give_the_same_tokens_and_say_what_the_pool_got) {
  const std::string args = "run -m " + model_path() + " -p 'Once upon a time' -n 24 --temp 0 --json";
  auto base = run_cli(args);
  auto huge = run_cli(args + " --kv-huge-pages");
  ASSERT_EQ(base.exit_code, 0) << base.err;
  ASSERT_EQ(huge.exit_code, 0) << huge.err;
  EXPECT_EQ(json::parse(huge.out)["tokens"], json::parse(base.out)["tokens"]);
  EXPECT_NE(huge.err.find("--kv-huge-pages: KV pool faulted in at start"), std::string::npos) << huge.err;
  EXPECT_EQ(base.err.find("--kv-huge-pages"), std::string::npos) << base.err;
}

TEST(cli_run, clear_errors) {
  auto missing = run_cli("run -m /nonexistent/model.gguf -p hi");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("/nonexistent/model.gguf"), std::string::npos) << missing.err;

  std::string long_prompt;
  for (int i = 0; i < 200; ++i) long_prompt += "Once upon a time ";
  auto too_long = run_cli("run -m " + model_path() + " --ctx 64 -p " + shell_quote(long_prompt));
  EXPECT_EQ(too_long.exit_code, 1);
  EXPECT_NE(too_long.err.find("context"), std::string::npos) << too_long.err;

  auto small_pool = run_cli("run -m " + model_path() + " --max-kv-tokens 16 -p " + shell_quote(long_prompt.substr(0, 300)));
  EXPECT_EQ(small_pool.exit_code, 1);
  EXPECT_NE(small_pool.err.find("pool"), std::string::npos) << small_pool.err;

  auto bad_type = run_cli("run -m " + model_path() + " -p hi --kv-cache-dtype f7");
  EXPECT_EQ(bad_type.exit_code, 1);
  EXPECT_NE(bad_type.err.find("f7"), std::string::npos) << bad_type.err;

  auto bad_temp = run_cli("run -m " + model_path() + " -p hi --temp -1");
  EXPECT_EQ(bad_temp.exit_code, 1);
  EXPECT_NE(bad_temp.err.find("temperature"), std::string::npos) << bad_temp.err;

  std::string junk = "/tmp/pagoda_junk_" + std::to_string(getpid()) + ".gguf";
  std::ofstream(junk) << "this is not a gguf file at all";
  auto not_gguf = run_cli("run -m " + junk + " -p hi");
  std::remove(junk.c_str());
  EXPECT_EQ(not_gguf.exit_code, 1);
  EXPECT_NE(not_gguf.err.find("magic"), std::string::npos) << not_gguf.err;
}

TEST(cli_tokenize, ids_on_one_line) {
  auto r = run_cli("tokenize -m " + model_path() + " -p 'Once upon a time'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "1 403 407 261 378\n");
  auto nb = run_cli("tokenize -m " + model_path() + " -p 'Once upon a time' --no-bos");
  EXPECT_EQ(nb.out, "403 407 261 378\n");
  // A vocabulary-only file is enough.
  auto vocab = run_cli("tokenize -m " + data_path("tokenizer/ggml-vocab-phi-3.gguf") + " -p 'Hello world' --no-bos");
  EXPECT_EQ(vocab.exit_code, 0) << vocab.err;
  EXPECT_FALSE(vocab.out.empty());
}

// The reference: 179,693 predicted tokens, mean NLL 1.3691 (tests/data/README.md),
// with every story cut at 512 tokens (--truncate; by default they are windowed).
TEST(cli_perplexity, dev_text_matches_reference_nll) {
  auto r = run_cli("perplexity -m " + model_path() + " -f " + data_path("tinystories_dev.txt") +
                   " --ctx 512 --kv-cache-dtype f32 --json --truncate");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["predicted_tokens"].get<long>(), 179693);
  EXPECT_EQ(j["documents"].get<int>(), 500);
  EXPECT_EQ(j["documents_truncated"].get<int>(), 55);
  EXPECT_NEAR(j["mean_nll"].get<double>(), 1.3691, 1.3691 * 0.001);
  EXPECT_NEAR(j["perplexity"].get<double>(), 3.932, 0.004);
}

TEST(cli_info, reports_shape_and_kv_cost) {
  auto r = run_cli("info -m " + model_path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("llama"), std::string::npos);
  EXPECT_NE(r.out.find("260032"), std::string::npos) << r.out;
  // 2 x 5 layers x 4 KV heads x 8 x 4 bytes = 1280; f16: 640.
  EXPECT_NE(r.out.find("1280.0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("640.0"), std::string::npos) << r.out;
}

// --kv-segment-dtype: info lists each class's cost beside the configured type.
TEST(cli_info, reports_the_kv_classes) {
  auto r = run_cli("info -m " + model_path() + " --kv-segment-dtype int4:0.5 --kv-segment-dtype int8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::size_t at = r.out.find("KV classes");
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_NE(r.out.find("int4/channel+int4/token", at), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("int8/token+int8/token", at), std::string::npos) << r.out;
}

// perplexity --segment-kv-type: the first 75% of each piece in int8, the rest
// f16; the rows past it are reported apart, and the typed part costs less.
TEST(cli_perplexity, a_typed_segment_of_each_piece) {
  std::ifstream in(std::string(PAGODA_SOURCE_DIR) + "/tests/data/tinystories_dev.txt");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  const std::string path = temp_file("cli", "segment.txt");
  std::ofstream(path) << text.substr(0, text.find("<|endoftext|>", 6000));
  auto r = run_cli("perplexity -m " + model_path() + " -f " + path +
                   " --ctx 256 --kv-cache-dtype f16 --segment-kv-type int8 --kl-divergence --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["segment"]["kv_type"], "int8");
  EXPECT_EQ(j["segment"]["fraction"].get<double>(), 0.75);
  EXPECT_LT(j["segment"]["mean_bytes_per_token"].get<double>(), j["kv"]["bytes_per_token"].get<double>());
  EXPECT_GT(j["after_segment"]["rows"].get<long>(), 100);
  EXPECT_GT(j["kl_divergence"]["mean_kl"].get<double>(), 0.0) << "int8 blocks were read";
  EXPECT_LT(j["after_segment"]["mean_kl"].get<double>(), j["kl_divergence"]["mean_kl"].get<double>());
  auto bad = run_cli("perplexity -m " + model_path() + " -f " + path + " --segment-kv-type int9");
  EXPECT_NE(bad.exit_code, 0);
}

// A llama-quantize Q4_K_M file (tests/data/oracle) mixes q4_K and q6_K: info
// lists both, and every matrix is used from the mapping as stored.
TEST(cli_info, reports_mixed_weight_types_and_resident_bytes) {
  auto r = run_cli("info -m " + data_path("oracle/gguf/synth-llama-Q4_K_M.gguf"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("q4_K x13"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("q6_K x3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("f32 x5"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("0 bytes repacked at load"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("resident:"), std::string::npos) << r.out;
}

// run --json gives each phase's process CPU time next to its wall time; with
// one thread the CPU time cannot exceed the wall time (by more than a clock
// tick), and generating 200 tokens takes some of it.
TEST(cli_run, json_timings_carry_cpu_time) {
  auto r = run_cli("run -m " + model_path() + " -p " + shell_quote("Once upon a time") +
                   " -n 200 --temp 0 --ignore-eos --json -t 1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json t = json::parse(r.out)["timings"];
  for (const char* phase : {"prompt", "generation"}) {
    const double cpu = t[std::string(phase) + "_cpu_ms"].get<double>(), wall = t[std::string(phase) + "_ms"].get<double>();
    EXPECT_GT(cpu, 0.0) << phase;
    EXPECT_LE(cpu, wall + 5.0) << phase;
  }
}

// --no-mmap reads the file into memory: info says so and counts it as
// resident, and run generates the same greedy text as from the mapping.
TEST(cli_no_mmap, info_reports_memory_and_run_matches_the_mapping) {
  const std::string model = data_path("oracle/gguf/synth-llama-Q4_K_M.gguf");
  auto info = run_cli("info -m " + model + " --no-mmap");
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_NE(info.out.find("read into memory at load (--no-mmap"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("resident:        883.84 KiB read into memory (the whole file"), std::string::npos) << info.out;
  EXPECT_EQ(info.out.find("paged in as used"), std::string::npos) << info.out;
  auto mapped = run_cli("info -m " + model);
  EXPECT_NE(mapped.out.find("paged in as used"), std::string::npos) << mapped.out;

  const std::string args = " -p " + shell_quote("Once upon a time") + " -n 24 --temp 0 --ignore-eos --json -t 1";
  auto a = run_cli("run -m " + model_path() + args);
  auto b = run_cli("run -m " + model_path() + args + " --no-mmap");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const json ja = json::parse(a.out), jb = json::parse(b.out);
  EXPECT_EQ(ja["tokens"].size(), 24u);
  EXPECT_EQ(ja["tokens"], jb["tokens"]);
  EXPECT_EQ(ja["text"], jb["text"]);
  auto missing = run_cli("run -m /nonexistent.gguf -p hi --no-mmap");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("/nonexistent.gguf: cannot open"), std::string::npos) << missing.err;
}

}  // namespace
}  // namespace pagoda::test
