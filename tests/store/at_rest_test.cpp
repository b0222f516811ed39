// Tenant data at rest in the disk tier: the store's files and the folders it
// creates are this user's only, and an erased tenant's token ids are gone
// from the file.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "store/block_record.h"
#include "store/block_store.h"
#include "store/store_key.h"

namespace pagoda {
namespace {

namespace fs = std::filesystem;

unsigned mode_of(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return st.st_mode & 07777;
}

// Defect: data.mdb was 0644 (another local user read every tenant's token ids)
// and new folders 0755.
TEST(disk_store_at_rest, files_are_0600_and_new_folders_0700) {
  const mode_t old_umask = ::umask(022);  // the usual umask: it must not decide the modes
  const fs::path root = fs::temp_directory_path() / ("pagoda_modes_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path dir = root / "cache" / "kv";
  {
    auto s = make_disk_store({dir.string(), 16 << 20, 0});
    ASSERT_TRUE(s.ok()) << s.error().message();
    block_record r;
    r.key = make_store_key({1, 2}, "alice", 7);
    r.chain = 7;
    r.tenant = "alice";
    r.tokens = {1, 2, 3};
    r.bytes.assign(1000, std::byte{3});
    ASSERT_TRUE((*s)->put(r.key, encode_block_record(r)).ok());
  }
  EXPECT_EQ(mode_of(root / "cache"), 0700u);
  EXPECT_EQ(mode_of(dir), 0700u);
  EXPECT_EQ(mode_of(dir / "data.mdb"), 0600u);
  EXPECT_EQ(mode_of(dir / "lock.mdb"), 0600u);
  // A store an older build left world-readable is tightened at open.
  fs::permissions(dir / "data.mdb", fs::perms(0644));
  { ASSERT_TRUE(make_disk_store({dir.string(), 16 << 20, 0}).ok()); }
  EXPECT_EQ(mode_of(dir / "data.mdb"), 0600u);
  // A quarantined file stays private too.
  fs::resize_file(dir / "data.mdb", 4096 + 100);
  { ASSERT_TRUE(make_disk_store({dir.string(), 16 << 20, 0}).ok()); }
  int n_damaged = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().rfind("data.mdb.damaged-", 0) != 0) continue;
    ++n_damaged;
    EXPECT_EQ(mode_of(e.path()), 0600u);
  }
  EXPECT_EQ(n_damaged, 1);
  ::umask(old_umask);
  fs::remove_all(root);
}

// A tenant's block with token ids and payload bytes no other block has.
block_record tenant_block(const std::string& tenant, int i, std::uint8_t marker) {
  block_record r;
  r.chain = static_cast<block_key>(marker) << 32 | static_cast<block_key>(i);
  r.key = make_store_key({1, 2}, tenant, r.chain);
  r.tenant = tenant;
  for (int t = 0; t < 16; ++t) r.tokens.push_back(static_cast<token_id>(marker << 24 | i << 8 | t));
  r.bytes.assign(i % 2 ? 700 : 12000, std::byte{marker});
  return r;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// How many of the blocks' token-id sequences appear in the bytes.
int n_found(const std::string& bytes, const std::vector<block_record>& blocks) {
  int n = 0;
  for (const block_record& r : blocks) {
    const std::string_view ids(reinterpret_cast<const char*>(r.tokens.data()), r.tokens.size() * sizeof(token_id));
    n += bytes.find(ids) != std::string::npos;
  }
  return n;
}

// Defect: after DELETE /v1/kv?tenant=alice, 19 of her 20 blocks were still in
// the file (LMDB frees pages without clearing them). Now the erase rewrites
// the file with the live entries only.
TEST(disk_store_at_rest, an_erased_tenant_leaves_no_token_ids_in_the_file) {
  const fs::path dir = fs::temp_directory_path() / ("pagoda_erase_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::vector<block_record> alice, bob;
  for (int i = 0; i < 40; ++i) {
    alice.push_back(tenant_block("alice", i, 0x41));
    bob.push_back(tenant_block("bob", i, 0x42));
  }
  {
    auto s = *make_disk_store({dir.string(), 64 << 20, 0});
    // Interleaved, in several transactions, and some read (hit counts pending).
    for (int i = 0; i < 40; i += 4) {
      std::vector<std::vector<std::byte>> enc;
      std::vector<store_entry> batch;
      for (int j = i; j < i + 4; ++j)
        for (const block_record* r : {&alice[static_cast<std::size_t>(j)], &bob[static_cast<std::size_t>(j)]})
          enc.push_back(encode_block_record(*r, /*compress=*/j % 3 == 0));
      for (std::size_t j = 0; j < enc.size(); ++j)
        batch.push_back({(j % 2 ? bob : alice)[static_cast<std::size_t>(i) + j / 2].key, enc[j]});
      ASSERT_TRUE(s->put_many(batch).ok());
      ASSERT_TRUE(s->get(alice[static_cast<std::size_t>(i)].key).ok());
    }
    ASSERT_EQ(n_found(file_bytes(dir / "data.mdb"), alice), 40);
    auto n = s->erase_tenant(tenant_hash("alice"));
    ASSERT_TRUE(n.ok()) << n.error().message();
    EXPECT_EQ(*n, 40u);
    EXPECT_EQ(n_found(file_bytes(dir / "data.mdb"), alice), 0) << "an erased tenant's token ids are still in the file";
    EXPECT_EQ(s->stats().compactions, 1);
    // The other tenant's blocks load, before and after a reopen.
    for (const block_record& r : bob) {
      auto v = s->get(r.key);
      ASSERT_TRUE(v.ok() && v->has_value());
      EXPECT_TRUE(decode_block_record(**v, r.key).ok());
    }
    EXPECT_EQ(s->stats().entries, 40);
    const block_record more = tenant_block("carol", 1, 0x43);
    ASSERT_TRUE(s->put(more.key, encode_block_record(more)).ok());
  }
  auto s = *make_disk_store({dir.string(), 64 << 20, 0});
  EXPECT_EQ(s->stats().entries, 41);
  EXPECT_EQ(s->stats().quarantined, 0);
  for (const block_record& r : bob) {
    auto v = s->get(r.key);
    ASSERT_TRUE(v.ok() && v->has_value());
    EXPECT_TRUE(decode_block_record(**v, r.key).ok());
  }
  EXPECT_EQ(n_found(file_bytes(dir / "data.mdb"), alice), 0);
  EXPECT_EQ(n_found(file_bytes(dir / "data.mdb"), bob), 40);
  EXPECT_FALSE(fs::exists(dir / "compact.tmp"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pagoda
