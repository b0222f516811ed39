#include "server/http_connection.h"

#include <poll.h>

#include <cstring>

#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/status.hpp>
#include <fmt/format.h>

#include "core/assert.h"
#include "server/server_log.h"
#include "server/api_error.h"
#include "server/openai_response.h"

namespace pagoda::server {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using boost::system::error_code;

namespace {

constexpr std::size_t k_read_chunk_bytes = 16u << 10;
constexpr std::size_t k_idle_read_bytes = 1024;
// Room past the header limit for pipelined bytes and chunk framing.
constexpr std::size_t k_buffer_slack_bytes = 16u << 10;
constexpr std::chrono::milliseconds k_linger{2000};
constexpr std::chrono::milliseconds k_probe_interval{10};
constexpr std::size_t k_max_gather = 64;

std::string chunk(std::string_view data) { return fmt::format("{:x}\r\n{}\r\n", data.size(), data); }

}  // namespace

// --- http_exchange ---------------------------------------------------------------

http_exchange::http_exchange(std::shared_ptr<http_connection> conn, http_request req)
    : conn_(std::move(conn)), req_(std::move(req)) {}

void http_exchange::post(std::function<void()> fn) {
  conn_->post([self = shared_from_this(), fn = std::move(fn)] { fn(); });
}

void http_exchange::mark_gone() {
  if (gone_ || answered_) return;
  gone_ = true;
  if (!head_sent_) status_ = 499;  // nginx's "client closed request"
  if (auto fn = std::move(on_gone_)) fn();
}

void http_exchange::respond(http_response r) {
  PAGODA_ASSERT(!head_sent_, "respond() after the response started");
  answered_ = head_sent_ = true;
  status_ = r.status;
  if (r.status >= 400) error_code = access_error_code(r.body);
  if (gone_) return;
  http_connection& c = *conn_;
  if (c.hooks_.decorate) c.hooks_.decorate(req_, r.fields);
  // A 204 has no body and no Content-Length (RFC 9110, 8.6).
  const std::string framing = r.status == 204 ? std::string() : fmt::format("Content-Length: {}\r\n", r.body.size());
  std::string bytes = c.head(r.status, r.content_type, r.fields, framing);
  if (!c.head_request_) bytes += r.body;
  c.queue(std::move(bytes), /*ends_exchange=*/true);
}

void http_exchange::begin_stream(int status, std::string content_type, http_fields fields, std::string heartbeat) {
  PAGODA_ASSERT(!head_sent_, "begin_stream() after the response started");
  head_sent_ = streaming_ = true;
  status_ = status;
  if (gone_) return;
  http_connection& c = *conn_;
  if (c.hooks_.decorate) c.hooks_.decorate(req_, fields);
  c.heartbeat_ = std::move(heartbeat);
  c.queue(c.head(status, content_type, fields, c.version_ == 10 ? "" : "Transfer-Encoding: chunked\r\n"));
}

void http_exchange::write(std::string data) {
  PAGODA_ASSERT(streaming_ && !answered_, "write() outside a stream");
  if (gone_ || data.empty()) return;
  http_connection& c = *conn_;
  c.queue(c.version_ == 10 ? std::move(data) : chunk(data));
}

void http_exchange::end_stream() {
  PAGODA_ASSERT(streaming_ && !answered_, "end_stream() outside a stream");
  answered_ = true;
  if (gone_) return;
  http_connection& c = *conn_;
  c.queue(c.version_ == 10 ? std::string() : std::string("0\r\n\r\n"), /*ends_exchange=*/true);
}

std::size_t http_exchange::pending_bytes() const { return conn_->pending_bytes_; }

void http_exchange::abort() { conn_->close(); }

// --- http_connection -------------------------------------------------------------

http_connection::http_connection(tcp::socket socket, const http_limits& limits, body_budget& budget,
                                 const connection_hooks& hooks)
    : socket_(std::move(socket)),
      executor_(socket_.get_executor()),
      read_timer_(socket_.get_executor()),
      write_timer_(socket_.get_executor()),
      probe_timer_(socket_.get_executor()),
      limits_(limits),
      budget_(budget),
      hooks_(hooks),
      buffer_(limits.max_header_bytes + k_buffer_slack_bytes) {
  error_code ec;
  const tcp::endpoint ep = socket_.remote_endpoint(ec);
  if (!ec) remote_ = fmt::format("{}:{}", ep.address().to_string(), ep.port());
  socket_.set_option(tcp::no_delay(true), ec);
}

void http_connection::start() {
  post([self = shared_from_this()] {
    self->arm_read_deadline(self->limits_.header_timeout);  // from accept, as nginx's client_header_timeout
    self->read_more();
  });
}

void http_connection::stop() {
  post([self = shared_from_this()] {
    self->stopping_ = true;
    if (self->closed_) return;
    // Idle, or a request still arriving: close now. Busy: after its response.
    if (self->phase_ == phase::fresh || self->phase_ == phase::idle || self->phase_ == phase::header ||
        self->phase_ == phase::body)
      self->close();
  });
}

// --- reading ---------------------------------------------------------------------

void http_connection::read_more() {
  if (reading_ || closed_ || peer_fin_) return;
  if (buffer_.size() >= buffer_.max_size()) return;  // parse() frees room, or the header is too large
  reading_ = true;
  // Reads land in scratch_ and are appended to buffer_ on completion, so
  // parsing may consume buffer_ while a read ahead is in flight. An idle
  // connection reads into a small scratch: thousands of them cost little.
  const std::size_t want = buffer_.size() == 0 && !parser_ && !current_ ? k_idle_read_bytes : k_read_chunk_bytes;
  scratch_.resize(std::min(want, buffer_.max_size() - buffer_.size()));
  if (want == k_idle_read_bytes) scratch_.shrink_to_fit();
  socket_.async_read_some(asio::buffer(scratch_), [self = shared_from_this()](const error_code& ec, std::size_t got) {
    self->on_read(ec, got);
  });
}

void http_connection::on_read(const error_code& ec, std::size_t n) {
  reading_ = false;
  if (closed_) return;
  if (!ec) {
    // buffer_ only shrank since the read started, so the bytes fit.
    auto room = buffer_.prepare(n);
    std::memcpy(room.data(), scratch_.data(), n);
    buffer_.commit(n);
  } else if (ec == asio::error::eof) {
    peer_fin_ = true;
  } else {
    close();  // reset, or an error: the client is gone
    return;
  }
  if (phase_ == phase::closing) {  // lingering: discard until the client closes
    buffer_.consume(buffer_.size());
    if (peer_fin_) close();
    else read_more();
    return;
  }
  if (current_) {  // reading ahead while a response is on its way
    if (peer_fin_) start_probe();
    else read_more();
    return;
  }
  parse();
}

void http_connection::start_request() {
  parser_ = std::make_unique<request_parser>(limits_, budget_, hooks_.admit);
  parser_->eager(true);  // header and body in one put() when both are there
  parser_->request().started = std::chrono::steady_clock::now();
  parser_->request().remote = remote_;
  // A fresh connection's header deadline runs from accept; a kept-alive one's
  // from the first byte of its next request.
  if (phase_ != phase::fresh) arm_read_deadline(limits_.header_timeout);
  phase_ = phase::header;
}

void http_connection::parse() {
  while (!current_ && !closed_ && phase_ != phase::closing) {
    if (!parser_) {
      if (buffer_.size() == 0) {
        if (peer_fin_ || stopping_) {
          shutdown_gracefully();  // the client sent all it had: done
          return;
        }
        read_more();
        return;
      }
      start_request();
    }
    error_code ec;
    const std::size_t used = parser_->put(buffer_.data(), ec);
    buffer_.consume(used);
    // A refusal first: one from the header (the API key) must not be
    // preceded by "100 Continue", which would invite the body.
    if (ec && ec != http::error::need_more) {
      const auto rest = buffer_.data();
      reject(parser_->rejection(ec, std::string_view(static_cast<const char*>(rest.data()), rest.size())));
      return;
    }
    if (parser_->is_header_done() && phase_ == phase::header) {
      header_received();
      if (closed_ || phase_ == phase::closing) return;
    }
    // Beast answers an empty buffer in the body with nothing consumed and no error.
    if (ec == http::error::need_more || (!ec && used == 0 && !parser_->is_done())) {
      if (peer_fin_) {  // the request stops halfway: nobody waits for an answer
        close();
        return;
      }
      read_more();
      return;
    }
    if (parser_->is_done()) dispatch();
  }
}

void http_connection::header_received() {
  phase_ = phase::body;
  arm_read_deadline(limits_.body_timeout);
  if (parser_->expects_continue() && !parser_->is_done()) queue("HTTP/1.1 100 Continue\r\n\r\n");
}

void http_connection::dispatch() {
  http_request req = std::move(parser_->request());
  parser_.reset();
  phase_ = phase::busy;
  ++read_deadline_gen_;
  read_timer_.cancel();
  version_ = req.version;
  head_request_ = req.method == "HEAD";
  probe_sent_ = false;
  heartbeat_.clear();
  current_ = std::make_shared<http_exchange>(shared_from_this(), std::move(req));
  hooks_.dispatch(current_);
  if (current_ && !current_->answered()) {
    if (peer_fin_) start_probe();
    else read_more();
  }
}

void http_connection::reject(const http_rejection& r) {
  const int status = r.status;
  http_fields fields = r.fields;
  if (parser_ && parser_->got_some() && hooks_.decorate) hooks_.decorate(parser_->request(), fields);
  hooks_.rejected(parser_ && parser_->got_some() ? &parser_->request() : nullptr, status);
  version_ = parser_ && parser_->got_some() ? parser_->request().version : 11;
  parser_.reset();
  phase_ = phase::busy;
  ++read_deadline_gen_;
  read_timer_.cancel();
  api_error e;
  e.http_status = status;
  e.message = r.message;
  e.code = r.code;
  if (status == 429) e.type = "rate_limit_error";
  // 501 and 505 refuse what the client sent: its error, not the server's.
  if (status == 503) e.type = "service_unavailable";
  if (status == 500) e.type = "internal_error";
  fields.emplace_back("Connection", "close");
  head_request_ = false;
  const std::string body = dump_json(error_body(e));
  queue(head(status, "application/json", fields, fmt::format("Content-Length: {}\r\n", body.size())) + body);
  close_when_drained_ = true;
}

void http_connection::exchange_done() {
  std::shared_ptr<http_exchange> ex = std::move(current_);
  ++read_deadline_gen_;
  probe_timer_.cancel();
  hooks_.finished(*ex);
  ex->release_handler();  // here, not inside a call of the handler's
  if (!ex->request().keep_alive || stopping_) {
    shutdown_gracefully();
    return;
  }
  if (version_ == 10 && ex->streaming()) {  // the stream was delimited by the close
    shutdown_gracefully();
    return;
  }
  phase_ = phase::idle;
  if (buffer_.size() == 0) buffer_.shrink_to_fit();
  arm_read_deadline(limits_.idle_timeout);
  parse();
}

// --- writing ---------------------------------------------------------------------

std::string http_connection::head(int status, const std::string& content_type, const http_fields& fields,
                                  const std::string& framing) {
  const auto reason = http::obsolete_reason(static_cast<http::status>(status));
  std::string h = fmt::format("HTTP/1.{} {} {}\r\n", version_ == 10 ? 0 : 1, status,
                              std::string_view(reason.data(), reason.size()));
  h += "Server: pagoda\r\n";
  if (!content_type.empty()) h += fmt::format("Content-Type: {}\r\n", content_type);
  h += framing;
  bool has_connection = false;
  for (const auto& [k, v] : fields) {
    h += fmt::format("{}: {}\r\n", k, v);
    has_connection |= iequals(k, "Connection");
  }
  if (!has_connection) {
    const bool keep = current_ && current_->request().keep_alive && !stopping_;
    if (!keep) h += "Connection: close\r\n";
    else if (version_ == 10) h += "Connection: keep-alive\r\n";
  }
  h += "\r\n";
  return h;
}

void http_connection::queue(std::string bytes, bool ends_exchange) {
  if (closed_) return;
  if (ends_exchange) finish_when_drained_ = true;
  if (!bytes.empty()) {
    pending_bytes_ += bytes.size();
    out_.push_back(std::move(bytes));
  }
  if (!writing_) write_next();
}

void http_connection::write_next() {
  if (out_.empty()) {
    writing_ = false;
    drained();
    return;
  }
  writing_ = true;
  std::vector<asio::const_buffer> bufs;
  n_writing_ = std::min(out_.size(), k_max_gather);
  for (std::size_t i = 0; i < n_writing_; ++i) bufs.emplace_back(out_[i].data(), out_[i].size());
  const std::uint64_t gen = ++write_gen_;
  write_timer_.expires_after(limits_.send_timeout);
  write_timer_.async_wait([self = shared_from_this(), gen](const error_code& ec) {
    if (!ec && gen == self->write_gen_ && !self->closed_) self->close();  // no progress within the send timeout
  });
  asio::async_write(socket_, bufs, [self = shared_from_this()](const error_code& ec, std::size_t) {
    self->on_write(ec, self->n_writing_);
  });
}

void http_connection::on_write(const error_code& ec, std::size_t n_strings) {
  ++write_gen_;
  write_timer_.cancel();
  if (closed_) return;
  if (ec) {
    close();
    return;
  }
  for (std::size_t i = 0; i < n_strings; ++i) {
    pending_bytes_ -= out_.front().size();
    out_.pop_front();
  }
  write_next();
}

void http_connection::drained() {
  if (finish_when_drained_) {
    finish_when_drained_ = false;
    exchange_done();
  } else if (close_when_drained_) {
    close_when_drained_ = false;
    shutdown_gracefully();
  }
}

// --- deadlines, probes, closing ----------------------------------------------------

void http_connection::arm_read_deadline(std::chrono::milliseconds d) {
  const std::uint64_t gen = ++read_deadline_gen_;
  read_timer_.expires_after(d);
  read_timer_.async_wait([self = shared_from_this(), gen](const error_code& ec) {
    if (!ec && gen == self->read_deadline_gen_ && !self->closed_) self->on_read_deadline();
  });
}

void http_connection::on_read_deadline() {
  switch (phase_) {
    case phase::header:
    case phase::body:
      reject({408, phase_ == phase::header ? "The request header did not arrive in time"
                                           : "The request body did not arrive in time"});
      break;
    case phase::closing:
    case phase::fresh:
    case phase::idle:
      close();  // an idle keep-alive connection, or the end of a linger: quietly
      break;
    case phase::busy:
      break;
  }
}

void http_connection::start_probe() {
  if (probe_sent_ || !current_ || current_->answered()) return;
  probe_sent_ = true;
  if (!current_->head_sent_) {
    // An informational response: allowed before any final one, ignored by
    // clients that do not need it. Not for HTTP/1.0, which has no 1xx.
    if (version_ == 11) queue("HTTP/1.1 100 Continue\r\n\r\n");
  } else if (!heartbeat_.empty()) {
    current_->write(heartbeat_);
  }
  poll_probe();
}

void http_connection::poll_probe() {
  probe_timer_.expires_after(k_probe_interval);
  probe_timer_.async_wait([self = shared_from_this()](const error_code& ec) {
    if (ec || self->closed_ || !self->current_ || self->current_->answered()) return;
    pollfd p{self->socket_.native_handle(), 0, 0};  // POLLERR and POLLHUP are always reported
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLERR | POLLHUP)) != 0) {
      self->close();  // the probe met a reset: the client closed its socket
      return;
    }
    self->poll_probe();
  });
}

void http_connection::shutdown_gracefully() {
  if (closed_) return;
  phase_ = phase::closing;
  error_code ec;
  socket_.shutdown(tcp::socket::shutdown_send, ec);
  if (ec || peer_fin_) {
    close();
    return;
  }
  arm_read_deadline(k_linger);
  buffer_.consume(buffer_.size());
  read_more();
}

void http_connection::close() {
  if (closed_) return;
  closed_ = true;
  phase_ = phase::closing;
  error_code ec;
  read_timer_.cancel();
  write_timer_.cancel();
  probe_timer_.cancel();
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  out_.clear();
  pending_bytes_ = 0;
  parser_.reset();
  if (std::shared_ptr<http_exchange> ex = std::move(current_)) {
    ex->mark_gone();
    hooks_.finished(*ex);
    ex->release_handler();
  }
  hooks_.closed(this);
}

}  // namespace pagoda::server
