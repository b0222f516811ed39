// Parsing a request body into JSON with its memory bounded before anything
// is built: a SAX pass (nlohmann::json::sax_parse, which materialises nothing
// but the current token) checks nesting depth, the number of values and the
// size of every string and key, and only a body within all three is parsed
// into a document. A 4 MiB array of two million zeros is thus refused after a
// scan, instead of becoming a 64 MB tree.
#pragma once

#include <cstddef>
#include <string_view>

#include <nlohmann/json.hpp>

#include "server/api_error.h"

namespace pagoda::server {

struct json_limits {
  int max_depth = 64;                      // nested arrays and objects
  std::size_t max_values = 262144;         // values of the whole document (keys not counted)
  std::size_t max_string_bytes = 2u << 20; // one string or key
};

// The document, or a 400 invalid_request_error: "not valid JSON: ..." or the
// limit it broke ("nested deeper than 64 levels", ...).
api_result<nlohmann::json> parse_bounded_json(std::string_view text, const json_limits& limits);

}  // namespace pagoda::server
