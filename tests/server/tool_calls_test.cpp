// Function calling: each family's tool format against hand-written prompts,
// the model's text parsed into calls (whole and streamed, malformed
// included), the grammar that forces calls, and the request's 400s.
#include "server/tool_calls.h"

#include <random>

#include <gtest/gtest.h>

#include "grammar/gbnf.h"
#include "grammar/matcher.h"
#include "server/openai_request.h"
#include "server/openai_response.h"
#include "server/server_util.h"

namespace pagoda::server {
namespace {

using nlohmann::json;

const chat_special_tokens k_tok{"<s>", "</s>"};

const json k_weather = {
    {"type", "function"},
    {"function",
     {{"name", "get_weather"},
      {"description", "Weather of a city"},
      {"parameters",
       {{"type", "object"},
        {"properties", {{"city", {{"type", "string"}, {"enum", {"Paris", "Tokyo"}}}}, {"days", {{"type", "integer"}}}}},
        {"required", {"city", "days"}},
        {"additionalProperties", false}}}}}};
const json k_time = {{"type", "function"}, {"function", {{"name", "get_time"}}}};

tool_request tools_for(chat_format f, json choice = "auto", bool parallel = true) {
  tool_request t;
  json body = {{"tools", {k_weather, k_time}}, {"tool_choice", choice}, {"parallel_tool_calls", parallel}};
  auto e = read_tools(body, f, t);
  EXPECT_FALSE(e) << e->message;
  return t;
}

// The conversation of a tool round trip: system, user, a call, two results.
std::vector<chat_message> round_trip() {
  return {{"system", "Be brief.", {}, {}},
          {"user", "Weather?", {}, {}},
          {"assistant", "", {{"call_1", "get_weather", R"({"city":"Paris","days":1})"}, {"call_2", "get_time", "{}"}}, {}},
          {"tool", "sunny", {}, "call_1"},
          {"tool", "noon", {}, "call_2"}};
}

std::string render(chat_format f, const std::vector<chat_message>& m, const chat_tools& tools) {
  auto r = render_chat(f, m, k_tok, true, tools);
  EXPECT_TRUE(r.ok()) << r.error().message();
  return r.ok() ? *r : std::string();
}

const std::string k_weather_line =
    R"({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": )"
    R"({"additionalProperties": false, "properties": {"city": {"enum": ["Paris", "Tokyo"], "type": "string"}, )"
    R"("days": {"type": "integer"}}, "required": ["city", "days"], "type": "object"}}})";
const std::string k_time_line = R"({"type": "function", "function": {"name": "get_time"}})";

TEST(tool_calls, python_json_separators_and_indent) {
  const auto j = nlohmann::ordered_json::parse(R"({"b": [1, {"x": null}], "a": "é", "e": {}})");
  EXPECT_EQ(python_json(j), R"({"b": [1, {"x": null}], "a": "é", "e": {}})");
  EXPECT_EQ(python_json(j, 2), "{\n  \"b\": [\n    1,\n    {\n      \"x\": null\n    }\n  ],\n  \"a\": \"é\",\n  \"e\": {}\n}");
}

TEST(tool_calls, chatml_and_qwen3_render_hermes_tools_calls_and_results) {
  const tool_request t = tools_for(chat_format::chatml);
  const std::string expected =
      "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou can call the functions below to help with the user's "
      "request.\n\nTheir signatures are inside <tools></tools> XML tags:\n<tools>\n" +
      k_weather_line + "\n" + k_time_line +
      "\n</tools>\n\nTo call a function, answer with a JSON object of its name and arguments inside "
      "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
      "<args-json-object>}\n</tool_call><|im_end|>\n"
      "<|im_start|>user\nWeather?<|im_end|>\n"
      "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 1}}"
      "\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
      "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n";
  EXPECT_EQ(render(chat_format::chatml, round_trip(), prompt_tools(t)), expected);
  // Qwen3's template writes the same for this conversation (no reasoning in it).
  EXPECT_EQ(render(chat_format::qwen3, round_trip(), prompt_tools(t)), expected);
  // Content before the calls, no system message, no tools (tool_choice none): the history alone.
  std::vector<chat_message> m = {{"user", "Q", {}, {}}, {"assistant", "Let me look.", {{"c", "get_time", "{}"}}, {}}};
  EXPECT_EQ(render(chat_format::chatml, m, {}),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nLet me look.\n<tool_call>\n{\"name\": \"get_time\", "
            "\"arguments\": {}}\n</tool_call><|im_end|>\n<|im_start|>assistant\n");
}

TEST(tool_calls, llama3_renders_tools_in_the_first_user_message) {
  const tool_request t = tools_for(chat_format::llama3);
  std::vector<chat_message> m = round_trip();
  m[2].tool_calls.pop_back();  // one call per assistant message in this format
  m.pop_back();
  const std::string indented_time = "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_time\"\n    }\n}";
  const std::string out = render(chat_format::llama3, m, prompt_tools(t));
  const std::string head =
      "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\nBe brief.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nAnswer the prompt below with a call to one of these functions, "
      "written as JSON with its arguments.\n\nUse the format {\"name\": function name, \"parameters\": object of "
      "argument names and values}, with literal values only.\n\n";
  EXPECT_EQ(out.substr(0, head.size()), head);
  const std::string tail = indented_time + "\n\nWeather?<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \"parameters\": "
                           "{\"city\": \"Paris\", \"days\": 1}}<|eot_id|>"
                           "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n";
  ASSERT_GE(out.size(), tail.size());
  EXPECT_EQ(out.substr(out.size() - tail.size()), tail);
  EXPECT_NE(out.find("{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\",\n"
                     "        \"description\": \"Weather of a city\",\n        \"parameters\": {\n"),
            std::string::npos)
      << out;
  // Two calls in one message, and tools with no user message to carry them, are errors.
  auto two = render_chat(chat_format::llama3, round_trip(), k_tok, true, prompt_tools(t));
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.error().message().find("messages[2].tool_calls"), std::string::npos) << two.error().message();
  auto no_user = render_chat(chat_format::llama3, std::vector<chat_message>{{"system", "s", {}, {}}}, k_tok, true,
                             prompt_tools(t));
  ASSERT_FALSE(no_user.ok());
  EXPECT_NE(no_user.error().message().find("first user message"), std::string::npos);
}

TEST(tool_calls, mistral_renders_v03_tool_blocks) {
  tool_request t = tools_for(chat_format::mistral);
  std::vector<chat_message> m = round_trip();
  m.push_back({"user", "Thanks", {}, {}});
  EXPECT_EQ(render(chat_format::mistral, m, prompt_tools(t)),
            "[INST] Be brief.\n\nWeather? [/INST][TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": "
            "\"Paris\", \"days\": 1}, \"id\": \"0000call1\"}, {\"name\": \"get_time\", \"arguments\": {}, \"id\": "
            "\"0000call2\"}]</s>[TOOL_RESULTS] {\"content\": sunny, \"call_id\": \"0000call1\"}[/TOOL_RESULTS]"
            "[TOOL_RESULTS] {\"content\": noon, \"call_id\": \"0000call2\"}[/TOOL_RESULTS][AVAILABLE_TOOLS] [" +
                k_weather_line + ", " + k_time_line + "][/AVAILABLE_TOOLS][INST] Thanks [/INST]");
  // A forced call writes the control token [TOOL_CALLS] at the end of the prompt.
  t = tools_for(chat_format::mistral, "required");
  const std::string forced = render(chat_format::mistral, {{"user", "Hi", {}, {}}}, prompt_tools(t));
  EXPECT_TRUE(forced.ends_with("[INST] Hi [/INST][TOOL_CALLS]")) << forced;
}

TEST(tool_calls, families_without_a_tool_format_refuse_tools_and_tool_messages) {
  for (chat_format f : {chat_format::plain, chat_format::phi3, chat_format::gemma, chat_format::llama2}) {
    tool_request t;
    auto e = read_tools({{"tools", {k_weather}}}, f, t);
    ASSERT_TRUE(e) << chat_format_name(f);
    EXPECT_EQ(e->param, "tools");
    EXPECT_NE(e->message.find("no tool format"), std::string::npos);
    // tool_choice none renders no tools, so any family takes it.
    EXPECT_FALSE(read_tools({{"tools", {k_weather}}, {"tool_choice", "none"}}, f, t));
    EXPECT_FALSE(t.active());
    auto r = render_chat(f, round_trip(), k_tok, true, {});
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().message().find("messages[2].tool_calls"), std::string::npos) << r.error().message();
  }
}

