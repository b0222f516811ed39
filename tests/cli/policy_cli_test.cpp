// KV policies end to end through the commands: every policy runs in `run`,
// `batch` and `perplexity`, with exact and quantized KV and prefix caching on;
// a policy whose budget is the whole context changes nothing; a small budget
// evicts (the engine counts its compactions) and frees blocks.
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "common/temp_files.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

// Greedy token ids of `pagoda run` (its --json output on stdout).
std::vector<int> run_ids(const std::string& extra, int n = 120) {
  auto r = run_cli("run -m " + model_path() + " -p " + shell_quote("Once upon a time") + " -n " + std::to_string(n) +
                   " --temp 0 --ignore-eos --json -t 1 " + extra);
  EXPECT_EQ(r.exit_code, 0) << extra << "\n" << r.err;
  if (r.exit_code != 0) return {};
  return json::parse(r.out)["tokens"].get<std::vector<int>>();
}

const char* const k_policies[] = {"window", "h2o", "snapkv", "pyramid", "merge", "cluster", "quest", "retrieval"};

// With a budget of the whole context, a policy keeps (or reads) everything:
// the tokens are those of full KV. A small one changes what the model sees.
TEST(cli_policy, run_every_policy_exact_at_full_budget) {
  for (const char* kv : {"f32", "int4"}) {
    const std::vector<int> full = run_ids(std::string("--kv-cache-dtype ") + kv);
    ASSERT_EQ(full.size(), 120u);
    for (const char* p : k_policies) {
      const std::string name(p);
      const std::string whole = name == "retrieval" ? "retrieval:k=1.0" : name + ":budget=1.0";
      EXPECT_EQ(run_ids(std::string("--kv-cache-dtype ") + kv + " --kv-policy " + whole), full) << whole << " " << kv;
      const std::string small = name == "retrieval" ? "retrieval:k=8,recent=16"
                                : name == "quest"   ? "quest:budget=0.125,min_context=32"
                                                    : name + ":budget=24";
      const std::vector<int> ids = run_ids(std::string("--kv-cache-dtype ") + kv + " --kv-policy " + small);
      EXPECT_EQ(ids.size(), 120u) << small << " " << kv;
    }
  }
}

std::string write_temp(const std::string& name, const std::string& content) {
  std::string path = temp_file("policy", name);
  std::ofstream(path) << content;
  return path;
}

// Per-line policies in a batch, with prefix caching on: every line completes,
// the evicting ones are counted, and the pool's blocks all come back.
TEST(cli_policy, batch_lines_name_their_own_policies) {
  std::string lines;
  int i = 0;
  for (const char* p : k_policies) {
    const std::string spec = std::string(p) == "retrieval" ? "retrieval:k=8" : std::string(p) + ":budget=0.25";
    lines += json({{"id", std::to_string(i++)}, {"prompt", "Once upon a time"}, {"max_tokens", 150},
                   {"temperature", 0}, {"ignore_eos", true}, {"kv_policy", spec}})
                 .dump() +
             "\n";
  }
  lines += R"({"id": "bad", "prompt": "Once", "kv_policy": "lru"})" "\n";
  const std::string in = write_temp("in.jsonl", lines);
  for (const char* kv : {"f16", "int4"}) {
    auto r = run_cli("batch -m " + model_path() + " -i " + in + " --json-summary -t 1 --kv-key-summaries --kv-cache-dtype " + kv);
    ASSERT_EQ(r.exit_code, 1) << "the bad line fails the batch's exit code: " << r.err;
    std::istringstream out(r.out);
    std::string line;
    int n_ok = 0;
    while (std::getline(out, line)) {
      if (line.empty()) continue;
      const json j = json::parse(line);
      if (j["id"] == "bad") {
        EXPECT_NE(j["error"]["message"].get<std::string>().find("lru"), std::string::npos) << j;
        continue;
      }
      EXPECT_EQ(j["completions"][0]["token_ids"].size(), 150u) << j;
      ++n_ok;
    }
    EXPECT_EQ(n_ok, 8);
    const json summary = json::parse(r.err.substr(r.err.rfind('{')));
    EXPECT_GT(summary["policy_compactions"].get<int>(), 0) << summary;
    EXPECT_GT(summary["policy_evicted_slots"].get<int>(), 0) << summary;
    // The quest and retrieval lines' key bounds and ANN indexes were counted.
    EXPECT_GT(summary["peak_selector_bytes"].get<std::int64_t>(), 0) << summary;
    // The retrieval line read fewer tokens than its rows could see; every line's rows were counted.
    EXPECT_GT(summary["decode_read_tokens_per_row"].get<double>(), 0.0) << summary;
    EXPECT_LT(summary["decode_read_fraction"].get<double>(), 1.0) << summary;
    EXPECT_GT(summary["decode_read_fraction"].get<double>(), 0.0) << summary;
    EXPECT_EQ(summary["kv_usage_end"].get<double>(), 0.0) << summary;
  }
  std::remove(in.c_str());
}

