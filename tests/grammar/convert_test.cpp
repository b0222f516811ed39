#include "grammar/convert.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "grammar/gbnf.h"
#include "grammar/matcher.h"

namespace pagoda::grammar {
namespace {

using nlohmann::json;

rules schema_rules(const char* schema) {
  auto text = json_schema_to_gbnf(json::parse(schema));
  EXPECT_TRUE(text.ok()) << text.error().message();
  auto g = parse_gbnf(text.ok() ? *text : "root ::= \"\"\n");
  EXPECT_TRUE(g.ok()) << g.error().message() << "\n" << *text;
  return std::move(*g);
}

std::string schema_error(const char* schema) {
  auto text = json_schema_to_gbnf(json::parse(schema));
  EXPECT_FALSE(text.ok()) << schema;
  return text.ok() ? "" : text.error().message();
}

TEST(json_schema, object_with_required_and_optional_properties) {
  const rules g = schema_rules(R"({"type": "object", "properties": {"name": {"type": "string"},
      "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
      "required": ["age"]})");
  EXPECT_TRUE(matches(g, R"({"age": 3})"));
  EXPECT_TRUE(matches(g, R"({"age": -3, "name": "x\"y", "tags": ["a", "b"]})"));
  EXPECT_TRUE(matches(g, "{\n  \"age\": 0,\n  \"tags\": []\n}"));
  EXPECT_FALSE(matches(g, R"({"name": "x"})"));                     // age is required
  EXPECT_FALSE(matches(g, R"({"age": 1.5})"));                      // an integer
  EXPECT_FALSE(matches(g, R"({"age": 1, "tags": ["a", "b", "c"]})"));  // maxItems
  EXPECT_FALSE(matches(g, R"({"age": 1, "other": 2})"));            // no other properties
}

TEST(json_schema, only_optional_properties_any_ordered_subset) {
  const rules g = schema_rules(R"({"properties": {"a": {"const": 1}, "b": {"const": 2}, "c": {"const": 3}}})");
  for (const char* ok : {"{}", R"({"a": 1})", R"({"b": 2})", R"({"a": 1, "c": 3})", R"({"a": 1, "b": 2, "c": 3})"})
    EXPECT_TRUE(matches(g, ok)) << ok;
  for (const char* bad : {R"({,})", R"({"a": 1,})", R"({"a": 2})", R"({"c": 3, "a": 1})"})
    EXPECT_FALSE(matches(g, bad)) << bad;
}

TEST(json_schema, enum_const_anyof_types_and_arrays) {
  const rules e = schema_rules(R"({"enum": ["red", "green", 3, null, {"k": [1]}]})");
  for (const char* ok : {R"("red")", R"("green")", "3", "null", R"({"k":[1]})"}) EXPECT_TRUE(matches(e, ok)) << ok;
  EXPECT_FALSE(matches(e, R"("blue")"));
  const rules a = schema_rules(R"({"anyOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "number"},
      "minItems": 2, "maxItems": 3}]})");
  EXPECT_TRUE(matches(a, "true"));
  EXPECT_TRUE(matches(a, "[1, 2.5e3]"));
  EXPECT_TRUE(matches(a, "[1,2,3]"));
  EXPECT_FALSE(matches(a, "[1]"));
  EXPECT_FALSE(matches(a, "[1,2,3,4]"));
  const rules t = schema_rules(R"({"type": ["string", "null"], "maxLength": 3, "minLength": 1})");
  EXPECT_TRUE(matches(t, "null"));
  EXPECT_TRUE(matches(t, R"("abc")"));
  EXPECT_FALSE(matches(t, R"("")"));
  EXPECT_FALSE(matches(t, R"("abcd")"));
}

TEST(json_schema, refs_within_the_document_and_recursion_through_structure) {
  const rules g = schema_rules(R"({"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
      "y": {"type": "number"}}, "required": ["x", "y"]}},
      "type": "array", "items": {"$ref": "#/$defs/point"}})");
  EXPECT_TRUE(matches(g, R"([{"x": 1, "y": 2}, {"x": 0, "y": -1}])"));
  EXPECT_FALSE(matches(g, R"([{"x": 1}])"));
  const rules tree = schema_rules(R"({"type": "object", "properties": {"v": {"type": "integer"},
      "kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["v"]})");
  EXPECT_TRUE(matches(tree, R"({"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": [{"v": 4}]}]})"));
  EXPECT_FALSE(matches(tree, R"({"v": 1, "kids": [{}]})"));
}

