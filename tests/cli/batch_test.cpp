// pagoda batch end to end: JSONL in, JSONL out, summary, bad lines.
#include <algorithm>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "model/llama.h"
#include "server/api_setup.h"

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
  ASSERT_EQ(r.exit_code, 1) << r.err;  // bad lines fail the run; the good ones still ran
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
  EXPECT_NE(lines[4]["error"]["message"].get<std::string>().find("max_tokens"), std::string::npos) << lines[4];
  // Same greedy prompt under another salt: same tokens.
  EXPECT_EQ(lines[5]["completions"][0]["token_ids"], lines[0]["completions"][0]["token_ids"]);
  // At startup, the KV it runs with and what its pool holds at the context (as serve's line).
  EXPECT_EQ(r.err.rfind("pagoda batch: context ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("KV f32+f32, policy none, pool "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("full-context sequences)"), std::string::npos) << r.err;
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
  ASSERT_EQ(r.exit_code, 1) << r.err;  // a line failed
  auto lines = parse_lines(r.out);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0]["error"]["message"].get<std::string>().find("max-num-seqs"), std::string::npos) << lines[0];
  EXPECT_EQ(lines[1]["completions"].size(), 4u);
}

// Prompt scoring is /v1/completions': a line asking for it is an error, never silently unscored.
TEST(cli_batch, echo_and_prompt_logprobs_lines_are_refused) {
  std::string in = write_temp("echo.jsonl", R"({"id": "e", "prompt": "Once upon", "echo": true, "max_tokens": 0})" "\n"
                                            R"({"id": "p", "prompt": "Once upon", "prompt_logprobs": 1})" "\n"
                                            R"({"id": "ok", "prompt": "Once upon", "max_tokens": 2})" "\n");
  auto r = run_cli("batch -m " + model_path() + " -i " + in + " -t 1");
  std::remove(in.c_str());
  ASSERT_EQ(r.exit_code, 1) << r.err;
  auto lines = parse_lines(r.out);
  ASSERT_EQ(lines.size(), 3u);
  for (int i = 0; i < 2; ++i)
    EXPECT_NE(lines[i]["error"]["message"].get<std::string>().find("prompt_logprobs"), std::string::npos) << lines[i];
  EXPECT_EQ(lines[2]["completions"].size(), 1u);
}

// A line is read by the server's parser: the same fields, ranges and messages.
TEST(cli_batch, lines_take_the_servers_fields_and_messages) {
  server::api_options opts;
  opts.model_path = model_path();
  opts.max_n = 128;
  auto model = llama_model::load(model_path());
  ASSERT_TRUE(model.ok());
  auto ctx = server::make_api_context(**model, 512, opts, nullptr);
  ASSERT_TRUE(ctx.ok());
  const std::vector<json> bad = {
      {{"prompt", "a"}, {"temperature", 2.5}},         // [0, 2] in both
      {{"prompt", "a"}, {"presence_penalty", 3}},      // no longer ignored
      {{"prompt", "a"}, {"frequency_penalty", "x"}},
      {{"prompt", "a"}, {"repetition_penalty", 0}},
      {{"prompt", "a"}, {"logit_bias", {{"999", 1}}}},
      {{"prompt", "a"}, {"top_p", 0}},
      {{"prompt", "a"}, {"stop", 5}},
      {{"prompt", "a"}, {"ignore_eos", 1}},
  };
  std::string jsonl;
  std::vector<std::string> want;
  for (std::size_t i = 0; i < bad.size(); ++i) {
    json line = bad[i];
    line["id"] = i;
    jsonl += line.dump() + "\n";
    auto e = server::parse_request(server::api_kind::completion, bad[i], *ctx, "");
    ASSERT_FALSE(e.ok()) << bad[i].dump();
    want.push_back(e.error.message);
  }
  std::string in = write_temp("fields.jsonl", jsonl);
  auto r = run_cli("batch -m " + model_path() + " -i " + in + " -c 512");
  std::remove(in.c_str());
  EXPECT_EQ(r.exit_code, 1) << r.err;  // every line failed
  auto lines = parse_lines(r.out);
  ASSERT_EQ(lines.size(), bad.size());
  for (std::size_t i = 0; i < bad.size(); ++i) {
    EXPECT_EQ(lines[i]["id"], i);
    EXPECT_EQ(lines[i]["error"]["message"], want[i]) << bad[i].dump();
  }
}

