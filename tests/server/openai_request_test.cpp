// Request parsing without a server: defaults, every field's checks, and that
// each error names its field.
#include "server/openai_request.h"

#include <algorithm>

#include <gtest/gtest.h>

#include "server/server_util.h"

namespace pagoda::server {
namespace {

using nlohmann::json;

api_context context() { return test::stories_api_context(); }

api_error completion_error(const json& body) {
  auto r = parse_request(api_kind::completion, body, context(), "");
  EXPECT_FALSE(r.ok()) << body.dump();
  return r.error;
}

TEST(openai_request, completion_defaults) {
  api_context ctx = context();
  auto r = parse_request(api_kind::completion, {{"prompt", "Once upon a time"}}, ctx, "alice");
  ASSERT_TRUE(r.ok()) << r.error.message;
  const api_call& c = *r.value;
  ASSERT_EQ(c.requests.size(), 1u);
  const request& q = c.requests[0];
  EXPECT_EQ(q.prompt, ctx.vocab->encode("Once upon a time", ctx.vocab->add_bos_default(), true));
  EXPECT_EQ(q.max_tokens, 16);                 // OpenAI's default for completions
  EXPECT_EQ(q.sampling.temperature, 1.0f);     // and for sampling
  EXPECT_EQ(q.sampling.top_p, 1.0f);
  EXPECT_EQ(q.tenant, "alice");                // from the key, never from the body
  EXPECT_FALSE(c.stream);
  EXPECT_EQ(c.logprobs, -1);
  // Two requests without a seed get different seeds.
  auto r2 = parse_request(api_kind::completion, {{"prompt", "x"}}, ctx, "");
  EXPECT_NE(r2.value->requests[0].sampling.seed, q.sampling.seed);
}

TEST(openai_request, completion_fields) {
  api_context ctx = context();
  json body = {{"model", "stories260K"},  {"prompt", {1, 2, 3}}, {"max_tokens", 7},      {"temperature", 0},
               {"top_p", 0.5},            {"top_k", 4},          {"min_p", 0.1},         {"seed", -3},
               {"n", 2},                  {"stop", "\n"},        {"stream", true},       {"stream_options", {{"include_usage", true}}},
               {"logprobs", 2},           {"cache_salt", "s"},   {"user", "u"},          {"priority", -1},
               {"ignore_eos", true},      {"stop_token_ids", {2}}, {"unknown_field", {1, 2}}};
  auto r = parse_request(api_kind::completion, body, ctx, "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  const request& q = r.value->requests[0];
  EXPECT_EQ(q.prompt, (std::vector<token_id>{1, 2, 3}));
  EXPECT_EQ(q.max_tokens, 7);
  EXPECT_EQ(q.sampling.top_k, 4);
  EXPECT_EQ(q.sampling.seed, static_cast<std::uint64_t>(-3));
  EXPECT_EQ(q.n, 2);
  EXPECT_EQ(q.stop, std::vector<std::string>{"\n"});
  EXPECT_EQ(q.logprobs, 2);
  EXPECT_EQ(q.cache_salt, "s");
  EXPECT_EQ(q.priority, -1);
  EXPECT_TRUE(q.ignore_eos);
  EXPECT_EQ(q.stop_token_ids, std::vector<token_id>{2});
  EXPECT_TRUE(r.value->stream);
  EXPECT_TRUE(r.value->include_usage);
}

TEST(openai_request, penalties_bias_and_token_ids) {
  json body = {{"prompt", "a"},
               {"presence_penalty", 0.5},
               {"frequency_penalty", -1.25},
               {"repetition_penalty", 1.3},
               {"logit_bias", {{"5", 100}, {"17", -100}, {"0", 0.5}}},
               {"return_tokens_as_token_ids", true},
               {"logprobs", 1}};
  auto r = parse_request(api_kind::completion, body, context(), "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  const sampling_params& p = r.value->requests[0].sampling;
  EXPECT_EQ(p.presence_penalty, 0.5f);
  EXPECT_EQ(p.frequency_penalty, -1.25f);
  EXPECT_EQ(p.repetition_penalty, 1.3f);
  auto bias = p.logit_bias;
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias, (std::vector<std::pair<token_id, float>>{{0, 0.5f}, {5, 100.0f}, {17, -100.0f}}));
  EXPECT_TRUE(r.value->tokens_as_ids);
  // Defaults: no penalty, no bias, pieces.
  auto d = parse_request(api_kind::completion, {{"prompt", "a"}}, context(), "");
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d.value->requests[0].sampling.adjusts_logits());
  EXPECT_FALSE(d.value->tokens_as_ids);
}

// A value inside a field's range is one the engine takes: a positive value
// too small for a float does not become 0 (which the engine would refuse).
TEST(openai_request, tiny_positive_values_stay_positive) {
  auto r = parse_request(api_kind::completion, {{"prompt", "a"}, {"top_p", 5e-324}, {"repetition_penalty", 1e-300},
                                                {"temperature", 5e-324}}, context(), "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  const sampling_params& p = r.value->requests[0].sampling;
  EXPECT_GT(p.top_p, 0.0f);
  EXPECT_GT(p.repetition_penalty, 0.0f);
  EXPECT_TRUE(p.validate().ok()) << p.validate().message();
  EXPECT_TRUE(p.is_greedy());  // below vLLM's epsilon
}

TEST(openai_request, several_prompts) {
  auto r = parse_request(api_kind::completion, {{"prompt", {"a", {5, 6}}}, {"n", 3}}, context(), "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  EXPECT_EQ(r.value->requests.size(), 2u);
  EXPECT_EQ(r.value->requests[1].prompt, (std::vector<token_id>{5, 6}));
  EXPECT_EQ(completion_error({{"prompt", {"a", "b"}}, {"n", 9}}).param, "n");  // 18 choices > 16
}

// echo and prompt_logprobs: the engine scores the prompt with the larger of
// the two alternative counts; echo keeps each prompt's text as sent.
TEST(openai_request, echo_and_prompt_logprobs) {
  auto r = parse_request(api_kind::completion,
                         {{"prompt", {"Once upon", {1, 403, 407}}}, {"echo", true}, {"logprobs", 3}, {"max_tokens", 0}},
                         context(), "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  EXPECT_TRUE(r.value->echo);
  EXPECT_EQ(r.value->prompt_logprobs, -1);
  ASSERT_EQ(r.value->requests.size(), 2u);
  EXPECT_EQ(r.value->requests[0].prompt_logprobs, 3);
  EXPECT_EQ(r.value->requests[0].max_tokens, 0);
  EXPECT_FALSE(r.value->requests[0].prompt_logits);  // the compact path, never whole rows
  EXPECT_EQ(r.value->echo_texts, (std::vector<std::string>{"Once upon", "Once upon"}));
  r = parse_request(api_kind::completion, {{"prompt", "a"}, {"echo", true}, {"logprobs", 1}, {"prompt_logprobs", 5}},
                    context(), "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  EXPECT_EQ(r.value->prompt_logprobs, 5);
  EXPECT_EQ(r.value->requests[0].prompt_logprobs, 5);
  // Echo without logprobs scores nothing; logprobs without echo score only the output.
  for (const json& body : {json{{"prompt", "a"}, {"echo", true}}, json{{"prompt", "a"}, {"logprobs", 2}}}) {
    r = parse_request(api_kind::completion, body, context(), "");
    ASSERT_TRUE(r.ok()) << r.error.message;
    EXPECT_EQ(r.value->requests[0].prompt_logprobs, -1) << body.dump();
  }
  EXPECT_EQ(completion_error({{"prompt", "a"}, {"max_tokens", 0}}).param, "max_tokens");
}

TEST(openai_request, errors_name_the_field) {
  struct bad {
    json body;
    const char* param;
  };
  const std::vector<bad> cases = {
      {{{"max_tokens", 4}}, "prompt"},
      {{{"prompt", 5}}, "prompt"},
      {{{"prompt", json::array()}}, "prompt"},
      {{{"prompt", {1, "x"}}}, "prompt[1]"},
      {{{"prompt", {1, 999999}}}, "prompt[1]"},
      {{{"prompt", {"a", 3.5}}}, "prompt[1]"},
      {{{"prompt", "a"}, {"model", "gpt-4"}}, "model"},
      {{{"prompt", "a"}, {"model", 3}}, "model"},
      {{{"prompt", "a"}, {"max_tokens", 0}}, "max_tokens"},
      {{{"prompt", "a"}, {"max_tokens", -5}}, "max_tokens"},
      {{{"prompt", "a"}, {"max_tokens", 1e30}}, "max_tokens"},
      {{{"prompt", "a"}, {"max_tokens", 18446744073709551615ull}}, "max_tokens"},
      {{{"prompt", "a"}, {"max_tokens", "16"}}, "max_tokens"},
      {{{"prompt", "a"}, {"max_tokens", 2.5}}, "max_tokens"},
      {{{"prompt", "a"}, {"max_completion_tokens", 100000}}, "max_completion_tokens"},
      {{{"prompt", "a"}, {"max_tokens", 511}}, "max_tokens"},  // BOS + "a" + 511 > 512
      {{{"prompt", "a"}, {"temperature", -1}}, "temperature"},
      {{{"prompt", "a"}, {"temperature", 2.5}}, "temperature"},
      {{{"prompt", "a"}, {"temperature", true}}, "temperature"},
      {{{"prompt", "a"}, {"top_p", 0}}, "top_p"},
      {{{"prompt", "a"}, {"top_p", 1.5}}, "top_p"},
      {{{"prompt", "a"}, {"top_k", -2}}, "top_k"},
      {{{"prompt", "a"}, {"min_p", 2}}, "min_p"},
      {{{"prompt", "a"}, {"n", 0}}, "n"},
      {{{"prompt", "a"}, {"n", 1000}}, "n"},
      {{{"prompt", "a"}, {"seed", "x"}}, "seed"},
      {{{"prompt", "a"}, {"seed", 1.5}}, "seed"},
      {{{"prompt", "a"}, {"stop", 5}}, "stop"},
      {{{"prompt", "a"}, {"stop", {"a", 5}}}, "stop[1]"},
      {{{"prompt", "a"}, {"stop", ""}}, "stop"},
      {{{"prompt", "a"}, {"stop", std::vector<std::string>(17, "x")}}, "stop"},
      {{{"prompt", "a"}, {"stop_token_ids", {-1}}}, "stop_token_ids[0]"},
      {{{"prompt", "a"}, {"stream", "yes"}}, "stream"},
      {{{"prompt", "a"}, {"stream_options", {{"include_usage", true}}}}, "stream_options"},
      {{{"prompt", "a"}, {"stream", true}, {"stream_options", {{"include_usage", 1}}}}, "stream_options.include_usage"},
      {{{"prompt", "a"}, {"logprobs", 50}}, "logprobs"},
      {{{"prompt", "a"}, {"logprobs", true}}, "logprobs"},
      {{{"prompt", "a"}, {"cache_salt", ""}}, "cache_salt"},
      {{{"prompt", "a"}, {"cache_salt", 5}}, "cache_salt"},
      {{{"prompt", "a"}, {"user", 5}}, "user"},
      {{{"prompt", "a"}, {"priority", "high"}}, "priority"},
      {{{"prompt", "a"}, {"presence_penalty", 2.5}}, "presence_penalty"},
      {{{"prompt", "a"}, {"presence_penalty", "1"}}, "presence_penalty"},
      {{{"prompt", "a"}, {"frequency_penalty", 3}}, "frequency_penalty"},
      {{{"prompt", "a"}, {"frequency_penalty", -2.01}}, "frequency_penalty"},
      {{{"prompt", "a"}, {"repetition_penalty", 0}}, "repetition_penalty"},
      {{{"prompt", "a"}, {"repetition_penalty", 2.5}}, "repetition_penalty"},
      {{{"prompt", "a"}, {"logit_bias", {1, 2}}}, "logit_bias"},
      {{{"prompt", "a"}, {"logit_bias", {{"x5", 1}}}}, "logit_bias"},
      {{{"prompt", "a"}, {"logit_bias", {{"-1", 1}}}}, "logit_bias"},
      {{{"prompt", "a"}, {"logit_bias", {{"512", 1}}}}, "logit_bias"},  // stories260K has 512 tokens
      {{{"prompt", "a"}, {"logit_bias", {{"5", 101}}}}, "logit_bias[\"5\"]"},
      {{{"prompt", "a"}, {"logit_bias", {{"5", "1"}}}}, "logit_bias[\"5\"]"},
      {{{"prompt", "a"}, {"return_tokens_as_token_ids", 1}}, "return_tokens_as_token_ids"},
      {{{"prompt", "a"}, {"ignore_eos", "yes"}}, "ignore_eos"},
      {{{"prompt", "a"}, {"min_tokens", 3}}, "min_tokens"},
      {{{"prompt", "a"}, {"echo", 1}}, "echo"},
      {{{"prompt", "a"}, {"prompt_logprobs", 21}}, "prompt_logprobs"},
      {{{"prompt", "a"}, {"echo", true}, {"max_completion_tokens", 0}, {"max_tokens", 0}, {"n", 2}, {"suffix", "x"}}, "suffix"},
      {{{"prompt", "a"}, {"suffix", "x"}}, "suffix"},
      {{{"prompt", "a"}, {"best_of", 3}}, "best_of"},
      {{{"prompt", "a"}, {"tools", {{{"type", "function"}}}}}, "tools"},
      {{{"prompt", "a"}, {"response_format", {{"type", "xml"}}}}, "response_format.type"},
      {{{"prompt", "a"}, {"guided_json", {{"type", "integer"}, {"minimum", 1}}}}, "guided_json"},
      {{{"prompt", "a"}, {"grammar", "root ::= x"}}, "grammar"},
      {{{"prompt", "a"}, {"guided_regex", "a"}, {"guided_choice", {"a"}}}, "guided_choice"},
  };
  for (const bad& b : cases) {
    api_error e = completion_error(b.body);
    EXPECT_EQ(e.http_status, 400) << b.body.dump();
    EXPECT_EQ(e.param, b.param) << b.body.dump() << ": " << e.message;
    EXPECT_FALSE(e.message.empty());
  }
  // Neutral values of unsupported fields are fine.
  auto ok = parse_request(api_kind::completion, 
      {{"prompt", "a"}, {"min_tokens", 0}, {"echo", false}, {"best_of", 1}}, context(), "");
  EXPECT_TRUE(ok.ok()) << ok.error.message;
  EXPECT_FALSE(parse_request(api_kind::completion, json::array({1}), context(), "").ok());
}

// Structured output (server/structured_output.h): each field becomes the
// request's grammar; "text" is no constraint.
TEST(openai_request, structured_output_fields) {
  auto grammar_of = [](const json& extra) {
    json body = {{"prompt", "a"}};
    if (extra.is_object()) body.update(extra);
    auto r = parse_request(api_kind::completion, body, context(), "");
    EXPECT_TRUE(r.ok()) << body.dump() << ": " << r.error.message;
    return r.ok() ? r.value->requests.at(0).sampling.grammar : std::string();
  };
  EXPECT_EQ(grammar_of({}), "");
  EXPECT_EQ(grammar_of({{"response_format", {{"type", "text"}}}}), "");
  EXPECT_NE(grammar_of({{"response_format", {{"type", "json_object"}}}}).find("root ::="), std::string::npos);
  const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}, {"required", {"a"}}};
  const std::string g = grammar_of({{"guided_json", schema}});
  EXPECT_NE(g.find("\"\\\"a\\\"\""), std::string::npos) << g;  // the property name as a literal
  EXPECT_EQ(grammar_of({{"json_schema", schema}}), g);
  EXPECT_EQ(grammar_of({{"guided_json", schema.dump()}}), g);
  EXPECT_EQ(grammar_of({{"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", schema}}}}}}), g);
  EXPECT_EQ(grammar_of({{"grammar", "root ::= \"a\"\n"}}), "root ::= \"a\"\n");
  EXPECT_EQ(grammar_of({{"guided_grammar", "root ::= \"a\"\n"}}), "root ::= \"a\"\n");
  EXPECT_NE(grammar_of({{"guided_choice", {"x", "y"}}}).find("\"y\""), std::string::npos);
  EXPECT_NE(grammar_of({{"guided_regex", "[0-9]+"}}).find("[0-9]+"), std::string::npos);
  // The same fields on chat completions.
  auto chat = parse_request(api_kind::chat, {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                                              {"response_format", {{"type", "json_object"}}}}, context(), "");
  ASSERT_TRUE(chat.ok()) << chat.error.message;
  EXPECT_FALSE(chat.value->requests.at(0).sampling.grammar.empty());
}