// ---- parsing ----

TEST(tool_calls, hermes_output_parses_into_calls_after_content) {
  const tool_request t = tools_for(chat_format::qwen3);
  auto p = parse_tool_output(t, "I will look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                                "\"Tokyo\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": "
                                "\"get_time\"}\n</tool_call>");
  ASSERT_TRUE(p.called);
  EXPECT_EQ(p.content, "I will look.");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, R"({"city": "Tokyo", "days": 2})");
  EXPECT_EQ(p.calls[1].name, "get_time");
  EXPECT_EQ(p.calls[1].arguments, "{}");
  // The last closing tag may be missing (the model stopped); arguments as JSON text are read too.
  p = parse_tool_output(t, "<tool_call>{\"name\": \"get_time\", \"arguments\": \"{\\\"a\\\": 1}\"}");
  ASSERT_TRUE(p.called);
  EXPECT_EQ(p.content, "");
  EXPECT_EQ(p.calls[0].arguments, R"({"a": 1})");
  // No call at all: plain content.
  p = parse_tool_output(t, "Just text.");
  EXPECT_FALSE(p.called);
  EXPECT_EQ(p.content, "Just text.");
}

TEST(tool_calls, malformed_calls_are_content) {
  const tool_request t = tools_for(chat_format::chatml);
  for (const char* text :
       {"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",  // bad JSON
        "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>",               // not a tool
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",           // cut short
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": [1]}\n</tool_call>",            // not an object
        "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call> and more text",                  // text after
        "<tool_call>\n{\"arguments\": {}}\n</tool_call>",                                     // no name
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}, \"parameters\": {}}</tool_call>"}) {  // two
    const auto p = parse_tool_output(t, text);
    EXPECT_FALSE(p.called) << text;
    EXPECT_EQ(p.content, text);
  }
}

