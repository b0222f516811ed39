// The KV warehouse's parts: store keys (pinned by known answers), block records
// (every corruption is an error), and the tiers, each passing the same suite:
// memory (the reference), disk (LMDB) and Redis (a server of the test's own).
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <csignal>
#include <filesystem>
#include <future>
#include <mutex>
#include <random>

#include <gtest/gtest.h>

#include "core/clock.h"
#include "core/hash.h"
#include "store/block_record.h"
#include "store/block_store.h"
#include "store/redis_util.h"
#include "store/store_key.h"

namespace pagoda {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("pagoda_store_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  return p.string();
}

// The key function is part of the stored format: these values must never
// change without k_store_key_version changing too (old entries then become
// misses instead of being read as something else).
TEST(store_key, known_answers) {
  const kv_space space{0x0123456789abcdefull, 0xfedcba9876543210ull};
  EXPECT_EQ(tenant_hash(""), 0xe8d7466e2ca94d8eull) << std::hex << tenant_hash("");
  EXPECT_EQ(tenant_hash("alice"), 0x4941dc8d81e61772ull) << std::hex << tenant_hash("alice");
  const store_key k = make_store_key(space, "alice", 0x1122334455667788ull);
  EXPECT_EQ(k.entry, 0x325365f193b759d5ull) << std::hex << k.entry;
  EXPECT_EQ(k.tenant, tenant_hash("alice"));
  // Byte order: tenant first, big-endian, so a tenant's entries sort together.
  EXPECT_EQ(k.hex().substr(0, 16), fmt::format("{:016x}", k.tenant));
  EXPECT_EQ(store_key::from_bytes(k.bytes().data()), k);
}

TEST(store_key, everything_that_gives_bytes_meaning_changes_the_key) {
  const kv_space a{1, 2};
  const store_key base = make_store_key(a, "t", 7);
  EXPECT_NE(make_store_key({3, 2}, "t", 7), base);  // another model
  EXPECT_NE(make_store_key({1, 4}, "t", 7), base);  // another KV layout
  EXPECT_NE(make_store_key(a, "u", 7), base);       // another tenant
  EXPECT_NE(make_store_key(a, "t", 8), base);       // another prefix
  kv_layout f16 = kv_layout::uniform(2, 2, 8, 16, kv_type::f16, kv_type::f16), f16b = f16;
  EXPECT_EQ(layout_fingerprint(f16), layout_fingerprint(f16b));
  f16b.block_size = 32;
  EXPECT_NE(layout_fingerprint(f16), layout_fingerprint(f16b));
  kv_layout int8 = kv_layout::uniform(2, 2, 8, 16, kv_type::int8, kv_type::f16);
  EXPECT_NE(layout_fingerprint(f16), layout_fingerprint(int8));
  // Two KV groups with the same formats over other model layers (gemma2's
  // window and full layers) hold other bytes: their blocks must not collide.
  const kv_layout four = kv_layout::uniform(4, 2, 8, 16, kv_type::f16, kv_type::f16);
  const int even[] = {0, 2}, odd[] = {1, 3}, every[] = {0, 1, 2, 3};
  EXPECT_NE(layout_fingerprint(four.select_layers(even)), layout_fingerprint(four.select_layers(odd)));
  EXPECT_EQ(layout_fingerprint(four.select_layers(every)), layout_fingerprint(four));  // one group keeps its keys
  const int second[] = {1};
  EXPECT_EQ(four.select_layers(odd).select_layers(second).model_layers, std::vector<int>{3});
}

block_record sample_record(const std::string& tenant, block_key chain, std::size_t n_bytes, unsigned seed) {
  block_record r;
  r.key = make_store_key({11, 22}, tenant, chain);
  r.chain = chain;
  r.parent = chain ^ 0x5555;
  r.tenant = tenant;
  for (int i = 0; i < 16; ++i) r.tokens.push_back(static_cast<token_id>(seed * 100 + i));
  std::mt19937 rng(seed);
  r.bytes.resize(n_bytes);
  // Half-compressible: f16-like values with many repeated high bytes.
  for (std::size_t i = 0; i < n_bytes; ++i) r.bytes[i] = static_cast<std::byte>(i % 2 ? 0x3c : rng() & 0xff);
  return r;
}

TEST(block_record, round_trips_compressed_or_not) {
  const block_record r = sample_record("alice", 42, 4096, 1);
  for (bool compress : {true, false}) {
    const auto enc = encode_block_record(r, compress);
    if (compress) {
      EXPECT_LT(enc.size(), r.bytes.size());
    }
    auto back = decode_block_record(enc, r.key);
    ASSERT_TRUE(back.ok()) << back.error().message();
    EXPECT_EQ(back->bytes, r.bytes);
    EXPECT_EQ(back->tokens, r.tokens);
    EXPECT_EQ(back->tenant, "alice");
    EXPECT_EQ(back->chain, 42u);
    EXPECT_EQ(back->parent, r.parent);
  }
}

TEST(block_record, every_flipped_byte_and_truncation_is_an_error) {
  const block_record r = sample_record("", 9, 600, 2);
  const auto enc = encode_block_record(r);
  for (std::size_t i = 0; i < enc.size(); ++i) {
    auto bad = enc;
    bad[i] ^= std::byte{0x20};
    auto d = decode_block_record(bad, r.key);
    ASSERT_FALSE(d.ok()) << "flipped byte " << i << " went unnoticed";
    EXPECT_EQ(d.error().code(), errc::corrupt) << i;
  }
  for (std::size_t n : {std::size_t{0}, std::size_t{3}, enc.size() / 2, enc.size() - 1})
    EXPECT_FALSE(decode_block_record(std::span(enc).first(n), r.key).ok()) << n;
  // Another key's entry (a hash collision in a tier's key space) is not served.
  EXPECT_EQ(decode_block_record(enc, make_store_key({11, 22}, "", 10)).error().code(), errc::not_found);
  EXPECT_EQ(decode_block_record(enc, make_store_key({11, 22}, "mallory", 9)).error().code(), errc::not_found);
}

// Defect (found by tests/fuzz/store_fuzz.cpp): a record whose checksum holds
// but whose raw size says 4 GiB made the decoder allocate 4 GiB before zstd
// refused the payload. Under a 1 GiB address-space limit that was the end of
// the process; now it is a corrupt record.
TEST(block_record, a_huge_declared_size_is_an_error_not_an_allocation) {
  const block_record r = sample_record("", 9, 4096, 3);
  std::vector<std::byte> enc = encode_block_record(r, true);
  // raw size: after magic, version, flags, 3 u64, the tenant (u32 + 0 bytes) and 16 tokens.
  const std::size_t at = 4 + 2 + 2 + 24 + 4 + 4 + 16 * sizeof(token_id);
  std::uint16_t flags = 0;
  std::memcpy(&flags, enc.data() + 6, 2);
  ASSERT_EQ(flags & 1, 1) << "the sample must be compressed";
  const std::uint32_t huge = 0xfffffff0u;
  std::memcpy(enc.data() + at, &huge, 4);
  const std::uint64_t sum = hash_bytes(enc.data(), enc.size() - 8);
  std::memcpy(enc.data() + enc.size() - 8, &sum, 8);
  const pid_t child = ::fork();
  if (child == 0) {
    const rlimit lim{std::uint64_t{1} << 30, std::uint64_t{1} << 30};
    ::setrlimit(RLIMIT_AS, &lim);
    auto d = decode_block_record(enc, r.key);
    ::_exit(!d.ok() && d.error().code() == errc::corrupt ? 0 : 1);
  }
  int st = 0;
  ::waitpid(child, &st, 0);
  ASSERT_TRUE(WIFEXITED(st)) << "the decoder died (signal " << WTERMSIG(st) << ")";
  EXPECT_EQ(WEXITSTATUS(st), 0);
}

// --- one suite for every tier ---------------------------------------------------

enum class tier_kind { memory, disk, redis };

class tier_test : public ::testing::TestWithParam<tier_kind> {
 protected:
  void SetUp() override {
    switch (GetParam()) {
      case tier_kind::memory: store_ = make_memory_store(); break;
      case tier_kind::disk: {
        dir_ = temp_dir("tier");
        auto s = make_disk_store({dir_, 64 << 20, 0});
        ASSERT_TRUE(s.ok()) << s.error().message();
        store_ = std::move(*s);
        break;
      }
      case tier_kind::redis: {
        redis_ = std::make_unique<test::redis_server>();
        auto s = make_redis_store({"127.0.0.1", redis_->port(), 0, 500});
        ASSERT_TRUE(s.ok()) << s.error().message();
        store_ = std::move(*s);
        break;
      }
    }
  }
  void TearDown() override {
    store_.reset();
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  std::unique_ptr<block_store> store_;
  std::unique_ptr<test::redis_server> redis_;
  std::string dir_;
};

TEST_P(tier_test, put_get_count_erase) {
  std::vector<block_record> recs;
  std::vector<store_key> keys;
  for (int i = 0; i < 6; ++i) {
    recs.push_back(sample_record(i < 4 ? "a" : "b", 100 + static_cast<block_key>(i), 2048 + 64 * i, i));
    keys.push_back(recs.back().key);
  }
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(store_->put(keys[i], encode_block_record(recs[i])).ok());
  auto got = store_->get(keys[1]);
  ASSERT_TRUE(got.ok() && got->has_value());
  EXPECT_EQ(decode_block_record(**got, keys[1])->bytes, recs[1].bytes);
  EXPECT_FALSE(store_->get(keys[3])->has_value());
  EXPECT_EQ(*store_->count_present(keys), 3u);
  EXPECT_EQ(*store_->count_present(std::span(keys).subspan(1)), 2u);
  EXPECT_EQ(*store_->count_present(std::span(keys).subspan(3)), 0u);
  // A second put of the same key keeps the entry (same key, same bytes).
  ASSERT_TRUE(store_->put(keys[0], encode_block_record(recs[0])).ok());
  for (int i = 3; i < 6; ++i) ASSERT_TRUE(store_->put(keys[i], encode_block_record(recs[i])).ok());
  ASSERT_TRUE(store_->erase(keys[2]).ok());
  EXPECT_EQ(*store_->count_present(keys), 2u);
  // Erasing tenant "a" leaves exactly "b"'s entries.
  EXPECT_EQ(*store_->erase_tenant(tenant_hash("a")), 3u);
  int n = 0;
  ASSERT_TRUE(store_->for_each([&](const store_key& k, std::span<const std::byte> v) {
                      EXPECT_EQ(k.tenant, tenant_hash("b"));
                      EXPECT_TRUE(check_block_record(v, k).ok());
                      ++n;
                      return true;
                    })
                  .ok());
  EXPECT_EQ(n, 2);
  const store_tier_stats st = store_->stats();
  EXPECT_GE(st.hits, 1);
  EXPECT_GE(st.misses, 1);
  EXPECT_EQ(st.writes, 6);
}

// A batch is stored as its entries one by one would be: present keys kept,
// the others written; contains_each answers per key.
TEST_P(tier_test, a_batch_stores_what_is_missing) {
  std::vector<block_record> recs;
  std::vector<std::vector<std::byte>> enc;
  std::vector<store_key> keys;
  for (int i = 0; i < 5; ++i) {
    recs.push_back(sample_record("t", 300 + static_cast<block_key>(i), 1024 + 32 * i, 40 + i));
    enc.push_back(encode_block_record(recs.back()));
    keys.push_back(recs.back().key);
  }
  ASSERT_TRUE(store_->put(keys[1], enc[1]).ok());
  std::vector<store_entry> batch;
  for (int i = 0; i < 4; ++i) batch.push_back({keys[i], enc[i]});
  batch.push_back({keys[0], enc[0]});  // twice in one batch: stored once
  ASSERT_TRUE(store_->put_many(batch).ok());
  EXPECT_EQ(store_->stats().writes, 4);
  EXPECT_EQ(*store_->contains_each(keys), (std::vector<bool>{true, true, true, true, false}));
  EXPECT_EQ(*store_->count_present(keys), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(decode_block_record(**store_->get(keys[i]), keys[i])->bytes, recs[i].bytes);
}

INSTANTIATE_TEST_SUITE_P(tiers, tier_test, ::testing::Values(tier_kind::memory, tier_kind::disk, tier_kind::redis),
                         [](const auto& info) {
                           return info.param == tier_kind::memory ? "memory"
                                  : info.param == tier_kind::disk ? "disk"
                                                                  : "redis";
                         });

// --- the disk tier -------------------------------------------------------------

TEST(disk_store, entries_survive_a_reopen) {
  const std::string dir = temp_dir("reopen");
  const block_record r = sample_record("t", 5, 3000, 3);
  {
    auto s = *make_disk_store({dir, 16 << 20, 0});
    ASSERT_TRUE(s->put(r.key, encode_block_record(r)).ok());
  }
  auto s = *make_disk_store({dir, 16 << 20, 0});
  EXPECT_EQ(s->stats().entries, 1);
  auto got = s->get(r.key);
  ASSERT_TRUE(got.ok() && got->has_value());
  EXPECT_EQ(decode_block_record(**got, r.key)->bytes, r.bytes);
  fs::remove_all(dir);
}

// One owner at a time: a second server on the same directory is refused,
// naming the holder's PID; a tool opens beside it and reports the owner's
// size cap, not its own default.
TEST(disk_store, one_owner_at_a_time_and_tools_see_its_cap) {
  const std::string dir = temp_dir("owner");
  {
    auto owner = make_disk_store({dir, 48 << 20, 0});
    ASSERT_TRUE(owner.ok()) << owner.error().message();
    auto second = make_disk_store({dir, 16 << 20, 0});
    ASSERT_FALSE(second.ok());
    EXPECT_NE(second.error().message().find("in use by process " + std::to_string(::getpid())), std::string::npos)
        << second.error().message();
    disk_store_options tool{dir, 8 << 20, 0};
    tool.owner = false;
    tool.use_recorded_capacity = true;
    auto t = make_disk_store(tool);
    ASSERT_TRUE(t.ok()) << t.error().message();
    EXPECT_EQ((*t)->stats().capacity_bytes, 48 << 20);
  }
  // The owner gone, the lock is free.
  auto next = make_disk_store({dir, 16 << 20, 0});
  EXPECT_TRUE(next.ok()) << next.error().message();
  fs::remove_all(dir);
}

// Over its cap the tier keeps what is read often: a block read many times
// outlives blocks written after it and never read.
TEST(disk_store, the_cap_evicts_cold_entries_before_hot_ones) {
  const std::string dir = temp_dir("cap");
  auto s = *make_disk_store({dir, 1 << 20, 0});
  std::vector<block_record> recs;
  for (int i = 0; i < 40; ++i) recs.push_back(sample_record("", 1000 + static_cast<block_key>(i), 64 << 10, 100 + i));
  ASSERT_TRUE(s->put(recs[0].key, encode_block_record(recs[0], false)).ok());
  for (int k = 0; k < 10; ++k) ASSERT_TRUE(s->get(recs[0].key)->has_value());
  for (int i = 1; i < 40; ++i) ASSERT_TRUE(s->put(recs[i].key, encode_block_record(recs[i], false)).ok());
  const store_tier_stats st = s->stats();
  EXPECT_LE(st.bytes, 1 << 20);
  EXPECT_GT(st.evictions, 0);
  EXPECT_TRUE(s->get(recs[0].key)->has_value()) << "the hot entry was evicted";
  EXPECT_FALSE(s->get(recs[1].key)->has_value()) << "a cold, older entry should have gone first";
  fs::remove_all(dir);
}

TEST(disk_store, entries_unused_past_the_ttl_are_misses) {
  const std::string dir = temp_dir("ttl");
  const block_record r = sample_record("", 77, 512, 4);
  manual_clock clock;
  {
    auto s = *make_disk_store({dir, 16 << 20, 0}, clock);
    ASSERT_TRUE(s->put(r.key, encode_block_record(r)).ok());
  }
  auto s = *make_disk_store({dir, 16 << 20, 1}, clock);
  clock.advance_seconds(0.9);
  ASSERT_TRUE(s->get(r.key)->has_value());  // a use: its age starts again
  clock.advance_seconds(0.9);
  ASSERT_TRUE(s->get(r.key)->has_value());
  clock.advance_seconds(1.1);
  EXPECT_FALSE(s->get(r.key)->has_value());
  EXPECT_EQ(*s->count_present(std::vector<store_key>{r.key}), 0u);
  EXPECT_EQ(*s->contains_each(std::vector<store_key>{r.key}), std::vector<bool>{false});
  fs::remove_all(dir);
}

// Defect 5: an expired entry was never stored again (put saw the stale key in
// the index and reported success without writing): the block stayed a miss
// for good. Now the put writes it afresh, and so does a batch.
TEST(disk_store, an_expired_entry_is_stored_again) {
  const std::string dir = temp_dir("ttl_again");
  const block_record r = sample_record("", 78, 512, 5), q = sample_record("", 79, 512, 6);
  manual_clock clock;
  auto s = *make_disk_store({dir, 16 << 20, 1}, clock);
  ASSERT_TRUE(s->put(r.key, encode_block_record(r)).ok());
  ASSERT_TRUE(s->put(q.key, encode_block_record(q)).ok());
  clock.advance_seconds(1.5);
  ASSERT_FALSE(s->get(r.key)->has_value());
  ASSERT_TRUE(s->put(r.key, encode_block_record(r)).ok());
  const auto eq = encode_block_record(q);
  const store_entry batch[] = {{q.key, eq}};
  ASSERT_TRUE(s->put_many(batch).ok());
  for (const block_record* b : {&r, &q}) {
    auto got = s->get(b->key);
    ASSERT_TRUE(got.ok() && got->has_value()) << "an expired entry could not be stored again";
    EXPECT_EQ(decode_block_record(**got, b->key)->bytes, b->bytes);
  }
  EXPECT_EQ(s->stats().entries, 2);
  // Expired entries are swept out by a later write (and counted as evictions).
  clock.advance_seconds(120);
  const block_record fresh = sample_record("", 80, 512, 7);
  ASSERT_TRUE(s->put(fresh.key, encode_block_record(fresh)).ok());
  EXPECT_EQ(s->stats().entries, 1);
  EXPECT_EQ(s->stats().evictions, 2);
  fs::remove_all(dir);
}

// Defect 4: the disk tier held its one lock across a synced LMDB write, and
// the engine thread's admission lookup (count_present) waited for it. Now a
// write held open inside its transaction (as a slow sync would) leaves every
// lookup answering.
TEST(disk_store, lookups_never_wait_for_a_write_in_progress) {
  const std::string dir = temp_dir("no_wait");
  std::mutex mu;
  std::condition_variable cv;
  bool in_commit = false, release = false;
  disk_store_options o{dir, 16 << 20, 0};
  o.before_commit = [&] {
    std::unique_lock lock(mu);
    in_commit = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
  };
  const block_record old = sample_record("", 90, 512, 8), r = sample_record("", 91, 512, 9);
  auto s = *make_disk_store({dir, 16 << 20, 0});
  ASSERT_TRUE(s->put(old.key, encode_block_record(old)).ok());
  s.reset();
  s = *make_disk_store(o);
  auto writing = std::async(std::launch::async, [&] { return s->put(r.key, encode_block_record(r)); });
  {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return in_commit; });
  }
  auto lookups = std::async(std::launch::async, [&] {
    const std::vector<store_key> keys{old.key, r.key};
    const std::size_t n = *s->count_present(keys);
    const bool got = s->get(old.key)->has_value();
    return n == 1 && got && s->stats().entries == 1;
  });
  const bool answered = lookups.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  {
    std::lock_guard lock(mu);
    release = true;
    cv.notify_all();
  }
  EXPECT_TRUE(answered) << "a lookup waited for a write transaction";
  EXPECT_TRUE(lookups.get());
  EXPECT_TRUE(writing.get().ok());
  EXPECT_EQ(*s->count_present(std::vector<store_key>{old.key, r.key}), 2u);
  s.reset();
  fs::remove_all(dir);
}

// kill -9 in the middle of heavy writing: after reopening, every entry there
// is whole (decodes and verifies); nothing torn is ever found.
TEST(disk_store, a_kill_during_writes_leaves_no_torn_entry) {
  const std::string dir = temp_dir("kill");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(ready[0]);
    auto s = make_disk_store({dir, 256 << 20, 0});
    if (!s.ok()) ::_exit(3);
    for (int i = 0;; ++i) {
      const block_record r = sample_record("", static_cast<block_key>(i), 32 << 10, static_cast<unsigned>(i));
      (void)(*s)->put(r.key, encode_block_record(r));
      if (i == 64) (void)!::write(ready[1], "k", 1);  // well into writing: kill it at any moment from here
    }
  }
  ::close(ready[1]);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1) << "the writer died before writing";
  ::close(ready[0]);
  ::kill(child, SIGKILL);
  int st = 0;
  ::waitpid(child, &st, 0);
  auto s = make_disk_store({dir, 256 << 20, 0});
  ASSERT_TRUE(s.ok()) << s.error().message();
  int n = 0, bad = 0;
  ASSERT_TRUE((*s)->for_each([&](const store_key& k, std::span<const std::byte> v) {
                    ++n;
                    if (!check_block_record(v, k).ok()) ++bad;
                    return true;
                  })
                  .ok());
  EXPECT_GT(n, 0) << "the child wrote nothing before it was killed";
  EXPECT_EQ(bad, 0);
  EXPECT_EQ((*s)->stats().entries, n);
  fs::remove_all(dir);
}

