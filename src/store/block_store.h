// One tier of the KV warehouse: stored blocks by store key (DESIGN.md: a small
// get/put/contains interface, so every tier passes the same tests). Values are
// encoded block records (block_record.h); a tier stores bytes and never
// interprets them, and a reader verifies what it gets.
//
// Implementations: memory_store (tests), disk_store (LMDB, the local default),
// redis_store (shared between server replicas). All are safe to call from
// several threads; the warehouse calls them from its own threads only, never
// from the engine thread (a tier may wait on its disk or network).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/clock.h"
#include "pagoda/status.h"
#include "store/store_key.h"

namespace pagoda {

struct store_tier_stats {
  std::string tier;                  // "memory", "disk", "redis"
  std::int64_t entries = -1;         // -1: unknown (a tier shared with others)
  std::int64_t bytes = -1;           // stored value bytes; -1: unknown
  std::int64_t capacity_bytes = 0;   // 0: no cap of its own
  std::int64_t hits = 0;             // gets that found the key
  std::int64_t misses = 0;           // gets that did not
  std::int64_t errors = 0;           // calls the tier failed (down, I/O, full)
  std::int64_t writes = 0;           // entries put
  std::int64_t evictions = 0;        // entries dropped for capacity or age
  std::int64_t quarantined = 0;      // damaged stores moved aside at open (also counted in errors)
  std::int64_t compactions = 0;      // rewrites of the store's file (after a tenant erase)
};

// One entry of a batch to store.
struct store_entry {
  store_key key;
  std::span<const std::byte> value;
};

class block_store {
 public:
  virtual ~block_store() = default;
  virtual const char* tier() const = 0;
  // Whether count_present answers from memory, without I/O and without
  // waiting on a lock held across I/O (an index of the tier's keys, kept up to
  // date by the tier): then anyone may ask it at any time. A tier shared with
  // other processes (Redis) has no such index.
  virtual bool indexed() const { return false; }

