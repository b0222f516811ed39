#include "server/request_parser.h"

#include <cstring>

#include <boost/beast/http/error.hpp>
#include <fmt/format.h>

#include "core/assert.h"

namespace pagoda::server {

namespace http = boost::beast::http;

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Whether the request line at the start of `bytes` ends in "HTTP/d.d" CRLF,
// with no other CR in it: then a version Beast refuses is well formed and
// unsupported (505), else the line is malformed (400).
bool well_formed_version(std::string_view bytes) {
  const std::size_t lf = bytes.find('\n');
  if (lf == std::string_view::npos || lf < 10) return false;
  const std::string_view line = bytes.substr(0, lf);
  if (line.back() != '\r' || line.find('\r') != line.size() - 1) return false;
  const std::string_view v = line.substr(line.size() - 9, 8);
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  return v.substr(0, 5) == "HTTP/" && digit(v[5]) && v[6] == '.' && digit(v[7]) && line[line.size() - 10] == ' ';
}

}  // namespace

bool body_budget::take(std::size_t n) {
  std::size_t used = used_.load(std::memory_order_relaxed);
  do {
    if (n > max_ || used > max_ - n) return false;
  } while (!used_.compare_exchange_weak(used, used + n, std::memory_order_relaxed));
  return true;
}

body_lease& body_lease::operator=(body_lease&& o) noexcept {
  if (this != &o) {
    release();
    budget_ = o.budget_;
    account_ = o.account_;
    n_ = std::exchange(o.n_, 0);
  }
  return *this;
}

void body_lease::set_account(body_budget* account) {
  PAGODA_ASSERT(n_ == 0, "a body lease's account is set before any byte is taken");
  account_ = account;
}

body_lease::grant body_lease::grow(std::size_t n) {
  if (budget_ == nullptr) return grant::server_spent;
  if (account_ != nullptr && !account_->take(n)) return grant::account_spent;
  if (!budget_->take(n)) {
    if (account_ != nullptr) account_->give(n);
    return grant::server_spent;
  }
  n_ += n;
  return grant::ok;
}

