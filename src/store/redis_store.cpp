#include <charconv>
#include <climits>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "store/block_store.h"
#include "store/redis_connection.h"

namespace pagoda {
namespace {

constexpr char k_prefix[] = "pagoda:kv:";

std::string redis_key(const store_key& k) { return k_prefix + k.hex(); }

bool parse_redis_key(const char* s, std::size_t n, store_key& out) {
  const std::size_t p = sizeof(k_prefix) - 1;
  if (n != p + 32 || std::memcmp(s, k_prefix, p) != 0) return false;
  std::byte b[16];
  for (int i = 0; i < 16; ++i) {
    unsigned v = 0;
    if (std::from_chars(s + p + 2 * i, s + p + 2 * i + 2, v, 16).ec != std::errc()) return false;
    b[i] = static_cast<std::byte>(v);
  }
  out = store_key::from_bytes(b);
  return true;
}

using reply_ptr = redis_reply_ptr;

// mu_ guards the connection and is held across each command's round trip
// (the warehouse's threads are its only callers); the counters have a lock of
// their own, so stats() never waits on the network.
class redis_store final : public block_store {
 public:
  redis_store(redis_store_options o, std::shared_ptr<const redis_credentials> creds, const clock_source& clock)
      : o_(std::move(o)), creds_(std::move(creds)), clock_(clock) {}

  const char* tier() const override { return "redis"; }

  // The first connection; its failure is the caller's to report.
  status connect_now() {
    std::lock_guard lock(mu_);
    status st = connect_locked(/*log=*/false);
    return st;
  }

  result<std::optional<std::vector<std::byte>>> get(const store_key& key) override {
    std::lock_guard lock(mu_);
    const std::string k = redis_key(key);
    PAGODA_ASSIGN_OR_RETURN(reply_ptr r, command_locked({"GET", k}));
    if (r->type == REDIS_REPLY_NIL) {
      count(&store_tier_stats::misses);
      return std::optional<std::vector<std::byte>>();
    }
    if (r->type != REDIS_REPLY_STRING) return fail_locked("GET answered something other than a string").error();
    count(&store_tier_stats::hits);
    const auto* p = reinterpret_cast<const std::byte*>(r->str);
    return std::optional<std::vector<std::byte>>(std::vector<std::byte>(p, p + r->len));
  }

  result<std::size_t> count_present(std::span<const store_key> keys) override {
    PAGODA_ASSIGN_OR_RETURN(std::vector<bool> present, contains_each(keys));
    std::size_t n = 0;
    while (n < present.size() && present[n]) ++n;
    return n;
  }

  result<std::vector<bool>> contains_each(std::span<const store_key> keys) override {
    std::lock_guard lock(mu_);
    std::vector<bool> out;
    if (keys.empty()) return out;
    PAGODA_RETURN_IF_ERROR(ensure_connected_locked());
    // One round trip for them all.
    for (const store_key& key : keys) {
      const std::string k = redis_key(key);
      conn_->append({"EXISTS", k});
    }
    PAGODA_RETURN_IF_ERROR(replies_locked(keys.size(), [&](const redisReply& r) {
      out.push_back(r.type == REDIS_REPLY_INTEGER && r.integer == 1);
      return status{};
    }));
    return out;
  }

  status put(const store_key& key, std::span<const std::byte> value) override {
    const store_entry e{key, value};
    return put_many(std::span<const store_entry>(&e, 1));
  }

  status put_many(std::span<const store_entry> entries) override {
    std::lock_guard lock(mu_);
    if (entries.empty()) return {};
    PAGODA_RETURN_IF_ERROR(ensure_connected_locked());
    const std::string ttl = std::to_string(o_.ttl_seconds);
    // Pipelined: one round trip for the batch.
    for (const store_entry& e : entries) {
      const std::string k = redis_key(e.key);
      const std::string_view v(reinterpret_cast<const char*>(e.value.data()), e.value.size());
      if (o_.ttl_seconds > 0)
        conn_->append({"SET", k, v, "NX", "EX", ttl});
      else
        conn_->append({"SET", k, v, "NX"});
    }
    status first;
    PAGODA_RETURN_IF_ERROR(replies_locked(entries.size(), [&](const redisReply& r) {
      if (r.type == REDIS_REPLY_ERROR) {
        status st = fail_locked(std::string("SET: ") + r.str).error();
        if (first.ok()) first = std::move(st);
      } else if (r.type == REDIS_REPLY_STATUS) {
        count(&store_tier_stats::writes);  // NIL: already there
      }
      return status{};
    }));
    return first;
  }

  status erase(const store_key& key) override {
    std::lock_guard lock(mu_);
    const std::string k = redis_key(key);
    auto r = command_locked({"UNLINK", k});
    return r.ok() ? status{} : r.error();
  }

  result<std::size_t> erase_tenant(std::uint64_t tenant) override {
    std::lock_guard lock(mu_);
    const std::string pattern = std::string(k_prefix) + store_key{tenant, 0}.hex().substr(0, 16) + "*";
    std::size_t n = 0;
    PAGODA_RETURN_IF_ERROR(scan_locked(pattern, [&](const char* key, std::size_t len) {
      auto r = command_locked({"UNLINK", std::string_view(key, len)});
      if (r.ok() && (*r)->type == REDIS_REPLY_INTEGER) n += static_cast<std::size_t>((*r)->integer);
      return r.ok();
    }));
    return n;
  }