TEST(tool_calls, llama3_and_mistral_outputs_parse) {
  const tool_request l = tools_for(chat_format::llama3);
  auto p = parse_tool_output(l, " <|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 1}}");
  ASSERT_TRUE(p.called);
  EXPECT_EQ(p.calls[0].arguments, R"({"city": "Paris", "days": 1})");
  EXPECT_FALSE(parse_tool_output(l, "The weather is {\"name\": \"get_time\"}").called);  // a call starts the answer
  EXPECT_FALSE(parse_tool_output(l, "{\"name\": \"get_time\"} {\"name\": \"get_time\"}").called);
  const tool_request m = tools_for(chat_format::mistral);
  p = parse_tool_output(m, "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}}, {\"name\": \"get_weather\", "
                           "\"arguments\": {\"city\": \"Tokyo\", \"days\": 3}, \"id\": \"abcdefghi\"}]");
  ASSERT_TRUE(p.called);
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[1].arguments, R"({"city": "Tokyo", "days": 3})");
  // The marker is a control token that decodes to nothing: a bare array counts.
  EXPECT_TRUE(parse_tool_output(m, " [{\"name\": \"get_time\", \"arguments\": {}}]").called);
  EXPECT_FALSE(parse_tool_output(m, "[1, 2]").called);
}

TEST(tool_calls, finish_reasons_and_ids) {
  EXPECT_EQ(tool_finish_reason(tools_for(chat_format::chatml), true, "stop"), "tool_calls");
  EXPECT_EQ(tool_finish_reason(tools_for(chat_format::chatml, "required"), true, "stop"), "tool_calls");
  const json named = {{"type", "function"}, {"function", {{"name", "get_time"}}}};
  EXPECT_EQ(tool_finish_reason(tools_for(chat_format::chatml, named), true, "stop"), "stop");  // OpenAI's and vLLM's
  EXPECT_EQ(tool_finish_reason(tools_for(chat_format::chatml), false, "length"), "length");
  const std::string a = tool_call_id(chat_format::chatml, "chatcmpl-1", 0, 0);
  EXPECT_EQ(a.size(), 29u);
  EXPECT_TRUE(a.starts_with("call_"));
  EXPECT_EQ(a, tool_call_id(chat_format::chatml, "chatcmpl-1", 0, 0));
  EXPECT_NE(a, tool_call_id(chat_format::chatml, "chatcmpl-1", 0, 1));
  EXPECT_NE(a, tool_call_id(chat_format::chatml, "chatcmpl-2", 0, 0));
  EXPECT_EQ(tool_call_id(chat_format::mistral, "chatcmpl-1", 0, 0).size(), 9u);
}