// A full disk (here: a file size limit) makes puts fail with an error the
// caller can count; reads of what is there go on.
TEST(disk_store, a_full_disk_fails_writes_and_keeps_reads) {
  const std::string dir = temp_dir("full");
  const block_record first = sample_record("", 1, 4096, 5);
  {
    auto s = *make_disk_store({dir, 64 << 20, 0});
    ASSERT_TRUE(s->put(first.key, encode_block_record(first)).ok());
  }
  const pid_t child = ::fork();
  if (child == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    const rlimit lim{fs::file_size(fs::path(dir) / "data.mdb") + (64 << 10),
                     fs::file_size(fs::path(dir) / "data.mdb") + (64 << 10)};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    auto s = make_disk_store({dir, 64 << 20, 0});
    if (!s.ok()) ::_exit(2);
    int failures = 0;
    for (int i = 0; i < 64; ++i) {
      const block_record r = sample_record("", 100 + static_cast<block_key>(i), 16 << 10, static_cast<unsigned>(i));
      if (!(*s)->put(r.key, encode_block_record(r, false)).ok()) ++failures;
    }
    auto got = (*s)->get(first.key);
    const bool read_ok = got.ok() && got->has_value();
    ::_exit(failures > 0 && read_ok && (*s)->stats().errors == failures ? 0 : 1);
  }
  int st = 0;
  ::waitpid(child, &st, 0);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0) << "writes past the limit must fail, be counted, and leave reads working";
  fs::remove_all(dir);
}

