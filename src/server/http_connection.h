// One client connection of the event-driven HTTP server (Boost.Asio sockets,
// Boost.Beast's parser). No thread belongs to a connection: every step is a
// completion handler on the connection's strand, so an idle or slow client
// costs a socket, a timer and a small buffer, never a thread.
//
// A connection reads one request at a time (request_parser, with the
// server's limits and deadlines), hands it to the server as an http_exchange,
// and reads the next only after the response is written: pipelined requests
// are answered in order. While a request is being answered the connection
// keeps reading ahead (into its bounded buffer) to see the client leave:
//   - a reset or a failed write: the client is gone; the exchange's on_gone
//     callback runs (the server cancels the engine requests: 499);
//   - end of stream (FIN): the client may only have half-closed its side
//     (shutdown(SHUT_WR) after sending) and still be reading. The connection
//     then sends one probe ("HTTP/1.1 100 Continue", an informational response
//     every HTTP/1.1 client must accept, or the stream's heartbeat once a
//     streamed response started). A client that closed its socket answers it
//     with a reset, seen within a few milliseconds; a half-closed one keeps
//     reading and gets its response.
// Deadlines: the header (from accept, or from the first byte of a later
// request), the body, the idle time between keep-alive requests, and every
// write. Errors before a request reaches the server are answered with a
// status and an OpenAI error object, then the connection closes after a short
// linger that drains what the client still sends (so it reads the answer
// instead of a reset).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/flat_buffer.hpp>

#include "server/http_limits.h"
#include "server/http_message.h"
#include "server/request_parser.h"

namespace pagoda::server {

class http_connection;

// One request and its response. Every member but post() runs on the
// connection's strand; other threads post() there.
class http_exchange : public std::enable_shared_from_this<http_exchange> {
 public:
  http_exchange(std::shared_ptr<http_connection> conn, http_request req);

  const http_request& request() const { return req_; }
  http_request& request() { return req_; }

  // Runs fn on the connection's strand; it runs even after the client left.
  void post(std::function<void()> fn);

  bool gone() const { return gone_; }          // the client left before the response was handed over
  bool answered() const { return answered_; }  // the whole response was handed to the connection
  bool streaming() const { return streaming_; }

  // A complete response. Ends the exchange.
  void respond(http_response r);
  // A streamed response (chunked; to HTTP/1.0 clients, delimited by the close).
  // `heartbeat`: bytes the stream may carry at any time without meaning
  // anything (an SSE comment), sent as the hang-up probe.
  void begin_stream(int status, std::string content_type, http_fields fields, std::string heartbeat);
  void write(std::string data);  // one piece of the stream
  void end_stream();             // ends the exchange
  // Bytes handed over and not yet written to the socket.
  std::size_t pending_bytes() const;
  // Closes the connection now (the response, if any, is cut short).
  void abort();

  // fn runs once, on the strand, when the client leaves before the response
  // was handed over in full.
  void on_gone(std::function<void()> fn) { on_gone_ = std::move(fn); }
  // Keeps the handler's state alive until the exchange ends.
  void keep(std::shared_ptr<void> state) { state_ = std::move(state); }

  // For the access log and metrics: the status answered (499: the client left first).
  int status() const { return status_; }
  // Filled by the handler for the access log.
  std::string tenant;
  std::string error_code;  // an error reply's code (the JSON body's error.code, else error.type), for the access log
  int prompt_tokens = -1, cached_tokens = -1, completion_tokens = -1;
  double ttft_ms = -1;
  std::string kv_policy;  // a generation's KV policy in force ("none": full KV)
  std::string endpoint;  // the metrics label of the route

 private:
  friend class http_connection;
  void mark_gone();
  // The exchange ended: drop what refers to the handler (its state and its
  // on_gone callback both hold it, and it holds the exchange).
  void release_handler() {
    state_.reset();
    on_gone_ = nullptr;
  }

