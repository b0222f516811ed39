// An HTTP/1.x request as the server received it, and a response to send.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pagoda::server {

using http_fields = std::vector<std::pair<std::string, std::string>>;

// Bytes of request bodies held by all connections at once, against a cap
// (http_limits::max_body_memory_bytes). Thread-safe.
class body_budget {
 public:
  explicit body_budget(std::size_t max_bytes) : max_(max_bytes) {}
  // Takes n bytes; false (and nothing taken) when that would pass the cap.
  bool take(std::size_t n);
  void give(std::size_t n) { used_.fetch_sub(n, std::memory_order_relaxed); }
  std::size_t used() const { return used_.load(std::memory_order_relaxed); }

 private:
  const std::size_t max_;
  std::atomic<std::size_t> used_{0};
};

// Bytes taken from the server's body_budget and, once the request is
// authenticated, from its account's (its API key's) budget too; given back to
// both when the lease ends. So one key's uploads can spend only its own share.
class body_lease {
 public:
  enum class grant { ok, account_spent, server_spent };

  body_lease() = default;
  explicit body_lease(body_budget* b) : budget_(b) {}
  body_lease(body_lease&& o) noexcept
      : budget_(o.budget_), account_(o.account_), n_(std::exchange(o.n_, 0)) {}
  body_lease& operator=(body_lease&& o) noexcept;
  ~body_lease() { release(); }

  // REQUIRES: nothing taken yet (the account is set from the header, before
  // any body byte).
  void set_account(body_budget* account);
  grant grow(std::size_t n);  // nothing taken unless ok
  void release();

 private:
  body_budget* budget_ = nullptr;
  body_budget* account_ = nullptr;
  std::size_t n_ = 0;
};

struct http_request {
  std::string method;  // as sent ("GET", "POST", ...)
  std::string target;  // as sent, query included
  int version = 11;    // 10 or 11
  bool keep_alive = true;
  http_fields fields;  // as received, in order (trailers not kept)
  std::string body;
  body_lease body_bytes;  // what `body` holds of the server's body budget
  std::string remote;     // "ADDR:PORT" of the client
  std::chrono::steady_clock::time_point started;  // when its first byte arrived

  // The first field of that name (case-insensitive), if any.
  std::optional<std::string_view> field(std::string_view name) const;
  std::size_t count(std::string_view name) const;
  // The target without its query ("/v1/models?x" -> "/v1/models").
  std::string_view path() const;
  // Frees the body and its share of the budget (once it has been parsed).
  void drop_body();
};

struct http_response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  http_fields fields;  // extra fields (Retry-After, WWW-Authenticate, ...)
};

bool iequals(std::string_view a, std::string_view b);

}  // namespace pagoda::server