// --- the Redis tier ---------------------------------------------------------------

TEST(redis_store, a_server_going_down_fails_fast_and_reconnects) {
  test::redis_server server;
  manual_clock clock;
  auto s = *make_redis_store({"127.0.0.1", server.port(), 0, 300}, true, clock);
  const block_record r = sample_record("", 3, 1024, 6);
  ASSERT_TRUE(s->put(r.key, encode_block_record(r)).ok());
  server.stop(/*kill=*/true);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(s->get(r.key).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3)) << "a down server must cost little per call";
  EXPECT_GE(s->stats().errors, 20);
  server.start();  // same port, empty (no persistence)
  EXPECT_FALSE(s->get(r.key).ok()) << "retried within a second of the last attempt";
  clock.advance_seconds(1.1);
  auto got = s->get(r.key);
  ASSERT_TRUE(got.ok()) << got.error().message();
  EXPECT_FALSE(got->has_value());
  ASSERT_TRUE(s->put(r.key, encode_block_record(r)).ok());
  EXPECT_TRUE(s->get(r.key)->has_value());
}

TEST(redis_store, urls) {
  auto o = parse_redis_url("redis://10.0.0.2:7000");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->host, "10.0.0.2");
  EXPECT_EQ(o->port, 7000);
  EXPECT_EQ(parse_redis_url("redis://localhost")->port, 6379);
  EXPECT_FALSE(parse_redis_url("http://x:1").ok());
  EXPECT_FALSE(parse_redis_url("redis://x:0").ok());
  EXPECT_FALSE(parse_redis_url("redis://x:12ab").ok());
  EXPECT_FALSE(parse_redis_url("redis://:80").ok());
}

}  // namespace
}  // namespace pagoda