  std::shared_ptr<http_connection> conn_;
  http_request req_;
  bool gone_ = false;
  bool answered_ = false;
  bool streaming_ = false;
  bool head_sent_ = false;
  int status_ = 0;
  std::function<void()> on_gone_;
  std::shared_ptr<void> state_;
};

// What the server learns from a connection. Every hook runs on the connection's strand.
struct connection_hooks {
  // A request's header is complete: refuse it before its body (the API key), or let it go on.
  header_admission admit;
  std::function<void(const std::shared_ptr<http_exchange>&)> dispatch;  // a complete request
  std::function<void(const http_exchange&)> finished;                   // an exchange ended (answered or not)
  // A request refused before dispatch (`req` null when not even its request line arrived).
  std::function<void(const http_request* req, int status)> rejected;
  std::function<void(http_connection*)> closed;  // once, when the socket closes
  // Adds the fields every response to `req` carries (CORS); may be empty.
  std::function<void(const http_request& req, http_fields& fields)> decorate;
};

class http_connection : public std::enable_shared_from_this<http_connection> {
 public:
  using tcp = boost::asio::ip::tcp;

  // REQUIRES: `socket` has a strand executor; limits, budget and hooks outlive the connection.
  http_connection(tcp::socket socket, const http_limits& limits, body_budget& budget, const connection_hooks& hooks);

  void start();
  // The server stops: close now if idle, else after the current response.
  void stop();
  // Closes now, from outside the strand. REQUIRES: no thread runs the
  // io_context any more (serve() has returned); breaks the connection <->
  // exchange cycle of an answer that never finished.
  void close_after_run() { close(); }

  template <typename F>
  void post(F&& f);

 private:
  friend class http_exchange;
  enum class phase { fresh, idle, header, body, busy, closing };

  void read_more();
  void on_read(const boost::system::error_code& ec, std::size_t n);
  void parse();
  void start_request();
  void header_received();
  void dispatch();
  void reject(const http_rejection& r);
  void exchange_done();

  void queue(std::string bytes, bool ends_exchange = false);
  void write_next();
  void on_write(const boost::system::error_code& ec, std::size_t n_strings);
  void drained();

  void arm_read_deadline(std::chrono::milliseconds d);
  void on_read_deadline();
  void start_probe();
  void poll_probe();
  void shutdown_gracefully();
  void close();

  std::string head(int status, const std::string& content_type, const http_fields& fields, const std::string& framing);

  tcp::socket socket_;
  const tcp::socket::executor_type executor_;  // the strand (a copy: post() reads it from any thread)
  boost::asio::steady_timer read_timer_;
  boost::asio::steady_timer write_timer_;
  boost::asio::steady_timer probe_timer_;
  const http_limits& limits_;
  body_budget& budget_;
  const connection_hooks& hooks_;
  std::string remote_;

  boost::beast::flat_buffer buffer_;  // received, not yet parsed (bounded: header limit + slack)
  std::vector<char> scratch_;         // the read in flight
  std::unique_ptr<request_parser> parser_;
  phase phase_ = phase::fresh;
  bool reading_ = false;
  bool peer_fin_ = false;
  bool stopping_ = false;
  bool closed_ = false;
  std::uint64_t read_deadline_gen_ = 0;
  std::uint64_t write_gen_ = 0;

  std::shared_ptr<http_exchange> current_;
  bool probe_sent_ = false;
  std::string heartbeat_;
  int version_ = 11;        // of the current exchange
  bool head_request_ = false;

  std::deque<std::string> out_;
  std::size_t n_writing_ = 0;        // strings of out_ in the write in flight
  std::size_t pending_bytes_ = 0;
  bool writing_ = false;
  bool finish_when_drained_ = false;  // the current exchange ends when out_ is written
  bool close_when_drained_ = false;
};

template <typename F>
void http_connection::post(F&& f) {
  boost::asio::post(executor_, std::forward<F>(f));
}

}  // namespace pagoda::server
