// Structured output end to end: request bodies read by the server's parser
// (server/openai_request.h, so the fields are the API's), run through the
// engine on stories260K (SentencePiece vocabulary, 512 tokens) and on a
// synth model carrying a byte-level BPE vocabulary (StarCoder's, 49152
// tokens), greedy and sampled. JSON outputs are checked by an independent
// validator (Debian's python3-jsonschema, validate_json_outputs.py); grammar
// outputs by the grammar itself.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "common/gguf_payload.h"
#include "common/temp_files.h"
#include "grammar/gbnf.h"
#include "grammar/grammars.h"
#include "grammar/matcher.h"
#include "model/gguf_writer.h"
#include "model/synth.h"
#include "model/tokenizer.h"
#include "pagoda/engine.h"
#include "server/openai_request.h"
#include "server/tool_calls.h"

namespace pagoda {
namespace {

using nlohmann::json;

std::string stories_path() { return std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf"; }

// synth "tiny" weights with StarCoder's byte-level BPE vocabulary, written once per process.
const std::string& bpe_model_path() {
  static const std::string path = [] {
    const std::string vocab_path = std::string(PAGODA_SOURCE_DIR) + "/tests/data/tokenizer/ggml-vocab-starcoder.gguf";
    auto vocab = gguf::file::open(vocab_path);
    EXPECT_TRUE(vocab.ok()) << vocab.error().message();
    std::int64_t n_vocab = 0;
    for (const gguf::metadata_entry& e : (*vocab)->metadata())
      if (e.key == "tokenizer.ggml.tokens") n_vocab = static_cast<std::int64_t>(e.val.array_size);
    synth_options o;
    o.preset = "tiny";
    o.weight_type = gguf::tensor_type::f32;
    o.n_threads = 1;
    o.n_vocab = static_cast<int>(n_vocab);
    const std::string weights = temp_file("structured", "weights.gguf");
    const status st = write_synth_model(o, weights);
    EXPECT_TRUE(st.ok()) << st.message();
    auto synth = gguf::file::open(weights);
    EXPECT_TRUE(synth.ok()) << synth.error().message();
    gguf::writer w;
    for (const gguf::metadata_entry& e : (*synth)->metadata()) {
      if (e.key.rfind("tokenizer.", 0) == 0) continue;
      if (e.key == "general.alignment") {
        w.set_alignment(static_cast<std::uint32_t>(e.val.u));
        continue;
      }
      w.add_raw(e.key, static_cast<std::uint32_t>(e.val.type), test::payload_of(e.val));
    }
    for (const gguf::metadata_entry& e : (*vocab)->metadata())
      if (e.key.rfind("tokenizer.", 0) == 0)
        w.add_raw(e.key, static_cast<std::uint32_t>(e.val.type), test::payload_of(e.val));
    for (const gguf::tensor_info& t : (*synth)->tensors())
      w.add_tensor(t.name, t.type, std::span<const std::int64_t>(t.ne, t.n_dims), std::span(t.data, t.size_bytes));
    const std::string out = temp_file("structured", "bpe.gguf");
    const status wst = w.write_file(out);
    EXPECT_TRUE(wst.ok()) << wst.message();
    return out;
  }();
  return path;
}

struct completion {
  std::string text;
  std::string finish_reason;
  std::vector<token_id> tokens;
};

std::ostream& operator<<(std::ostream& os, const completion& c) {
  os << c.finish_reason << " " << json(c.text).dump() << " tokens";
  for (const token_id t : c.tokens) os << " " << t;
  return os;
}

// Runs every body (a /v1/completions body; "id" names it) through one engine
// on `model`; a body the parser refuses gets its error message as text and
// finish reason "400".
std::map<std::string, std::vector<completion>> run(const std::string& model, const std::vector<json>& bodies) {
  engine_config c;
  c.model_path = model;
  c.n_threads = 1;
  c.n_ctx = 4096;  // room for tools written into a chat prompt (llama3 indents them)
  c.max_num_seqs = 16;
  auto eng = engine::create(c);
  EXPECT_TRUE(eng.ok()) << eng.error().message();
  auto file = gguf::file::open(model);
  auto vocab = tokenizer::from_gguf(**file);
  server::api_context ctx;
  ctx.vocab = vocab->get();
  ctx.limits.max_model_len = ctx.limits.max_prompt_tokens = 4096;
  ctx.limits.max_tokens = 2048;
  std::map<std::string, std::vector<completion>> out;
  for (const json& body : bodies) {
    const std::string id = body["id"].get<std::string>();
    json b = body;
    b.erase("id");
    // A chat body ("messages") is rendered with the family "chat_template" names.
    server::api_context body_ctx = ctx;
    if (b.contains("chat_template")) {
      body_ctx.chat = server::chat_format_from_name(b["chat_template"].get<std::string>()).value();
      b.erase("chat_template");
    }
    const auto kind = b.contains("messages") ? server::api_kind::chat : server::api_kind::completion;
    auto call = server::parse_request(kind, b, body_ctx, "");
    if (!call.ok()) {
      out[id] = {{call.error.message, "400"}};
      continue;
    }
    request r = std::move(call.value->requests.at(0));
    r.id = id;
    out[id].resize(static_cast<std::size_t>(r.n));
    const status st = (*eng)->add_request(std::move(r));
    EXPECT_TRUE(st.ok()) << id << ": " << st.message();
  }
  std::vector<engine_event> events;
  while ((*eng)->has_work()) {
    events.clear();
    (*eng)->step(events);
    for (const engine_event& e : events) {
      completion& x = out[e.request_id].at(static_cast<std::size_t>(e.index));
      x.text += e.text;
      x.tokens.insert(x.tokens.end(), e.tokens.begin(), e.tokens.end());
      if (!e.finish_reason.empty()) x.finish_reason = e.finish_reason;
    }
  }
  return out;
}

// Bounded schemas (every string, array and number has a length limit), so
// every output ends well within max_tokens.
std::vector<json> schemas() {
  const char* texts[] = {
      R"({"type": "boolean"})",
      R"({"type": "integer"})",
      R"({"type": "number"})",
      R"({"type": "null"})",
      R"({"type": "string", "maxLength": 10})",
      R"({"type": "string", "minLength": 2, "maxLength": 5})",
      R"({"enum": ["red", "green", "blue"]})",
      R"({"const": "fixed"})",
      R"({"enum": [1, 2.5, null, true, "x", {"k": [1]}]})",
      R"({"type": ["integer", "null"]})",
      R"({"type": "array", "items": {"type": "integer"}, "maxItems": 4})",
      R"({"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3})",
      R"({"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 5})",
      R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]})",
      R"({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"const": 3}}})",
      R"({"type": "object", "properties": {"id": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}, "required": ["id"]})",
      R"({"type": "object", "properties": {"user": {"type": "object", "properties": {
          "first": {"type": "string", "maxLength": 8}, "last": {"type": "string", "maxLength": 8}},
          "required": ["first", "last"]}, "active": {"type": "boolean"}}, "required": ["user", "active"]})",
      R"({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]})",
      R"({"anyOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
          "required": ["kind", "r"]}, {"type": "object", "properties": {"kind": {"const": "square"},
          "side": {"type": "integer"}}, "required": ["kind", "side"]}]})",
      R"({"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
          "required": ["x", "y"]}}, "type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 3})",
      R"({"definitions": {"color": {"enum": ["r", "g", "b"]}}, "type": "object",
          "properties": {"fg": {"$ref": "#/definitions/color"}, "bg": {"$ref": "#/definitions/color"}},
          "required": ["fg", "bg"]})",
      R"({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}}, "$ref": "#/$defs/a"})",
      R"({"type": "string", "format": "date"})",
      R"({"type": "string", "format": "date-time"})",
      R"({"type": "string", "format": "uuid"})",
      R"({"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"})",
      R"({"type": "object", "additionalProperties": false})",
      R"({"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"], "additionalProperties": false})",
      R"({"type": "array", "maxItems": 0})",
      R"({"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "maxItems": 2})",
      R"({"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": "integer"},
          "detail": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]}},
          "required": ["status", "code", "detail"]})",
      R"({"title": "Deep", "type": "object", "properties": {"l1": {"type": "object", "properties": {"l2": {
          "type": "object", "properties": {"l3": {"type": "array", "items": {"type": "number"}, "maxItems": 2}},
          "required": ["l3"]}}, "required": ["l2"]}}, "required": ["l1"]})",
      R"({"type": ["boolean", "string"], "maxLength": 3})",
      R"({"description": "a mixed list", "type": "array", "items": {"anyOf": [{"type": "integer"},
          {"$ref": "#/$defs/s"}]}, "minItems": 1, "maxItems": 3, "$defs": {"s": {"type": "string", "maxLength": 4}}})",
  };
  std::vector<json> out;
  for (const char* t : texts) out.push_back(json::parse(t));
  return out;
}