  status for_each(const std::function<bool(const store_key&, std::span<const std::byte>)>& fn) override {
    std::lock_guard lock(mu_);
    return scan_locked(std::string(k_prefix) + "*", [&](const char* key, std::size_t len) {
      store_key k;
      if (!parse_redis_key(key, len, k)) return true;
      auto r = command_locked({"GET", std::string_view(key, len)});
      if (!r.ok()) return false;
      if ((*r)->type != REDIS_REPLY_STRING) return true;
      return fn(k, std::span<const std::byte>(reinterpret_cast<const std::byte*>((*r)->str), (*r)->len));
    });
  }

  store_tier_stats stats() override {
    std::lock_guard lock(stats_mu_);
    store_tier_stats s = stats_;
    s.tier = tier();
    return s;
  }

 std::string down_reason() const override {
    std::lock_guard lock(reason_mu_);
    return reason_copy_;
  }

 private:
  // Opens a connection (TLS, AUTH, SELECT, PING); a failure is logged when its
  // reason differs from the last one, so a tier that stays down logs once.
  status connect_locked(bool log = true) {
    conn_.reset();
    last_attempt_us_ = clock_.monotonic_us();
    auto c = redis_connection::open(o_, creds_);
    if (!c.ok()) {
      if (log) note_down_locked(c.error().message());
      else set_down_reason_locked(c.error().message());
      return c.error();
    }
    conn_ = std::move(*c);
    if (!down_reason_.empty()) std::fprintf(stderr, "pagoda: Redis tier %s:%d is back\n", o_.host.c_str(), o_.port);
    set_down_reason_locked("");
    return {};
  }

  void note_down_locked(const std::string& why) {
    if (why != down_reason_) std::fprintf(stderr, "pagoda: Redis tier is down: %s\n", why.c_str());
    set_down_reason_locked(why);
  }
  // down_reason_ and the copy down_reason() reads without waiting on a round trip.
  void set_down_reason_locked(const std::string& why) {
    down_reason_ = why;
    std::lock_guard lock(reason_mu_);
    reason_copy_ = why;
  }

  status ensure_connected_locked() {
    if (conn_) return {};
    // Down: retry at most once a second, so a dead server costs nothing per call.
    if (clock_.monotonic_us() - last_attempt_us_ < k_retry_us) {
      count(&store_tier_stats::errors);
      return error(errc::io_error, "Redis {}:{} is down: {}", o_.host, o_.port, down_reason_);
    }
    status st = connect_locked();
    if (!st.ok()) count(&store_tier_stats::errors);
    return st;
  }

  status drop_locked(const status& why) {
    conn_.reset();
    count(&store_tier_stats::errors);
    note_down_locked(why.message());
    return why;
  }

  result<reply_ptr> fail_locked(const std::string& why) {
    count(&store_tier_stats::errors);
    return error(errc::io_error, "Redis {}:{}: {}", o_.host, o_.port, why);
  }

  void count(std::int64_t store_tier_stats::*field) {
    std::lock_guard lock(stats_mu_);
    ++(stats_.*field);
  }

  // Reads n pipelined replies, each handed to on_reply; a lost connection is dropped.
  template <typename F>
  status replies_locked(std::size_t n, F&& on_reply) {
    for (std::size_t i = 0; i < n; ++i) {
      auto r = conn_->read_reply();
      if (!r.ok()) return drop_locked(r.error());
      PAGODA_RETURN_IF_ERROR(on_reply(**r));
    }
    return {};
  }

  result<reply_ptr> command_locked(std::initializer_list<std::string_view> args) {
    PAGODA_RETURN_IF_ERROR(ensure_connected_locked());
    auto r = conn_->command(args);
    if (!r.ok()) return drop_locked(r.error());
    return r;
  }

  template <typename F>
  status scan_locked(const std::string& pattern, F&& on_key) {
    std::string cursor = "0";
    do {
      PAGODA_ASSIGN_OR_RETURN(reply_ptr r, command_locked({"SCAN", cursor, "MATCH", pattern, "COUNT", "512"}));
      if (r->type != REDIS_REPLY_ARRAY || r->elements != 2) return fail_locked("SCAN answered something unexpected").error();
      cursor.assign(r->element[0]->str, r->element[0]->len);
      const redisReply* keys = r->element[1];
      for (std::size_t i = 0; i < keys->elements; ++i)
        if (!on_key(keys->element[i]->str, keys->element[i]->len)) return {};
    } while (cursor != "0");
    return {};
  }

  static constexpr std::int64_t k_retry_us = 1'000'000;

  redis_store_options o_;
  std::shared_ptr<const redis_credentials> creds_;
  const clock_source& clock_;
  std::mutex mu_;  // the connection; held across round trips
  std::unique_ptr<redis_connection> conn_;  // null: down
  std::string down_reason_;                 // why the last connection failed or was lost; "" when up
  mutable std::mutex reason_mu_;            // guards reason_copy_ (never held across I/O)
  std::string reason_copy_;
  std::int64_t last_attempt_us_ = INT64_MIN / 2;  // monotonic_us of the last connection attempt
  std::mutex stats_mu_;
  store_tier_stats stats_;
};

}  // namespace

result<std::unique_ptr<block_store>> make_redis_store(const redis_store_options& options, bool require_connection,
                                                      const clock_source& clock) {
  PAGODA_ASSIGN_OR_RETURN(auto creds, redis_credentials::load(options));
  auto s = std::make_unique<redis_store>(options, std::move(creds), clock);
  status st = s->connect_now();
  // A server that is down may come up; one that refuses us will not.
  if (!st.ok() && (require_connection || st.code() != errc::io_error)) return st;
  if (!st.ok()) std::fprintf(stderr, "pagoda: Redis tier is down, retrying: %s\n", st.message().c_str());
  return std::unique_ptr<block_store>(std::move(s));
}

}  // namespace pagoda
