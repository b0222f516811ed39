// parse_redis_url: the Redis URL grammar of block_store.h. Strict on purpose: a
// URL that means something else than the operator thinks (an unencoded '@' or
// ':' in a password, an IPv6 address without brackets, a parameter we ignore)
// would otherwise connect somewhere else or without the protection asked for.
#include <arpa/inet.h>

#include <charconv>
#include <optional>

#include "store/block_store.h"

namespace pagoda {
namespace {

// The URL for messages: the password (between the first ':' of the userinfo and
// its last '@') is replaced by "***".
std::string redacted(std::string_view url) {
  const std::size_t scheme_end = url.find("://");
  if (scheme_end == std::string_view::npos) return std::string(url);
  const std::size_t start = scheme_end + 3;
  const std::size_t at = url.rfind('@');
  if (at == std::string_view::npos || at < start) return std::string(url);
  const std::size_t colon = url.find(':', start);
  if (colon == std::string_view::npos || colon > at) return std::string(url);
  return std::string(url.substr(0, colon + 1)) + "***" + std::string(url.substr(at));
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// %XX escapes decoded; false on a malformed escape.
bool percent_decode(std::string_view in, std::string& out) {
  out.clear();
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out += in[i];
      continue;
    }
    if (i + 2 >= in.size()) return false;
    const int hi = hex_value(in[i + 1]), lo = hex_value(in[i + 2]);
    if (hi < 0 || lo < 0) return false;
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return true;
}

// s as a whole decimal number in [lo, hi]; nullopt otherwise.
std::optional<int> whole_number(std::string_view s, int lo, int hi) {
  int n = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  if (ec != std::errc() || p != s.data() + s.size() || n < lo || n > hi) return std::nullopt;
  return n;
}

bool host_name_ok(std::string_view h) {
  for (const char c : h)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
          c == '_'))
      return false;
  return true;
}

class url_parser {
 public:
  explicit url_parser(const std::string& url) : url_(url), shown_(redacted(url)) {}

  result<redis_store_options> parse() {
    std::string_view rest = url_;
    if (rest.rfind("rediss://", 0) == 0) {
      o_.tls = true;
      rest.remove_prefix(9);
    } else if (rest.rfind("redis://", 0) == 0) {
      rest.remove_prefix(8);
    } else {
      const std::size_t s = rest.find("://");
      return fail("the scheme '{}' is not redis:// or rediss://",
                  s == std::string_view::npos ? std::string(rest) : std::string(rest.substr(0, s + 3)));
    }
    if (const std::size_t hash = rest.find('#'); hash != std::string_view::npos)
      return fail("a fragment ('#...') has no meaning here; a '#' in a password must be written %23");
    std::string_view query;
    if (const std::size_t q = rest.find('?'); q != std::string_view::npos) {
      query = rest.substr(q + 1);
      rest = rest.substr(0, q);
    }
    const std::size_t at = rest.rfind('@');
    if (at != std::string_view::npos) {
      PAGODA_RETURN_IF_ERROR(parse_userinfo(rest.substr(0, at)));
      rest.remove_prefix(at + 1);
    }
    std::string_view path;
    if (const std::size_t slash = rest.find('/'); slash != std::string_view::npos) {
      path = rest.substr(slash + 1);
      rest = rest.substr(0, slash);
    }
    PAGODA_RETURN_IF_ERROR(parse_host_port(rest));
    PAGODA_RETURN_IF_ERROR(parse_db(path));
    PAGODA_RETURN_IF_ERROR(parse_query(query));
    if (!o_.user.empty() && !has_password_ && o_.password_file.empty())
      return fail("user '{}' has no password (write USER:PASSWORD@ or add password_file=)", o_.user);
    if (has_password_ && !o_.password_file.empty())
      return fail("a password in the URL and password_file= both; give one");
    if (!o_.cert_file.empty() != !o_.key_file.empty()) return fail("cert= and key= go together; one is missing");
    return o_;
  }

