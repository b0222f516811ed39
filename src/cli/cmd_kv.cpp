// pagoda kv: offline tools for a KV warehouse tier (a --kv-store directory or
// a Redis server): list, count, verify, prune, export and import stored blocks.
// Works while a server uses the same store (LMDB and Redis both allow it).
//
// Export format (little-endian): "PGKX", u32 version 1, then per entry
// u8 1, 16-byte store key, u32 length, the encoded block record; then u8 0,
// u64 entry count and u64 xxh3 of every byte before it. import checks the
// trailer and verifies every record against its key before storing it.
#include <xxhash.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/common.h"
#include "store/block_record.h"
#include "store/block_store.h"
#include "store/lmdb_check.h"

namespace pagoda::cli {
namespace {

constexpr char k_export_magic[4] = {'P', 'G', 'K', 'X'};
constexpr std::uint32_t k_export_version = 1;

struct kv_options {
  std::string store;           // directory or a Redis URL (redis://, rediss://)
  double size_gib = 8;         // disk tier cap (import, prune)
  std::string tenant;          // ls, prune, export: only this tenant
  bool all_tenants = false;    // prune: every entry
  bool delete_corrupt = false; // verify: erase what fails
  std::string file;            // export -o / import -i
  std::int64_t limit = 0;      // ls: at most this many rows (0: all)
  std::string secret_file;     // --kv-store-secret-file: records are checked against their MAC
  std::shared_ptr<const record_secret> secret;  // read from secret_file before the command runs
};

// Reads --kv-store-secret-file, when given, into o.secret.
status load_secret(kv_options& o) {
  if (o.secret_file.empty()) return {};
  auto s = record_secret::from_file(o.secret_file);
  if (!s.ok()) return s.error().with_context("--kv-store-secret-file");
  o.secret = std::make_shared<const record_secret>(std::move(*s));
  return {};
}

result<std::unique_ptr<block_store>> open_store(const kv_options& o, bool create) {
  if (looks_like_url(o.store)) {
    PAGODA_ASSIGN_OR_RETURN(redis_store_options r, parse_redis_url(o.store));
    return make_redis_store(r, /*require_connection=*/true);
  }
  if (!create && !std::filesystem::exists(std::filesystem::path(o.store) / "data.mdb"))
    return error(errc::not_found, "no KV store at {} (expected {}/data.mdb)", o.store, o.store);
  disk_store_options d;
  d.path = o.store;
  d.capacity_bytes = static_cast<std::int64_t>(o.size_gib * static_cast<double>(std::int64_t{1} << 30));
  d.quarantine_damaged = false;  // a tool reports damage; the server moves a damaged store aside
  d.owner = false;                // beside a running server: no lock, and the server's cap is the one reported
  d.use_recorded_capacity = !create;
  return make_disk_store(d);
}

// Walks the store, decoding each record (verified) for fn; a record that
// fails verification is passed with its error.
using visit_fn = std::function<bool(const store_key&, std::span<const std::byte>, const result<block_record>&)>;
status walk(block_store& s, const record_secret* secret, const visit_fn& fn) {
  return s.for_each([&](const store_key& k, std::span<const std::byte> v) { return fn(k, v, decode_block_record(v, k, secret)); });
}

bool tenant_matches(const kv_options& o, const store_key& k) {
  return o.tenant.empty() || k.tenant == tenant_hash(o.tenant == "-" ? "" : o.tenant);
}

int kv_ls(const kv_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(auto store, open_store(o, false));
  std::printf("%-32s  %-12s  %6s  %9s  %s\n", "key", "tenant", "tokens", "bytes", "first tokens");
  std::int64_t n = 0;
  PAGODA_RETURN_IF_ERROR_CLI(walk(*store, o.secret.get(), [&](const store_key& k, std::span<const std::byte> v,
                                              const result<block_record>& r) {
    if (!tenant_matches(o, k)) return true;
    if (!r.ok()) {
      std::printf("%-32s  %-12s  %6s  %9zu  (%s)\n", k.hex().c_str(), "?", "?", v.size(), r.error().message().c_str());
    } else {
      std::string first;
      for (std::size_t i = 0; i < r->tokens.size() && i < 6; ++i) first += (i ? " " : "") + std::to_string(r->tokens[i]);
      if (r->tokens.size() > 6) first += " ...";
      std::printf("%-32s  %-12s  %6zu  %9zu  %s\n", k.hex().c_str(), r->tenant.empty() ? "-" : r->tenant.c_str(),
                  r->tokens.size(), v.size(), first.c_str());
    }
    return o.limit <= 0 || ++n < o.limit;
  }));
  return 0;
}

int kv_stats(const kv_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(auto store, open_store(o, false));
  struct per_tenant {
    std::int64_t entries = 0, bytes = 0, tokens = 0, raw_bytes = 0;
  };
  std::map<std::string, per_tenant> tenants;
  std::int64_t corrupt = 0;
  PAGODA_RETURN_IF_ERROR_CLI(walk(*store, o.secret.get(), [&](const store_key&, std::span<const std::byte> v,
                                              const result<block_record>& r) {
    if (!r.ok()) {
      ++corrupt;
      return true;
    }
    per_tenant& t = tenants[r->tenant.empty() ? "-" : r->tenant];
    ++t.entries;
    t.bytes += static_cast<std::int64_t>(v.size());
    t.tokens += static_cast<std::int64_t>(r->tokens.size());
    t.raw_bytes += static_cast<std::int64_t>(r->bytes.size());
    return true;
  }));
  const store_tier_stats s = store->stats();
  per_tenant total;
  // stored: the encoded records (zstd where it pays); KV: the blocks' own bytes.
  std::printf("%-16s  %8s  %10s  %12s  %12s  %6s\n", "tenant", "blocks", "tokens", "stored", "KV", "ratio");
  const auto row = [](const std::string& name, const per_tenant& t) {
    std::printf("%-16s  %8lld  %10lld  %12s  %12s  %6.3f\n", name.c_str(), static_cast<long long>(t.entries),
                static_cast<long long>(t.tokens), human_bytes(static_cast<double>(t.bytes)).c_str(),
                human_bytes(static_cast<double>(t.raw_bytes)).c_str(),
                t.raw_bytes > 0 ? static_cast<double>(t.bytes) / static_cast<double>(t.raw_bytes) : 0.0);
  };
  for (const auto& [name, t] : tenants) {
    row(name, t);
    total.entries += t.entries;
    total.bytes += t.bytes;
    total.tokens += t.tokens;
    total.raw_bytes += t.raw_bytes;
  }
  row("total", total);
  std::printf("tier %s", s.tier.c_str());
  if (s.capacity_bytes > 0)
    std::printf(", capacity %s (%.1f%% used)", human_bytes(static_cast<double>(s.capacity_bytes)).c_str(),
                100.0 * static_cast<double>(total.bytes) / static_cast<double>(s.capacity_bytes));
  std::printf(", %lld unreadable\n", static_cast<long long>(corrupt));
  return 0;
}

// What verify found: blocks that verified, and the keys of those that did
// not (of which `forged` failed their MAC: see block_record.h).
struct verify_tally {
  const record_secret* secret = nullptr;
  std::int64_t ok = 0, forged = 0;
  std::vector<store_key> bad;
  void check(const store_key& k, std::span<const std::byte> v) {
    const status st = check_block_record(v, k, secret);
    if (st.ok()) {
      ++ok;
      return;
    }
    const bool mac = st.code() == errc::unauthenticated;
    std::printf("%s: %s%s\n", k.hex().c_str(), mac ? "forged: " : "", st.message().c_str());
    forged += mac;
    bad.push_back(k);
  }
  // Erases the failed blocks when asked, prints the summary, returns the exit code.
  int finish(const kv_options& o, block_store* store) const {
    if (o.delete_corrupt && store)
      for (const store_key& k : bad) PAGODA_RETURN_IF_ERROR_CLI(store->erase(k));
    const std::string forged_note = forged ? fmt::format(", {} of them forged (no MAC or a wrong one)", forged) : "";
    std::printf("%lld blocks verified, %zu failed%s%s\n", static_cast<long long>(ok), bad.size(), forged_note.c_str(),
                bad.empty() ? "" : (o.delete_corrupt ? " (erased)" : " (erase them with --delete-corrupt)"));
    return bad.empty() || o.delete_corrupt ? 0 : 1;
  }
};

// A disk store is verified from its file (lmdb_check.h), never through
// LMDB's map: every page and every reachable record is checked, and damaged
// pages are reported and counted instead of crashing the walk.
int kv_verify_disk(const kv_options& o) {
  const std::string data = (std::filesystem::path(o.store) / "data.mdb").string();
  if (!std::filesystem::exists(data))
    return fail(error(errc::not_found, "no KV store at {} (expected {})", o.store, data));
  verify_tally t{o.secret.get()};
  std::int64_t bad_keys = 0;
  const auto visit = [&](std::string_view db, std::span<const std::byte> k, std::span<const std::byte> v) {
    if (db != "blocks") return;
    if (k.size() == 16) return t.check(store_key::from_bytes(k.data()), v);
    std::printf("a key of %zu bytes: not a store key\n", k.size());
    ++bad_keys;
  };
  PAGODA_ASSIGN_OR_RETURN_CLI(const lmdb_check_report rep, check_lmdb_file(data, visit));
  for (const std::string& p : rep.problems) std::printf("damaged: %s\n", p.c_str());
  if (rep.ok() && bad_keys == 0) {
    std::unique_ptr<block_store> store;
    if (o.delete_corrupt && !t.bad.empty()) {
      PAGODA_ASSIGN_OR_RETURN_CLI(store, open_store(o, false));
    }
    return t.finish(o, store.get());
  }
  // Blocks behind damaged pages cannot be reached: the counts are floors.
  std::printf("damaged store %s: %lld damaged pages or structures; %lld blocks verified, %zu failed, the blocks "
              "behind the damage not reached; a server moves it aside at start and begins empty%s\n",
              o.store.c_str(), static_cast<long long>(rep.damage), static_cast<long long>(t.ok),
              t.bad.size() + static_cast<std::size_t>(bad_keys),
              o.delete_corrupt ? " (--delete-corrupt does not repair damaged pages)" : "");
  return 1;
}

int kv_verify(const kv_options& o) {
  if (!looks_like_url(o.store)) return kv_verify_disk(o);
  PAGODA_ASSIGN_OR_RETURN_CLI(auto store, open_store(o, false));
  verify_tally t{o.secret.get()};
  PAGODA_RETURN_IF_ERROR_CLI(store->for_each([&](const store_key& k, std::span<const std::byte> v) {
    t.check(k, v);
    return true;
  }));
  return t.finish(o, store.get());
}

int kv_prune(const kv_options& o) {
  if (o.tenant.empty() == !o.all_tenants)
    return fail(error(errc::invalid_argument, "kv prune: give exactly one of --tenant NAME and --all"));
  PAGODA_ASSIGN_OR_RETURN_CLI(auto store, open_store(o, false));
  std::size_t n = 0;
  if (o.all_tenants) {
    std::vector<store_key> keys;
    PAGODA_RETURN_IF_ERROR_CLI(store->for_each([&](const store_key& k, std::span<const std::byte>) {
      keys.push_back(k);
      return true;
    }));
    for (const store_key& k : keys) PAGODA_RETURN_IF_ERROR_CLI(store->erase(k));
    n = keys.size();
  } else {
    PAGODA_ASSIGN_OR_RETURN_CLI(n, store->erase_tenant(tenant_hash(o.tenant == "-" ? "" : o.tenant)));
  }
  std::printf("erased %zu blocks\n", n);
  return 0;
}

class hashed_writer {
 public:
  explicit hashed_writer(std::ofstream& out) : out_(out) { XXH3_64bits_reset(state_); }
  ~hashed_writer() { XXH3_freeState(state_); }
  hashed_writer(const hashed_writer&) = delete;
  hashed_writer& operator=(const hashed_writer&) = delete;
  void write(const void* p, std::size_t n) {
    XXH3_64bits_update(state_, p, n);
    out_.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
  }
  template <class T>
  void put(T v) {
    write(&v, sizeof v);
  }
  std::uint64_t digest() const { return XXH3_64bits_digest(state_); }