// ---- streaming ----

struct streamed {
  std::string content;
  std::vector<std::string> names, args;
  bool called = false;
};

// Feeds `text` in pieces of `step` bytes.
streamed stream_text(const tool_request& t, std::string_view text, std::size_t step) {
  tool_call_stream s(std::make_shared<tool_request>(t));
  std::vector<tool_delta> deltas;
  for (std::size_t i = 0; i < text.size(); i += step) s.feed(text.substr(i, step), deltas);
  streamed out;
  out.called = s.finish(deltas);
  for (const tool_delta& d : deltas) {
    if (!d.is_call) {
      out.content += d.text;
      continue;
    }
    if (!d.name.empty()) {
      EXPECT_EQ(d.index, out.names.size()) << "calls are announced in order, name first";
      out.names.push_back(d.name);
      out.args.emplace_back();
    }
    EXPECT_LT(d.index, out.args.size());
    if (d.index < out.args.size()) out.args[d.index] += d.text;
  }
  return out;
}

TEST(tool_calls, streamed_deltas_add_up_to_the_parsed_output) {
  const std::vector<std::pair<chat_format, std::string>> cases = {
      {chat_format::chatml, "Looking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
                            "\"days\": 12}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}"},
      {chat_format::chatml, "No calls here, just <tool text and {braces}.\n"},
      {chat_format::chatml, "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}</tool_call>"},
      {chat_format::llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Tokyo\", \"days\": 1}}"},
      {chat_format::llama3, "{\"answer\": 42}"},
      {chat_format::mistral, "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {\"x\": \"}]\"}}]"},
      {chat_format::mistral, "[citation] text"},
  };
  for (const auto& [f, text] : cases) {
    const tool_request t = tools_for(f);
    const parsed_tool_output whole = parse_tool_output(t, text);
    for (std::size_t step : {1u, 3u, 1000u}) {
      const streamed s = stream_text(t, text, step);
      EXPECT_EQ(s.called, whole.called) << text;
      EXPECT_EQ(s.content, whole.content) << text << " step " << step;
      ASSERT_EQ(s.names.size(), whole.calls.size()) << text;
      for (std::size_t k = 0; k < s.names.size(); ++k) {
        EXPECT_EQ(s.names[k], whole.calls[k].name);
        EXPECT_EQ(s.args[k], whole.calls[k].arguments) << text << " step " << step;
      }
    }
  }
}

// Random cuts and edits of well-formed outputs: the parser never fails
// hard, and the stream gives what the whole parse gives (or, for text that
// stops being a call after its name went out, nothing as content).
TEST(tool_calls, mutated_outputs_stream_as_they_parse) {
  const std::vector<std::pair<chat_format, std::string>> seeds = {
      {chat_format::qwen3, "Ok.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n"
                           "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"z\": [1, \"]}\"]}}\n</tool_call>"},
      {chat_format::llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Tokyo\", \"days\": 10}}"},
      {chat_format::mistral, "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}}, {\"name\": \"get_weather\", "
                             "\"arguments\": {\"city\": \"Paris\", \"days\": 1}}]"},
  };
  std::mt19937 rng(36);
  const std::string alphabet = "{}[]\",:\\ <>/_\nabnTOLC0";
  int n_called = 0, n_not = 0;
  for (const auto& [f, seed] : seeds) {
    const tool_request t = tools_for(f);
    for (int round = 0; round < 300; ++round) {
      std::string text = seed;
      const int edits = static_cast<int>(rng() % 4);
      for (int e = 0; e < edits && !text.empty(); ++e) {
        const std::size_t at = rng() % text.size();
        switch (rng() % 3) {
          case 0: text.erase(at, 1 + rng() % 3); break;
          case 1: text.insert(at, 1, alphabet[rng() % alphabet.size()]); break;
          default: text.resize(at); break;
        }
      }
      const parsed_tool_output whole = parse_tool_output(t, text);
      (whole.called ? n_called : n_not)++;
      const streamed s = stream_text(t, text, 1 + rng() % 5);
      EXPECT_EQ(s.called, whole.called) << text;
      if (whole.called) {
        EXPECT_EQ(s.content, whole.content) << text;
        ASSERT_EQ(s.names.size(), whole.calls.size()) << text;
        for (std::size_t k = 0; k < s.names.size(); ++k) EXPECT_EQ(s.args[k], whole.calls[k].arguments) << text;
      } else {
        EXPECT_EQ(whole.content, text);
        if (s.names.empty()) EXPECT_EQ(s.content, text);
        else EXPECT_TRUE(text.starts_with(s.content)) << text;
      }
    }
  }
  EXPECT_GT(n_called, 50);  // both kinds occur
  EXPECT_GT(n_not, 50);
}

