// Fuzz targets for the disk KV store's readers, for fuzz_driver (and
// libFuzzer): bytes from a damaged or hostile disk must give an error or a
// verified value, never a crash.
//
// store_record: decode_block_record on the input as is, and again with its
// trailing checksum recomputed (so mutations reach the field parser behind
// the checksum), under the key the input names, without a secret and with
// one (the MAC check of block_record.h: a mutated input never passes it). A
// record that decodes must encode and decode back to the same record, also
// MACed under the secret (and then fail without it).
//
// lmdb_file: the input as a store's data.mdb: the structural check
// (lmdb_check.h), and when it passes, the disk tier opened on it (as a tool:
// no quarantine) and every entry walked, looked up and verified.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>

#include "fuzz_check.h"
#include "core/hash.h"
#include "store/block_record.h"
#include "store/block_store.h"
#include "store/lmdb_check.h"

namespace {

using namespace pagoda;

// The key the record names: its entry field and the hash of its tenant field
// (layout in block_record.h), so a well-formed input can decode.
store_key named_key(std::span<const std::byte> d) {
  store_key k{0, 0};
  if (d.size() >= 16) std::memcpy(&k.entry, d.data() + 8, 8);
  std::uint32_t n = 0;
  if (d.size() >= 36) std::memcpy(&n, d.data() + 32, 4);
  if (d.size() >= 36 && n <= d.size() - 36)
    k.tenant = tenant_hash(std::string(reinterpret_cast<const char*>(d.data()) + 36, n));
  return k;
}

const record_secret& fuzz_secret() {
  static const record_secret s("pagoda-fuzz-secret-0123456789");
  return s;
}

void decode_one(std::span<const std::byte> d) {
  const store_key key = named_key(d);
  auto m = decode_block_record(d, key, &fuzz_secret());
  FUZZ_CHECK(m.ok() || (m.error().code() != errc::ok && !m.error().message().empty()));
  auto r = decode_block_record(d, key);
  if (!r.ok()) {
    FUZZ_CHECK(r.error().code() != errc::ok && !r.error().message().empty());
    FUZZ_CHECK(!check_block_record(d, key).ok());
    return;
  }
  FUZZ_CHECK(check_block_record(d, key).ok());
  FUZZ_CHECK(r->key == key);
  const auto again = decode_block_record(encode_block_record(*r, false), key);
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->tokens == r->tokens && again->bytes == r->bytes && again->tenant == r->tenant &&
             again->chain == r->chain && again->parent == r->parent);
  const auto maced = encode_block_record(*r, true, &fuzz_secret());
  const auto back = decode_block_record(maced, key, &fuzz_secret());
  FUZZ_CHECK(back.ok() && back->tokens == r->tokens && back->bytes == r->bytes && back->tenant == r->tenant);
  FUZZ_CHECK(check_block_record(maced, key).code() == errc::unauthenticated);
}

int fuzz_record(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> d(reinterpret_cast<const std::byte*>(data), size);
  decode_one(d);
  if (size >= 8) {
    std::vector<std::byte> sealed(d.begin(), d.end());
    const std::uint64_t sum = hash_bytes(sealed.data(), size - 8);
    std::memcpy(sealed.data() + size - 8, &sum, 8);
    decode_one(sealed);
  }
  return 0;
}

int fuzz_lmdb_file(const std::uint8_t* data, std::size_t size) {
  static const std::string dir = [] {
    const std::filesystem::path shm = "/dev/shm";
    const auto base = std::filesystem::is_directory(shm) ? shm : std::filesystem::temp_directory_path();
    return (base / ("pagoda_store_fuzz_" + std::to_string(::getpid()))).string();
  }();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string file = dir + "/data.mdb";
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  std::int64_t n_entries = 0;
  auto rep = check_lmdb_file(file, [&](std::string_view db, std::span<const std::byte>, std::span<const std::byte>) {
    n_entries += db == "blocks";
  });
  FUZZ_CHECK(rep.ok());
  FUZZ_CHECK(rep->exists == (size > 0));
  if (!rep->ok()) {
    FUZZ_CHECK(!rep->problems.empty());
    return 0;
  }
  disk_store_options o{dir, 16 << 20, 0};
  o.quarantine_damaged = false;
  auto s = make_disk_store(o);
  if (!s.ok()) return 0;  // LMDB refused it: an error, not a crash
  std::vector<store_key> keys;
  (void)(*s)->for_each([&](const store_key& k, std::span<const std::byte> v) {
    keys.push_back(k);
    (void)check_block_record(v, k);
    return true;
  });
  for (const store_key& k : keys) {
    auto v = (*s)->get(k);
    if (v.ok() && v->has_value()) (void)decode_block_record(**v, k);
  }
  return 0;
}

}  // namespace

#if defined(PAGODA_FUZZ_LMDB_FILE)
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { return fuzz_lmdb_file(data, size); }
#else
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { return fuzz_record(data, size); }
#endif