 private:
  std::ofstream& out_;
  XXH3_state_t* state_ = XXH3_createState();
};

int kv_export(const kv_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(auto store, open_store(o, false));
  std::ofstream out(o.file, std::ios::binary | std::ios::trunc);
  if (!out) return fail(error(errc::io_error, "cannot write {}", o.file));
  hashed_writer w(out);
  w.write(k_export_magic, 4);
  w.put(k_export_version);
  std::uint64_t n = 0;
  std::int64_t skipped = 0;
  PAGODA_RETURN_IF_ERROR_CLI(store->for_each([&](const store_key& k, std::span<const std::byte> v) {
    if (!tenant_matches(o, k)) return true;
    if (!check_block_record(v, k, o.secret.get()).ok()) {  // never copy a damaged or forged block elsewhere
      ++skipped;
      return true;
    }
    w.put(std::uint8_t{1});
    const auto kb = k.bytes();
    w.write(kb.data(), kb.size());
    w.put(static_cast<std::uint32_t>(v.size()));
    w.write(v.data(), v.size());
    ++n;
    return true;
  }));
  w.put(std::uint8_t{0});
  w.put(n);
  const std::uint64_t digest = w.digest();
  out.write(reinterpret_cast<const char*>(&digest), sizeof digest);
  out.close();
  if (!out) return fail(error(errc::io_error, "writing {} failed", o.file));
  std::printf("exported %llu blocks to %s (%lld unreadable skipped)\n", static_cast<unsigned long long>(n),
              o.file.c_str(), static_cast<long long>(skipped));
  return 0;
}

int kv_import(const kv_options& o) {
  std::ifstream in(o.file, std::ios::binary);
  if (!in) return fail(error(errc::not_found, "cannot open {}", o.file));
  std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto bad = [&](const char* what) { return fail(error(errc::corrupt, "{}: not a KV export ({})", o.file, what)); };
  if (data.size() < 4 + 4 + 1 + 8 + 8 || std::memcmp(data.data(), k_export_magic, 4) != 0) return bad("bad magic");
  std::uint32_t version = 0;
  std::memcpy(&version, data.data() + 4, 4);
  if (version != k_export_version) return bad("unknown version");
  std::uint64_t digest = 0;
  std::memcpy(&digest, data.data() + data.size() - 8, 8);
  if (XXH3_64bits(data.data(), data.size() - 8) != digest) return bad("checksum mismatch: truncated or damaged");
  // The checksum holds: walk the entries (bounds still checked: a valid
  // checksum over a crafted file proves nothing).
  struct entry {
    store_key key;
    std::span<const std::byte> value;
  };
  std::vector<entry> entries;
  std::size_t p = 8;
  const std::size_t end = data.size() - 8;
  const auto* bytes = reinterpret_cast<const std::byte*>(data.data());
  for (;;) {
    if (p + 1 > end) return bad("truncated entry");
    const auto tag = static_cast<std::uint8_t>(data[p++]);
    if (tag == 0) break;
    if (tag != 1 || p + 16 + 4 > end) return bad("bad entry");
    const store_key k = store_key::from_bytes(bytes + p);
    std::uint32_t len = 0;
    std::memcpy(&len, data.data() + p + 16, 4);
    p += 20;
    if (len > end - p) return bad("entry runs past the end");
    entries.push_back({k, std::span<const std::byte>(bytes + p, len)});
    p += len;
  }
  std::uint64_t count = 0;
  if (p + 8 != end) return bad("bad trailer");
  std::memcpy(&count, data.data() + p, 8);
  if (count != entries.size()) return bad("entry count mismatch");
  PAGODA_ASSIGN_OR_RETURN_CLI(auto store, open_store(o, true));
  std::int64_t stored = 0, rejected = 0;
  for (const entry& e : entries) {
    if (!check_block_record(e.value, e.key, o.secret.get()).ok()) {
      ++rejected;
      continue;
    }
    PAGODA_RETURN_IF_ERROR_CLI(store->put(e.key, e.value));
    ++stored;
  }
  std::printf("imported %lld blocks into %s (%lld failed verification)\n", static_cast<long long>(stored),
              o.store.c_str(), static_cast<long long>(rejected));
  return rejected == 0 ? 0 : 1;
}

}  // namespace

void register_kv(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<kv_options>();
  CLI::App* kv = app.add_subcommand("kv", "inspect and manage a persistent KV store (--kv-store directory or Redis)");
  kv->require_subcommand(1);
  const auto sub = [&](const char* name, const char* help, int (*fn)(const kv_options&)) {
    CLI::App* c = kv->add_subcommand(name, help);
    c->add_option("--store", opts->store, "the store: a --kv-store directory or a Redis URL (redis:// or rediss://, docs/kv-store.md)")->required();
    c->callback([opts, fn, &action] {
      action = [opts, fn] {
        if (const status st = load_secret(*opts); !st.ok()) return fail(st);
        return fn(*opts);
      };
    });
    return c;
  };
  // The subcommands that read records check their MACs with the server's secret.
  const auto secret_option = [&](const char* name) {
    kv->get_subcommand(name)->add_option(
        "--kv-store-secret-file", opts->secret_file,
        "the secret the server's --kv-store-secret-file names: records are checked against their MAC");
  };
  sub("ls", "list stored blocks: key, tenant, tokens, bytes", kv_ls)
      ->add_option("--tenant", opts->tenant, "only this tenant ('-' for requests without one)");
  kv->get_subcommand("ls")->add_option("--limit", opts->limit, "at most this many rows (0: all)")->capture_default_str();
  sub("stats", "blocks, tokens and bytes per tenant", kv_stats);
  sub("verify", "check every stored block's checksum, MAC and key; exit 1 when one fails", kv_verify)
      ->add_flag("--delete-corrupt", opts->delete_corrupt, "erase the blocks that fail");
  CLI::App* prune = sub("prune", "erase one tenant's blocks, or all", kv_prune);
  prune->add_option("--tenant", opts->tenant, "erase this tenant's blocks ('-' for requests without one)");
  prune->add_flag("--all", opts->all_tenants, "erase every block");
  sub("export", "write verified blocks to a file", kv_export)
      ->add_option("-o,--output", opts->file, "the export file")
      ->required();
  kv->get_subcommand("export")->add_option("--tenant", opts->tenant, "only this tenant");
  CLI::App* imp = sub("import", "store the blocks of an export file (each verified first)", kv_import);
  imp->add_option("-i,--input", opts->file, "the export file")->required();
  imp->add_option("--size", opts->size_gib, "disk store cap in GiB")->capture_default_str()->check(finite_positive());
  for (const char* name : {"ls", "stats", "verify", "export", "import"}) secret_option(name);
}

}  // namespace pagoda::cli