TEST(tool_calls, arguments_stream_before_the_call_ends) {
  const tool_request t = tools_for(chat_format::chatml);
  tool_call_stream s(std::make_shared<tool_request>(t));
  std::vector<tool_delta> d;
  s.feed("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa", d);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].name, "get_weather");
  EXPECT_EQ(d[1].text, "{\"city\": \"Pa");
  // Text that may begin a marker is held back, the rest goes out at once.
  d.clear();
  tool_call_stream c(std::make_shared<tool_request>(t));
  c.feed("Hello <tool_", d);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].text, "Hello");
}

// ---- grammar ----

grammar::rules grammar_of(const tool_request& t) {
  auto g = tool_call_grammar(t);
  EXPECT_TRUE(g.ok()) << g.error().message();
  auto r = grammar::parse_gbnf(g.ok() ? *g : "root ::= \"x\"");
  EXPECT_TRUE(r.ok());
  return *r;
}

TEST(tool_calls, the_grammar_forces_calls_in_each_format) {
  const json named = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  const std::string weather = R"({"name": "get_weather", "arguments": {"city": "Tokyo", "days": 7}})";
  const std::string time = R"({"name": "get_time", "arguments": {}})";
  const std::string hermes_w = "<tool_call>\n" + weather + "\n</tool_call>";
  const std::string hermes_t = "<tool_call>\n" + time + "\n</tool_call>";

  grammar::rules g = grammar_of(tools_for(chat_format::chatml, "required"));
  EXPECT_TRUE(grammar::matches(g, hermes_w));
  EXPECT_TRUE(grammar::matches(g, hermes_t + "\n" + hermes_w));  // parallel calls
  EXPECT_FALSE(grammar::matches(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\", \"days\": 7}}\n</tool_call>"));
  EXPECT_FALSE(grammar::matches(g, "Sure." + hermes_w));
  g = grammar_of(tools_for(chat_format::chatml, "required", /*parallel=*/false));
  EXPECT_FALSE(grammar::matches(g, hermes_t + "\n" + hermes_w));
  g = grammar_of(tools_for(chat_format::qwen3, named));
  EXPECT_TRUE(grammar::matches(g, hermes_w));
  EXPECT_FALSE(grammar::matches(g, hermes_t));

  g = grammar_of(tools_for(chat_format::llama3, "required"));
  EXPECT_TRUE(grammar::matches(g, R"({"name": "get_time", "parameters": {}})"));
  EXPECT_FALSE(grammar::matches(g, time));
  g = grammar_of(tools_for(chat_format::mistral, "required"));
  EXPECT_TRUE(grammar::matches(g, " [" + time + ", " + weather + "]"));
  g = grammar_of(tools_for(chat_format::mistral, named));
  EXPECT_TRUE(grammar::matches(g, "[" + weather + "]"));
  EXPECT_FALSE(grammar::matches(g, "[" + weather + ", " + weather + "]"));
  // Every string the grammar takes parses back into the same calls.
  const auto p = parse_tool_output(tools_for(chat_format::mistral, named), "[" + weather + "]");
  ASSERT_TRUE(p.called);
  EXPECT_EQ(p.calls[0].arguments, R"({"city": "Tokyo", "days": 7})");
}