// The same schema through each of the fields that carry one.
json with_schema(json body, const json& schema, std::size_t i) {
  switch (i % 4) {
    case 0: body["guided_json"] = schema; break;
    case 1: body["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", "s"}, {"schema", schema}}}}; break;
    case 2: body["json_schema"] = schema; break;
    default: body["guided_json"] = schema.dump(); break;  // vLLM takes the schema as text too
  }
  return body;
}

// Runs the JSONL file of {"id", "schema", "text"} through the independent
// validator; expects `n` of them to validate.
void expect_validated(const std::string& cases, std::size_t n) {
  const std::string cmd = "/usr/bin/python3 " + std::string(PAGODA_SOURCE_DIR) +
                          "/tests/grammar/validate_json_outputs.py " + cases + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string report;
  char buf[4096];
  while (std::size_t got = fread(buf, 1, sizeof buf, p)) report.append(buf, got);
  const int rc = pclose(p);
  EXPECT_EQ(rc, 0) << report;
  EXPECT_NE(report.find("validated " + std::to_string(n) + " of"), std::string::npos) << report;
}

void expect_schemas_validate(const std::string& model, const std::string& name) {
  const std::vector<json> all = schemas();
  ASSERT_GE(all.size(), 30u);
  std::vector<json> bodies;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const json base = {{"prompt", "Once upon a time"}, {"max_tokens", 1500}};
    json greedy = with_schema(base, all[i], i);
    greedy["id"] = "g" + std::to_string(i);
    greedy["temperature"] = 0;
    json sampled = with_schema(base, all[i], i + 1);
    sampled["id"] = "s" + std::to_string(i);
    sampled["temperature"] = 1.0;
    sampled["seed"] = 100 + i;
    bodies.push_back(greedy);
    bodies.push_back(sampled);
  }
  const auto results = run(model, bodies);
  const std::string cases = temp_file("structured", name + "_cases.jsonl");
  {
    std::ofstream f(cases);
    for (std::size_t i = 0; i < all.size(); ++i)
      for (const char* kind : {"g", "s"}) {
        const std::string id = kind + std::to_string(i);
        const completion& c = results.at(id).at(0);
        EXPECT_EQ(c.finish_reason, "stop") << name << " " << id << ": " << c.text;
        f << json{{"id", id}, {"schema", all[i]}, {"text", c.text}}.dump() << "\n";
        if (std::getenv("PAGODA_TEST_SHOW_OUTPUTS")) std::printf("%s %s: %s\n", name.c_str(), id.c_str(), c.text.c_str());
      }
  }
  expect_validated(cases, 2 * all.size());
}

