// OpenAI-style errors: an HTTP status and the body
//   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
// that the OpenAI SDKs turn into their APIError classes.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "pagoda/status.h"
#include "server/http_message.h"

namespace pagoda::server {

struct api_error {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the request field at fault ("" -> null)
  std::string code;   // a machine-readable code ("" -> null)
};

// 400 invalid_request_error naming `param`.
api_error bad_request(std::string param, std::string message, std::string code = "");

// The HTTP status an engine status maps to: invalid_argument and out_of_range
// 400, not_found 404, resource_exhausted 429, cancelled 503, anything else 500.
api_error from_status(const status& st, std::string param = "");

nlohmann::json error_body(const api_error& e);

// A JSON body with that status.
http_response json_response(int status, const nlohmann::json& body);
// An error's response: its status and error_body, with Retry-After: 1 on 429
// and 503 (both say: try again).
http_response error_response(const api_error& e);

// A result that fails with an api_error.
template <typename T>
struct api_result {
  api_result(T v) : value(std::move(v)) {}          // NOLINT: implicit by design
  api_result(api_error e) : error(std::move(e)) {}  // NOLINT: implicit by design
  bool ok() const { return value.has_value(); }
  std::optional<T> value;
  api_error error;
};

}  // namespace pagoda::server
