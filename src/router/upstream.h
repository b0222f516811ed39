// One HTTP/1.1 exchange between the router and a replica (Boost.Beast's
// client parser over Asio), event-driven like the server's connections:
// every step is a completion handler on the call's strand.
//
// Each call opens its own connection and sends `Connection: close`: loopback
// or LAN connects cost well under a millisecond against a prefill's tens, and
// a call never inherits a half-dead pooled socket (a replica that restarted),
// so a failure before the response's head always means this replica failed.
// Limits: the connect, the response head and each later read have deadlines;
// the head and the body have size caps (a replica is trusted less than the
// router's own memory).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "pagoda/status.h"
#include "server/http_message.h"

namespace pagoda::router {

// A replica's address: "http://HOST:PORT" (no path, no TLS), resolved once.
struct replica_address {
  std::string url;   // as given, without a trailing '/'
  std::string host;  // for the Host field
  std::string port;
  std::vector<boost::asio::ip::tcp::endpoint> endpoints;
};
// errc::invalid_argument naming the URL when it is not http://HOST:PORT or HOST does not resolve.
result<replica_address> parse_replica_url(std::string_view url);

struct upstream_limits {
  std::chrono::milliseconds connect_timeout{2'000};
  std::chrono::milliseconds head_timeout{600'000};  // a non-streamed completion sends its head when done
  std::chrono::milliseconds read_timeout{600'000};  // between two pieces of the body
  std::size_t max_head_bytes = 64u << 10;
  std::size_t max_body_bytes = 256u << 20;
};

// What a call reports, on its strand. on_end runs exactly once, last.
struct upstream_handlers {
  std::function<void(int status, server::http_fields fields)> on_head;
  std::function<void(std::string piece)> on_body;  // body bytes, decoded from the chunked framing
  // error "": the whole response arrived. Otherwise what failed, and whether
  // it failed before the head arrived (nothing of the answer was seen).
  std::function<void(const std::string& error, bool before_head)> on_end;
};

class upstream_call : public std::enable_shared_from_this<upstream_call> {
 public:
  // request: the whole request as bytes (head and body).
  static std::shared_ptr<upstream_call> start(const boost::asio::any_io_executor& io, const replica_address& to,
                                              std::string request, const upstream_limits& limits,
                                              upstream_handlers handlers);
  // Closes the connection (the replica sees the client leave and cancels);
  // on_end reports "cancelled". Any thread.
  void cancel();

  struct impl;
  explicit upstream_call(std::unique_ptr<impl> i);
  ~upstream_call();

 private:
  void read_body();
  std::unique_ptr<impl> impl_;
};

// The request head for a replica: method, target, the client's fields except
// the hop-by-hop ones (Connection, Keep-Alive, Transfer-Encoding, TE,
// Upgrade, Proxy-*, Host, Content-Length, Expect), then Host, Content-Length
// and Connection: close. Authorization and every other field pass unchanged.
std::string upstream_request(const server::http_request& req, const replica_address& to);
// A GET of path with an optional bearer key.
std::string upstream_get(std::string_view path, const replica_address& to, std::string_view bearer);
// Whether a response field is one the router sets itself (framing, connection).
bool hop_by_hop(std::string_view name);

}  // namespace pagoda::router
