// The KV pool's tiles in transparent huge pages (kv_pool_memory::huge_pages,
// --kv-huge-pages): the same pool, 2 MiB aligned, resident from creation, and
// in huge pages where the kernel gives them.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/anon_memory.h"
#include "kv/kv_storage.h"

namespace pagoda {
namespace {

constexpr std::size_t k_2mib = std::size_t{2} << 20;

kv_pool_memory huge() { return {.huge_pages = true}; }

// Pages of [p, p + bytes) resident now (mincore), out of how many.
std::pair<std::size_t, std::size_t> resident_pages(const std::byte* p, std::size_t bytes) {
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((bytes + page - 1) / page);
  EXPECT_EQ(mincore(const_cast<std::byte*>(p), bytes, in.data()), 0);
  std::size_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return {n, in.size()};
}

// Sum of AnonHugePages (bytes) over the /proc/self/smaps entries that overlap [lo, hi).
std::size_t smaps_anon_huge_bytes(std::uintptr_t lo, std::uintptr_t hi) {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  bool overlaps = false;
  std::size_t kb = 0;
  while (std::getline(in, line)) {
    unsigned long long a = 0, b = 0, n = 0;
    char perms[8];
    if (std::sscanf(line.c_str(), "%llx-%llx %7s", &a, &b, perms) == 3) overlaps = a < hi && b > lo;
    else if (overlaps && std::sscanf(line.c_str(), "AnonHugePages: %llu kB", &n) == 1) kb += n;
  }
  return kb * 1024;
}

// Writes n_tokens of random K/V into every layer of s through table (the same
// values for the same seed), then copies the first block into `spare`.
void fill(kv_storage& s, const std::vector<block_id>& table, int n_tokens, block_id spare) {
  const kv_layout& l = s.layout();
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<std::size_t>(n_tokens) * l.n_kv_heads * l.head_dim), v(k.size());
  for (int layer = 0; layer < l.n_layers; ++layer) {
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    s.write(layer, table, 0, n_tokens, k.data(), v.data());
  }
  s.copy_block(table[0], spare, l.block_size);
}

// Every block's bytes (read_block), in block id order.
std::vector<std::vector<std::byte>> all_blocks(const kv_storage& s) {
  std::vector<std::vector<std::byte>> out;
  for (std::int64_t b = 0; b < s.n_blocks(); ++b) {
    out.emplace_back(s.block_layout(block_id(static_cast<std::int32_t>(b))).tile_bytes_per_block());
    s.read_block(block_id(static_cast<std::int32_t>(b)), out.back());
  }
  return out;
}

// Per-token formats, a sealed one (KIVI int4: keys staged in f16 until a
// block is full), and two block classes: the same writes give the same bytes
// in every block, with huge pages or without (the untouched ones zero).
TEST(kv_huge_pages, a_pool_reads_back_as_in_base_pages) {
  auto f16 = kv_layout::uniform(3, 2, 32, 16, kv_type::f16, kv_type::f16);
  auto kivi = kv_layout::uniform(3, 2, 32, 16, kv_type::int4, kv_type::int4);
  auto int8 = kv_layout::uniform(3, 2, 32, 16, kv_type::int8, kv_type::int8);
  const kv_class_spec extra[] = {{int8, 40}};
  struct pool_case {
    const char* name;
    const kv_layout* layout;
    std::span<const kv_class_spec> extra;
  };
  for (const pool_case& c : {pool_case{"f16", &f16, {}}, pool_case{"int4 KIVI", &kivi, {}},
                             pool_case{"f16 + an int8 class", &f16, extra}}) {
    SCOPED_TRACE(c.name);
    auto base = kv_storage::create(*c.layout, 300, 2, c.extra);
    auto hp = kv_storage::create(*c.layout, 300, 2, c.extra, huge());
    ASSERT_TRUE(base.ok()) << base.error().message();
    ASSERT_TRUE(hp.ok()) << hp.error().message();
    EXPECT_EQ((*hp)->total_bytes(), (*base)->total_bytes());
    // A table scattered over the pool (every class), 12 whole blocks.
    std::vector<block_id> table;
    for (int i = 0; i < 12; ++i) table.push_back(block_id((i * 97 + 5) % static_cast<int>((*base)->n_blocks())));
    const block_id spare(299);
    fill(**base, table, 12 * 16, spare);
    fill(**hp, table, 12 * 16, spare);
    const auto want = all_blocks(**base);
    const auto got = all_blocks(**hp);
    ASSERT_EQ(got.size(), want.size());
    std::size_t nonzero = 0;
    for (std::size_t b = 0; b < want.size(); ++b) {
      EXPECT_EQ(got[b], want[b]) << "block " << b;
      for (std::byte x : want[b]) nonzero += x != std::byte{0};
    }
    EXPECT_GT(nonzero, 0u);  // the writes landed
  }
}

// Each arena's tiles: aligned to and a multiple of 2 MiB, every page resident
// when create() returns. Without the option nothing is resident until written.
TEST(kv_huge_pages, tiles_are_aligned_and_resident_from_creation) {
  auto layout = kv_layout::uniform(2, 4, 64, 16, kv_type::f16, kv_type::f16);  // 32 KiB a block
  auto hp = kv_storage::create(layout, 100, 1, {}, huge());  // 3.1 MiB of tiles
  ASSERT_TRUE(hp.ok()) << hp.error().message();
  const anon_memory& m = (*hp)->arena(0).tile_memory();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(m.data()) % k_2mib, 0u);
  EXPECT_EQ(m.size_bytes() % k_2mib, 0u);
  EXPECT_GE(m.size_bytes(), 100 * layout.bytes_per_block());
  EXPECT_EQ(huge_page_bytes() % k_2mib, 0u);
  EXPECT_TRUE(m.huge().asked);
  EXPECT_TRUE(m.huge().resident) << m.huge().problem;
  const auto [in, of] = resident_pages(m.data(), m.size_bytes());
  EXPECT_EQ(in, of);

