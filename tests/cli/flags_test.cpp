// The CLI's traps, each a one-line error and a non-zero exit: a KV pool too
// small for the sequence, NaN sizes, overlapping --kv-layer-types, a bad
// --tenant-quota, GGUFs with a non-finite rope base or NaN token scores. And
// what a llama.cpp user types: run -f FILE, --version, defaults in every
// --help, the GPU flags (accepted, with a note that this build runs on the CPU).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <regex>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "model/gguf.h"
#include "model/gguf_util.h"
#include "model/gguf_writer.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

std::string temp_file(const std::string& name) { return "/tmp/pagoda_flags_" + std::to_string(getpid()) + "_" + name; }

int line_count(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

// A failure: exit 1, nothing on stdout, one line on stderr holding `fragment`.
void expect_one_line_error(const cli_result& r, const std::string& fragment) {
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_EQ(line_count(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
}

const std::string k_run = "run -m " + model_path() + " ";

// Each of `bad` (run arguments) fails with `fragment`; `good` runs.
void expect_refused_but(const std::vector<std::string>& bad, const std::string& fragment, const std::string& good) {
  for (const std::string& args : bad) expect_one_line_error(run_cli(k_run + args), fragment);
  auto ok = run_cli(k_run + good);
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

TEST(cli_flags, run_with_a_pool_too_small_for_the_sequence_fails) {
  // The same pool with a sequence that fits runs.
  expect_refused_but({"-p 'Once upon a time' -n 200 --max-kv-tokens 64", "-p 'Once upon a time' -n 200 --kv-cache-size 0.05"},
                     "KV pool is too small", "-p 'Once upon a time' -n 40 --max-kv-tokens 64 --json");
}

TEST(cli_flags, non_finite_numbers_are_refused) {
  for (const char* v : {"nan", "inf", "-1", "0", "x"})
    expect_one_line_error(run_cli(k_run + "-p a --kv-cache-size " + std::string(v)), "--kv-cache-size");
  expect_one_line_error(run_cli("serve -m " + model_path() + " --http-header-timeout nan --no-kv-store"),
                        "--http-header-timeout");
  expect_one_line_error(run_cli("serve -m " + model_path() + " --log-stats-interval inf --no-kv-store"),
                        "--log-stats-interval");
}

TEST(cli_flags, overlapping_kv_layer_types_are_refused) {
  expect_refused_but({"-p a -n 1 --kv-layer-types 0-3:f16,2-:int4", "-p a -n 1 --kv-layer-types 1:f16,1-1:int8"},
                     "both set layer", "-p a -n 1 --kv-layer-types 0-1:f16,2-:int4");
}

TEST(cli_flags, tenant_quota_must_be_a_whole_number) {
  const std::string in = temp_file("quota.jsonl");
  std::ofstream(in) << R"({"id": 1, "prompt": "a", "max_tokens": 1})" "\n";
  for (const char* q : {"a=5x", "a=", "=5", "a=-1", "a=1.5"})
    expect_one_line_error(run_cli("batch -m " + model_path() + " -i " + in + " --tenant-quota " + q), "--tenant-quota");
  auto ok = run_cli("batch -m " + model_path() + " -i " + in + " --tenant-quota a=5");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  std::remove(in.c_str());
}

TEST(cli_flags, run_reads_its_prompt_from_a_file) {
  const std::string prompt = "Once upon a time, there was a cat";
  const std::string path = temp_file("prompt.txt");
  std::ofstream(path) << prompt << "\n";  // one trailing newline is dropped, as llama.cpp does
  auto from_file = run_cli(k_run + "-f " + path + " -n 12 --temp 0 --json");
  auto from_flag = run_cli(k_run + "-p " + shell_quote(prompt) + " -n 12 --temp 0 --json");
  ASSERT_EQ(from_file.exit_code, 0) << from_file.err;
  ASSERT_EQ(from_flag.exit_code, 0) << from_flag.err;
  json a = json::parse(from_file.out), b = json::parse(from_flag.out);
  EXPECT_EQ(a["prompt"], prompt);
  EXPECT_EQ(a["prompt_tokens"], b["prompt_tokens"]);
  EXPECT_EQ(a["tokens"], b["tokens"]);
  expect_one_line_error(run_cli(k_run + "-f " + path + " -p x"), "excludes");
  expect_one_line_error(run_cli(k_run + "-n 2"), "-p TEXT or -f FILE");
  expect_one_line_error(run_cli(k_run + "-f /nonexistent/prompt.txt"), "/nonexistent/prompt.txt");
  expect_one_line_error(run_cli(k_run + "-f /tmp"), "directory");
  std::remove(path.c_str());
}

// --logit-bias 2+100 makes stories260K's EOS (token 2) the next token: run
// stops at once; with --ignore-eos it goes on to -n. Speed counts the tokens
// of the passes after the prompt's, the EOS one included.
TEST(cli_flags, run_ignore_eos_and_logit_bias) {
  auto stop = run_cli(k_run + "-p 'Once upon a time' -n 5 --temp 0 --json --logit-bias 2+100");
  ASSERT_EQ(stop.exit_code, 0) << stop.err;
  json a = json::parse(stop.out);
  EXPECT_EQ(a["stop_reason"], "eos");
  EXPECT_TRUE(a["tokens"].empty());
  EXPECT_EQ(a["timings"]["generation_tokens"], 0);  // the EOS came with the prompt's pass
  auto go = run_cli(k_run + "-p 'Once upon a time' -n 5 --temp 0 --json -l 2+100 --ignore-eos");
  ASSERT_EQ(go.exit_code, 0) << go.err;
  json b = json::parse(go.out);
  EXPECT_EQ(b["stop_reason"], "length");
  EXPECT_EQ(b["tokens"], json(std::vector<int>(5, 2)));
  EXPECT_EQ(b["timings"]["generation_tokens"], 4);
  EXPECT_EQ(b["timings"]["generation_passes"], 4);
  EXPECT_NEAR(b["timings"]["generation_tokens_per_s"].get<double>(),
              4 / (b["timings"]["generation_ms"].get<double>() * 1e-3), 1e-6 * b["timings"]["generation_tokens_per_s"].get<double>());
  // A -inf bias bans a token: greedy never picks it.
  auto plain = run_cli(k_run + "-p 'Once upon a time' -n 8 --temp 0 --json");
  const int first = json::parse(plain.out)["tokens"][0];
  auto banned = run_cli(k_run + "-p 'Once upon a time' -n 8 --temp 0 --json -l " + std::to_string(first) + "-inf");
  ASSERT_EQ(banned.exit_code, 0) << banned.err;
  EXPECT_NE(json::parse(banned.out)["tokens"][0], first);
  expect_one_line_error(run_cli(k_run + "-p a -l 2x5"), "--logit-bias");
  expect_one_line_error(run_cli(k_run + "-p a -l 2+500"), "logit_bias");
  expect_one_line_error(run_cli(k_run + "-p a -l 9999+1"), "outside the vocabulary");
}

TEST(cli_flags, version_is_the_servers) {
  auto r = run_cli("--version");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, std::string("pagoda ") + PAGODA_VERSION_STRING + "\n");
}

// Every numeric option of every subcommand shows its default in --help.
TEST(cli_flags, every_help_shows_defaults) {
  auto top = run_cli("--help");
  ASSERT_EQ(top.exit_code, 0);
  std::vector<std::string> subcommands;
  {
    std::istringstream in(top.out.substr(top.out.find("Subcommands:")));
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::smatch m;
      if (std::regex_search(line, m, std::regex(R"(^\s+(\w+)\s)"))) subcommands.push_back(m[1]);
    }
  }
  EXPECT_GE(subcommands.size(), 9u) << top.out;
  // CLI11 prints "-n,--n-predict INT:INT in [0 - 16777216]=128": the type, its check, "=" and the default.
  const std::regex numeric(R"(^\s+-\S+\s+(INT|UINT|FLOAT)\b)");
  for (const std::string& sub : subcommands) {
    auto h = run_cli(sub + " --help");
    ASSERT_EQ(h.exit_code, 0) << sub;
    std::istringstream in(h.out);
    std::string line;
    int n_numeric = 0;
    while (std::getline(in, line)) {
      std::smatch m;
      if (!std::regex_search(line, m, numeric)) continue;
      ++n_numeric;
      // The type column ends at the description, two spaces on (or the line's end).
      const std::string type = line.substr(m.position(1), line.find("  ", m.position(1)) - m.position(1));
      EXPECT_TRUE(std::regex_search(type, std::regex(R"(=\S|REQUIRED)"))) << sub << ": " << line;
    }
    if (sub == "run" || sub == "serve" || sub == "batch") {
      EXPECT_GT(n_numeric, 3) << sub << "\n" << h.out;
    }
  }
  auto run_help = run_cli("run --help");
  EXPECT_NE(run_help.out.find("=128"), std::string::npos) << run_help.out;  // -n
}

TEST(cli_flags, llama_cpp_gpu_flags_are_accepted_with_a_note) {
  auto r = run_cli(k_run + "-p 'Once upon a time' -n 4 --temp 0 --json -ngl 99 -fa -sm layer -mg 0 -ts 1,1 -nkvo");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["tokens"].size(), 4u);
  std::istringstream in(r.err);
  std::string line;
  int notes = 0;
  while (std::getline(in, line)) {
    if (line.find("this build runs on the CPU") == std::string::npos) continue;
    ++notes;
    for (const char* f : {"--n-gpu-layers", "--flash-attn", "--split-mode", "--main-gpu", "--tensor-split", "--no-kv-offload"})
      EXPECT_NE(line.find(f), std::string::npos) << line;
  }
  EXPECT_EQ(notes, 1) << r.err;
  for (const char* flags : {"--n-gpu-layers 10", "-fa on", "--flash-attn off", "-ngl=99", "--gpu-layers 1"}) {
    auto g = run_cli(k_run + "-p a -n 1 " + std::string(flags));
    EXPECT_EQ(g.exit_code, 0) << flags << ": " << g.err;
    EXPECT_NE(g.err.find("this build runs on the CPU"), std::string::npos) << flags;
  }
  auto plain = run_cli(k_run + "-p a -n 1");
  EXPECT_EQ(plain.err.find("this build runs on the CPU"), std::string::npos) << plain.err;
}

// stories260K copied with one metadata value replaced.
std::string with_metadata(const std::string& name, const std::string& key, const std::function<void(gguf::writer&)>& add) {
  auto f = gguf::file::open(model_path());
  EXPECT_TRUE(f.ok());
  gguf::writer w;
  for (const gguf::metadata_entry& m : (*f)->metadata()) {
    const std::string k(m.key);
    if (k == "general.alignment" || k == key) continue;
    copy_value(w, k, m.val);
  }
  add(w);
  for (const gguf::tensor_info& t : (*f)->tensors())
    w.add_tensor(t.name, t.type, std::vector<std::int64_t>(t.ne, t.ne + t.n_dims),
                 std::span<const std::byte>(t.data, t.size_bytes));
  const std::string path = temp_file(name + ".gguf");
  EXPECT_TRUE(w.write_file(path).ok());
  return path;
}

TEST(cli_flags, gguf_with_non_finite_values_is_refused) {
  for (float base : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    const std::string path = with_metadata("rope", "llama.rope.freq_base",
                                           [&](gguf::writer& w) { w.add_f32("llama.rope.freq_base", base); });
    expect_one_line_error(run_cli("run -m " + path + " -p a -n 1"), "rope.freq_base");
    std::remove(path.c_str());
  }
  auto f = gguf::file::open(model_path());
  ASSERT_TRUE(f.ok());
  auto scores = (*f)->get_f32_array("tokenizer.ggml.scores");
  ASSERT_TRUE(scores.ok());
  std::vector<float> bad(scores->begin(), scores->end());
  bad[5] = std::nanf("");
  const std::string path = with_metadata("scores", "tokenizer.ggml.scores",
                                         [&](gguf::writer& w) { w.add_array("tokenizer.ggml.scores", bad); });
  expect_one_line_error(run_cli("run -m " + path + " -p a -n 1"), "tokenizer.ggml.scores[5] is NaN");
  std::remove(path.c_str());
}

}  // namespace
}  // namespace pagoda::test
