// Writes the store fuzz seeds: encoded block records (tests/fuzz/corpus/store_record:
// raw and zstd payloads, a tenant and the global one) and the smallest disk
// store holding one record (tests/fuzz/corpus/lmdb/one_entry.mdb). Regenerate with
//   build/release/tests/fuzz/make_store_seeds tests/fuzz/corpus
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "store/block_record.h"
#include "store/block_store.h"

using namespace pagoda;

namespace {

block_record sample(const std::string& tenant, block_key chain, std::size_t n_bytes) {
  block_record r;
  r.key = make_store_key({7, 8}, tenant, chain);
  r.chain = chain;
  r.parent = chain + 1;
  r.tenant = tenant;
  r.tokens = {1, 2, 3, 4};
  r.bytes.resize(n_bytes);
  for (std::size_t i = 0; i < n_bytes; ++i) r.bytes[i] = static_cast<std::byte>(i % 7 ? 0x3c : i);
  return r;
}

bool save(const std::filesystem::path& p, std::span<const std::byte> bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return static_cast<bool>(out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_store_seeds CORPUS_DIR\n");
    return 2;
  }
  const std::filesystem::path root = argv[1];
  std::filesystem::create_directories(root / "store_record");
  std::filesystem::create_directories(root / "lmdb");
  bool ok = save(root / "store_record" / "raw.pgkb", encode_block_record(sample("alice", 5, 64), false)) &&
            save(root / "store_record" / "zstd.pgkb", encode_block_record(sample("", 6, 256), true));
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "pagoda_store_seed";
  std::filesystem::remove_all(dir);
  {
    auto s = make_disk_store({dir.string(), 16 << 20, 0});
    const block_record r = sample("bob", 9, 48);
    ok = ok && s.ok() && (*s)->put(r.key, encode_block_record(r, false)).ok();
  }
  std::error_code ec;
  std::filesystem::copy_file(dir / "data.mdb", root / "lmdb" / "one_entry.mdb",
                             std::filesystem::copy_options::overwrite_existing, ec);
  std::filesystem::remove_all(dir);
  ok = ok && !ec;
  std::fprintf(stderr, "make_store_seeds: %s\n", ok ? "written" : "failed");
  return ok ? 0 : 1;
}