  auto base = kv_storage::create(layout, 100, 1);
  ASSERT_TRUE(base.ok());
  const anon_memory& b = (*base)->arena(0).tile_memory();
  EXPECT_FALSE(b.huge().asked);
  EXPECT_EQ(b.size_bytes(), 100 * layout.bytes_per_block());
  EXPECT_EQ(resident_pages(b.data(), b.size_bytes()).first, 0u);
}

// Where the kernel has transparent huge pages (enabled: always or madvise),
// the tiles' range is backed by them (AnonHugePages in /proc/self/smaps), and
// the arena's own count agrees that some are.
TEST(kv_huge_pages, the_range_is_in_huge_pages_where_the_kernel_has_them) {
  std::ifstream enabled("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes;
  if (!std::getline(enabled, modes)) GTEST_SKIP() << "no /sys/kernel/mm/transparent_hugepage/enabled: no THP here";
  if (modes.find("[never]") != std::string::npos) GTEST_SKIP() << "transparent huge pages are off here: " << modes;
  auto layout = kv_layout::uniform(1, 8, 128, 16, kv_type::f16, kv_type::f16);  // 64 KiB a block
  auto hp = kv_storage::create(layout, 256, 1, {}, huge());             // 16 MiB
  ASSERT_TRUE(hp.ok()) << hp.error().message();
  const anon_memory& m = (*hp)->arena(0).tile_memory();
  const auto lo = reinterpret_cast<std::uintptr_t>(m.data());
  EXPECT_GT(smaps_anon_huge_bytes(lo, lo + m.size_bytes()), 0u) << modes;
  ASSERT_TRUE(m.huge().huge_bytes.has_value());
  EXPECT_GT(*m.huge().huge_bytes, 0u) << m.huge().problem;
  EXPECT_LE(*m.huge().huge_bytes, m.size_bytes());
}

}  // namespace
}  // namespace pagoda
