#include "store/redis_connection.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/assert.h"

namespace pagoda {
namespace {

SSL_CTX* as_ctx(void* p) { return static_cast<SSL_CTX*>(p); }
SSL* as_ssl(void* p) { return static_cast<SSL*>(p); }

// The oldest OpenSSL error queued (the root cause), and the queue cleared.
std::string openssl_error() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no detail from OpenSSL";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof buf);
  return buf;
}

std::string endpoint(const redis_store_options& o) {
  const bool v6 = o.host.find(':') != std::string::npos;
  return fmt::format("{}{}{}:{}", v6 ? "[" : "", o.host, v6 ? "]" : "", o.port);
}

bool is_ip_literal(const std::string& host) {
  in6_addr a6{};
  in_addr a4{};
  return ::inet_pton(AF_INET6, host.c_str(), &a6) == 1 || ::inet_pton(AF_INET, host.c_str(), &a4) == 1;
}

// OpenSSL writes to the socket with write(): on a connection the server closed
// that raises SIGPIPE, which kills a process that did not ignore it (the
// `pagoda kv` tools). Blocks it for this thread around the write and discards
// one it raised.
class sigpipe_guard {
 public:
  sigpipe_guard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~sigpipe_guard() {
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
      const timespec zero{0, 0};
      sigtimedwait(&pipe_, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t pipe_, old_;
  bool was_pending_ = false;
};

}  // namespace

result<std::shared_ptr<const redis_credentials>> redis_credentials::load(const redis_store_options& o) {
  std::shared_ptr<redis_credentials> c(new redis_credentials());
  c->password_ = o.password;
  if (!o.password_file.empty()) {
    std::ifstream in(o.password_file, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    if (!in) return error(errc::invalid_argument, "Redis password file {}: cannot read it", o.password_file);
    c->password_ = s.str();
    if (c->password_.ends_with('\n')) c->password_.pop_back();
    if (c->password_.ends_with('\r')) c->password_.pop_back();
    if (c->password_.empty()) return error(errc::invalid_argument, "Redis password file {} is empty", o.password_file);
  }
  if (!o.tls) return std::shared_ptr<const redis_credentials>(std::move(c));
  ERR_clear_error();
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (!ctx) return error(errc::internal, "TLS: cannot create a context: {}", openssl_error());
  c->ssl_ctx_ = ctx;
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  const bool trusted = o.ca_file.empty() ? SSL_CTX_set_default_verify_paths(ctx) == 1
                                         : SSL_CTX_load_verify_locations(ctx, o.ca_file.c_str(), nullptr) == 1;
  if (!trusted)
    return error(errc::invalid_argument, "Redis TLS: cannot load the CA file {}: {}",
                 o.ca_file.empty() ? "(system default)" : o.ca_file, openssl_error());
  if (!o.cert_file.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx, o.cert_file.c_str()) != 1)
      return error(errc::invalid_argument, "Redis TLS: cannot load the client certificate {}: {}", o.cert_file,
                   openssl_error());
    if (SSL_CTX_use_PrivateKey_file(ctx, o.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(ctx) != 1)
      return error(errc::invalid_argument, "Redis TLS: cannot load the client key {} (or it does not match {}): {}",
                   o.key_file, o.cert_file, openssl_error());
  }
  return std::shared_ptr<const redis_credentials>(std::move(c));
}

redis_credentials::~redis_credentials() {
  if (ssl_ctx_) SSL_CTX_free(as_ctx(ssl_ctx_));
}

redis_connection::redis_connection(const redis_store_options& o, std::shared_ptr<const redis_credentials> creds)
    : o_(o), creds_(std::move(creds)), reader_(redisReaderCreate()) {}

redis_connection::~redis_connection() {
  if (ssl_) {
    sigpipe_guard guard;
    SSL_shutdown(as_ssl(ssl_));  // one close_notify, not waiting for the server's
    SSL_free(as_ssl(ssl_));
  }
  if (fd_ >= 0) ::close(fd_);
  if (reader_) redisReaderFree(reader_);
}

template <typename... A>
status redis_connection::fail(errc code, fmt::format_string<A...> f, A&&... args) {
  return status(code, fmt::format("Redis {}: {}", endpoint(o_), fmt::format(f, std::forward<A>(args)...)));
}

result<std::unique_ptr<redis_connection>> redis_connection::open(const redis_store_options& o,
                                                                 std::shared_ptr<const redis_credentials> creds) {
  std::unique_ptr<redis_connection> c(new redis_connection(o, std::move(creds)));
  if (!c->reader_) return error(errc::internal, "Redis: cannot allocate a reply reader");
  PAGODA_RETURN_IF_ERROR(c->connect_socket());
  if (o.tls) PAGODA_RETURN_IF_ERROR(c->handshake_tls());
  PAGODA_RETURN_IF_ERROR(c->hello());
  return c;
}

status redis_connection::connect_socket() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const std::string port = std::to_string(o_.port);
  if (const int rc = ::getaddrinfo(o_.host.c_str(), port.c_str(), &hints, &list); rc != 0)
    return fail(errc::io_error, "cannot resolve the host: {}", ::gai_strerror(rc));
  std::string why = "no address";
  for (addrinfo* a = list; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = ::poll(&p, 1, o_.timeout_ms);
      int err = 0;
      socklen_t len = sizeof err;
      if (rc == 0) {
        errno = ETIMEDOUT;
        rc = -1;
      } else if (rc > 0 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0) {
        errno = err;
        rc = -1;
      } else if (rc > 0) {
        rc = 0;
      }
    }
    if (rc != 0) {
      why = std::strerror(errno);
      ::close(fd);
      continue;
    }
    fd_ = fd;
    break;
  }
  ::freeaddrinfo(list);
  if (fd_ < 0) return fail(errc::io_error, "cannot connect: {}", why);
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
  // Blocking from here, each read and write bounded by the timeout.
  const timeval tv{o_.timeout_ms / 1000, (o_.timeout_ms % 1000) * 1000};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return {};
}

