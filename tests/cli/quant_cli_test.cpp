// Quantized KV caches end to end: run, perplexity (--kl-divergence), batch,
// info, calibrate / --kv-scales and the KV type options' errors.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "common/temp_files.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

std::string temp_path(const std::string& name) {
  return temp_file("quant_cli", name);
}

// The first n documents of the dev text, for quick runs.
std::string dev_subset(int n) {
  std::string path = temp_path("dev" + std::to_string(n) + ".txt");
  std::ifstream in(data_path("tinystories_dev.txt"));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str(), out;
  std::size_t at = 0;
  for (int i = 0; i < n && at != std::string::npos; ++i) {
    std::size_t next = text.find("<|endoftext|>", at);
    out += text.substr(at, next == std::string::npos ? std::string::npos : next + 13 - at);
    at = next == std::string::npos ? next : next + 13;
  }
  std::ofstream(path) << out;
  return path;
}

json perplexity(const std::string& file, const std::string& args) {
  auto r = run_cli("perplexity -m " + model_path() + " -f " + file + " --ctx 512 --kl-divergence --json " + args);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r.exit_code == 0 ? json::parse(r.out) : json();
}

TEST(quant_cli, kl_divergence_of_the_exact_cache_is_zero) {
  json j = perplexity(dev_subset(20), "--kv-cache-dtype f32");
  const json& k = j["kl_divergence"];
  EXPECT_EQ(k["mean_kl"].get<double>(), 0.0);
  EXPECT_EQ(k["top1_agreement"].get<double>(), 1.0);
  EXPECT_EQ(k["perplexity_change_percent"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(k["exact_perplexity"].get<double>(), j["perplexity"].get<double>());
}

TEST(quant_cli, every_codec_runs_perplexity_with_sane_quality) {
  std::string file = dev_subset(20);
  struct expect {
    const char* dtype;
    double max_change_percent;  // loose: 20 documents
    double max_kl;
  };
  for (expect e : {expect{"f16", 0.01, 1e-5}, expect{"bf16", 0.1, 1e-3}, expect{"fp8", 3, 0.05},
                   expect{"fp8_e5m2", 10, 0.1}, expect{"int8", 0.3, 0.01}, expect{"int8/channel", 0.3, 0.01},
                   expect{"int4", 5, 0.05}, expect{"int2", 200, 2}, expect{"q8_0", 0.5, 0.01}, expect{"q4_0", 300, 2},
                   expect{"k8v4", 1, 0.02}, expect{"k4v2", 20, 0.3}}) {
    json j = perplexity(file, std::string("--kv-cache-dtype ") + e.dtype);
    const json& k = j["kl_divergence"];
    EXPECT_LT(std::abs(k["perplexity_change_percent"].get<double>()), e.max_change_percent) << e.dtype;
    EXPECT_LT(k["mean_kl"].get<double>(), e.max_kl) << e.dtype;
    if (std::string(e.dtype) != "f16") {
      EXPECT_GT(k["mean_kl"].get<double>(), 0.0) << e.dtype << " is not quantizing";
    }
  }
}

// The bounds on the whole dev text at --ctx 512: int8 (any granularity)
// within 0.1% perplexity of f32 KV; KIVI-style int4 within 5%.
TEST(quant_cli, done_when_quality_bounds_on_the_dev_text) {
  std::string file = data_path("tinystories_dev.txt");
  for (const char* dtype : {"int8", "int8/channel"}) {
    json j = perplexity(file, std::string("--kv-cache-dtype ") + dtype);
    EXPECT_LT(std::abs(j["kl_divergence"]["perplexity_change_percent"].get<double>()), 0.1) << dtype;
  }
  json kivi = perplexity(file, "--kv-cache-dtype int4");
  EXPECT_EQ(kivi["kv"]["layout"], "int4/channel+int4/token");
  EXPECT_LT(std::abs(kivi["kl_divergence"]["perplexity_change_percent"].get<double>()), 5.0);
}

TEST(quant_cli, run_with_quantized_caches) {
  for (const char* args : {"--kv-cache-dtype int8", "-ctk int4 -ctv int2", "--kv-cache-dtype q8_0",
                           "--kv-cache-dtype f32 --kv-layer-types 0-1:f16,2-:k8v4", "--kv-cache-dtype fp8_e5m2"}) {
    auto r = run_cli("run -m " + model_path() + " -p 'Once upon a time' -n 40 --temp 0 --json " + args);
    ASSERT_EQ(r.exit_code, 0) << args << ": " << r.err;
    json j = json::parse(r.out);
    EXPECT_GE(j["tokens"].size(), 20u) << args;
    EXPECT_TRUE(j["text"].get<std::string>().starts_with(",")) << args << ": " << j["text"];
  }
  auto r = run_cli("run -m " + model_path() + " -p 'Once upon a time' -n 10 --temp 0 --json -ctk int4 -ctv int4");
  json j = json::parse(r.out);
  EXPECT_EQ(j["kv"]["type_k"], "int4");
  // KIVI int4 on stories260K: K 16x8/2 codes + 2x2x8 scale/offset bytes per 16 tokens, V 4 + 4 per token; x 4 heads x 5 layers.
  EXPECT_DOUBLE_EQ(j["kv"]["bytes_per_token"].get<double>(), 5 * 4 * ((64.0 + 32) / 16 + 8));
}

// Every codec family in the engine: many sequences with open blocks at once,
// forks (copy-on-write of a staged block) and a deterministic result.
TEST(quant_cli, batch_with_every_codec_is_deterministic) {
  std::string in = temp_path("batch.jsonl");
  {
    std::ofstream f(in);
    for (int i = 0; i < 12; ++i)
      f << "{\"id\": \"r" << i << "\", \"prompt\": \"Once upon a time there was a " << (i % 3 ? "cat" : "little dog")
        << "\", \"max_tokens\": " << 20 + i << ", \"temperature\": 0.8, \"seed\": " << i
        << (i % 4 == 0 ? ", \"n\": 2" : "") << "}\n";
  }
  for (const char* kv : {"-ctk int4 -ctv int4", "--kv-cache-dtype int8", "--kv-cache-dtype fp8", "-ctk bf16 -ctv fp8_e5m2",
                         "-ctk int4 -ctv int2", "--kv-cache-dtype int2", "-ctk q8_0 -ctv q4_0",
                         "--kv-cache-dtype f32 --kv-layer-types 0-1:f16,2-:k8v4"}) {
    std::string args = "batch -m " + model_path() + " -i " + in + " -t 1 --max-num-seqs 8 " + kv;
    auto a = run_cli(args), b = run_cli(args);
    ASSERT_EQ(a.exit_code, 0) << kv << ": " << a.err;
    EXPECT_EQ(a.out, b.out) << kv;
    std::istringstream lines(a.out);
    std::string line;
    int n = 0;
    while (std::getline(lines, line)) {
      json j = json::parse(line);
      EXPECT_FALSE(j.contains("error")) << kv << ": " << line;
      EXPECT_GE(j["usage"]["completion_tokens"].get<int>(), 1) << kv << ": " << line;
      ++n;
    }
    EXPECT_EQ(n, 12) << kv;
  }
  std::remove(in.c_str());
}

TEST(quant_cli, calibrate_then_static_scales) {
  std::string file = dev_subset(30), scales = temp_path("scales.json");
  auto c = run_cli("calibrate -m " + model_path() + " -f " + file + " --ctx 512 --clip p99.9 -o " + scales);
  ASSERT_EQ(c.exit_code, 0) << c.err;
  std::ifstream in(scales);
  json s = json::parse(in);
  EXPECT_EQ(s["format"], "pagoda-kv-scales");
  EXPECT_EQ(s["clip"], "p99.9");
  EXPECT_EQ(s["layers"].size(), 5u);
  json j = perplexity(file, "--kv-cache-dtype int8 --kv-scales " + scales);
  EXPECT_EQ(j["kv"]["layout"], "int8/static+int8/static");
  EXPECT_LT(std::abs(j["kl_divergence"]["perplexity_change_percent"].get<double>()), 0.5);
  // An explicit mode wins over the file.
  json t = perplexity(file, "--kv-cache-dtype int8 -ctv int4/token --kv-scales " + scales);
  EXPECT_EQ(t["kv"]["layout"], "int8/static+int4/token");
  // Static scales without a file: a clear error.
  auto none = run_cli("run -m " + model_path() + " -p hi -n 1 -ctk int8/static");
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.err.find("--kv-scales"), std::string::npos) << none.err;
  // A file for another shape.
  s["head_dim"] = 16;
  for (auto& layer : s["layers"])
    for (const char* kind : {"k", "v"})
      for (const char* side : {"lo", "hi"})
        for (auto& head : layer[kind][side]) head = std::vector<float>(16, 0.0f);
  std::ofstream(scales) << s.dump();
  auto wrong = run_cli("run -m " + model_path() + " -p hi -n 1 --kv-cache-dtype int8 --kv-scales " + scales);
  EXPECT_EQ(wrong.exit_code, 1);
  EXPECT_NE(wrong.err.find("head_dim 16"), std::string::npos) << wrong.err;
  std::remove(scales.c_str());
}

TEST(quant_cli, kv_type_option_errors) {
  struct bad {
    const char* args;
    const char* expect;
  };
  for (bad b : {bad{"--kv-cache-dtype int3", "int3"}, bad{"-ctk int4/g3", "does not divide head_dim 8"},
                bad{"-ctv f16/token", "scale mode"}, bad{"--kv-layer-types 0-9:int8", "past the model's 5 layers"},
                bad{"--kv-layer-types 2:int4/diagonal", "diagonal"}, bad{"--kv-cache-dtype k3v4", "bits"}}) {
    auto r = run_cli("run -m " + model_path() + " -p hi -n 1 " + b.args);
    EXPECT_EQ(r.exit_code, 1) << b.args;
    EXPECT_NE(r.err.find(b.expect), std::string::npos) << b.args << ": " << r.err;
  }
}

TEST(quant_cli, info_lists_bytes_per_token_per_configuration) {
  auto r = run_cli("info -m " + model_path() + " -ctk int4 -ctv int2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* row : {"int8/token+int8/token", "int4/channel+int4/token", "int4/token+int4/token", "q8_0+q8_0",
                          "int8/token+int4/token", "configured:"})
    EXPECT_NE(r.out.find(row), std::string::npos) << row << "\n" << r.out;
  // KIVI int4: 280 bytes/token sealed, a 5 KiB f16 window (K of 5 layers x 4 heads x 16 x 8 x 2 bytes).
  EXPECT_NE(r.out.find("280.0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("5.00 KiB"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace pagoda::test