TEST(openai_request, chat_messages) {
  api_context ctx = context();
  auto r = parse_request(api_kind::chat, {{"messages", {{{"role", "developer"}, {"content", "Be kind."}},
                                             {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Once"}},
                                                                             {{"type", "text"}, {"text", "upon"}}}}}}},
                               {"max_completion_tokens", 5},
                               {"logprobs", true},
                               {"top_logprobs", 3}},
                              ctx, "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  const request& q = r.value->requests[0];
  // stories260K has no template: contents joined plainly.
  EXPECT_EQ(q.prompt, ctx.vocab->encode("Be kind.\nOnce\nupon", ctx.vocab->add_bos_default(), true));
  EXPECT_EQ(q.max_tokens, 5);
  EXPECT_EQ(r.value->logprobs, 3);
  // Without max_tokens a chat may use the rest of the context.
  auto d = parse_request(api_kind::chat, {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}}, ctx, "");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d.value->requests[0].max_tokens, 512 - static_cast<int>(d.value->requests[0].prompt.size()));

  struct bad {
    json body;
    const char* param;
  };
  const std::vector<bad> cases = {
      {json::object(), "messages"},
      {{{"messages", "hi"}}, "messages"},
      {{{"messages", json::array()}}, "messages"},
      {{{"messages", {5}}}, "messages[0]"},
      {{{"messages", {{{"content", "x"}}}}}, "messages[0].role"},
      {{{"messages", {{{"role", "tool"}, {"content", "x"}}}}}, "messages[0].role"},
      {{{"messages", {{{"role", "user"}}}}}, "messages[0].content"},
      {{{"messages", {{{"role", "user"}, {"content", 5}}}}}, "messages[0].content"},
      {{{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}}, "messages[0].content[0].type"},
      {{{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}}}}}}}}, "messages[0].content[0].text"},
      {{{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"top_logprobs", 2}}, "top_logprobs"},
      {{{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"logprobs", 3}}, "logprobs"},
      {{{"messages", {{{"role", "user"}, {"content", "Once upon a time there was a girl"}}}}, {"max_tokens", 505}},
       "max_tokens"},
  };
  for (const bad& b : cases) {
    auto e = parse_request(api_kind::chat, b.body, ctx, "");
    ASSERT_FALSE(e.ok()) << b.body.dump();
    EXPECT_EQ(e.error.param, b.param) << b.body.dump() << ": " << e.error.message;
  }
}

}  // namespace
}  // namespace pagoda::server

