// The other ways a request states its output's shape, turned into the one
// representation the sampler applies: GBNF text (grammar/gbnf.h).
//
// JSON Schema (json_schema_to_gbnf): `type` (one or a list), `properties`
// with `required` (required properties first, then the optional ones, each in
// the schema's order), `additionalProperties` (false, true or a schema; with
// `properties` the object holds only those), `enum`, `const`, `items` with
// `minItems`/`maxItems`, `anyOf`, `$ref` to anywhere in the same document
// ("#", "#/$defs/x", "#/definitions/x", any JSON pointer), strings with
// `minLength`/`maxLength`, `pattern` (the regex subset below) and `format`
// date, time, date-time or uuid; annotations (title, description, default,
// examples, $schema, $id, $comment, $defs, definitions, deprecated,
// readOnly, writeOnly) are ignored. Any other keyword is refused with an
// error naming it and where it is; so is a `$ref` that leaves the document or
// a chain of `$ref`/`anyOf` that comes back to itself without any text in
// between (the grammar would never end; a schema that recurses through an
// object or array is fine). Numbers are at most 16 digits before and after
// the point and 3 in the exponent; whitespace between tokens is at most a
// newline and 16 spaces or tabs, so every output is finite when lengths and
// item counts are bounded.
//
// Regex (regex_to_gbnf, vLLM's guided_regex): the whole output matches.
// Literals, `.` (not a newline), classes `[a-z]`, `[^...]`, the escapes \d
// \w \s \D \W \S \n \t \r and escaped punctuation, groups `(...)` and
// `(?:...)`, `|`, `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}` (a trailing lazy `?`
// is accepted and means nothing here), `^` at the start and `$` at the end.
// Backreferences, lookaround and other `(?` forms are refused.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "pagoda/status.h"

namespace pagoda::grammar {

result<std::string> json_schema_to_gbnf(const nlohmann::json& schema);
// Several schemas in one grammar, for a caller that writes its own `root`
// around them (tool calls: server/tool_calls.h). Schema i's rules are named
// prefixes[i] + "...", so prefixes that differ and are not "json-" or "ws"
// keep them apart; the building blocks (json-string, ws, ...) appear once.
// `tops[i]` is the expression that matches schema i. REQUIRES:
// prefixes.size() == schemas.size().
struct schema_set_gbnf {
  std::string rules;
  std::vector<std::string> tops;
};
result<schema_set_gbnf> json_schemas_to_gbnf(std::span<const nlohmann::json> schemas,
                                             std::span<const std::string> prefixes);
// Any JSON object (response_format json_object).
std::string json_object_gbnf();
result<std::string> regex_to_gbnf(std::string_view regex);
// Exactly one of the choices (vLLM's guided_choice). REQUIRES nothing: an
// empty list is an error.
result<std::string> choice_to_gbnf(const std::vector<std::string>& choices);

// A GBNF expression for `regex` (no rules of its own: one expression).
// in_json_string (a schema's `pattern`): `.` and negated classes leave out
// what a JSON string must escape, and a pattern that names such a character
// is refused.
result<std::string> regex_expression(std::string_view regex, bool in_json_string);

}  // namespace pagoda::grammar
