// The request fields that constrain a completion's shape, all turned into one
// GBNF grammar (sampling_params::grammar; grammar/convert.h, grammar/gbnf.h):
//
//   response_format  {"type": "text"} (nothing), {"type": "json_object"} (any
//                    JSON object; with "schema": that schema, as llama.cpp
//                    takes it), {"type": "json_schema", "json_schema":
//                    {"name", "schema", "strict"}} (OpenAI)
//   guided_json      a JSON Schema, as an object or as JSON text (vLLM)
//   guided_regex     a regex the whole output matches (vLLM)
//   guided_choice    an array of strings, the output is one of them (vLLM)
//   guided_grammar   GBNF (vLLM's field; Pagoda reads GBNF only)
//   grammar          GBNF (llama.cpp)
//   json_schema      a JSON Schema object (llama.cpp)
//
// At most one of them per request. guided_decoding_backend is accepted and
// ignored (there is one engine here); guided_whitespace_pattern is refused.
// Every problem is a 400 before generation naming the field: a schema
// keyword that is not supported, a $ref cycle, a grammar that does not parse,
// one past the size limits (gbnf.h).
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "server/api_error.h"

namespace pagoda::server {

// Sets `grammar` from the body's fields; leaves it empty when none asks for a shape.
std::optional<api_error> read_structured_output(const nlohmann::json& body, std::string& grammar);

}  // namespace pagoda::server