TEST(structured_output, json_schemas_validate_on_stories260k) { expect_schemas_validate(stories_path(), "stories"); }

TEST(structured_output, json_schemas_validate_on_a_byte_level_bpe_vocabulary) {
  expect_schemas_validate(bpe_model_path(), "bpe");
}

// Function calling forced by tool_choice (required with one call, and each
// function by name) in every chat format with a tool format: each output
// parses into a call (server/tool_calls.h) whose arguments validate against
// the function's parameter schema, greedy and sampled, on both vocabularies.
TEST(structured_output, forced_tool_calls_parse_and_validate) {
  const json tools = json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer"}},
      "required": ["city", "days"], "additionalProperties": false}}},
    {"type": "function", "function": {"name": "book", "description": "Book rooms", "parameters": {"type": "object",
      "properties": {"guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                               "vip": {"type": "boolean"}}, "required": ["name", "vip"]},
                     "nights": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                     "rooms": {"type": "array", "items": {"$ref": "#/$defs/room"}, "minItems": 1, "maxItems": 2}},
      "required": ["guest", "nights", "rooms"], "$defs": {"room": {"enum": ["single", "double"]}}}}},
    {"type": "function", "function": {"name": "ping"}}])");
  const std::vector<json> choices = {"required", {{"type", "function"}, {"function", {{"name", "get_weather"}}}},
                                     {{"type", "function"}, {"function", {{"name", "book"}}}},
                                     {{"type", "function"}, {"function", {{"name", "ping"}}}}};
  for (const auto& [model, name] : {std::pair{stories_path(), "stories"}, std::pair{bpe_model_path(), "bpe"}}) {
    std::vector<json> bodies;
    for (const char* family : {"chatml", "qwen3", "llama3", "mistral"})
      for (std::size_t c = 0; c < choices.size(); ++c)
        for (int seed = 0; seed < 2; ++seed)
          bodies.push_back({{"id", fmt::format("{}-{}-{}", family, c, seed)},
                            {"chat_template", family},
                            {"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
                            {"tools", tools},
                            {"tool_choice", choices[c]},
                            {"parallel_tool_calls", false},
                            {"max_tokens", 400},
                            {"temperature", seed == 0 ? 0.0 : 1.0},
                            {"seed", seed}});
    const auto results = run(model, bodies);
    const std::string cases = temp_file("structured", std::string(name) + "_tools.jsonl");
    std::ofstream f(cases);
    for (const json& body : bodies) {
      const std::string id = body["id"];
      const completion& out = results.at(id).at(0);
      EXPECT_EQ(out.finish_reason, "stop") << name << " " << id << ": " << out;
      server::tool_request t;
      ASSERT_FALSE(server::read_tools(body, *server::chat_format_from_name(body["chat_template"].get<std::string>()), t));
      const server::parsed_tool_output parsed = server::parse_tool_output(t, out.text);
      ASSERT_TRUE(parsed.called) << name << " " << id << ": " << out.text;
      ASSERT_EQ(parsed.calls.size(), 1u) << out.text;
      if (t.choice == server::tool_choice_kind::named) {
        EXPECT_EQ(parsed.calls[0].name, t.named) << out.text;
      }
      const server::tool_function* fn = t.find(parsed.calls[0].name);
      ASSERT_NE(fn, nullptr);
      const json schema = fn->parameters.is_null() ? json{{"type", "object"}, {"additionalProperties", false}} : fn->parameters;
      f << json{{"id", name + std::string(" ") + id}, {"schema", schema}, {"text", parsed.calls[0].arguments}}.dump() << "\n";
      if (std::getenv("PAGODA_TEST_SHOW_OUTPUTS")) std::printf("%s %s: %s\n", name, id.c_str(), out.text.c_str());
    }
    f.close();
    expect_validated(cases, bodies.size());
  }
}

