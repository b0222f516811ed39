// Redis URLs, AUTH and TLS (docs/kv-store.md, "Redis"): every URL Pagoda
// cannot use is refused naming the part; a redis-server started here with
// --requirepass and an ACL user, and one serving TLS only with certificates
// made here by the openssl CLI, show what connects, what round-trips and what
// is refused (and that a refusal never falls back to something weaker).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/clock.h"
#include "store/block_store.h"
#include "store/redis_connection.h"
#include "store/redis_util.h"

namespace pagoda {
namespace {

namespace fs = std::filesystem;

// --- URLs ---------------------------------------------------------------------------

TEST(redis_url, the_forms_it_takes) {
  auto a = parse_redis_url("redis://:p%40ss%3Aw0rd@10.0.0.2:7000/3");
  ASSERT_TRUE(a.ok()) << a.error().message();
  EXPECT_EQ(a->host, "10.0.0.2");
  EXPECT_EQ(a->port, 7000);
  EXPECT_EQ(a->user, "");
  EXPECT_EQ(a->password, "p@ss:w0rd");
  EXPECT_EQ(a->db, 3);
  EXPECT_FALSE(a->tls);

  auto b = parse_redis_url("rediss://alice:pw@[::1]:6380?ca=/etc/ca.pem&cert=/c.pem&key=/k%20.pem");
  ASSERT_TRUE(b.ok()) << b.error().message();
  EXPECT_EQ(b->host, "::1");
  EXPECT_EQ(b->port, 6380);
  EXPECT_EQ(b->user, "alice");
  EXPECT_EQ(b->password, "pw");
  EXPECT_TRUE(b->tls);
  EXPECT_EQ(b->ca_file, "/etc/ca.pem");
  EXPECT_EQ(b->cert_file, "/c.pem");
  EXPECT_EQ(b->key_file, "/k .pem");

  auto c = parse_redis_url("redis://bob@cache-1.internal?password_file=/run/secrets/redis");
  ASSERT_TRUE(c.ok()) << c.error().message();
  EXPECT_EQ(c->user, "bob");
  EXPECT_EQ(c->password, "");
  EXPECT_EQ(c->password_file, "/run/secrets/redis");
  EXPECT_EQ(c->port, 6379);

  auto d = parse_redis_url("rediss://[::1]");
  ASSERT_TRUE(d.ok()) << d.error().message();
  EXPECT_EQ(d->host, "::1");
  EXPECT_EQ(d->port, 6379);
  EXPECT_EQ(parse_redis_url("redis://localhost/")->db, 0);
  EXPECT_EQ(parse_redis_url("redis://:a/b@h")->password, "a/b");  // the userinfo ends at the last '@'
}

TEST(redis_url, what_it_cannot_use_is_refused_naming_the_part) {
  struct bad {
    std::string url;
    std::string names;  // a piece of the message
  };
  const std::vector<bad> rows = {
      {"http://x:1", "scheme 'http://'"},
      {"x:6379", "scheme"},
      {"redis://:secret@a:b:6379", "extra ':' in 'a:b:6379'"},
      {"redis://::1:6379", "extra ':'"},
      {"redis://[::1", "'[' without ']'"},
      {"redis://[zz]:1", "'[zz]' is not an IPv6 address"},
      {"redis://[::1]x", "'x' after the IPv6 address"},
      {"redis://[::1]:", "port after ':' is empty"},
      {"redis://x:", "port after ':' is empty"},
      {"redis://x:0", "port '0'"},
      {"redis://x:12ab", "port '12ab'"},
      {"redis://x:70000", "port '70000'"},
      {"redis://:80", "no host"},
      {"redis://", "no host"},
      {"redis://[]", "'[]' is not an IPv6 address"},
      {"redis://h o:1", "host 'h o'"},
      {"redis://x/abc", "database '/abc'"},
      {"redis://x/-1", "database '/-1'"},
      {"redis://x?timeout=5", "unknown parameter 'timeout'"},
      {"redis://x?ca=/c.pem", "'ca' needs rediss://"},
      {"rediss://x?ca=", "'ca' needs a value"},
      {"rediss://x?ca", "'ca' needs a value"},
      {"rediss://x?ca=a&ca=b", "'ca' is given twice"},
      {"rediss://x?cert=/c.pem", "cert= and key="},
      {"redis://alice@x", "user 'alice' has no password"},
      {"redis://:secret@x?password_file=/f", "password_file= both"},
      {"redis://:@x", "password after ':' is empty"},
      {"redis://:secret%zz@x", "password has a malformed %-escape"},
      {"redis://x#frag", "fragment"},
  };
  for (const bad& r : rows) {
    auto o = parse_redis_url(r.url);
    ASSERT_FALSE(o.ok()) << r.url;
    EXPECT_EQ(o.error().code(), errc::invalid_argument) << r.url;
    EXPECT_NE(o.error().message().find(r.names), std::string::npos) << r.url << " -> " << o.error().message();
    EXPECT_EQ(o.error().message().find("secret"), std::string::npos) << "the password leaked: " << o.error().message();
  }
}

// --- AUTH ---------------------------------------------------------------------------

struct temp_dir {
  fs::path path;
  explicit temp_dir(const std::string& name)
      : path(fs::temp_directory_path() / ("pagoda_redis_sec_" + std::to_string(::getpid()) + "_" + name)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
  std::string file(const std::string& name, const std::string& text) const {
    std::ofstream(path / name) << text;
    return (path / name).string();
  }
};

std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

// Puts a few values (one pipelined batch), reads them back, finds them by scan.
void expect_round_trip(block_store& s) {
  std::vector<std::vector<std::byte>> values;
  std::vector<store_entry> entries;
  for (std::uint64_t i = 0; i < 3; ++i) values.push_back(bytes_of(std::string(1000 + i, static_cast<char>('a' + i))));
  for (std::uint64_t i = 0; i < 3; ++i) entries.push_back({store_key{7, 100 + i}, values[i]});
  ASSERT_TRUE(s.put_many(entries).ok());
  for (std::uint64_t i = 0; i < 3; ++i) {
    auto got = s.get(store_key{7, 100 + i});
    ASSERT_TRUE(got.ok()) << got.error().message();
    ASSERT_TRUE(got->has_value());
    EXPECT_EQ(**got, values[i]);
  }
  auto present = s.contains_each(std::vector<store_key>{store_key{7, 100}, store_key{7, 999}});
  ASSERT_TRUE(present.ok()) << present.error().message();
  EXPECT_EQ(*present, (std::vector<bool>{true, false}));
  int n = 0;
  ASSERT_TRUE(s.for_each([&](const store_key&, std::span<const std::byte>) { return ++n, true; }).ok());
  EXPECT_GE(n, 3);
}

result<std::unique_ptr<block_store>> open_url(const std::string& url, const clock_source& clock = system_clock_source()) {
  PAGODA_ASSIGN_OR_RETURN(redis_store_options o, parse_redis_url(url));
  // Not required: what must fail here fails even where a down server would not.
  return make_redis_store(o, /*require_connection=*/false, clock);
}

void expect_refused(const std::string& url, const std::string& names) {
  auto s = open_url(url);
  ASSERT_FALSE(s.ok()) << url << " connected";
  EXPECT_EQ(s.error().code(), errc::invalid_argument) << s.error().message();
  EXPECT_NE(s.error().message().find(names), std::string::npos) << url << " -> " << s.error().message();
}

std::vector<std::string> auth_args() {
  return {"--requirepass", "s3cret", "--user", "alice", "on", ">alice pw", "~*", "&*", "+@all"};
}

TEST(redis_auth, the_right_password_works_and_a_wrong_or_missing_one_is_refused) {
  test::redis_server server(auth_args(), /*tls=*/false);
  const std::string at = "127.0.0.1:" + std::to_string(server.port());
  temp_dir dir("auth");
  for (const std::string& url : {"redis://:s3cret@" + at, "redis://alice:alice%20pw@" + at + "/2",
                                "redis://" + at + "?password_file=" + dir.file("pw", "s3cret\n"),
                                "redis://alice@" + at + "?password_file=" + dir.file("alice", "alice pw")}) {
    auto s = open_url(url);
    ASSERT_TRUE(s.ok()) << url << ": " << s.error().message();
    expect_round_trip(**s);
  }
  expect_refused("redis://" + at, "NOAUTH");
  expect_refused("redis://:wrong@" + at, "AUTH refused: WRONGPASS");
  expect_refused("redis://alice:s3cret@" + at, "AUTH refused: WRONGPASS");
  expect_refused("redis://" + at + "?password_file=" + (dir.path / "none").string(), "cannot read");
  expect_refused("redis://" + at + "?password_file=" + dir.file("empty", "\n"), "is empty");
}

TEST(redis_auth, a_reconnection_the_server_refuses_leaves_the_tier_down_with_the_reason) {
  test::redis_server server({"--requirepass", "old"}, /*tls=*/false);
  const std::string at = "127.0.0.1:" + std::to_string(server.port());
  manual_clock clock;
  auto s = open_url("redis://:old@" + at, clock);
  ASSERT_TRUE(s.ok()) << s.error().message();
  expect_round_trip(**s);
  // The operator rotates the password and drops every client.
  const redis_store_options admin = *parse_redis_url("redis://:old@" + at);
  auto c = redis_connection::open(admin, *redis_credentials::load(admin));
  ASSERT_TRUE(c.ok()) << c.error().message();
  ASSERT_TRUE((*c)->command({"CONFIG", "SET", "requirepass", "new"}).ok());
  auto killed = (*c)->command({"CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"});
  ASSERT_TRUE(killed.ok()) << killed.error().message();
  ASSERT_EQ((*killed)->type, REDIS_REPLY_INTEGER);
  EXPECT_FALSE((*s)->get(store_key{7, 100}).ok()) << "the connection was killed";
  clock.advance_seconds(1.1);
  auto again = (*s)->get(store_key{7, 100});
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.error().message().find("AUTH refused"), std::string::npos) << again.error().message();
  // Down with that reason: calls fail fast and say why.
  auto fast = (*s)->get(store_key{7, 100});
  ASSERT_FALSE(fast.ok());
  EXPECT_NE(fast.error().message().find("WRONGPASS"), std::string::npos) << fast.error().message();
  EXPECT_GE((*s)->stats().errors, 3);
}

// --- TLS ----------------------------------------------------------------------------

// A throwaway CA, a server certificate it signed for 127.0.0.1 and redis.test,
// a client certificate, and another CA that signed nothing of the server's.
class redis_tls : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new temp_dir("tls");
    const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes ";
    const std::string script =
        "cd '" + dir_->path.string() + "' && printf 'subjectAltName=IP:127.0.0.1,DNS:redis.test\\n' > san.cnf" +
        " && openssl req -x509" + ec + "-keyout ca.key -out ca.crt -days 2 -subj /CN=pagoda-test-ca" +
        " && openssl req -x509" + ec + "-keyout other.key -out other.crt -days 2 -subj /CN=pagoda-other-ca" +
        " && openssl req" + ec + "-keyout server.key -out server.csr -subj /CN=pagoda-test-server" +
        " && openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt -days 2"
        " -extfile san.cnf" +
        " && openssl req" + ec + "-keyout client.key -out client.csr -subj /CN=pagoda-test-client" +
        " && openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out client.crt -days 2"
        " >/dev/null 2>&1";
    ASSERT_EQ(std::system(("(" + script + ") >/dev/null 2>&1").c_str()), 0) << "openssl could not make certificates";
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string file(const std::string& name) { return (dir_->path / name).string(); }
  static std::vector<std::string> tls_args(bool auth_clients) {
    return {"--tls-cert-file", file("server.crt"), "--tls-key-file", file("server.key"), "--tls-ca-cert-file",
            file("ca.crt"), "--tls-auth-clients", auth_clients ? "yes" : "no"};
  }
  static inline temp_dir* dir_ = nullptr;
};

TEST_F(redis_tls, rediss_round_trips_blocks_with_the_certificate_verified) {
  auto args = tls_args(false);
  args.insert(args.end(), {"--requirepass", "s3cret"});
  test::redis_server server(args, /*tls=*/true);
  const std::string port = std::to_string(server.port());
  auto s = open_url("rediss://:s3cret@127.0.0.1:" + port + "?ca=" + file("ca.crt"));
  ASSERT_TRUE(s.ok()) << s.error().message();
  expect_round_trip(**s);
  expect_refused("rediss://127.0.0.1:" + port + "?ca=" + file("ca.crt"), "NOAUTH");
}

TEST_F(redis_tls, a_certificate_that_does_not_verify_is_refused) {
  test::redis_server server(tls_args(false), /*tls=*/true);
  const std::string port = std::to_string(server.port());
  expect_refused("rediss://127.0.0.1:" + port + "?ca=" + file("other.crt"), "certificate does not verify");
  expect_refused("rediss://127.0.0.1:" + port, "certificate does not verify");  // the system's CAs never signed it
  // The right CA, but the certificate does not name "localhost".
  expect_refused("rediss://localhost:" + port + "?ca=" + file("ca.crt"), "certificate does not verify");
  expect_refused("rediss://127.0.0.1:" + port + "?ca=" + file("none.crt"), "cannot load the CA file");
}

TEST_F(redis_tls, plaintext_to_a_tls_port_and_tls_to_a_plaintext_port_fail_clearly) {
  test::redis_server server(tls_args(false), /*tls=*/true);
  expect_refused("redis://127.0.0.1:" + std::to_string(server.port()), "rediss://");
  // A plaintext server waits for the end of a line that a TLS hello never
  // sends: no answer, which may be a slow server, so an error where the
  // connection is required (pagoda kv), and never a plaintext connection.
  test::redis_server plain;
  auto o = parse_redis_url("rediss://127.0.0.1:" + std::to_string(plain.port()) + "?ca=" + file("ca.crt"));
  auto s = make_redis_store(*o, /*require_connection=*/true);
  ASSERT_FALSE(s.ok()) << "TLS to a plaintext port connected";
  EXPECT_NE(s.error().message().find("is this port serving TLS?"), std::string::npos) << s.error().message();
}

TEST_F(redis_tls, a_server_that_asks_for_a_client_certificate_gets_one) {
  test::redis_server server(tls_args(/*auth_clients=*/true), /*tls=*/true);
  const std::string base = "rediss://127.0.0.1:" + std::to_string(server.port()) + "?ca=" + file("ca.crt");
  auto s = open_url(base + "&cert=" + file("client.crt") + "&key=" + file("client.key"));
  ASSERT_TRUE(s.ok()) << s.error().message();
  expect_round_trip(**s);
  expect_refused(base, "require a client certificate");
  expect_refused(base + "&cert=" + file("client.crt") + "&key=" + file("server.key"), "does not match");
}

}  // namespace
}  // namespace pagoda