namespace pagoda::server {
namespace {

// Pagoda's kv_policy extension: checked when the request is parsed.
TEST(openai_request, kv_policy_is_checked) {
  api_context ctx = context();
  auto r = parse_request(api_kind::completion, {{"prompt", "Once"}, {"kv_policy", "h2o:budget=0.25"}}, ctx, "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  EXPECT_EQ(r.value->requests[0].kv_policy, "h2o:budget=0.25");
  for (const json& bad : {json("no_such_policy"), json("h2o:budget=0"), json("h2o:budget"), json(3)}) {
    const api_error e = completion_error({{"prompt", "Once"}, {"kv_policy", bad}});
    EXPECT_EQ(e.param, "kv_policy") << bad.dump();
  }
}

// StreamingLLM: a fixed window renumbered within the cache may ask for more
// tokens than the context holds, by its own kv_policy or the server's
// default; any other policy may not.
TEST(openai_request, a_streaming_window_asks_past_the_context) {
  api_context ctx = context();
  const int past = ctx.limits.max_model_len * 10;
  const json body = {{"prompt", "Once"}, {"max_tokens", past}, {"kv_policy", "window:budget=32,positions=cache"}};
  auto r = parse_request(api_kind::completion, body, ctx, "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  EXPECT_EQ(r.value->requests[0].max_tokens, past);
  for (const char* policy : {"window:budget=32", "window:budget=0.25,positions=cache", "h2o:budget=32", ""}) {
    json b = body;
    if (*policy) b["kv_policy"] = policy;
    else b.erase("kv_policy");
    EXPECT_FALSE(parse_request(api_kind::completion, b, ctx, "").ok()) << policy;
  }
  ctx.default_kv_policy = "window:budget=32,positions=cache";  // the server's --kv-policy
  json by_default = body;
  by_default.erase("kv_policy");
  EXPECT_TRUE(parse_request(api_kind::completion, by_default, ctx, "").ok());
}

// Pagoda's speculative extension: a bad drafter, parameter or k is a 400 naming the field.
TEST(openai_request, speculative_is_checked) {
  api_context ctx = context();
  auto r = parse_request(api_kind::completion, {{"prompt", "Once"}, {"speculative", "ngram:k=4"}}, ctx, "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  EXPECT_EQ(r.value->requests[0].speculative, "ngram:k=4");
  for (const json& bad : {json("medusa"), json("ngram:k=0"), json("ngram:k=16"), json("ngram:depth=2"), json(4)}) {
    const api_error e = completion_error({{"prompt", "Once"}, {"speculative", bad}});
    EXPECT_EQ(e.param, "speculative") << bad.dump();
  }
}

// A completion's prompt as parts: the part with a policy becomes a segment
// over exactly its tokens.
TEST(openai_request, prompt_parts_become_segments) {
  api_context ctx = context();
  const std::string doc = "Once upon a time there was a big red dog.";
  const std::string question = " What color was the dog?";
  json body = {{"prompt", json::array({{{"text", doc}, {"kv", {{"policy", "h2o:budget=0.25"}}}}, {{"text", question}}})}};
  auto r = parse_request(api_kind::completion, body, ctx, "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  const request& q = r.value->requests[0];
  EXPECT_EQ(q.prompt, ctx.vocab->encode(doc + question, ctx.vocab->add_bos_default(), true));
  ASSERT_EQ(q.segments.size(), 1u);
  const auto doc_tokens = ctx.vocab->encode(doc, ctx.vocab->add_bos_default(), true);
  EXPECT_EQ(q.segments[0].begin, 1);  // after BOS
  EXPECT_EQ(q.segments[0].end, static_cast<std::int32_t>(doc_tokens.size()));
  EXPECT_EQ(q.segments[0].kv_policy, "h2o:budget=0.25");
  // A part's KV type rides along (the engine says whether it keeps it); a
  // part with a type only is a segment too.
  body["prompt"][0]["kv"]["type"] = "int4";
  body["prompt"][1]["kv"] = {{"type", "int8/token"}};
  auto typed = parse_request(api_kind::completion, body, ctx, "");
  ASSERT_TRUE(typed.ok()) << typed.error.message;
  const request& t = typed.value->requests[0];
  ASSERT_EQ(t.segments.size(), 2u);
  EXPECT_EQ(t.segments[0].kv_type, "int4");
  EXPECT_EQ(t.segments[0].kv_policy, "h2o:budget=0.25");
  EXPECT_EQ(t.segments[1].kv_type, "int8/token");
  EXPECT_EQ(t.segments[1].kv_policy, "");
  EXPECT_EQ(t.segments[1].begin, t.segments[0].end);
  EXPECT_EQ(t.segments[1].end, static_cast<std::int32_t>(t.prompt.size()));
  for (const json& bad : {json("int9"), json(4), json(std::string(65, 'a'))}) {
    body["prompt"][0]["kv"]["type"] = bad;
    EXPECT_EQ(completion_error(body).param, "prompt[0].kv.type") << bad.dump();
  }
  body["prompt"][0]["kv"] = {{"dtype", "int4"}};
  EXPECT_EQ(completion_error(body).param, "prompt[0].kv.dtype");
}

// Chat: policies by role and per message, placed on the messages' tokens.
TEST(openai_request, chat_policies_by_role_and_message) {
  api_context ctx = context();
  json body = {{"messages", json::array({{{"role", "system"}, {"content", "You tell short stories."}},
                                         {{"role", "user"}, {"content", "A story about a cat and a ball."}},
                                         {{"role", "assistant"}, {"content", "The cat ran."}, {"kv", {{"policy", "none"}}}},
                                         {{"role", "user"}, {"content", "And then?"}}})},
               {"kv_policy_by_role", {{"user", "snapkv:budget=0.5"}}}};
  auto r = parse_request(api_kind::chat, body, ctx, "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  const request& q = r.value->requests[0];
  ASSERT_EQ(q.segments.size(), 3u);  // two user messages and the assistant's "none"
  EXPECT_EQ(q.segments[0].kv_policy, "snapkv:budget=0.5");
  EXPECT_EQ(q.segments[1].kv_policy, "none");
  EXPECT_EQ(q.segments[2].kv_policy, "snapkv:budget=0.5");
  for (std::size_t i = 0; i < q.segments.size(); ++i) {
    EXPECT_LT(q.segments[i].begin, q.segments[i].end);
    EXPECT_LE(q.segments[i].end, static_cast<std::int32_t>(q.prompt.size()));
    if (i > 0) {
      EXPECT_LE(q.segments[i - 1].end, q.segments[i].begin);
    }
  }
  // The first user message's tokens decode to its text.
  const std::string text = ctx.vocab->decode(std::span<const token_id>(q.prompt).subspan(
      static_cast<std::size_t>(q.segments[0].begin), static_cast<std::size_t>(q.segments[0].end - q.segments[0].begin)));
  EXPECT_NE(text.find("cat and a ball"), std::string::npos) << text;
  body["kv_policy_by_role"] = {{"robot", "none"}};
  EXPECT_EQ(parse_request(api_kind::chat, body, ctx, "").error.param, "kv_policy_by_role.robot");
}

// Chat: a message's KV type applies to its content parts, which may name
// their own; a part's type and the role's policy combine.
TEST(openai_request, chat_kv_types_per_message_and_part) {
  api_context ctx = context();
  json body = {{"messages", json::array({{{"role", "user"},
                                          {"kv", {{"type", "int4"}}},
                                          {"content", json::array({{{"type", "text"}, {"text", "A story about a cat."}},
                                                                   {{"type", "text"},
                                                                    {"text", "And a dog."},
                                                                    {"kv", {{"type", "int8"}}}}})}}})},
               {"kv_policy_by_role", {{"user", "h2o:budget=0.5"}}}};
  auto r = parse_request(api_kind::chat, body, ctx, "");
  ASSERT_TRUE(r.ok()) << r.error.message;
  const request& q = r.value->requests[0];
  ASSERT_EQ(q.segments.size(), 2u);
  EXPECT_EQ(q.segments[0].kv_type, "int4");
  EXPECT_EQ(q.segments[1].kv_type, "int8");
  for (const prompt_segment& p : q.segments) EXPECT_EQ(p.kv_policy, "h2o:budget=0.5");
  body["messages"][0]["kv"]["type"] = json::array();
  EXPECT_EQ(parse_request(api_kind::chat, body, ctx, "").error.param, "messages[0].kv.type");
}

}  // namespace
}  // namespace pagoda::server