  // The value under key; std::nullopt when absent. An error means the tier
  // failed (callers count it and treat it as a miss).
  virtual result<std::optional<std::vector<std::byte>>> get(const store_key& key) = 0;
  // How many of keys, from the first, are present.
  virtual result<std::size_t> count_present(std::span<const store_key> keys) = 0;
  // [keys]: whether each key is present (one round trip where the tier can).
  virtual result<std::vector<bool>> contains_each(std::span<const store_key> keys);
  // Stores value under key (an existing value is kept: same key, same bytes).
  virtual status put(const store_key& key, std::span<const std::byte> value) = 0;
  // Stores a batch the same way: in one transaction where the tier has them
  // (the disk tier: one LMDB commit, one sync, for the whole batch). An error
  // means some of the batch, perhaps all of it, is not stored.
  virtual status put_many(std::span<const store_entry> entries);
  virtual status erase(const store_key& key) = 0;
  // Erases every entry of one tenant (tenant_hash); returns how many. The
  // disk tier also rewrites its file, so that none of the tenant's bytes
  // stay in it (docs/kv-store.md).
  virtual result<std::size_t> erase_tenant(std::uint64_t tenant) = 0;
  // Calls fn for every entry in key order until it returns false (offline
  // tools: ls, verify, export).
  virtual status for_each(const std::function<bool(const store_key&, std::span<const std::byte>)>& fn) = 0;
  virtual store_tier_stats stats() = 0;
  // Why the tier is down now ("" when it is up, or cannot tell): for /health.
  virtual std::string down_reason() const { return {}; }
};

// An in-memory tier: the reference the other tiers are tested against.
std::unique_ptr<block_store> make_memory_store();

// The local disk tier: an LMDB environment in directory `path` (created if
// missing, mode 0700; its files 0600) holding at most capacity_bytes of values. Over the cap, entries with
// the lowest aged hit count go first (frequency-aware, not plain LRU: a block
// read often keeps its place over one written once); with ttl_seconds > 0,
// entries unused that long are misses, are dropped, and may be stored again.
// It keeps an index of its keys in memory (read from the directory at open,
// kept up to date by every put, erase, eviction and expiry): count_present
// answers from it, and no lock it takes there is ever held across disk I/O.
// Ages and the TTL are read from `clock` (wall time: they mean the same after
// a restart); REQUIRES: clock outlives the store. A damaged store never
// crashes the process: it is checked before LMDB maps it, and quarantined
// (see quarantine_damaged); one found damaged or truncated while open fails
// every call (counted errors) until a restart quarantines it.
struct disk_store_options {
  std::string path;
  std::int64_t capacity_bytes = std::int64_t{8} << 30;
  std::int64_t ttl_seconds = 0;
  // Tests: called inside every write transaction, just before its commit
  // (holds a write open, as a slow disk's sync would).
  std::function<void()> before_commit;
  // A store whose file is damaged (the structural check of lmdb_check.h, or
  // LMDB's own) is moved aside as data.mdb.damaged-<UTC time> and an empty one
  // started, logged and counted (errors, quarantined); false: opening it fails
  // with errc::corrupt instead (offline tools, which report and never move).
  bool quarantine_damaged = true;
  // The process that serves from the store (true) takes the directory's lock
  // (a second owner is refused, naming the holder's PID: two servers on one
  // store would each evict what the other relies on) and records its size cap
  // in the directory; a tool (false) takes no lock and, with
  // use_recorded_capacity, reports the owner's recorded cap as its own.
  bool owner = true;
  bool use_recorded_capacity = false;
};
result<std::unique_ptr<block_store>> make_disk_store(const disk_store_options& options,
                                                     const clock_source& clock = system_clock_source());

// A tier in a Redis server shared by any number of `pagoda serve` processes.
// Keys are "pagoda:kv:<32 hex digits>"; capacity is Redis's own (run it with
// maxmemory and maxmemory-policy allkeys-lfu: frequency-aware); ttl_seconds > 0
// sets an expiry on every entry. A server that is down or goes down makes calls
// fail fast (counted errors); the connection is retried at most once a second
// of `clock`'s monotonic time (REQUIRES: clock outlives the store). Every
// (re)connection authenticates (AUTH), selects `db` and PINGs before use; a
// reconnection the server refuses leaves the tier down, logged with the reason.
struct redis_store_options {
  std::string host = "127.0.0.1";  // a name or an IP address (IPv6 without brackets)
  int port = 6379;
  std::int64_t ttl_seconds = 0;
  int timeout_ms = 500;            // connect, and each read or write
  std::string user;                // ACL user; "" with a password: AUTH PASSWORD (the default user)
  std::string password;            // "" and no password_file: no AUTH
  std::string password_file;       // the password is this file's content (one trailing newline dropped)
  int db = 0;                      // SELECTed when not 0
  bool tls = false;                // rediss://: TLS, the server's certificate verified, never plaintext
  std::string ca_file;             // TLS: trusted CAs (PEM); "" = the system's trust store
  std::string cert_file;           // TLS: client certificate (PEM), for tls-auth-clients
  std::string key_file;            // TLS: its private key (PEM)
};
// require_connection: fail when the server cannot be reached now; otherwise
// the tier starts down and connects when the server answers. A server that
// answers but refuses us (wrong password, a certificate that does not verify,
// not speaking Redis or TLS as the URL says) and unreadable credential files
// fail either way: those do not heal by waiting.
result<std::unique_ptr<block_store>> make_redis_store(const redis_store_options& options,
                                                      bool require_connection = true,
                                                      const clock_source& clock = system_clock_source());
// redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?PARAMS] or rediss://... (TLS) into
// options; HOST may be [IPv6]; USER and PASSWORD are percent-decoded; PARAMS are
// ca=, cert=, key= (rediss:// only) and password_file=. Anything else is an error
// naming the part that is wrong; messages never repeat the password.
result<redis_store_options> parse_redis_url(const std::string& url);
// Whether a --store/--kv-store-remote value is meant as a URL (has "://").
bool looks_like_url(std::string_view s);

}  // namespace pagoda