// ---- requests ----

api_context chat_context(chat_format f) {
  api_context ctx = test::stories_api_context();
  ctx.chat = f;
  // stories260K's 512-token vocabulary spells the tools' JSON almost a character a token.
  ctx.limits.max_model_len = ctx.limits.max_prompt_tokens = 4096;
  return ctx;
}

api_error chat_error(const json& body, chat_format f = chat_format::chatml) {
  json b = body;
  if (!b.contains("messages")) b["messages"] = {{{"role", "user"}, {"content", "Weather?"}}};
  auto r = parse_request(api_kind::chat, b, chat_context(f), "");
  EXPECT_FALSE(r.ok()) << b.dump();
  return r.ok() ? api_error{} : r.error;
}

TEST(tool_calls, bad_requests_are_400s_naming_the_field) {
  const json no_name = {{"type", "function"}, {"function", {{"description", "x"}}}};
  const json unsupported_schema = {
      {"type", "function"},
      {"function", {{"name", "f"}, {"parameters", {{"type", "object"}, {"properties", {{"n", {{"type", "integer"}, {"minimum", 1}}}}}}}}}};
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"tools", {no_name}}}, "tools[0].function.name"},
      {{{"tools", {{{"type", "function"}, {"function", {{"name", "a b"}}}}}}}, "tools[0].function.name"},
      {{{"tools", {k_time, k_time}}}, "tools[1].function.name"},
      {{{"tools", {{{"type", "retrieval"}}}}}, "tools[0].type"},
      {{{"tools", "get_time"}}, "tools"},
      {{{"tools", {{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", "x"}}}}}}}, "tools[0].function.parameters"},
      {{{"tools", {{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", {{"type", "string"}}}}}}}}},
       "tools[0].function.parameters.type"},
      {{{"tools", {k_time, unsupported_schema}}, {"tool_choice", "required"}}, "tools[1].function.parameters"},
      {{{"tools", {k_time}}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}}},
       "tool_choice.function.name"},
      {{{"tools", {k_time}}, {"tool_choice", "sometimes"}}, "tool_choice"},
      {{{"tool_choice", "required"}}, "tool_choice"},
      {{{"tools", {k_time}}, {"tool_choice", "required"}, {"response_format", {{"type", "json_object"}}}}, "tool_choice"},
      {{{"tools", {k_time}}, {"parallel_tool_calls", 1}}, "parallel_tool_calls"},
      {{{"messages", {{{"role", "tool"}, {"content", "x"}}}}}, "messages[0].tool_call_id"},
      {{{"messages",
         {{{"role", "assistant"},
           {"content", nullptr},
           {"tool_calls", {{{"id", "c"}, {"type", "function"}, {"function", {{"name", "f"}, {"arguments", "{bad"}}}}}}}}}},
       "messages[0].tool_calls[0].function.arguments"},
      {{{"messages", {{{"role", "user"}, {"content", "x"}, {"tool_calls", {{{"function", {{"name", "f"}}}}}}}}}},
       "messages[0].tool_calls"},
  };
  for (const auto& [body, param] : cases) {
    const api_error e = chat_error(body);
    EXPECT_EQ(e.http_status, 400) << body.dump();
    EXPECT_EQ(e.param, param) << body.dump() << ": " << e.message;
  }
  // Tools with a template that has no tool format; a tool message there.
  EXPECT_EQ(chat_error({{"tools", {k_time}}}, chat_format::phi3).param, "tools");
  EXPECT_EQ(chat_error({{"messages", {{{"role", "tool"}, {"content", "x"}, {"tool_call_id", "c"}}}}}, chat_format::plain).param,
            "messages[0].role");
  // Completions still refuse tools.
  auto r = parse_request(api_kind::completion, {{"prompt", "x"}, {"tools", {k_time}}}, chat_context(chat_format::chatml), "");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error.param, "tools");
}

TEST(tool_calls, a_forced_call_sets_the_grammar_and_the_call_keeps_the_tools) {
  const api_context ctx = chat_context(chat_format::chatml);
  json body = {{"messages", {{{"role", "user"}, {"content", "Weather?"}}}}, {"tools", {k_weather, k_time}}};
  auto automatic = parse_request(api_kind::chat, body, ctx, "");
  ASSERT_TRUE(automatic.ok()) << automatic.error.message;
  ASSERT_TRUE(automatic.value->tools);
  EXPECT_EQ(automatic.value->tools->choice, tool_choice_kind::automatic);
  EXPECT_TRUE(automatic.value->requests[0].sampling.grammar.empty());
  const std::string prompt = ctx.vocab->decode(automatic.value->requests[0].prompt);
  EXPECT_NE(prompt.find("<tools>"), std::string::npos) << prompt;

  body["tool_choice"] = "required";
  auto required = parse_request(api_kind::chat, body, ctx, "");
  ASSERT_TRUE(required.ok()) << required.error.message;
  EXPECT_EQ(required.value->requests[0].sampling.grammar, *tool_call_grammar(*required.value->tools));

  body["tool_choice"] = "none";
  auto none = parse_request(api_kind::chat, body, ctx, "");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none.value->tools);
  EXPECT_EQ(ctx.vocab->decode(none.value->requests[0].prompt).find("<tools>"), std::string::npos);

  // A round trip's history parses: an assistant's calls (content null) and tool results.
  body["messages"] = {{{"role", "user"}, {"content", "Weather?"}},
                      {{"role", "assistant"},
                       {"content", nullptr},
                       {"tool_calls",
                        {{{"id", "call_9"},
                          {"type", "function"},
                          {"function", {{"name", "get_weather"}, {"arguments", R"({"city":"Paris","days":1})"}}}}}}},
                      {{"role", "tool"}, {"tool_call_id", "call_9"}, {"content", "sunny"}}};
  auto history = parse_request(api_kind::chat, body, ctx, "");
  ASSERT_TRUE(history.ok()) << history.error.message;
  EXPECT_NE(ctx.vocab->decode(history.value->requests[0].prompt).find("<tool_response>\nsunny\n</tool_response>"),
            std::string::npos);
}

TEST(tool_calls, responses_carry_tool_calls_whole_and_streamed) {
  const api_context ctx = chat_context(chat_format::chatml);
  json body = {{"messages", {{{"role", "user"}, {"content", "Weather?"}}}}, {"tools", {k_weather}}};
  auto call = parse_request(api_kind::chat, body, ctx, "");
  ASSERT_TRUE(call.ok());
  const std::string text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>";
  response_builder whole(*call.value, "chatcmpl-x", "m", 0, *ctx.vocab);
  response_builder streaming(*call.value, "chatcmpl-x", "m", 0, *ctx.vocab);
  std::vector<json> chunks;
  for (std::size_t i = 0; i < text.size(); i += 7) {
    engine_event e;
    e.text = text.substr(i, 7);
    if (i + 7 >= text.size()) {
      e.finish_reason = "stop";
      e.request_finished = true;
    }
    whole.add(0, e);
    streaming.add(0, e);
    streaming.chunks_for(0, e, chunks);
  }
  const json b = whole.body();
  const json& choice = b["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  const json& tc = choice["message"]["tool_calls"][0];
  EXPECT_EQ(tc["type"], "function");
  EXPECT_EQ(tc["function"]["name"], "get_weather");
  EXPECT_EQ(tc["function"]["arguments"], R"({"city": "Paris", "days": 3})");
  // The stream: the id, type and name first, then argument pieces, then the finish reason.
  std::string args, finish;
  ASSERT_FALSE(chunks.empty());
  const json& first = chunks[0]["choices"][0]["delta"]["tool_calls"][0];
  EXPECT_EQ(first["id"], tc["id"]);
  EXPECT_EQ(first["function"]["name"], "get_weather");
  for (const json& c : chunks) {
    const json& ch = c["choices"][0];
    EXPECT_FALSE(ch["delta"].contains("content")) << c.dump();
    if (ch["delta"].contains("tool_calls")) args += ch["delta"]["tool_calls"][0]["function"]["arguments"].get<std::string>();
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  EXPECT_EQ(args, tc["function"]["arguments"]);
  EXPECT_EQ(finish, "tool_calls");
}

}  // namespace
}  // namespace pagoda::server
