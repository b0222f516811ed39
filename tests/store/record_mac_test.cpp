// Stored records that cannot be forged (issue 29): with a server secret every
// record carries an HMAC-SHA256 over its key and bytes, so a record rebuilt by
// whoever can write a tier (and recompute the xxh3 checksum) fails as forged
// (errc::unauthenticated), apart from damage (errc::corrupt); the warehouse
// serves no forged record from a disk or Redis tier and counts it.
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "core/hash.h"
#include "store/block_record.h"
#include "store/block_store.h"
#include "store/redis_util.h"
#include "store/warehouse.h"

namespace pagoda {
namespace {

namespace fs = std::filesystem;

constexpr std::uint64_t k_layout = 0x2b2b;
constexpr std::size_t k_mac = 32;

const record_secret& secret() {
  static const record_secret s("the-server-secret-0123456789");
  return s;
}
const record_secret& other_secret() {
  static const record_secret s("another-secret-9876543210abcdef");
  return s;
}

block_record sample(const std::string& tenant, block_key chain, std::size_t n_bytes = 600) {
  block_record r;
  r.key = make_store_key({11, 22}, tenant, chain);
  r.chain = chain;
  r.parent = chain ^ 0x77;
  r.tenant = tenant;
  for (int i = 0; i < 16; ++i) r.tokens.push_back(static_cast<token_id>(chain * 16 + static_cast<block_key>(i)));
  r.bytes.resize(n_bytes);
  for (std::size_t i = 0; i < n_bytes; ++i) r.bytes[i] = static_cast<std::byte>((chain * 13 + i * 5) & 0xff);
  return r;
}

// What anyone who can write a tier can do: recompute the trailing checksum.
void rechecksum(std::vector<std::byte>& rec) {
  const std::uint64_t sum = hash_bytes(rec.data(), rec.size() - 8);
  std::memcpy(rec.data() + rec.size() - 8, &sum, 8);
}

// `edited`'s fields with `genuine`'s MAC, re-checksummed: a record edited in
// place, its MAC kept (an attacker cannot compute a new one).
std::vector<std::byte> with_mac_of(std::vector<std::byte> edited, const std::vector<std::byte>& genuine) {
  std::memcpy(edited.data() + edited.size() - 8 - k_mac, genuine.data() + genuine.size() - 8 - k_mac, k_mac);
  rechecksum(edited);
  return edited;
}

errc code_of(std::span<const std::byte> rec, const store_key& key, const record_secret* s) {
  auto d = decode_block_record(rec, key, s);
  return d.ok() ? errc::ok : d.error().code();
}

TEST(record_mac, round_trips_under_its_secret_only) {
  const block_record r = sample("alice", 7, 4096);
  for (bool compress : {true, false}) {
    const auto enc = encode_block_record(r, compress, &secret());
    std::uint16_t version = 0;
    std::memcpy(&version, enc.data() + 4, 2);
    EXPECT_EQ(version, k_block_record_mac_version);
    auto back = decode_block_record(enc, r.key, &secret());
    ASSERT_TRUE(back.ok()) << back.error().message();
    EXPECT_EQ(back->bytes, r.bytes);
    EXPECT_EQ(back->tokens, r.tokens);
    EXPECT_EQ(back->tenant, "alice");
    EXPECT_TRUE(check_block_record(enc, r.key, &secret()).ok());
    // Another secret, or none (a MAC nobody here can check), is not trusted.
    EXPECT_EQ(code_of(enc, r.key, &other_secret()), errc::unauthenticated);
    EXPECT_EQ(code_of(enc, r.key, nullptr), errc::unauthenticated);
  }
  // A record without a MAC is forged to a server with a secret (and still
  // read, only checksummed, by one without).
  const auto plain = encode_block_record(r, true);
  EXPECT_EQ(code_of(plain, r.key, &secret()), errc::unauthenticated);
  EXPECT_EQ(code_of(plain, r.key, nullptr), errc::ok);
}

// Every byte an attacker may change (all but the checksum, which they
// recompute) makes a forged record, never KV and never "corrupt"; without the
// recomputed checksum the same change is damage.
TEST(record_mac, every_rechecksummed_change_is_forged_not_corrupt) {
  const block_record r = sample("alice", 9);
  const auto enc = encode_block_record(r, false, &secret());
  for (std::size_t i = 0; i + 8 < enc.size(); ++i) {
    auto bad = enc;
    bad[i] ^= std::byte{0x20};
    EXPECT_EQ(code_of(bad, r.key, &secret()), errc::corrupt) << "byte " << i;
    rechecksum(bad);
    const errc c = code_of(bad, r.key, &secret());
    // The magic and version are read before the MAC (they say whether there is one).
    if (i < 6) {
      EXPECT_NE(c, errc::ok) << "byte " << i;
    } else {
      EXPECT_EQ(c, errc::unauthenticated) << "byte " << i << (i + 8 + k_mac >= enc.size() ? " (in the MAC)" : "");
    }
  }
}

// The forgeries of the issue, each rebuilt as a whole and given the genuine
// record's MAC (or rebuilt without one, or under a secret of the attacker's).
TEST(record_mac, rebuilt_records_are_forged) {
  const block_record r = sample("alice", 21);
  const auto genuine = encode_block_record(r, false, &secret());
  ASSERT_TRUE(check_block_record(genuine, r.key, &secret()).ok());

  block_record tokens = r;
  tokens.tokens[3] += 1;
  block_record payload = r;
  payload.bytes[100] ^= std::byte{0x40};
  block_record chain = r;
  chain.parent ^= 1;
  for (const block_record* f : {&tokens, &payload, &chain}) {
    const auto forged = with_mac_of(encode_block_record(*f, false, &secret()), genuine);
    EXPECT_EQ(code_of(forged, r.key, &secret()), errc::unauthenticated);
    EXPECT_EQ(code_of(encode_block_record(*f, false), r.key, &secret()), errc::unauthenticated);  // no MAC
    EXPECT_EQ(code_of(encode_block_record(*f, false, &other_secret()), r.key, &secret()), errc::unauthenticated);
  }

  // Moved to another tenant: the tenant field and the key follow, the MAC does not.
  block_record moved = r;
  moved.tenant = "bob";
  moved.key = make_store_key({11, 22}, "bob", 21);
  const auto to_bob = with_mac_of(encode_block_record(moved, false, &secret()), genuine);
  EXPECT_EQ(code_of(to_bob, moved.key, &secret()), errc::unauthenticated);
  // The genuine bytes under bob's key (a copy between keys) fail too.
  EXPECT_EQ(code_of(genuine, moved.key, &secret()), errc::unauthenticated);
  // And under another key of alice's (another block's place in a prompt).
  block_record elsewhere = r;
  elsewhere.key = make_store_key({11, 22}, "alice", 22);
  EXPECT_EQ(code_of(with_mac_of(encode_block_record(elsewhere, false, &secret()), genuine), elsewhere.key, &secret()),
            errc::unauthenticated);
}

// --- the secret file --------------------------------------------------------------

class secret_file : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("pagoda_secret_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text, mode_t mode = 0600) {
    const std::string p = (dir_ / name).string();
    std::ofstream(p, std::ios::binary) << text;
    ::chmod(p.c_str(), mode);
    return p;
  }
  fs::path dir_;
};

TEST_F(secret_file, a_private_file_of_enough_bytes_is_read_without_its_newline) {
  auto with_nl = record_secret::from_file(write("a", "0123456789abcdef0123\n"));
  auto without = record_secret::from_file(write("b", "0123456789abcdef0123"));
  ASSERT_TRUE(with_nl.ok()) << with_nl.error().message();
  ASSERT_TRUE(without.ok()) << without.error().message();
  const block_record r = sample("", 3);
  EXPECT_TRUE(check_block_record(encode_block_record(r, true, &*with_nl), r.key, &*without).ok());
}

TEST_F(secret_file, empty_short_open_or_missing_files_are_refused) {
  for (const std::string& p : {write("empty", ""), write("newline", "\n"), write("short", "only15bytes....")}) {
    auto s = record_secret::from_file(p);
    ASSERT_FALSE(s.ok()) << p;
    EXPECT_EQ(s.error().code(), errc::invalid_argument);
    EXPECT_NE(s.error().message().find("at least"), std::string::npos) << s.error().message();
  }
  for (mode_t m : {0640, 0604, 0660, 0644}) {
    auto s = record_secret::from_file(write("open", "0123456789abcdef0123", m));
    ASSERT_FALSE(s.ok()) << std::oct << m;
    EXPECT_NE(s.error().message().find("chmod 600"), std::string::npos) << s.error().message();
  }
  EXPECT_FALSE(record_secret::from_file((dir_ / "missing").string()).ok());
  EXPECT_FALSE(record_secret::from_file(dir_.string()).ok());  // a directory
  EXPECT_FALSE(record_secret::from_file(write("huge", std::string(8192, 'x'))).ok());
}

// --- the warehouse over real tiers ------------------------------------------------

// What the engine commits of a sample block (its store key is the warehouse's).
cached_block committed(const block_record& r) { return {k_layout, r.chain, r.parent, r.tenant, r.tokens, r.bytes}; }

// Writes a block of alice's through a warehouse with the secret, replaces its
// stored record with `forge`(the genuine record), and loads it again.
// Returns the loaded tier (-1: a miss) and leaves the counters in `c`.
int load_after_forging(std::unique_ptr<block_store> tier,
                       const std::function<std::vector<std::byte>(const block_record&, const std::vector<std::byte>&)>& forge,
                       warehouse_counters& c) {
  std::vector<std::unique_ptr<block_store>> tiers;
  tiers.push_back(std::move(tier));
  warehouse_options o;
  o.model = 0x5eed;
  o.secret = std::make_shared<const record_secret>(secret());
  kv_warehouse w(std::move(tiers), o);
  const block_record b = sample("alice", 5, 4096);
  const stored_block_ref ref{k_layout, b.chain};
  w.write(committed(b));
  w.flush();
  const store_key sk = w.key_of("alice", ref);
  block_store& t = *w.tiers()[0];
  auto stored = t.get(sk);
  EXPECT_TRUE(stored.ok() && stored->has_value());
  if (!stored.ok() || !stored->has_value()) return -2;
  auto genuine = decode_block_record(**stored, sk, &secret());
  EXPECT_TRUE(genuine.ok());
  if (!genuine.ok()) return -2;
  const std::vector<std::byte> forged = forge(*genuine, **stored);
  EXPECT_TRUE(t.erase(sk).ok());
  EXPECT_TRUE(t.put(sk, forged).ok());
  const std::vector<stored_block_ref> refs{ref};
  EXPECT_EQ(w.n_available("alice", refs), 1);
  w.prefetch("alice", refs);
  w.quiesce();
  std::vector<std::byte> out(b.bytes.size());
  const int got = w.read("alice", ref, out);
  w.release("alice", refs);
  c = w.counters();
  // A forged record is erased so that the next write-back replaces it.
  EXPECT_FALSE(t.get(sk)->has_value());
  return got;
}

// The forgery: the record rebuilt with other KV and a recomputed
// checksum (without a MAC, the attacker having no secret), and the same with
// the genuine MAC kept.
std::vector<std::byte> rebuilt_without_mac(const block_record& r, const std::vector<std::byte>&) {
  block_record f = r;
  for (std::byte& x : f.bytes) x = std::byte{0};
  return encode_block_record(f, true);
}
std::vector<std::byte> edited_keeping_mac(const block_record& r, const std::vector<std::byte>& genuine) {
  block_record f = r;
  f.tokens[0] = 424242;
  for (std::byte& x : f.bytes) x = std::byte{0};
  return with_mac_of(encode_block_record(f, true, &other_secret()), genuine);
}

void expect_forged_miss(const std::function<std::unique_ptr<block_store>()>& make_tier) {
  for (auto forge : {rebuilt_without_mac, edited_keeping_mac}) {
    warehouse_counters c;
    EXPECT_EQ(load_after_forging(make_tier(), forge, c), -1) << "a forged record was served";
    EXPECT_EQ(c.forged, 1);
    EXPECT_EQ(c.corrupt, 0);
    EXPECT_EQ(c.loads, 0);
  }
}

TEST(record_mac, a_forged_record_on_disk_is_a_counted_miss) {
  const fs::path dir = fs::temp_directory_path() / ("pagoda_mac_disk_" + std::to_string(::getpid()));
  expect_forged_miss([&] {
    fs::remove_all(dir);
    auto s = make_disk_store({dir.string(), 64 << 20, 0});
    EXPECT_TRUE(s.ok());
    return std::move(*s);
  });
  fs::remove_all(dir);
}

TEST(record_mac, a_forged_record_in_redis_is_a_counted_miss) {
  test::redis_server server;
  expect_forged_miss([&] {
    auto s = make_redis_store({"127.0.0.1", server.port(), 0, 500});
    EXPECT_TRUE(s.ok());
    return std::move(*s);
  });
}

// A server without a secret meeting records MACed by a replica with one:
// misses (it cannot check them), counted as forged, and left in place for the
// replicas that can.
TEST(record_mac, a_server_without_the_secret_leaves_maced_records_alone) {
  std::vector<std::unique_ptr<block_store>> tiers;
  tiers.push_back(make_memory_store());
  kv_warehouse w(std::move(tiers), {});
  block_record r = sample("", 8);
  const stored_block_ref ref{k_layout, r.chain};
  r.key = w.key_of("", ref);
  ASSERT_TRUE(w.tiers()[0]->put(r.key, encode_block_record(r, true, &secret())).ok());
  const std::vector<stored_block_ref> refs{ref};
  w.prefetch("", refs);
  w.quiesce();
  std::vector<std::byte> out(r.bytes.size());
  EXPECT_EQ(w.read("", ref, out), -1);
  w.release("", refs);
  EXPECT_EQ(w.counters().forged, 1);
  EXPECT_EQ(w.counters().corrupt, 0);
  EXPECT_TRUE(w.tiers()[0]->get(r.key)->has_value());
}

}  // namespace
}  // namespace pagoda