// llama.cpp-style example grammars (written here, grammars.h) through the
// `grammar` field: what ends by "stop" is a sentence, what ends by length a prefix of one.
TEST(structured_output, gbnf_grammars_are_respected) {
  const std::pair<const char*, const char*> grammars[] = {
      {"json", grammar::testing::k_json}, {"arithmetic", grammar::testing::k_arithmetic}, {"list", grammar::testing::k_list}};
  for (const std::string& model : {stories_path(), bpe_model_path()}) {
    std::vector<json> bodies;
    for (const auto& [name, text] : grammars)
      for (int seed = 0; seed < 3; ++seed)
        bodies.push_back({{"id", std::string(name) + std::to_string(seed)}, {"prompt", "Once upon a time"},
                          {"max_tokens", 200}, {"temperature", seed == 0 ? 0.0 : 1.0}, {"seed", seed}, {"grammar", text}});
    const auto results = run(model, bodies);
    int n_stopped = 0;
    for (const auto& [name, text] : grammars) {
      auto g = grammar::parse_gbnf(text);
      ASSERT_TRUE(g.ok()) << g.error().message();
      for (int seed = 0; seed < 3; ++seed) {
        const completion& c = results.at(std::string(name) + std::to_string(seed)).at(0);
        grammar::match_state s = grammar::initial_state(*g);
        EXPECT_TRUE(grammar::advance(*g, s, c.text)) << name << ": " << c.text;
        if (c.finish_reason == "stop") {
          ++n_stopped;
          EXPECT_TRUE(s.accepts()) << name << ": " << c.text;
        } else {
          EXPECT_EQ(c.finish_reason, "length") << name << ": " << c;
        }
      }
    }
    EXPECT_GT(n_stopped, 0) << model;
  }
}

