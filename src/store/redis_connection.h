// One connection to a Redis server, over plain TCP or TLS (OpenSSL: Debian's
// hiredis 0.14 has no TLS). hiredis is used only to format commands
// (redisFormatCommandArgv) and parse replies (redisReader), so both transports
// share one code path. Not thread-safe: redis_store serializes its callers.
#pragma once

#include <hiredis/hiredis.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>

#include "pagoda/status.h"
#include "store/block_store.h"

namespace pagoda {

struct redis_reply_deleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using redis_reply_ptr = std::unique_ptr<redisReply, redis_reply_deleter>;

// What every connection of a store needs, resolved once when the store is made
// (so an unreadable password file, CA or client key fails at startup): the
// password, and for TLS the OpenSSL context with the trusted CAs and the
// client certificate.
class redis_credentials {
 public:
  static result<std::shared_ptr<const redis_credentials>> load(const redis_store_options& o);
  ~redis_credentials();
  redis_credentials(const redis_credentials&) = delete;
  redis_credentials& operator=(const redis_credentials&) = delete;

  const std::string& password() const { return password_; }
  void* tls_context() const { return ssl_ctx_; }  // SSL_CTX*; null for plain TCP

 private:
  redis_credentials() = default;
  std::string password_;
  void* ssl_ctx_ = nullptr;
};

class redis_connection {
 public:
  // Connects (each address of the host in turn), does the TLS handshake with
  // the server's certificate and name verified, then AUTH, SELECT and PING in
  // one round trip. Errors: errc::io_error when the server cannot be reached
  // or does not answer in time (may heal); errc::invalid_argument when it
  // answers but refuses us or is not what the URL says (credentials, the
  // certificate, TLS against plaintext or the reverse): waiting will not help.
  // REQUIRES: o outlives the connection.
  static result<std::unique_ptr<redis_connection>> open(const redis_store_options& o,
                                                        std::shared_ptr<const redis_credentials> creds);
  ~redis_connection();
  redis_connection(const redis_connection&) = delete;
  redis_connection& operator=(const redis_connection&) = delete;

  // Queues a command (pipelining); sent by the next read_reply().
  void append(std::initializer_list<std::string_view> args);
  // Sends what is queued, then reads one reply. Any error leaves the
  // connection unusable (the caller drops it): replies may be out of step.
  result<redis_reply_ptr> read_reply();
  result<redis_reply_ptr> command(std::initializer_list<std::string_view> args) {
    append(args);
    return read_reply();
  }

 private:
  redis_connection(const redis_store_options& o, std::shared_ptr<const redis_credentials> creds);
  status connect_socket();
  status handshake_tls();
  status hello();
  status flush();
  status fill();  // reads what the socket has into the reply reader
  template <typename... A>
  status fail(errc code, fmt::format_string<A...> f, A&&... args);

  const redis_store_options& o_;
  std::shared_ptr<const redis_credentials> creds_;
  int fd_ = -1;
  void* ssl_ = nullptr;  // SSL*
  redisReader* reader_ = nullptr;
  std::string out_;  // formatted commands not yet sent
  bool eof_ = false;  // the server closed or reset the connection
  // A TLS alert ended a read: with TLS 1.3 a server that requires a client
  // certificate says so only after the client's handshake has finished.
  bool tls_alert_ = false;
};

}  // namespace pagoda