TEST(json_schema, formats_and_patterns) {
  const rules d = schema_rules(R"({"type": "string", "format": "date-time"})");
  EXPECT_TRUE(matches(d, R"("2026-12-07T05:04:22Z")"));
  EXPECT_TRUE(matches(d, R"("2026-12-07T05:04:22.5+01:00")"));
  EXPECT_FALSE(matches(d, R"("2026-13-07T05:04:22Z")"));
  const rules u = schema_rules(R"({"type": "string", "format": "uuid"})");
  EXPECT_TRUE(matches(u, R"("123e4567-e89b-12d3-a456-426614174000")"));
  const rules p = schema_rules(R"({"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"})");
  EXPECT_TRUE(matches(p, R"("AB-123")"));
  EXPECT_FALSE(matches(p, R"("AB-12")"));
  const rules any = schema_rules(R"({"type": "string", "pattern": "a.c"})");
  EXPECT_TRUE(matches(any, R"("abc")"));
  EXPECT_FALSE(matches(any, R"("a"c")"));  // '.' never a quote inside a JSON string
}

TEST(json_schema, what_is_refused_is_named) {
  EXPECT_NE(schema_error(R"({"type": "integer", "minimum": 0})").find("\"minimum\""), std::string::npos);
  EXPECT_NE(schema_error(R"({"oneOf": [{"type": "integer"}]})").find("\"oneOf\""), std::string::npos);
  EXPECT_NE(schema_error(R"({"properties": {"a": {"type": "string", "format": "email"}}})").find("email"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"properties": {"a": {"type": "string", "format": "email"}}})").find("#/properties/a"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"$ref": "http://example.com/s.json"})").find("within the document"), std::string::npos);
  EXPECT_NE(schema_error(R"({"$ref": "#/$defs/missing"})").find("names nothing"), std::string::npos);
  EXPECT_NE(schema_error(R"({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
      "$ref": "#/$defs/a"})").find("$ref cycle"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type": "strin"})").find("unknown type"), std::string::npos);
  EXPECT_NE(schema_error("false").find("allows no value"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type": "array", "minItems": 3, "maxItems": 2})").find("maxItems"), std::string::npos);
  EXPECT_NE(schema_error(R"x({"type": "string", "pattern": "a(?=b)"})x").find("not supported"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type": "string", "pattern": "[\"x]"})").find("quote"), std::string::npos);
  // A schema whose grammar passes the size limit (gbnf.h: k_max_elements).
  json big = {{"type", "object"}, {"properties", json::object()}};
  for (int i = 0; i < 8; ++i) big["properties"]["p" + std::to_string(i)] = {{"type", "string"}, {"maxLength", 10000}};
  auto text = json_schema_to_gbnf(big);
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.error().message().find("more than"), std::string::npos) << text.error().message();
}

TEST(json_schema, json_object_mode_is_any_object) {
  auto g = parse_gbnf(json_object_gbnf());
  ASSERT_TRUE(g.ok()) << g.error().message();
  EXPECT_TRUE(matches(*g, R"({"a": {"b": [1, "x", null, false]}})"));
  EXPECT_FALSE(matches(*g, "[1]"));
  EXPECT_FALSE(matches(*g, R"("x")"));
}

TEST(regex, full_match_subset) {
  auto r = [](const char* re) {
    auto text = regex_to_gbnf(re);
    EXPECT_TRUE(text.ok()) << text.error().message();
    auto g = parse_gbnf(*text);
    EXPECT_TRUE(g.ok()) << g.error().message() << "\n" << *text;
    return std::move(*g);
  };
  const rules phone = r(R"(^\(\d{3}\) \d{3}-\d{4}$)");
  EXPECT_TRUE(matches(phone, "(555) 123-4567"));
  EXPECT_FALSE(matches(phone, "555-123-4567"));
  const rules alt = r("(cat|dog)s?|bird+?");
  for (const char* ok : {"cat", "dogs", "bird", "birddd"}) EXPECT_TRUE(matches(alt, ok)) << ok;
  for (const char* bad : {"cats!", "bir", "catdog"}) EXPECT_FALSE(matches(alt, bad)) << bad;
  const rules cls = r(R"([^\s,]+(?:,[\w.-]*)*)");
  EXPECT_TRUE(matches(cls, "a,b.c,,x-y"));
  EXPECT_FALSE(matches(cls, " a"));
  const rules dot = r("a.b");
  EXPECT_TRUE(matches(dot, "a\xc3\xa9" "b"));
  EXPECT_FALSE(matches(dot, "a\nb"));
  for (const char* bad : {"(a", "a)", "[a", "*a", "(?<n>a)", "(a)\\1", "a{2", "\\bx"})
    EXPECT_FALSE(regex_to_gbnf(bad).ok()) << bad;
}

TEST(choice, exactly_one_of_them) {
  auto text = choice_to_gbnf({"yes", "no", "a \"quoted\"\nline"});
  ASSERT_TRUE(text.ok());
  auto g = parse_gbnf(*text);
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(matches(*g, "yes"));
  EXPECT_TRUE(matches(*g, "a \"quoted\"\nline"));
  EXPECT_FALSE(matches(*g, "yesno"));
  EXPECT_FALSE(choice_to_gbnf({}).ok());
  EXPECT_FALSE(choice_to_gbnf({"a", ""}).ok());
}

}  // namespace
}  // namespace pagoda::grammar
