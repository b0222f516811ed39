#include "server/structured_output.h"

#include <fmt/format.h>

#include "grammar/convert.h"
#include "grammar/gbnf.h"

namespace pagoda::server {

namespace {

using nlohmann::json;

const json* present(const json& body, const char* name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

// A grammar from `make`, or a 400 naming `field` with its message.
std::optional<api_error> take(const std::string& field, result<std::string> made, std::string& grammar) {
  if (!made.ok()) return bad_request(field, fmt::format("'{}': {}", field, made.error().message()));
  grammar = std::move(*made);
  return {};
}

std::optional<api_error> from_schema(const std::string& field, const json& schema, std::string& grammar) {
  if (schema.is_string()) {
    const json parsed = json::parse(schema.get<std::string>(), nullptr, false);
    if (parsed.is_discarded()) return bad_request(field, fmt::format("'{}' is a string that is not JSON", field));
    return take(field, grammar::json_schema_to_gbnf(parsed), grammar);
  }
  if (!schema.is_object() && !schema.is_boolean())
    return bad_request(field, fmt::format("'{}' must be a JSON Schema (an object)", field));
  return take(field, grammar::json_schema_to_gbnf(schema), grammar);
}

std::optional<api_error> from_response_format(const json& v, std::string& grammar) {
  if (!v.is_object()) return bad_request("response_format", "'response_format' must be an object");
  const auto t = v.find("type");
  if (t == v.end() || !t->is_string())
    return bad_request("response_format.type", "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"");
  const std::string type = t->get<std::string>();
  if (type == "text") return {};
  if (type == "json_object") {
    if (const json* s = present(v, "schema")) return from_schema("response_format.schema", *s, grammar);
    grammar = grammar::json_object_gbnf();
    return {};
  }
  if (type == "json_schema") {
    const json* js = present(v, "json_schema");
    if (!js || !js->is_object())
      return bad_request("response_format.json_schema", "'response_format.json_schema' must be an object with a 'schema'");
    const json* s = present(*js, "schema");
    if (!s) {
      // llama.cpp also takes the schema itself here.
      if (js->contains("type") || js->contains("properties") || js->contains("$ref") || js->contains("anyOf"))
        return from_schema("response_format.json_schema", *js, grammar);
      grammar = grammar::json_object_gbnf();  // OpenAI: a schema-less json_schema is any object
      return {};
    }
    return from_schema("response_format.json_schema.schema", *s, grammar);
  }
  return bad_request("response_format.type",
                     fmt::format("'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", not \"{}\"",
                                 type.substr(0, 40)));
}

std::optional<api_error> from_gbnf(const std::string& field, const json& v, std::string& grammar) {
  if (!v.is_string()) return bad_request(field, fmt::format("'{}' must be a string (GBNF)", field));
  std::string text = v.get<std::string>();
  if (auto g = grammar::parse_gbnf(text); !g.ok())
    return bad_request(field, fmt::format("'{}': {}", field, g.error().message()));
  grammar = std::move(text);
  return {};
}

}  // namespace

std::optional<api_error> read_structured_output(const json& body, std::string& grammar) {
  grammar.clear();
  if (present(body, "guided_whitespace_pattern"))
    return bad_request("guided_whitespace_pattern",
                       "'guided_whitespace_pattern' is not supported by this server; omit it",
                       "unsupported_parameter");
  const char* fields[] = {"response_format", "guided_json", "guided_regex", "guided_choice",
                          "guided_grammar",  "grammar",     "json_schema"};
  const char* given = nullptr;
  for (const char* f : fields) {
    const json* v = present(body, f);
    if (!v) continue;
    if (std::string(f) == "response_format" && v->is_object() && v->value("type", json()) == json("text")) continue;
    if (given)
      return bad_request(f, fmt::format("'{}' and '{}' both constrain the output; give at most one", given, f));
    given = f;
  }
  if (!given) return {};
  const std::string field = given;
  const json& v = *present(body, given);
  if (field == "response_format") return from_response_format(v, grammar);
  if (field == "guided_json" || field == "json_schema") return from_schema(field, v, grammar);
  if (field == "guided_regex") {
    if (!v.is_string()) return bad_request(field, "'guided_regex' must be a string");
    return take(field, grammar::regex_to_gbnf(v.get<std::string>()), grammar);
  }
  if (field == "guided_choice") {
    if (!v.is_array()) return bad_request(field, "'guided_choice' must be an array of strings");
    std::vector<std::string> choices;
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_string()) return bad_request(fmt::format("guided_choice[{}]", i), "'guided_choice' must be an array of strings");
      choices.push_back(v[i].get<std::string>());
    }
    return take(field, grammar::choice_to_gbnf(choices), grammar);
  }
  return from_gbnf(field, v, grammar);
}

}  // namespace pagoda::server
