// Prompt scoring over /v1/completions (issue 36): echo with logprobs,
// prompt_logprobs and max_tokens 0, as lm-evaluation-harness's loglikelihood
// requests use them. The sum of the prompt tokens' logprobs equals what
// `pagoda perplexity` computes on the same documents.
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "server/server_util.h"

namespace pagoda::test {
namespace {

// The first n stories of the dev text, each cut to about `chars` characters
// at a word, trimmed as `pagoda perplexity` trims its documents.
std::vector<std::string> documents(std::size_t n, std::size_t chars) {
  std::ifstream in(std::string(PAGODA_SOURCE_DIR) + "/tests/data/tinystories_dev.txt");
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (out.size() < n) {
    const std::size_t end = text.find("<|endoftext|>", pos);
    std::string story = text.substr(pos, end - pos);
    story = story.substr(story.find_first_not_of(" \t\r\n"));
    if (story.size() > chars) story = story.substr(0, story.rfind(' ', chars));
    story = story.substr(0, story.find_last_not_of(" \t\r\n") + 1);
    out.push_back(story);
    pos = end + 13;
  }
  return out;
}

// An lm-eval loglikelihood request: prompt = context + continuation as token
// ids, echo, logprobs 1, max_tokens 0.
json loglikelihood_body(const std::vector<std::vector<token_id>>& prompts) {
  json p = json::array();
  for (const auto& ids : prompts) p.push_back(ids);
  return {{"prompt", p}, {"echo", true}, {"logprobs", 1}, {"max_tokens", 0}, {"temperature", 0}};
}

double sum_from(const json& token_logprobs, std::size_t first) {
  double s = 0;
  for (std::size_t i = first; i < token_logprobs.size(); ++i) s += token_logprobs[i].get<double>();
  return s;
}

TEST(scoring, loglikelihood_sums_equal_pagoda_perplexity) {
  const std::vector<std::string> docs = documents(4, 700);
  const std::string path = "/tmp/pagoda_scoring_" + std::to_string(getpid()) + ".txt";
  {
    std::ofstream f(path);
    for (const std::string& d : docs) f << d << "\n<|endoftext|>\n";
  }
  const cli_result ppl = run_cli("perplexity -m " + model_path() + " -f " + path + " --kv-cache-dtype f32 -t 1 --ctx 512 --json");
  std::remove(path.c_str());
  ASSERT_EQ(ppl.exit_code, 0) << ppl.err;
  const json pj = json::parse(ppl.out);
  ASSERT_EQ(pj["documents"], 4);
  ASSERT_EQ(pj["documents_windowed"], 0);  // each scored whole, as one request scores it
  const double ppl_sum = pj["mean_nll"].get<double>() * pj["predicted_tokens"].get<double>();

  test_server s(default_setup());  // f32 KV, context 512, as above
  auto c = s.client();
  std::vector<std::vector<token_id>> prompts;
  std::size_t n_predicted = 0;
  for (const std::string& d : docs) {
    prompts.push_back(stories().vocab().encode(d, /*add_bos=*/true));
    n_predicted += prompts.back().size() - 1;
  }
  ASSERT_EQ(static_cast<std::int64_t>(n_predicted), pj["predicted_tokens"].get<std::int64_t>());
  http_reply r = post_json(*c, "/v1/completions", loglikelihood_body(prompts).dump());
  ASSERT_EQ(r.status, 200) << r.body;
  double nll = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const json& ch = r.json_body["choices"][i];
    EXPECT_EQ(ch["finish_reason"], "length");
    const json& lp = ch["logprobs"];
    ASSERT_EQ(lp["token_logprobs"].size(), prompts[i].size()) << "prompt tokens only: max_tokens 0";
    EXPECT_TRUE(lp["token_logprobs"][0].is_null());
    EXPECT_TRUE(lp["top_logprobs"][0].is_null());
    // lm-eval's loglikelihood: the continuation's sum, and whether each of
    // its tokens was the most likely; here the continuation is all but BOS.
    const std::size_t ctxlen = 1;
    nll -= sum_from(lp["token_logprobs"], ctxlen);
    for (std::size_t t = ctxlen; t < prompts[i].size(); ++t) {
      const json& top = lp["top_logprobs"][t];
      ASSERT_EQ(top.size(), 1u);
      EXPECT_LE(lp["token_logprobs"][t].get<double>(), top.begin().value().get<double>() + 1e-6);
      EXPECT_EQ(lp["tokens"][t], stories().vocab().token_to_piece(prompts[i][t], true));
    }
  }
  EXPECT_EQ(r.json_body["usage"]["completion_tokens"], 0);
  // Tolerance: 1e-5 relative. Both sides run the same engine with f32 KV;
  // only the steps differ (perplexity batches documents into 2048-token
  // steps, the server scores at most 128 tokens a step), which moves sums by
  // float rounding, far below an off-by-one position (several percent).
  EXPECT_NEAR(nll, ppl_sum, 1e-5 * ppl_sum) << "server " << nll << " vs perplexity " << ppl_sum;
}

TEST(scoring, echo_text_starts_with_the_prompt_and_logprobs_cover_it_then_the_output) {
  test_server s(default_setup());
  auto c = s.client();
  const std::string prompt = "Once upon a time, there was a little girl named Lily.";
  const auto ids = stories().vocab().encode(prompt, true);
  json body = {{"prompt", prompt}, {"echo", true}, {"logprobs", 2}, {"max_tokens", 5}, {"temperature", 0},
               {"ignore_eos", true}};
  http_reply r = post_json(*c, "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const json& ch = r.json_body["choices"][0];
  const std::string text = ch["text"];
  ASSERT_TRUE(text.starts_with(prompt)) << text;
  body["echo"] = false;
  http_reply plain = post_json(*c, "/v1/completions", body.dump());
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(text, prompt + plain.json_body["choices"][0]["text"].get<std::string>());
  const json& lp = ch["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), ids.size() + 5);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  for (std::size_t i = 1; i < lp["tokens"].size(); ++i) {
    EXPECT_LE(lp["token_logprobs"][i].get<double>(), 0.0) << i;
    EXPECT_EQ(lp["top_logprobs"][i].size(), 2u) << i;
  }
  // The generated part is what the call without echo returns; offsets run on.
  const json& gen = plain.json_body["choices"][0]["logprobs"];
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(lp["tokens"][ids.size() + i], gen["tokens"][i]);
    EXPECT_NEAR(lp["token_logprobs"][ids.size() + i].get<double>(), gen["token_logprobs"][i].get<double>(), 1e-5);
  }
  for (std::size_t i = 1; i < lp["text_offset"].size(); ++i)
    EXPECT_GT(lp["text_offset"][i].get<int>(), lp["text_offset"][i - 1].get<int>());
  EXPECT_EQ(r.json_body["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(r.json_body["usage"]["completion_tokens"], 5);
}

// n completions and several prompts: every choice carries its own prompt's echo and scores.
TEST(scoring, each_choice_echoes_its_own_prompt) {
  test_server s(default_setup());
  auto c = s.client();
  const std::vector<std::string> prompts = {"Once upon a time", "The little dog ran"};
  json body = {{"prompt", prompts}, {"echo", true}, {"logprobs", 1}, {"max_tokens", 3}, {"n", 2},
               {"temperature", 1}, {"seed", 7}, {"prompt_logprobs", 0}};
  http_reply r = post_json(*c, "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const json& choices = r.json_body["choices"];
  ASSERT_EQ(choices.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) {
    const std::string& prompt = prompts[i / 2];
    const std::size_t n_prompt = stories().vocab().encode(prompt, true).size();
    EXPECT_TRUE(choices[i]["text"].get<std::string>().starts_with(prompt)) << choices[i];
    EXPECT_EQ(choices[i]["logprobs"]["tokens"].size(), n_prompt + 3) << i;
    EXPECT_EQ(choices[i]["prompt_logprobs"].size(), n_prompt) << i;
    for (std::size_t t = 1; t < n_prompt; ++t)
      EXPECT_EQ(choices[i]["logprobs"]["token_logprobs"][t], choices[i / 2 * 2]["logprobs"]["token_logprobs"][t]);
  }
  EXPECT_NE(choices[0]["prompt_logprobs"], choices[2]["prompt_logprobs"]);
}

TEST(scoring, prompt_logprobs_in_vllms_shape) {
  test_server s(default_setup());
  auto c = s.client();
  const std::string prompt = "Once upon a time, there was a little girl named Lily.";
  const auto ids = stories().vocab().encode(prompt, true);
  json body = {{"prompt", prompt}, {"prompt_logprobs", 2}, {"echo", true}, {"logprobs", 0}, {"max_tokens", 0}};
  http_reply r = post_json(*c, "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const json ch = r.json_body["choices"][0];  // copies: r is reused below
  const json pl = ch["prompt_logprobs"];
  ASSERT_EQ(pl.size(), ids.size());
  EXPECT_TRUE(pl[0].is_null());
  for (std::size_t i = 1; i < ids.size(); ++i) {
    const json& e = pl[i];
    const std::string id = std::to_string(ids[i]);
    ASSERT_TRUE(e.contains(id)) << e.dump();
    // The token's own entry, the same logprob echo gives it, and the top 2 by rank.
    EXPECT_NEAR(e[id]["logprob"].get<double>(), ch["logprobs"]["token_logprobs"][i].get<double>(), 1e-6);
    EXPECT_EQ(e[id]["decoded_token"], stories().vocab().token_to_piece(ids[i], true));
    const int rank = e[id]["rank"];
    EXPECT_GE(rank, 1);
    EXPECT_EQ(e.size(), rank <= 2 ? 2u : 3u) << e.dump();
    std::vector<int> ranks;
    for (const auto& [k, v] : e.items()) ranks.push_back(v["rank"]);
    std::sort(ranks.begin(), ranks.end());
    EXPECT_EQ(ranks[0], 1);
    EXPECT_EQ(ranks[1], 2);
    for (const auto& [k, v] : e.items())
      if (v["rank"] == 1) {
        EXPECT_GE(v["logprob"].get<double>(), e[id]["logprob"].get<double>());
      }
  }
  // Without echo: no prompt in the text, prompt_logprobs still there.
  body.erase("echo");
  body["max_tokens"] = 1;
  r = post_json(*c, "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json_body["choices"][0]["prompt_logprobs"], pl);
  EXPECT_FALSE(r.json_body["choices"][0]["text"].get<std::string>().starts_with("Once"));
}

TEST(scoring, a_second_identical_request_hits_the_prefix_cache_and_returns_the_same_logprobs) {
  test_server s(default_setup());
  auto c = s.client();
  const std::vector<token_id> ids = stories().vocab().encode(documents(1, 400)[0], true);
  ASSERT_GT(ids.size(), 40u);
  const std::string body = loglikelihood_body({ids}).dump();
  http_reply a = post_json(*c, "/v1/completions", body);
  ASSERT_EQ(a.status, 200) << a.body;
  const double hits_before = metric(s.metrics(), "pagoda:prefix_cache_hits_total");
  http_reply b = post_json(*c, "/v1/completions", body);
  ASSERT_EQ(b.status, 200) << b.body;
  EXPECT_EQ(a.json_body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  // The second takes the cached blocks whose scores the engine kept, but
  // the last (prompt_score_cache.h): every full block's scores are kept.
  const std::size_t n_cached = (ids.size() / 16 - 1) * 16;
  EXPECT_EQ(b.json_body["usage"]["prompt_tokens_details"]["cached_tokens"], n_cached);
  EXPECT_EQ(metric(s.metrics(), "pagoda:prefix_cache_hits_total") - hits_before, static_cast<double>(n_cached));
  const json& la = a.json_body["choices"][0]["logprobs"];
  const json& lb = b.json_body["choices"][0]["logprobs"];
  EXPECT_EQ(la["tokens"], lb["tokens"]);
  EXPECT_EQ(la["top_logprobs"].size(), lb["top_logprobs"].size());
  ASSERT_EQ(la["token_logprobs"].size(), ids.size());
  ASSERT_EQ(lb["token_logprobs"].size(), ids.size());
  EXPECT_TRUE(lb["token_logprobs"][0].is_null());
  for (std::size_t i = 1; i < ids.size(); ++i) {
    // The cached positions' scores are the first request's own; the rest computed again, to float rounding.
    if (i <= n_cached) {
      EXPECT_EQ(la["token_logprobs"][i], lb["token_logprobs"][i]) << i;
    } else {
      EXPECT_NEAR(la["token_logprobs"][i].get<double>(), lb["token_logprobs"][i].get<double>(), 1e-5) << i;
    }
  }
  EXPECT_NEAR(sum_from(la["token_logprobs"], 1), sum_from(lb["token_logprobs"], 1), 1e-5);
}

TEST(scoring, streaming_echo_sends_the_prompt_first) {
  test_server s(default_setup());
  auto c = s.client();
  const std::string prompt = "Once upon a time, there was a little girl";
  const auto ids = stories().vocab().encode(prompt, true);
  json body = {{"prompt", prompt}, {"echo", true}, {"logprobs", 1}, {"max_tokens", 4}, {"temperature", 0},
               {"ignore_eos", true}, {"prompt_logprobs", 1}};
  http_reply whole = post_json(*c, "/v1/completions", body.dump());
  ASSERT_EQ(whole.status, 200) << whole.body;
  body["stream"] = true;
  http_reply r = post_json(*c, "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const auto events = sse_data(r.body);
  ASSERT_GE(events.size(), 3u);
  const json first = json::parse(events[0]);
  const json& ch = first["choices"][0];
  EXPECT_EQ(ch["text"], prompt);
  EXPECT_EQ(ch["logprobs"]["tokens"].size(), ids.size());
  EXPECT_TRUE(ch["logprobs"]["token_logprobs"][0].is_null());
  EXPECT_EQ(ch["prompt_logprobs"], whole.json_body["choices"][0]["prompt_logprobs"]);
  std::string text;
  json token_logprobs = json::array();
  for (const std::string& e : events) {
    if (e == "[DONE]") continue;
    const json j = json::parse(e);
    for (const json& x : j["choices"]) {
      text += x["text"].get<std::string>();
      if (!x["logprobs"].is_null())
        for (const json& v : x["logprobs"]["token_logprobs"]) token_logprobs.push_back(v);
    }
  }
  EXPECT_EQ(text, whole.json_body["choices"][0]["text"]);
  EXPECT_EQ(token_logprobs, whole.json_body["choices"][0]["logprobs"]["token_logprobs"]);
}

TEST(scoring, bad_combinations_are_400s_naming_the_field) {
  test_server s(default_setup());
  auto c = s.client();
  struct bad {
    std::string path;
    json body;
    std::string param;
  };
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 2}};
  const std::string long_prompt = [] {
    std::string p;
    for (int i = 0; i < 400; ++i) p += "Once upon a time ";
    return p;
  }();
  const std::vector<bad> cases = {
      {"/v1/chat/completions", [&] { json j = chat; j["echo"] = true; return j; }(), "echo"},
      {"/v1/chat/completions", [&] { json j = chat; j["prompt_logprobs"] = 1; return j; }(), "prompt_logprobs"},
      {"/v1/chat/completions", [&] { json j = chat; j["max_tokens"] = 0; return j; }(), "max_tokens"},
      {"/v1/completions", {{"prompt", "a"}, {"prompt_logprobs", 21}}, "prompt_logprobs"},  // the server's max_logprobs is 20
      {"/v1/completions", {{"prompt", "a"}, {"prompt_logprobs", -1}}, "prompt_logprobs"},
      {"/v1/completions", {{"prompt", "a"}, {"prompt_logprobs", "2"}}, "prompt_logprobs"},
      {"/v1/completions", {{"prompt", "a"}, {"echo", "yes"}}, "echo"},
      {"/v1/completions", {{"prompt", "a"}, {"max_tokens", 0}}, "max_tokens"},
      {"/v1/completions", {{"prompt", "a"}, {"echo", true}, {"logprobs", 21}}, "logprobs"},
      {"/v1/completions", {{"prompt", long_prompt}, {"echo", true}, {"logprobs", 1}, {"max_tokens", 0}}, "prompt"},
  };
  for (const bad& b : cases) {
    http_reply r = post_json(*c, b.path, b.body.dump());
    EXPECT_EQ(r.status, 400) << b.body.dump() << ": " << r.body;
    EXPECT_EQ(r.json_body["error"]["param"], b.param) << r.body;
  }
  // Nothing was left running.
  EXPECT_TRUE(wait_idle(s));
}

}  // namespace
}  // namespace pagoda::test