status redis_connection::handshake_tls() {
  ERR_clear_error();
  SSL* ssl = SSL_new(as_ctx(creds_->tls_context()));
  if (!ssl) return fail(errc::internal, "TLS: {}", openssl_error());
  ssl_ = ssl;
  SSL_set_fd(ssl, fd_);
  // The certificate must name the host of the URL: an IP address as an IP SAN,
  // a name as a DNS name (also sent as SNI).
  if (is_ip_literal(o_.host)) {
    X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), o_.host.c_str());
  } else {
    SSL_set_tlsext_host_name(ssl, o_.host.c_str());
    SSL_set1_host(ssl, o_.host.c_str());
  }
  sigpipe_guard guard;
  errno = 0;
  if (SSL_connect(ssl) == 1) return {};
  const long verify = SSL_get_verify_result(ssl);
  const int err = SSL_get_error(ssl, 0);
  if (verify != X509_V_OK) {
    ERR_clear_error();
    return fail(errc::invalid_argument, "TLS: the server's certificate does not verify ({}); refusing to connect",
                X509_verify_cert_error_string(verify));
  }
  if (err == SSL_ERROR_SSL)
    return fail(errc::invalid_argument, "TLS handshake failed ({}); is this port serving TLS?", openssl_error());
  ERR_clear_error();
  if (errno == EAGAIN || errno == EWOULDBLOCK || err == SSL_ERROR_WANT_READ)
    return fail(errc::io_error, "TLS handshake: no answer within {} ms (is this port serving TLS?)", o_.timeout_ms);
  return fail(errc::io_error, "TLS handshake: the connection closed ({}); is this port serving TLS?",
              errno ? std::strerror(errno) : "end of stream");
}

// AUTH, SELECT and PING pipelined: one round trip per (re)connection.
status redis_connection::hello() {
  std::vector<const char*> sent;
  const std::string& pw = creds_->password();
  if (!pw.empty()) {
    if (o_.user.empty()) append({"AUTH", pw});
    else append({"AUTH", o_.user, pw});
    sent.push_back("AUTH");
  }
  const std::string db = std::to_string(o_.db);
  if (o_.db != 0) {
    append({"SELECT", db});
    sent.push_back("SELECT");
  }
  append({"PING"});
  sent.push_back("PING");
  status first;
  bool answered = false;
  for (const char* what : sent) {
    auto r = read_reply();
    if (!r.ok()) {
      // Bytes that are not RESP, or a close or reset before any answer: the
      // server will not talk to us (Redis resets a plaintext client on a TLS
      // port, and drops a TLS client without the certificate it requires).
      if (r.error().code() == errc::corrupt || (!answered && (eof_ || tls_alert_)))
        return fail(errc::invalid_argument, "{}; {}", r.error().message(),
                    o_.tls ? "does the server require a client certificate (cert=, key=)?"
                           : "if this port serves TLS only, use rediss://");
      return r.error();
    }
    if ((*r)->type == REDIS_REPLY_ERROR && first.ok()) {
      const std::string msg((*r)->str, (*r)->len);
      first = fail(errc::invalid_argument, "{} refused: {}{}", what, msg,
                   msg.rfind("NOAUTH", 0) == 0 ? " (the server needs a password: USER:PASSWORD@ or password_file=)" : "");
    }
    answered = true;
  }
  return first;
}