TEST(structured_output, regex_choice_and_composition_with_sampling_options) {
  const json choices = {"yes", "no", "maybe"};
  std::vector<json> bodies = {
      {{"id", "regex"}, {"prompt", "Once"}, {"max_tokens", 40}, {"temperature", 1.0}, {"seed", 3},
       {"guided_regex", "[0-9]{3}-[a-z]{2,4}"}},
      // n > 1, penalties and a large bias on a token outside the choices: the mask wins.
      {{"id", "choice"}, {"prompt", "Once"}, {"max_tokens", 20}, {"temperature", 1.0}, {"seed", 4}, {"n", 3},
       {"presence_penalty", 1.5}, {"repetition_penalty", 1.3}, {"logit_bias", {{"300", 100}}},
       {"guided_choice", choices}},
      // A stop string inside the grammar's output cuts it as usual.
      {{"id", "stop"}, {"prompt", "Once"}, {"max_tokens", 20}, {"temperature", 0}, {"guided_choice", {"abcdef"}},
       {"stop", {"cd"}}},
      // After the grammar's end only EOS is allowed; ignoring it ends the request with finish reason "grammar".
      {{"id", "ignore_eos"}, {"prompt", "Once"}, {"max_tokens", 20}, {"temperature", 0}, {"guided_choice", {"done"}},
       {"ignore_eos", true}},
      {{"id", "json_object"}, {"prompt", "Once"}, {"max_tokens", 400}, {"temperature", 0},
       {"response_format", {{"type", "json_object"}}}},
      // Speculative decoding: the prompt's n-grams are drafted; drafts the grammar refuses are rejected.
      {{"id", "spec_greedy"}, {"prompt", "ab ab ab ab ab ab"}, {"max_tokens", 30}, {"temperature", 0},
       {"speculative", "ngram:k=3"}, {"guided_regex", "(ab ){3}"}},
      {{"id", "spec_sampled"}, {"prompt", "ab ab ab ab ab ab"}, {"max_tokens", 30}, {"temperature", 1.0},
       {"seed", 5}, {"speculative", "ngram:k=3"}, {"guided_regex", "(ab ){2}c"}},
      // A model drafter's sampled drafts go through rejection sampling against the masked law.
      {{"id", "spec_self"}, {"prompt", "ab ab ab ab ab ab"}, {"max_tokens", 30}, {"temperature", 1.0},
       {"seed", 6}, {"speculative", "self:k=3,view=window,sinks=4,window=32"}, {"guided_regex", "(ab ){2}c"}},
  };
  for (const std::string& model : {stories_path(), bpe_model_path()}) {
    const auto r = run(model, bodies);
    auto g = grammar::parse_gbnf("root ::= [0-9]{3} \"-\" [a-z]{2,4}\n");
    EXPECT_TRUE(grammar::matches(*g, r.at("regex")[0].text)) << r.at("regex")[0].text;
    EXPECT_EQ(r.at("regex")[0].finish_reason, "stop");
    for (const completion& c : r.at("choice")) {
      EXPECT_TRUE(c.text == "yes" || c.text == "no" || c.text == "maybe") << model << ": " << c;
      EXPECT_EQ(c.finish_reason, "stop");
    }
    EXPECT_EQ(r.at("stop")[0].text, "ab");
    EXPECT_EQ(r.at("stop")[0].finish_reason, "stop");
    EXPECT_EQ(r.at("ignore_eos")[0].text, "done") << model << ": " << r.at("ignore_eos")[0];
    EXPECT_EQ(r.at("ignore_eos")[0].finish_reason, "grammar");
    EXPECT_EQ(r.at("spec_greedy")[0].text, "ab ab ab ") << r.at("spec_greedy")[0];
    EXPECT_EQ(r.at("spec_sampled")[0].text, "ab ab c") << r.at("spec_sampled")[0];
    EXPECT_EQ(r.at("spec_self")[0].text, "ab ab c") << r.at("spec_self")[0];
    const completion& obj = r.at("json_object")[0];
    ASSERT_FALSE(obj.text.empty());
    EXPECT_EQ(obj.text[0], '{');
    if (obj.finish_reason == "stop") {
      EXPECT_TRUE(json::parse(obj.text, nullptr, false).is_object()) << obj.text;
    }
  }
}

