// A damaged disk store never takes the process down: damaged pages and a
// truncated file are found before LMDB maps them and the store is quarantined
// (moved aside, an empty one started, counted); a file truncated while open
// takes the store out of use instead of raising a bus error. Every case that
// could crash runs in a child process first, so that a crash is a failure of
// this test and not the end of the suite.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include <gtest/gtest.h>

#include "store/block_record.h"
#include "store/block_store.h"
#include "store/lmdb_check.h"
#include "store/store_key.h"

namespace pagoda {
namespace {

namespace fs = std::filesystem;

std::string fresh_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("pagoda_damage_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  return p.string();
}

block_record record(const std::string& tenant, block_key chain, std::size_t n_bytes) {
  block_record r;
  r.key = make_store_key({5, 6}, tenant, chain);
  r.chain = chain;
  r.parent = chain + 1;
  r.tenant = tenant;
  for (int i = 0; i < 16; ++i) r.tokens.push_back(static_cast<token_id>(chain * 16 + static_cast<block_key>(i)));
  std::mt19937 rng(static_cast<unsigned>(chain));
  r.bytes.resize(n_bytes);
  for (auto& b : r.bytes) b = static_cast<std::byte>(rng());
  return r;
}

// A store of inline (small) and overflow (big) values over several B-tree
// levels, with erases so that its free list is not empty. Returns its keys.
std::vector<store_key> fill(const std::string& dir, int n = 160) {
  auto s = make_disk_store({dir, 64 << 20, 0});
  EXPECT_TRUE(s.ok()) << s.error().message();
  std::vector<store_key> keys;
  for (int i = 0; i < n; ++i) {
    const block_record r = record(i % 3 ? "alice" : "bob", static_cast<block_key>(i), i % 2 ? 300 : 9000);
    EXPECT_TRUE((*s)->put(r.key, encode_block_record(r, false)).ok());
    keys.push_back(r.key);
  }
  for (int i = 0; i < n; i += 7) EXPECT_TRUE((*s)->erase(keys[static_cast<std::size_t>(i)]).ok());
  return keys;
}

std::vector<char> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Opens the store in a child process and uses it the way a server does (every
// lookup, a batch of writes, an erase, a walk); the child's exit status says
// whether it got through: 0 when it did, 2 when the open failed, a signal
// when it crashed.
int use_in_child(const std::string& dir, const std::vector<store_key>& keys) {
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(2);  // the quarantine's log line is expected here
    auto s = make_disk_store({dir, 64 << 20, 0});
    if (!s.ok()) ::_exit(2);
    for (const store_key& k : keys) {
      auto v = (*s)->get(k);
      if (v.ok() && v->has_value()) (void)decode_block_record(**v, k);
    }
    for (int i = 0; i < 8; ++i) {
      const block_record r = record("carol", 10'000 + static_cast<block_key>(i), i % 2 ? 200 : 7000);
      (void)(*s)->put(r.key, encode_block_record(r, false));
    }
    (void)(*s)->erase(keys.front());
    (void)(*s)->for_each([](const store_key&, std::span<const std::byte>) { return true; });
    ::_exit(0);
  }
  int st = 0;
  ::waitpid(child, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

int n_quarantined_files(const std::string& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.path().filename().string().rfind("data.mdb.damaged-", 0) == 0;
  return n;
}

TEST(lmdb_check, a_healthy_store_passes_after_writes_erases_and_evictions) {
  const std::string dir = fresh_dir("healthy");
  const std::vector<store_key> keys = fill(dir);
  {
    // Evictions under a small cap, across a reopen.
    auto s = *make_disk_store({dir, 1 << 20, 0});
    for (int i = 0; i < 200; ++i) {
      const block_record r = record("dave", 50'000 + static_cast<block_key>(i), 6000);
      ASSERT_TRUE(s->put(r.key, encode_block_record(r, false)).ok());
    }
  }
  std::int64_t n_blocks = 0;
  auto rep = check_lmdb_file(dir + "/data.mdb", [&](std::string_view db, std::span<const std::byte> k,
                                                    std::span<const std::byte> v) {
    if (db != "blocks") return;
    ++n_blocks;
    EXPECT_TRUE(check_block_record(v, store_key::from_bytes(k.data())).ok());
  });
  ASSERT_TRUE(rep.ok());
  EXPECT_TRUE(rep->ok()) << rep->summary();
  EXPECT_TRUE(rep->exists);
  EXPECT_GT(n_blocks, 0);
  auto s = *make_disk_store({dir, 1 << 20, 0});
  EXPECT_EQ(s->stats().entries, n_blocks);
  EXPECT_EQ(s->stats().quarantined, 0);
  fs::remove_all(dir);
}

// Defect: a truncated data file gave a bus error at open (LMDB maps the file
// and reads the index's pages past its end).
TEST(disk_store, a_truncated_file_is_quarantined_not_a_crash) {
  const std::string dir = fresh_dir("truncated");
  const std::vector<store_key> keys = fill(dir);
  const fs::path data = fs::path(dir) / "data.mdb";
  for (double keep : {0.5, 0.9}) {
    fs::resize_file(data, static_cast<std::uintmax_t>(static_cast<double>(fs::file_size(data)) * keep) / 4096 * 4096);
    EXPECT_EQ(use_in_child(dir, keys), 0) << "keeping " << keep << " of the file";
    fill(dir);
  }
  fs::resize_file(data, fs::file_size(data) / 2);
  auto s = make_disk_store({dir, 64 << 20, 0});
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_EQ((*s)->stats().quarantined, 1);
  EXPECT_EQ((*s)->stats().errors, 1);
  EXPECT_EQ((*s)->stats().entries, 0);
  EXPECT_EQ(n_quarantined_files(dir), 3);  // one per damaged open
  const block_record r = record("erin", 1, 5000);
  ASSERT_TRUE((*s)->put(r.key, encode_block_record(r)).ok());
  auto back = (*s)->get(r.key);
  ASSERT_TRUE(back.ok() && back->has_value());
  fs::remove_all(dir);
}

// Defect: a damaged B-tree page gave a segfault at open (or a store that
// failed to open: a server that did not start). Here every page of the file
// gets garbage at its header, its first node offsets and its end in turn: the
// process always opens the store and survives using it; damaged structure is
// quarantined, damaged record bytes are records that fail verification.
TEST(disk_store, damaged_pages_never_crash_the_process) {
  const std::string dir = fresh_dir("pages");
  const std::vector<store_key> keys = fill(dir, 120);
  const fs::path data = fs::path(dir) / "data.mdb";
  const std::vector<char> good = read_file(data);
  const std::size_t page = 4096, n_pages = good.size() / page;
  ASSERT_GT(n_pages, 8u);
  int quarantined = 0, crashed = 0;
  for (std::size_t p = 0; p < n_pages; ++p) {
    for (std::size_t at : {std::size_t{0}, std::size_t{8}, page - 48}) {
      std::vector<char> bad = good;
      for (std::size_t i = 0; i < 40; ++i) bad[p * page + at + i] = static_cast<char>(0xa5 ^ (i * 37));
      write_file(data, bad);
      fs::remove(fs::path(dir) / "lock.mdb");
      const int rc = use_in_child(dir, keys);
      if (rc != 0) {
        ++crashed;
        ADD_FAILURE() << "page " << p << " offset " << at << ": the child ended with " << rc;
      }
      for (const auto& e : fs::directory_iterator(dir))
        if (e.path().filename().string().rfind("data.mdb.damaged-", 0) == 0) {
          ++quarantined;
          fs::remove(e.path());
        }
    }
  }
  EXPECT_EQ(crashed, 0);
  EXPECT_GT(quarantined, 0) << "tree damage must be found, not passed to LMDB";
  fs::remove_all(dir);
}

// One damaged leaf page (its node offsets overwritten): quarantined at open,
// counted, and the server's store starts empty and works.
TEST(disk_store, a_damaged_tree_page_is_quarantined_and_counted) {
  const std::string dir = fresh_dir("leaf");
  fill(dir);
  const fs::path data = fs::path(dir) / "data.mdb";
  std::vector<char> bytes = read_file(data);
  // The main database's root (a leaf naming "blocks" and "meta"), from the
  // newer meta page (LMDB 0.9: txn id at byte 144, main root at 128).
  std::uint64_t txn[2], root[2];
  for (int m = 0; m < 2; ++m) {
    std::memcpy(&txn[m], bytes.data() + m * 4096 + 144, 8);
    std::memcpy(&root[m], bytes.data() + m * 4096 + 128, 8);
  }
  const std::uint64_t leaf = txn[1] > txn[0] ? root[1] : root[0];
  ASSERT_LT(leaf, bytes.size() / 4096);
  std::memset(bytes.data() + leaf * 4096 + 16, 0xff, 4);  // its node offsets
  write_file(data, bytes);
  auto rep = check_lmdb_file(data.string());
  ASSERT_TRUE(rep.ok());
  EXPECT_FALSE(rep->ok());
  auto s = make_disk_store({dir, 64 << 20, 0});
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_EQ((*s)->stats().quarantined, 1);
  EXPECT_EQ((*s)->stats().entries, 0);
  EXPECT_EQ(n_quarantined_files(dir), 1);
  // A tool (no quarantine) gets a clear error instead, and moves nothing.
  const std::string dir2 = fresh_dir("leaf2");
  fs::create_directories(dir2);
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("data.mdb.damaged-", 0) == 0) fs::copy_file(e.path(), fs::path(dir2) / "data.mdb");
  disk_store_options tool{dir2, 64 << 20, 0};
  tool.quarantine_damaged = false;
  auto t = make_disk_store(tool);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.error().code(), errc::corrupt);
  EXPECT_NE(t.error().message().find("damaged"), std::string::npos) << t.error().message();
  EXPECT_EQ(n_quarantined_files(dir2), 0);
  fs::remove_all(dir);
  fs::remove_all(dir2);
}

// Defect: a file truncated while the store is open gave a bus error at the
// next read. Now the store notices the shrink and fails every call instead.
TEST(disk_store, a_file_truncated_while_open_fails_calls_instead_of_a_bus_error) {
  const std::string dir = fresh_dir("live");
  const std::vector<store_key> keys = fill(dir);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(2);
    auto s = make_disk_store({dir, 64 << 20, 0});
    if (!s.ok()) ::_exit(2);
    fs::resize_file(fs::path(dir) / "data.mdb", 3 * 4096);
    int failed = 0, live = 0;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (i % 7 == 0) continue;  // erased by fill(): a miss from the index, without a read
      ++live;
      failed += !(*s)->get(keys[i]).ok();
    }
    const block_record r = record("carol", 77, 7000);
    failed += !(*s)->put(r.key, encode_block_record(r)).ok();
    failed += !(*s)->for_each([](const store_key&, std::span<const std::byte>) { return true; }).ok();
    ::_exit(failed == live + 2 && (*s)->stats().errors == failed ? 0 : 1);
  }
  int st = 0;
  ::waitpid(child, &st, 0);
  ASSERT_TRUE(WIFEXITED(st)) << "killed by signal " << WTERMSIG(st);
  EXPECT_EQ(WEXITSTATUS(st), 0) << "every call on the truncated store must fail and be counted";
  // The next open quarantines it.
  auto s = make_disk_store({dir, 64 << 20, 0});
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_EQ((*s)->stats().quarantined, 1);
  fs::remove_all(dir);
}

TEST(lmdb_check, garbage_and_short_files_are_damage_not_errors) {
  const std::string dir = fresh_dir("garbage");
  fs::create_directories(dir);
  const fs::path f = fs::path(dir) / "data.mdb";
  for (std::size_t n : {std::size_t{1}, std::size_t{100}, std::size_t{4096}, std::size_t{3 * 4096}}) {
    write_file(f, std::vector<char>(n, '\x5a'));
    auto rep = check_lmdb_file(f.string());
    ASSERT_TRUE(rep.ok());
    EXPECT_TRUE(rep->exists);
    EXPECT_FALSE(rep->ok()) << n;
  }
  fs::remove(f);
  auto rep = check_lmdb_file(f.string());
  ASSERT_TRUE(rep.ok());
  EXPECT_FALSE(rep->exists);
  EXPECT_TRUE(rep->ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pagoda