// A temporary file of the dev text's first n documents.
std::string first_dev_documents(int n) {
  std::ifstream f(data_path("tinystories_dev.txt"));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::size_t at = 0;
  for (int d = 0; d < n; ++d) at = text.find("<|endoftext|>", at) + 13;
  return write_temp("docs" + std::to_string(n) + ".txt", text.substr(0, at));
}

// Perplexity states the decode-time setting and what the cache kept; with an
// evicting policy it is worse than exact, never better by more than noise.
TEST(cli_policy, perplexity_in_the_decode_time_setting) {
  const std::string file = first_dev_documents(6);
  auto r = run_cli("perplexity -m " + model_path() + " -f " + file + " --ctx 512 --json --kl-divergence " +
                   "--kv-policy window:budget=0.25,slack=0");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_NE(j["scoring"].get<std::string>().find("decode-time setting"), std::string::npos) << j["scoring"];
  const double kept = j["kv_policy"]["mean_kept_fraction"];
  EXPECT_GT(kept, 0.2);
  EXPECT_LT(kept, 0.5);
  // An evicting policy reads all it keeps.
  EXPECT_EQ(j["kv_policy"]["read"]["read_fraction"].get<double>(), 1.0) << j["kv_policy"];
  EXPECT_GT(j["kl_divergence"]["mean_kl"].get<double>(), 0.0);
  EXPECT_GT(j["kl_divergence"]["perplexity_change_percent"].get<double>(), -0.5);
  std::remove(file.c_str());
}

// A sparse read keeps everything and reads a part: perplexity reports the
// part read beside what was kept (steps of up to 8 tokens: quest selects for them).
TEST(cli_policy, perplexity_reports_what_a_sparse_read_read) {
  const std::string file = first_dev_documents(6);
  auto r = run_cli("perplexity -m " + model_path() + " -f " + file + " --ctx 512 --json --kv-cache-dtype f16 " +
                   "--kv-policy quest:budget=0.25,min_context=64 --policy-step 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["kv_policy"]["mean_kept_fraction"].get<double>(), 1.0) << j["kv_policy"];
  const json read = j["kv_policy"]["read"];
  EXPECT_GT(read["rows"].get<std::int64_t>(), 0) << read;
  EXPECT_LT(read["read_fraction"].get<double>(), 0.9) << read;
  EXPECT_GT(read["read_fraction"].get<double>(), 0.2) << read;
  EXPECT_LE(read["read_fraction"].get<double>(), read["read_blocks_fraction"].get<double>() + 0.05) << read;
  std::remove(file.c_str());
}

// Perplexity sizes its pool for every document in flight: with a policy
// whose side memory (snapkv's statistics) is paid from the pool, that memory
// too. (Sized for the KV alone, the two caches of --kl-divergence scored
// different positions here: "784 positions were scored by only one of the
// two caches"; with 5 documents and --max-num-seqs 128 one was refused.)
TEST(cli_policy, perplexity_pool_holds_the_policys_side_memory) {
  const std::string file = first_dev_documents(20);
  auto r = run_cli("perplexity -m " + model_path() + " -f " + file + " --ctx 512 --truncate --json --kl-divergence " +
                   "--kv-cache-dtype f16 --kv-policy snapkv:budget=0.5,slack=0 --policy-step 16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["documents"].get<int>(), 20);
  EXPECT_GT(j["kl_divergence"]["mean_kl"].get<double>(), 0.0);
  std::remove(file.c_str());
}

// A bad --kv-policy is a one-line error, not a crash.
TEST(cli_policy, a_bad_policy_is_a_clear_error) {
  auto r = run_cli("run -m " + model_path() + " -p x -n 2 --kv-policy h2o:budget=-1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("budget"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

}  // namespace
}  // namespace pagoda::test
