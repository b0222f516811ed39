// pagoda batch end to end: JSONL in, JSONL out, summary, bad lines.
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"

namespace pagoda::test {
namespace {

using nlohmann::json;

std::string write_temp(const std::string& name, const std::string& content) {
  std::string path = "/tmp/pagoda_batch_" + std::to_string(getpid()) + "_" + name;
  std::ofstream(path) << content;
  return path;
}

std::vector<json> parse_lines(const std::string& out) {
  std::vector<json> v;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) v.push_back(json::parse(line));
  return v;
}

TEST(cli_batch, results_usage_summary_and_bad_lines) {
  std::string in = write_temp("in.jsonl",
                              R"({"id": "a", "prompt": "Once upon a time", "max_tokens": 30, "temperature": 0})" "\n"
                              R"({"id": "b", "prompt": "The little dog", "max_tokens": 12, "temperature": 0.7, "seed": 5, "n": 2})" "\n"
                              "{not json\n"
                              R"({"id": "c", "prompt": 42})" "\n"
                              R"({"id": "d", "prompt": "Once upon a time", "max_tokens": 5000})" "\n"
                              "\n"
                              R"({"id": "e", "prompt": "Once upon a time", "max_tokens": 30, "temperature": 0, "cache_salt": "t1"})" "\n");
  auto r = run_cli("batch -m " + model_path() + " -i " + in + " --json-summary -t 1");
  std::remove(in.c_str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto lines = parse_lines(r.out);
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_EQ(lines[0]["id"], "a");
  EXPECT_EQ(lines[0]["completions"][0]["token_ids"].size(), 30u);
  EXPECT_EQ(lines[0]["usage"]["completion_tokens"], 30);
  EXPECT_EQ(lines[0]["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(lines[1]["completions"].size(), 2u);
  EXPECT_EQ(lines[1]["usage"]["completion_tokens"], 24);
  // Bad lines are reported by line number, and the others still ran.
  EXPECT_TRUE(lines[2].contains("error"));
  EXPECT_NE(r.err.find("line 3"), std::string::npos) << r.err;
  EXPECT_NE(lines[3]["error"]["message"].get<std::string>().find("prompt"), std::string::npos);
  EXPECT_NE(lines[4]["error"]["message"].get<std::string>().find("context"), std::string::npos) << lines[4];
  // Same greedy prompt under another salt: same tokens.
  EXPECT_EQ(lines[5]["completions"][0]["token_ids"], lines[0]["completions"][0]["token_ids"]);
  // The JSON summary is the last line of stderr.
  std::string last = r.err.substr(r.err.rfind('{'));
  json s = json::parse(last);
  EXPECT_EQ(s["requests"], 6);
  EXPECT_EQ(s["errors"], 3);
  EXPECT_EQ(s["generated_tokens"], 30 + 24 + 30);
  EXPECT_GT(s["generation_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(s["peak_blocks_used"].get<int>(), 0);
  EXPECT_TRUE(s.contains("prefix_hit_rate"));
  EXPECT_TRUE(s.contains("preemptions"));
  EXPECT_TRUE(s.contains("fragmentation_mean"));
}

// Greedy batch results are, token for token, those of `pagoda run` alone.
TEST(cli_batch, greedy_batch_equals_run) {
  const char* prompts[] = {"Once upon a time", "The little dog", "Lily and Ben", "One day, a big", "Tom had a red"};
  std::string jsonl;
  for (int i = 0; i < 5; ++i)
    jsonl += json({{"id", std::to_string(i)}, {"prompt", prompts[i]}, {"max_tokens", 40}, {"temperature", 0}}).dump() + "\n";
  std::string in = write_temp("eq.jsonl", jsonl);
  auto r = run_cli("batch -m " + model_path() + " -i " + in + " --max-num-seqs 8");
  std::remove(in.c_str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto lines = parse_lines(r.out);
  ASSERT_EQ(lines.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    auto one = run_cli("run -m " + model_path() + " -p " + shell_quote(prompts[i]) + " -n 40 --temp 0 --json");
    ASSERT_EQ(one.exit_code, 0) << one.err;
    json j = json::parse(one.out);
    auto want = j["tokens"].get<std::vector<int>>();
    auto got = lines[i]["completions"][0]["token_ids"].get<std::vector<int>>();
    // run stops at EOS; batch too (no ignore_eos), so both are the same sequence.
    EXPECT_EQ(got, want) << prompts[i];
  }
}

// n above --max-num-seqs could never be admitted: it used to be accepted, and
// the engine then spun forever. Now that line is an error and the rest run.
TEST(cli_batch, n_above_the_sequence_cap_is_an_error_not_a_hang) {
  std::string in = write_temp("n.jsonl", R"({"id": "big", "prompt": "Once upon a time", "max_tokens": 4, "n": 5})" "\n"
                                         R"({"id": "ok", "prompt": "Once upon a time", "max_tokens": 4, "n": 4})" "\n");
  auto r = run_cli("batch -m " + model_path() + " -i " + in + " --max-num-seqs 4");
  std::remove(in.c_str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto lines = parse_lines(r.out);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0]["error"]["message"].get<std::string>().find("max-num-seqs"), std::string::npos) << lines[0];
  EXPECT_EQ(lines[1]["completions"].size(), 4u);
}

TEST(cli_batch, missing_input_is_a_clear_error) {
  auto r = run_cli("batch -m " + model_path() + " -i /nonexistent/requests.jsonl");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("/nonexistent/requests.jsonl"), std::string::npos);
}

}  // namespace
}  // namespace pagoda::test
