#include "router/upstream.h"

#include <array>

#include <boost/asio/connect.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <fmt/format.h>

namespace pagoda::router {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;

result<replica_address> parse_replica_url(std::string_view url) {
  replica_address a;
  auto bad = [&](std::string_view why) {
    return error(errc::invalid_argument, "replica '{}': {} (expected http://HOST:PORT)", url.substr(0, 200), why);
  };
  constexpr std::string_view scheme = "http://";
  if (url.substr(0, scheme.size()) != scheme) return bad("not an http:// URL");
  std::string_view rest = url.substr(scheme.size());
  while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  if (rest.find('/') != std::string_view::npos) return bad("a path is not allowed");
  const std::size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == rest.size()) return bad("no port");
  a.host = std::string(rest.substr(0, colon));
  a.port = std::string(rest.substr(colon + 1));
  if (a.port.find_first_not_of("0123456789") != std::string::npos || a.port.size() > 5 || std::stoi(a.port) == 0 ||
      std::stoi(a.port) > 65535)
    return bad("the port is not a number from 1 to 65535");
  if (a.host.size() > 2 && a.host.front() == '[' && a.host.back() == ']') a.host = a.host.substr(1, a.host.size() - 2);
  a.url = std::string(scheme) + std::string(rest);
  asio::io_context ioc;
  tcp::resolver resolver(ioc);
  error_code ec;
  const auto found = resolver.resolve(a.host, a.port, tcp::resolver::numeric_service, ec);
  if (ec || found.empty()) return bad(fmt::format("host '{}' does not resolve ({})", a.host, ec.message()));
  for (const auto& e : found) a.endpoints.push_back(e.endpoint());
  return a;
}

bool hop_by_hop(std::string_view name) {
  for (const char* h : {"Connection", "Keep-Alive", "Transfer-Encoding", "TE", "Trailer", "Upgrade", "Host",
                        "Content-Length", "Expect", "Proxy-Connection", "Proxy-Authorization", "Proxy-Authenticate"})
    if (server::iequals(name, h)) return true;
  return false;
}

namespace {

std::string host_field(const replica_address& to) {
  return to.host.find(':') != std::string::npos ? fmt::format("[{}]:{}", to.host, to.port)
                                                 : fmt::format("{}:{}", to.host, to.port);
}

}  // namespace

std::string upstream_request(const server::http_request& req, const replica_address& to) {
  std::string out = fmt::format("{} {} HTTP/1.1\r\n", req.method, req.target);
  for (const auto& [name, value] : req.fields)
    if (!hop_by_hop(name)) out += fmt::format("{}: {}\r\n", name, value);
  out += fmt::format("Host: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", host_field(to), req.body.size());
  out += req.body;
  return out;
}

std::string upstream_get(std::string_view path, const replica_address& to, std::string_view bearer) {
  std::string out = fmt::format("GET {} HTTP/1.1\r\nHost: {}\r\n", path, host_field(to));
  if (!bearer.empty()) out += fmt::format("Authorization: Bearer {}\r\n", bearer);
  return out + "Connection: close\r\n\r\n";
}

struct upstream_call::impl {
  asio::strand<asio::any_io_executor> strand;
  tcp::socket socket;
  asio::steady_timer deadline;
  std::string request;
  upstream_limits limits;
  upstream_handlers handlers;
  boost::beast::flat_buffer buffer;
  http::response_parser<http::buffer_body> parser;
  std::array<char, 16384> piece{};
  bool head_seen = false;
  bool ended = false;
  std::uint64_t deadline_gen = 0;

  impl(const asio::any_io_executor& io, std::string req, const upstream_limits& l, upstream_handlers h)
      : strand(asio::make_strand(io)),
        socket(strand),
        deadline(strand),
        request(std::move(req)),
        limits(l),
        handlers(std::move(h)) {
    parser.header_limit(static_cast<std::uint32_t>(std::min<std::size_t>(limits.max_head_bytes, UINT32_MAX)));
    parser.body_limit(limits.max_body_bytes);
  }

  void end(const std::string& err) {
    if (ended) return;
    ended = true;
    deadline.cancel();
    error_code ignored;
    socket.close(ignored);
    auto on_end = std::move(handlers.on_end);
    handlers = {};
    if (on_end) on_end(err, !head_seen);
  }

  void arm(std::chrono::milliseconds d, std::shared_ptr<upstream_call> self, const char* what) {
    const std::uint64_t gen = ++deadline_gen;
    deadline.expires_after(d);
    deadline.async_wait([this, self = std::move(self), gen, what](const error_code& ec) {
      if (ec || gen != deadline_gen) return;
      end(fmt::format("{} timed out", what));
    });
  }
};

upstream_call::upstream_call(std::unique_ptr<impl> i) : impl_(std::move(i)) {}
upstream_call::~upstream_call() = default;

std::shared_ptr<upstream_call> upstream_call::start(const asio::any_io_executor& io, const replica_address& to,
                                                    std::string request, const upstream_limits& limits,
                                                    upstream_handlers handlers) {
  auto call = std::make_shared<upstream_call>(std::make_unique<impl>(io, std::move(request), limits, std::move(handlers)));
  impl& s = *call->impl_;
  asio::post(s.strand, [call, endpoints = to.endpoints] {
    impl& s = *call->impl_;
    if (s.ended) return;
    s.arm(s.limits.connect_timeout, call, "connect");
    asio::async_connect(s.socket, endpoints, [call](const error_code& ec, const tcp::endpoint&) {
      impl& s = *call->impl_;
      if (s.ended) return;
      if (ec) return s.end(fmt::format("connect: {}", ec.message()));
      s.arm(s.limits.head_timeout, call, "response head");
      asio::async_write(s.socket, asio::buffer(s.request), [call](const error_code& ec, std::size_t) {
        impl& s = *call->impl_;
        if (s.ended) return;
        if (ec) return s.end(fmt::format("send: {}", ec.message()));
        http::async_read_header(s.socket, s.buffer, s.parser, [call](const error_code& ec, std::size_t) {
          impl& s = *call->impl_;
          if (s.ended) return;
          if (ec) return s.end(fmt::format("response head: {}", ec.message()));
          s.head_seen = true;
          server::http_fields fields;
          for (const auto& f : s.parser.get().base())
            fields.emplace_back(std::string(f.name_string()), std::string(f.value()));
          if (s.handlers.on_head) s.handlers.on_head(static_cast<int>(s.parser.get().result_int()), std::move(fields));
          call->read_body();
        });
      });
    });
  });
  return call;
}

void upstream_call::read_body() {
  impl& s = *impl_;
  if (s.ended) return;
  if (s.parser.is_done()) return s.end("");
  s.arm(s.limits.read_timeout, shared_from_this(), "response body");
  s.parser.get().body().data = s.piece.data();
  s.parser.get().body().size = s.piece.size();
  // read_some: a stream's events are handed on as they arrive (async_read
  // would wait for the piece buffer to fill).
  http::async_read_some(s.socket, s.buffer, s.parser, [self = shared_from_this()](error_code ec, std::size_t) {
    impl& s = *self->impl_;
    if (s.ended) return;
    if (ec == http::error::need_buffer) ec = {};
    if (ec) return s.end(fmt::format("response body: {}", ec.message()));
    const std::size_t n = s.piece.size() - s.parser.get().body().size;
    if (n > 0 && s.handlers.on_body) s.handlers.on_body(std::string(s.piece.data(), n));
    self->read_body();
  });
}

void upstream_call::cancel() {
  asio::post(impl_->strand, [self = shared_from_this()] { self->impl_->end("cancelled"); });
}

}  // namespace pagoda::router
