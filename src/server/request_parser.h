// Boost.Beast's HTTP/1.1 request parser, storing into an http_request and
// enforcing the server's limits as bytes arrive: the header's size (Beast's
// header_limit) and its field count, the body's size however it is framed
// (Content-Length or chunked: counted as decoded body bytes, against Beast's
// body_limit and the shared body budget), no Content-Encoding, no transfer
// coding but chunked, and no NUL byte in a body. A broken limit stops the
// parse at once with the status to answer (rejection()).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include <boost/beast/http/basic_parser.hpp>

#include "server/http_limits.h"
#include "server/http_message.h"

namespace pagoda::server {

// Why a request is refused before it reaches a handler.
struct http_rejection {
  int status = 400;
  std::string message;
  std::string code;    // the error object's code ("" -> null)
  http_fields fields;  // extra response fields (WWW-Authenticate, Retry-After, ...)
};

// Decides from a request's header alone, before any body byte is taken,
// whether the request may go on: a rejection to answer at once, or nothing
// (and then it may give the request's body lease an account, whose budget
// its body is counted against too). `has_body`: a Content-Length above zero,
// or chunked. Runs on the connection's strand.
using header_admission = std::function<std::optional<http_rejection>(http_request& req, bool has_body)>;

class request_parser final : public boost::beast::http::basic_parser<true> {
 public:
  // `admit` (may be empty) runs once the header is complete.
  request_parser(const http_limits& limits, body_budget& budget, const header_admission& admit);

  http_request& request() { return req_; }
  // Whether the client asked for "100 Continue" before sending its body.
  bool expects_continue() const { return expect_continue_; }
  // After put() failed: the status and message to answer with. `unparsed`:
  // the bytes put() did not consume (they hold the request line when that failed).
  http_rejection rejection(const boost::beast::error_code& ec, std::string_view unparsed) const;

 private:
  using string_view = boost::beast::string_view;
  using error_code = boost::beast::error_code;

  void on_request_impl(boost::beast::http::verb, string_view method, string_view target, int version,
                       error_code& ec) override;
  void on_response_impl(int, string_view, int, error_code&) override {}
  void on_field_impl(boost::beast::http::field, string_view name, string_view value, error_code& ec) override;
  void on_header_impl(error_code& ec) override;
  void on_body_init_impl(const boost::optional<std::uint64_t>& content_length, error_code& ec) override;
  std::size_t on_body_impl(string_view body, error_code& ec) override;
  void on_chunk_header_impl(std::uint64_t, string_view, error_code&) override {}
  std::size_t on_chunk_body_impl(std::uint64_t, string_view body, error_code& ec) override;
  void on_finish_impl(error_code&) override {}

  void refuse(int status, std::string message, error_code& ec);

  const http_limits& limits_;
  const header_admission& admit_;
  http_request req_;
  int n_fields_ = 0;
  bool header_done_ = false;
  bool expect_continue_ = false;
  std::optional<http_rejection> refused_;
};

}  // namespace pagoda::server