 private:
  template <typename... A>
  status fail(fmt::format_string<A...> f, A&&... args) {
    return error(errc::invalid_argument, "Redis URL '{}': {}", shown_, fmt::format(f, std::forward<A>(args)...));
  }

  status parse_userinfo(std::string_view info) {
    const std::size_t colon = info.find(':');
    if (!percent_decode(info.substr(0, colon), o_.user)) return fail("the user has a malformed %-escape");
    if (colon == std::string_view::npos) return {};
    has_password_ = true;
    if (!percent_decode(info.substr(colon + 1), o_.password)) return fail("the password has a malformed %-escape");
    if (o_.password.empty()) return fail("the password after ':' is empty");
    return {};
  }

  status parse_host_port(std::string_view hp) {
    std::string_view port;
    if (!hp.empty() && hp.front() == '[') {
      const std::size_t close = hp.find(']');
      if (close == std::string_view::npos) return fail("'[' without ']' around the IPv6 address");
      o_.host = std::string(hp.substr(1, close - 1));
      in6_addr a{};
      if (::inet_pton(AF_INET6, o_.host.c_str(), &a) != 1) return fail("'[{}]' is not an IPv6 address", o_.host);
      std::string_view after = hp.substr(close + 1);
      if (!after.empty() && after.front() != ':') return fail("'{}' after the IPv6 address is not ':PORT'", after);
      if (!after.empty()) port = after.substr(1);
      if (!after.empty() && port.empty()) return fail("the port after ':' is empty");
    } else {
      const std::size_t colon = hp.find(':');
      o_.host = std::string(hp.substr(0, colon));
      if (colon != std::string_view::npos) {
        port = hp.substr(colon + 1);
        if (port.find(':') != std::string_view::npos)
          return fail("extra ':' in '{}' (an IPv6 address goes in brackets: [::1]:6379; a ':' in a password "
                      "needs USER:PASSWORD@ before the host)",
                      hp);
        if (port.empty()) return fail("the port after ':' is empty");
      }
      if (o_.host.empty()) return fail("no host");
      if (!host_name_ok(o_.host)) return fail("the host '{}' is not a host name or IPv4 address", o_.host);
    }
    if (o_.host.empty()) return fail("no host");
    if (!port.empty()) {
      const std::optional<int> n = whole_number(port, 1, 65535);
      if (!n) return fail("the port '{}' is not a number in 1..65535", port);
      o_.port = *n;
    }
    return {};
  }

  status parse_db(std::string_view path) {
    if (path.empty()) return {};
    const std::optional<int> n = whole_number(path, 0, 65535);
    if (!n) return fail("the database '/{}' is not a number in 0..65535", path);
    o_.db = *n;
    return {};
  }

  status parse_query(std::string_view query) {
    while (!query.empty()) {
      const std::size_t amp = query.find('&');
      const std::string_view item = query.substr(0, amp);
      query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
      const std::size_t eq = item.find('=');
      const std::string_view name = item.substr(0, eq);
      std::string value;
      if (eq == std::string_view::npos || !percent_decode(item.substr(eq + 1), value) || value.empty())
        return fail("the parameter '{}' needs a value (NAME=VALUE)", name);
      std::string* field = nullptr;
      if (name == "ca") field = &o_.ca_file;
      else if (name == "cert") field = &o_.cert_file;
      else if (name == "key") field = &o_.key_file;
      else if (name == "password_file") field = &o_.password_file;
      else return fail("unknown parameter '{}' (known: ca, cert, key, password_file)", name);
      if (!field->empty()) return fail("the parameter '{}' is given twice", name);
      if (field != &o_.password_file && !o_.tls) return fail("the parameter '{}' needs rediss:// (TLS)", name);
      *field = std::move(value);
    }
    return {};
  }

  const std::string& url_;
  const std::string shown_;
  redis_store_options o_;
  bool has_password_ = false;
};

}  // namespace

result<redis_store_options> parse_redis_url(const std::string& url) { return url_parser(url).parse(); }

bool looks_like_url(std::string_view s) { return s.find("://") != std::string_view::npos; }

}  // namespace pagoda