void redis_connection::append(std::initializer_list<std::string_view> args) {
  const char* argv[8];
  std::size_t lens[8];
  PAGODA_ASSERT(args.size() <= 8, "redis_connection::append: at most 8 arguments");
  int n = 0;
  for (std::string_view a : args) {
    argv[n] = a.data();
    lens[n++] = a.size();
  }
  char* cmd = nullptr;
  const int len = redisFormatCommandArgv(&cmd, n, argv, lens);
  PAGODA_ASSERT(len > 0 && cmd, "redisFormatCommandArgv failed (out of memory)");
  out_.append(cmd, static_cast<std::size_t>(len));
  redisFreeCommand(cmd);
}

status redis_connection::flush() {
  std::size_t done = 0;
  while (done < out_.size()) {
    long n;
    if (ssl_) {
      sigpipe_guard guard;
      errno = 0;
      const int chunk = static_cast<int>(std::min<std::size_t>(out_.size() - done, 1 << 30));
      n = SSL_write(as_ssl(ssl_), out_.data() + done, chunk);
      if (n <= 0) {
        tls_alert_ = SSL_get_error(as_ssl(ssl_), static_cast<int>(n)) == SSL_ERROR_SSL;
        ERR_clear_error();
      }
    } else {
      n = ::send(fd_, out_.data() + done, out_.size() - done, MSG_NOSIGNAL);
    }
    if (n <= 0) {
      if (errno == EINTR) continue;
      if (errno == ECONNRESET || errno == EPIPE) eof_ = true;
      out_.clear();
      if (errno == EAGAIN || errno == EWOULDBLOCK) return fail(errc::io_error, "write timed out after {} ms", o_.timeout_ms);
      return fail(errc::io_error, "write failed: {}", errno ? std::strerror(errno) : "connection closed");
    }
    done += static_cast<std::size_t>(n);
  }
  out_.clear();
  return {};
}

status redis_connection::fill() {
  char buf[64 * 1024];
  long n;
  errno = 0;
  if (ssl_) {
    n = SSL_read(as_ssl(ssl_), buf, sizeof buf);
    if (n <= 0) {
      const int err = SSL_get_error(as_ssl(ssl_), static_cast<int>(n));
      const std::string detail = err == SSL_ERROR_SSL ? openssl_error() : "";
      ERR_clear_error();
      if (err == SSL_ERROR_ZERO_RETURN) n = 0;
      else if (err == SSL_ERROR_SSL) {
        tls_alert_ = true;
        return fail(errc::io_error, "TLS: {}", detail);
      } else if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) errno = EAGAIN;
    }
  } else {
    n = ::recv(fd_, buf, sizeof buf, 0);
  }
  if (n == 0) {
    eof_ = true;
    return fail(errc::io_error, "the server closed the connection");
  }
  if (n < 0) {
    if (errno == EINTR) return {};
    if (errno == ECONNRESET) eof_ = true;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return fail(errc::io_error, "no answer within {} ms", o_.timeout_ms);
    return fail(errc::io_error, "read failed: {}", errno ? std::strerror(errno) : "connection closed");
  }
  if (redisReaderFeed(reader_, buf, static_cast<std::size_t>(n)) != REDIS_OK)
    return fail(errc::internal, "cannot buffer a reply (out of memory)");
  return {};
}

result<redis_reply_ptr> redis_connection::read_reply() {
  PAGODA_RETURN_IF_ERROR(flush());
  for (;;) {
    void* raw = nullptr;
    if (redisReaderGetReply(reader_, &raw) != REDIS_OK)
      return fail(errc::corrupt, "the answer is not the Redis protocol ({})", reader_->errstr);
    if (raw) return redis_reply_ptr(static_cast<redisReply*>(raw));
    PAGODA_RETURN_IF_ERROR(fill());
  }
}

}  // namespace pagoda