TEST(structured_output, bad_input_is_refused_before_generation) {
  std::string huge = "root ::= r0\n";
  for (int i = 0; i < 25; ++i) huge += "r" + std::to_string(i) + " ::= \"a\"{10000}\n";
  const std::vector<json> bodies = {
      {{"id", "keyword"}, {"prompt", "x"}, {"guided_json", {{"type", "integer"}, {"minimum", 0}}}},
      {{"id", "cycle"}, {"prompt", "x"}, {"json_schema", {{"$defs", {{"a", {{"$ref", "#/$defs/a"}}}}}, {"$ref", "#/$defs/a"}}}},
      {{"id", "bad_gbnf"}, {"prompt", "x"}, {"grammar", "root ::= missing\n"}},
      {{"id", "huge"}, {"prompt", "x"}, {"grammar", huge}},
      {{"id", "two"}, {"prompt", "x"}, {"grammar", "root ::= \"a\"\n"}, {"guided_regex", "a"}},
      {{"id", "format"}, {"prompt", "x"}, {"response_format", {{"type", "xml"}}}},
      {{"id", "not_json"}, {"prompt", "x"}, {"guided_json", "{not json"}},
      {{"id", "regex"}, {"prompt", "x"}, {"guided_regex", "(a"}},
      {{"id", "choice"}, {"prompt", "x"}, {"guided_choice", json::array()}},
      {{"id", "whitespace"}, {"prompt", "x"}, {"guided_json", {{"type", "boolean"}}}, {"guided_whitespace_pattern", " "}},
  };
  const auto r = run(stories_path(), bodies);
  auto refused = [&](const char* id, const char* needle) {
    const completion& c = r.at(id).at(0);
    EXPECT_EQ(c.finish_reason, "400") << id << ": " << c.text;
    EXPECT_NE(c.text.find(needle), std::string::npos) << id << ": " << c.text;
  };
  refused("keyword", "\"minimum\"");
  refused("cycle", "$ref cycle");
  refused("bad_gbnf", "'missing' is used but not defined");
  refused("huge", "more than");
  refused("two", "at most one");
  refused("format", "json_schema");
  refused("not_json", "not JSON");
  refused("regex", "regex");
  refused("choice", "empty");
  refused("whitespace", "guided_whitespace_pattern");
}

}  // namespace
}  // namespace pagoda