// Penalties, logit_bias, ignore_eos, logprobs with token ids and top_p
// 5e-324 work in a batch line; ids come back exactly as written; no internal
// id shows in a message.
TEST(cli_batch, sampling_fields_ids_and_messages) {
  const std::string p = "Once upon a time, there was a little girl named Lily. She loved to play outside.";
  json base = {{"prompt", p}, {"max_tokens", 30}, {"temperature", 0}, {"ignore_eos", true}};
  std::vector<json> lines_in;
  auto add = [&](json id, json extra) {
    json j = base;
    j.update(extra);
    j["id"] = id;
    lines_in.push_back(j);
  };
  add("plain", json::object());
  add("penalised", {{"presence_penalty", 1.5}, {"frequency_penalty", 1.0}});
  add("eos", {{"logit_bias", {{"2", 100}}}, {"ignore_eos", false}});  // token 2 is stories260K's EOS
  add("eos-ignored", {{"logit_bias", {{"2", 100}}}, {"max_tokens", 5}});
  add("ids", {{"logprobs", 1}, {"return_tokens_as_token_ids", true}, {"max_tokens", 3}});
  add("tiny", {{"top_p", 5e-324}, {"temperature", 1}, {"max_tokens", 3}});
  add(18446744073709551615ull, {{"max_tokens", 1}});
  add(-5, {{"max_tokens", 1}});
  add("toomany", {{"n", 9}, {"max_tokens", 2}});  // above --max-num-seqs 8: the engine refuses it
  std::string jsonl;
  for (const json& j : lines_in) jsonl += j.dump() + "\n";
  std::string in = write_temp("sampling.jsonl", jsonl);
  auto r = run_cli("batch -m " + model_path() + " -i " + in + " --max-num-seqs 8");
  std::remove(in.c_str());
  ASSERT_EQ(r.exit_code, 1) << r.err;  // the "toomany" line failed
  auto lines = parse_lines(r.out);
  ASSERT_EQ(lines.size(), lines_in.size()) << r.out;
  auto tokens = [&](int i) { return lines[i]["completions"][0]["token_ids"].get<std::vector<int>>(); };
  EXPECT_EQ(tokens(0).size(), 30u);
  EXPECT_NE(tokens(1), tokens(0));  // presence_penalty is honoured, not ignored
  EXPECT_EQ(tokens(2), std::vector<int>{2});
  EXPECT_EQ(lines[2]["completions"][0]["finish_reason"], "stop");
  EXPECT_EQ(tokens(3), std::vector<int>(5, 2));
  EXPECT_EQ(lines[3]["completions"][0]["finish_reason"], "length");
  const json& lp = lines[4]["completions"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 3u) << lines[4];
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(lp["tokens"][i], "token_id:" + std::to_string(tokens(4)[i]));
  EXPECT_EQ(lp["token_logprobs"][0], lp["top_logprobs"][0][lp["tokens"][0].get<std::string>()]);
  const std::vector<int> greedy = tokens(0);
  EXPECT_EQ(tokens(5), std::vector<int>(greedy.begin(), greedy.begin() + 3));  // top_p ~0 keeps the top token
  EXPECT_NE(r.out.find(R"("id":18446744073709551615)"), std::string::npos) << r.out;
  EXPECT_EQ(lines[6]["id"].get<std::uint64_t>(), 18446744073709551615ull);
  EXPECT_EQ(lines[7]["id"], -5);
  const std::string msg = lines[8]["error"]["message"].get<std::string>();
  EXPECT_NE(msg.find("max-num-seqs"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("line-"), std::string::npos) << msg;
  EXPECT_EQ(r.err.find("line-"), std::string::npos) << r.err;
}

TEST(cli_batch, reads_stdin_and_refuses_a_directory) {
  std::string in = write_temp("stdin.jsonl", R"({"id": 7, "prompt": "Once upon a time", "max_tokens": 3})" "\n");
  auto r = run_cli("batch -m " + model_path() + " -i - < " + in);
  std::remove(in.c_str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto lines = parse_lines(r.out);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["id"], 7);
  EXPECT_EQ(lines[0]["completions"][0]["token_ids"].size(), 3u);
  auto d = run_cli("batch -m " + model_path() + " -i /tmp");
  EXPECT_EQ(d.exit_code, 1);
  EXPECT_NE(d.err.find("/tmp is a directory"), std::string::npos) << d.err;
  EXPECT_EQ(std::count(d.err.begin(), d.err.end(), '\n'), 1) << d.err;
  EXPECT_TRUE(d.out.empty());
}

// Decode speed counts the tokens of steps without prompt work over those
// steps' time: one request of 10 tokens has its first with the prompt's step.
TEST(cli_batch, decode_speed_counts_the_passes_that_produced_the_tokens) {
  std::string in = write_temp("speed.jsonl", R"({"id": 1, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": true})" "\n");
  auto r = run_cli("batch -m " + model_path() + " -i " + in + " --json-summary");
  std::remove(in.c_str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json s = json::parse(r.err.substr(r.err.rfind('{')));
  EXPECT_EQ(s["generated_tokens"], 10);
  EXPECT_EQ(s["decode_tokens"], 9);
  EXPECT_NEAR(s["decode_tokens_per_s"].get<double>(), 9 / s["decode_seconds"].get<double>(),
              1e-6 * s["decode_tokens_per_s"].get<double>());
}

// --prefix-cache-eviction: both orders run and give the same greedy text; anything else is one clear error.
TEST(cli_batch, prefix_cache_eviction_flag) {
  const std::string in = write_temp("evict.jsonl", R"({"id":"a","prompt":"Once upon a time","max_tokens":4,"temperature":0}
{"id":"b","prompt":"Once upon a time","max_tokens":4,"temperature":0}
)");
  std::vector<std::string> texts;
  for (const char* e : {"lru", "lfu"}) {
    auto r = run_cli("batch -m " + model_path() + " -i " + in + " --prefix-cache-eviction " + e);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    texts.push_back(r.out);
  }
  EXPECT_EQ(texts[0], texts[1]);
  // In a pool of three blocks, each new prompt evicts the one before: the summary splits evictions by reason.
  const std::string tight = write_temp("evict_tight.jsonl", R"({"id":"a","prompt":"Once upon a time there was a little girl named Lily who loved the park","max_tokens":4,"temperature":0}
{"id":"b","prompt":"Tom was a happy boy who liked to help his mom in the kitchen every day","max_tokens":4,"temperature":0}
{"id":"c","prompt":"A small bird lived in a nest on a tall tree and sang to the sun","max_tokens":4,"temperature":0}
)");
  auto t = run_cli("batch -m " + model_path() + " -i " + tight + " --max-kv-tokens 48 --max-num-seqs 1 --json-summary");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  const json s = json::parse(t.err.substr(t.err.rfind('{')));
  EXPECT_EQ(s["errors"].get<int>(), 0) << s;
  EXPECT_GT(s["evictions"].get<int>(), 0) << s;
  EXPECT_EQ(s["evictions_capacity"].get<int>(), s["evictions"].get<int>()) << s;
  EXPECT_EQ(s["evictions_quota"].get<int>(), 0) << s;
  EXPECT_EQ(s["evictions_admin"].get<int>(), 0) << s;
  std::remove(tight.c_str());
  auto bad = run_cli("batch -m " + model_path() + " -i " + in + " --prefix-cache-eviction arc");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_TRUE(bad.out.empty()) << bad.out;
  EXPECT_NE(bad.err.find("--prefix-cache-eviction"), std::string::npos) << bad.err;
  EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << bad.err;
  std::remove(in.c_str());
}

TEST(cli_batch, missing_input_is_a_clear_error) {
  auto r = run_cli("batch -m " + model_path() + " -i /nonexistent/requests.jsonl");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("/nonexistent/requests.jsonl"), std::string::npos);
}

}  // namespace
}  // namespace pagoda::test
