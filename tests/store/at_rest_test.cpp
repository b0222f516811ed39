// Tenant data at rest in the disk tier: the store's files and the folders it
// creates are this user's only.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

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

}  // namespace
}  // namespace pagoda