void body_lease::release() {
  if (budget_ != nullptr && n_ > 0) budget_->give(n_);
  if (account_ != nullptr && n_ > 0) account_->give(n_);
  n_ = 0;
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

std::optional<std::string_view> http_request::field(std::string_view name) const {
  for (const auto& [k, v] : fields)
    if (iequals(k, name)) return std::string_view(v);
  return std::nullopt;
}

std::size_t http_request::count(std::string_view name) const {
  std::size_t n = 0;
  for (const auto& [k, v] : fields) n += iequals(k, name) ? 1 : 0;
  return n;
}

std::string_view http_request::path() const {
  std::string_view t = target;
  return t.substr(0, t.find('?'));
}

void http_request::drop_body() {
  std::string().swap(body);
  body_bytes.release();
}

request_parser::request_parser(const http_limits& limits, body_budget& budget, const header_admission& admit)
    : limits_(limits), admit_(admit) {
  header_limit(static_cast<std::uint32_t>(std::min<std::size_t>(limits.max_header_bytes, UINT32_MAX)));
  body_limit(static_cast<std::uint64_t>(limits.max_body_bytes));
  req_.body_bytes = body_lease(&budget);
}

void request_parser::refuse(int status, std::string message, error_code& ec) {
  refused_ = http_rejection{status, std::move(message)};
  ec = http::error::bad_value;
}

void request_parser::on_request_impl(http::verb, string_view method, string_view target, int version, error_code& ec) {
  if (version != 10 && version != 11)
    return refuse(505, fmt::format("HTTP version {}.{} is not supported (1.0 and 1.1 are)", version / 10, version % 10), ec);
  req_.method.assign(method.data(), method.size());
  req_.target.assign(target.data(), target.size());
  req_.version = version;
}

void request_parser::on_field_impl(http::field, string_view name, string_view value, error_code& ec) {
  if (++n_fields_ > limits_.max_header_count)
    return refuse(431, fmt::format("The request has more than {} header fields", limits_.max_header_count), ec);
  if (header_done_) return;  // a trailer: counted, not kept
  const std::string_view n(name.data(), name.size());
  const std::string_view v = trim(std::string_view(value.data(), value.size()));
  if (iequals(n, "Content-Encoding") && !iequals(v, "identity"))
    return refuse(415, fmt::format("Content-Encoding '{}' is not accepted: send the body uncompressed",
                                   v.substr(0, 64)), ec);
  if (iequals(n, "Transfer-Encoding") && !iequals(v, "chunked"))
    return refuse(501, fmt::format("Transfer-Encoding '{}' is not supported (only chunked is)", v.substr(0, 64)), ec);
  if (iequals(n, "Expect")) {
    if (!iequals(v, "100-continue"))
      return refuse(417, fmt::format("Expect '{}' is not supported", v.substr(0, 64)), ec);
    expect_continue_ = true;
  }
  req_.fields.emplace_back(n, v);
}

void request_parser::on_header_impl(error_code& ec) {
  header_done_ = true;
  req_.keep_alive = keep_alive();
  // RFC 9112 3.2: a server responds 400 to an HTTP/1.1 request without a
  // Host field, and to any request with more than one.
  const std::size_t n_hosts = req_.count("Host");
  if (n_hosts > 1) return refuse(400, "The request has more than one Host header", ec);
  if (n_hosts == 0 && req_.version == 11) return refuse(400, "An HTTP/1.1 request needs a Host header", ec);
  if (!admit_) return;
  const bool has_body = chunked() || (content_length() && *content_length() > 0);
  if (std::optional<http_rejection> r = admit_(req_, has_body)) {
    refused_ = std::move(*r);
    ec = http::error::bad_value;
  }
}

void request_parser::on_body_init_impl(const boost::optional<std::uint64_t>& content_length, error_code& ec) {
  if (content_length && *content_length > limits_.max_body_bytes)
    return refuse(413, fmt::format("The request body is larger than this server's limit of {} bytes",
                                   limits_.max_body_bytes), ec);
  // Reserving the announced length up front would let a client that never
  // sends it hold the budget; bytes are taken as they arrive instead.
}

std::size_t request_parser::on_body_impl(string_view body, error_code& ec) {
  if (std::memchr(body.data(), '\0', body.size()) != nullptr) {
    refuse(400, "The request body contains a NUL byte", ec);
    return 0;
  }
  switch (req_.body_bytes.grow(body.size())) {
    case body_lease::grant::ok:
      break;
    case body_lease::grant::account_spent:
      refuse(429, fmt::format("This API key's request bodies in flight hold more than {} bytes; retry later",
                              limits_.max_body_memory_per_key_bytes), ec);
      refused_->fields.emplace_back("Retry-After", "1");
      return 0;
    case body_lease::grant::server_spent:
      refuse(503, "The server is receiving too many request bodies at once; retry later", ec);
      refused_->fields.emplace_back("Retry-After", "1");
      return 0;
  }
  req_.body.append(body.data(), body.size());
  return body.size();
}

std::size_t request_parser::on_chunk_body_impl(std::uint64_t, string_view body, error_code& ec) {
  return on_body_impl(body, ec);
}

http_rejection request_parser::rejection(const error_code& ec, std::string_view unparsed) const {
  if (refused_) return *refused_;
  if (ec == http::error::header_limit || ec == http::error::buffer_overflow)
    return {431, fmt::format("The request header is larger than this server's limit of {} bytes", limits_.max_header_bytes)};
  if (ec == http::error::body_limit)
    return {413, fmt::format("The request body is larger than this server's limit of {} bytes", limits_.max_body_bytes)};
  // Beast reports a request line that does not end in "HTTP/d.d" CRLF (a
  // bare LF or CR, or a malformed version) as a bad version. RFC 9112 2.2
  // lets a server refuse bare line endings; it is 400, never 505 (kept for a
  // well-formed version other than 1.0 and 1.1, on_request_impl).
  if (ec == http::error::bad_version) {
    if (well_formed_version(unparsed)) return {505, "Unsupported HTTP version (1.0 and 1.1 are)"};
    return {400, "Malformed request line: it must end with HTTP/1.0 or HTTP/1.1 and CRLF (a bare LF or CR is not a line "
                 "ending here)"};
  }
  if (ec == http::error::bad_line_ending) return {400, "Malformed HTTP request: lines must end with CRLF"};
  return {400, fmt::format("Malformed HTTP request: {}", ec.message())};
}

}  // namespace pagoda::server
