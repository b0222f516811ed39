#include "server/connection_limits.h"

#include <boost/asio/write.hpp>
#include <fmt/format.h>

#include "server/api_error.h"
#include "server/openai_response.h"

namespace pagoda::server {

namespace asio = boost::asio;
using boost::system::error_code;

namespace {

constexpr std::size_t k_max_request_line_bytes = 1024;
constexpr std::chrono::milliseconds k_overflow_lifetime{1000};  // to read the request line, answer and linger

// "GET /health HTTP/1.1", "HEAD /health?x HTTP/1.0", ... (the line as sent).
bool asks_health(std::string_view line, bool& head) {
  head = line.rfind("HEAD ", 0) == 0;
  if (!head && line.rfind("GET ", 0) != 0) return false;
  std::string_view target = line.substr(head ? 5 : 4);
  constexpr std::string_view path = "/health";
  if (target.rfind(path, 0) != 0) return false;
  return target.size() > path.size() && (target[path.size()] == ' ' || target[path.size()] == '?');
}

}  // namespace

std::string client_address_key(const asio::ip::address& a) {
  if (a.is_v4()) return a.to_v4().to_string();
  asio::ip::address_v6 v6 = a.to_v6();
  if (v6.is_v4_mapped()) return asio::ip::make_address_v4(asio::ip::v4_mapped, v6).to_string();
  asio::ip::address_v6::bytes_type b = v6.to_bytes();
  for (std::size_t i = 8; i < b.size(); ++i) b[i] = 0;
  return asio::ip::address_v6(b).to_string() + "/64";
}

bool address_counter::take(const std::string& key) {
  std::lock_guard lock(mu_);
  int& n = open_[key];
  if (max_ > 0 && n >= max_) return false;
  ++n;
  return true;
}

void address_counter::give(const std::string& key) {
  std::lock_guard lock(mu_);
  auto it = open_.find(key);
  if (it == open_.end()) return;
  if (--it->second <= 0) open_.erase(it);
}

std::size_t address_counter::n_addresses() const {
  std::lock_guard lock(mu_);
  return open_.size();
}

overflow_reply::overflow_reply(tcp::socket s, std::atomic<int>& n_live, int health_status, std::string health_body,
                               std::string refusal)
    : socket_(std::move(s)),
      timer_(socket_.get_executor()),
      n_live_(n_live),
      health_status_(health_status),
      health_body_(std::move(health_body)),
      refusal_(std::move(refusal)) {
  ++n_live_;
}

overflow_reply::~overflow_reply() { --n_live_; }

void overflow_reply::start() {
  // Whatever the client does, the socket closes within the lifetime.
  timer_.expires_after(k_overflow_lifetime);
  timer_.async_wait([self = shared_from_this()](const error_code&) {
    error_code ec;
    self->socket_.close(ec);
  });
  read_line();
}

void overflow_reply::read_line() {
  socket_.async_read_some(asio::buffer(sink_), [self = shared_from_this()](const error_code& ec, std::size_t n) {
    if (ec && ec != asio::error::eof) {
      self->timer_.cancel();  // closed by the client or by the timer
      return;
    }
    self->got_.append(self->sink_, std::min(n, k_max_request_line_bytes - self->got_.size()));
    if (!ec && self->got_.find('\n') == std::string::npos && self->got_.size() < k_max_request_line_bytes)
      return self->read_line();
    self->answer();
  });
}

void overflow_reply::answer() {
  bool head = false;
  const bool health = asks_health(got_.substr(0, got_.find('\n')), head);
  std::string body;
  int status = health ? health_status_ : 503;
  if (health) {
    body = health_body_;
  } else {
    api_error e;
    e.http_status = 503;
    e.type = "service_unavailable";
    e.message = refusal_;
    body = dump_json(error_body(e));
  }
  text_ = fmt::format("HTTP/1.1 {} {}\r\nServer: pagoda\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}"
                      "Connection: close\r\n\r\n{}",
                      status, status == 200 ? "OK" : "Service Unavailable", body.size(),
                      status == 503 ? "Retry-After: 1\r\n" : "", head ? "" : body);
  asio::async_write(socket_, asio::buffer(text_), [self = shared_from_this()](const error_code& ec, std::size_t) {
    if (ec) {
      self->timer_.cancel();
      return;
    }
    error_code ignored;
    self->socket_.shutdown(tcp::socket::shutdown_send, ignored);
    self->drain();
  });
}

void overflow_reply::drain() {
  socket_.async_read_some(asio::buffer(sink_), [self = shared_from_this()](const error_code& ec, std::size_t) {
    if (ec) {
      self->timer_.cancel();  // closed by the client or by the timer
      return;
    }
    self->drain();
  });
}

}  // namespace pagoda::server
