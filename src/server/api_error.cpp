#include "server/api_error.h"

#include "server/openai_response.h"

namespace pagoda::server {

api_error bad_request(std::string param, std::string message, std::string code) {
  api_error e;
  e.message = std::move(message);
  e.param = std::move(param);
  e.code = std::move(code);
  return e;
}

api_error from_status(const status& st, std::string param) {
  api_error e;
  e.message = st.message();
  e.param = std::move(param);
  switch (st.code()) {
    case errc::invalid_argument:
    case errc::out_of_range:
      e.http_status = 400;
      break;
    case errc::not_found:
      e.http_status = 404;
      e.type = "not_found_error";
      break;
    case errc::resource_exhausted:
      e.http_status = 429;
      e.type = "rate_limit_error";
      e.code = "queue_full";
      break;
    case errc::cancelled:
      e.http_status = 503;
      e.type = "service_unavailable";
      break;
    default:
      e.http_status = 500;
      e.type = "internal_error";
      break;
  }
  return e;
}

nlohmann::json error_body(const api_error& e) {
  using nlohmann::json;
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

http_response json_response(int status, const nlohmann::json& body) {
  http_response r;
  r.status = status;
  r.body = dump_json(body);
  return r;
}

http_response error_response(const api_error& e) {
  http_response r = json_response(e.http_status, error_body(e));
  if (e.http_status == 429 || e.http_status == 503) r.fields.emplace_back("Retry-After", "1");
  return r;
}

}  // namespace pagoda::server
