// The KV warehouse: the persistent tiers behind the in-memory pool, chained
// disk -> Redis, seen by the engine as a kv_block_source (the load path) and
// fed by its commits (write-through).
//
// Threads. The engine thread calls write(), n_available(), prefetch(),
// settled(), read() and release(); each answers from memory and takes only
// mu_, which no thread holds across disk or network I/O. The I/O runs on the
// warehouse's own threads:
// - the writer: takes everything queued (after lingering for more, a group
//   commit), encodes it (block_record: checksum, zstd when it pays) and puts
//   the batch into every tier that lacks it, one put_many per tier (one LMDB
//   transaction, one sync, on disk). It runs at a lower priority (nice 10):
//   under CPU contention its work, on no request's path, yields to the
//   engine thread;
// - the fetcher: fetches and verifies prefetched blocks;
// - the looker: answers lookups in tiers without an in-memory index (Redis).
// Other callers (HTTP handlers: flush, n_stored, erase_tenant, stats) may
// wait on I/O; the engine thread never calls them.
//
// Write path: the queue is bounded (blocks and bytes): when it is full the
// block is dropped and counted, so an engine step never waits on a disk or a
// network. close() (and the destructor) drains what is queued: a graceful
// shutdown loses nothing.
//
// Read path: n_available() finds how far a prompt's chain of blocks continues
// in the tiers (disk first, then Redis). An indexed tier (disk) answers from
// its index. For Redis, shared with other replicas and so without an index
// here, it answers from the results of earlier lookups, remembered for
// lookup_ttl_us; a key not known yet starts a lookup on the looker and the
// answer is k_source_pending (the scheduler asks again at its next step). A
// lookup that failed marks the tier down for lookup_ttl_us (it then holds
// nothing, answered at once), and one in flight past lookup_timeout_us counts
// as "none", so a stuck tier costs recomputation, never a stalled queue.
// prefetch() queues blocks for the fetcher, which holds them, verified,
// until release(): nothing a loading sequence still needs is ever dropped.
// Memory is bounded by refusing new prefetches past max_prefetch_bytes (their
// blocks are computed instead). read() hands over what the fetcher holds and
// never fetches: a block not prefetched and fetched is a miss (counted, computed).
// A block that is missing, fails its checksum or its MAC, belongs to another
// key or comes from a failed tier is a miss too, and nothing unverified is ever
// returned. A block found only in Redis is also written to the disk tier; a
// corrupt one is erased from its tier by the fetcher, outside mu_, and so is
// a forged one when there is a secret (the next write-back replaces it; a
// server without a secret leaves MACed records to the replicas that can check
// them).
//
// Keys: store_key (the chained key, the model fingerprint, the layout of the
// block's own bytes, and the tenant), so tenants never share an entry in any
// tier and blocks of two KV classes never share one either.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/histogram.h"
#include "kv/kv_hooks.h"
#include "pagoda/events.h"
#include "store/block_record.h"
#include "store/block_store.h"
#include "store/store_key.h"

namespace pagoda {

struct warehouse_options {
  std::uint64_t model = 0;  // model_fingerprint (sched/engine_setup.h); each block brings its layout
  std::size_t max_queue_blocks = 1024;
  std::size_t max_queue_bytes = std::size_t{256} << 20;
  // Group commit: once a block is queued, the writer waits up to this long
  // for more (or for batch_bytes, a flush, close) before it writes, so that
  // neither its wake-ups nor its syncs come once per block. Real time: it
  // only delays when a block reaches the tiers, never what a caller sees
  // (flush() cuts it short).
  std::int64_t write_linger_us = 20'000;
  std::size_t batch_bytes = std::size_t{16} << 20;
  // Prefetched blocks held for loading sequences, at most (KV bytes): past
  // it new prefetches are refused (those blocks are computed).
  std::size_t max_prefetch_bytes = std::size_t{512} << 20;
  // How long an answer of a tier without an index (Redis) is remembered, and
  // how long a tier whose lookup failed counts as down.
  std::int64_t lookup_ttl_us = 2'000'000;
  // A lookup in flight longer than this counts as "none" (the request computes).
  std::int64_t lookup_timeout_us = 1'000'000;
  bool compress = true;
  // The server secret (--kv-store-secret-file): records are written MACed and
  // only records whose MAC verifies are read (block_record.h); null: records
  // are only checksummed, and MACed ones (of replicas with a secret) are misses.
  std::shared_ptr<const record_secret> secret;
  const clock_source* clock = nullptr;  // null: the system clock; REQUIRES: outlives the warehouse
};

struct warehouse_counters {
  std::int64_t queued = 0;          // blocks handed to write()
  std::int64_t written = 0;         // blocks put into at least one tier
  std::int64_t already_stored = 0;  // skipped: every tier had them
  std::int64_t dropped = 0;         // the queue was full
  std::int64_t write_errors = 0;    // a tier refused a put (down, full)
  std::int64_t write_batches = 0;   // batches the writer took (one put_many per tier each)
  std::int64_t queue_blocks = 0;    // waiting now
  std::int64_t lookups = 0;         // n_available calls
  std::int64_t lookups_pending = 0; // of those, answered k_source_pending
  std::int64_t loads = 0;           // blocks served to the engine
  std::int64_t load_misses = 0;     // announced but not delivered (gone, failed tier, not fetched)
  std::int64_t corrupt = 0;         // failed verification: damaged (checksum, fields), another key's
  std::int64_t forged = 0;          // failed authentication: no MAC, a wrong MAC, or a MAC and no secret
  std::int64_t prefetch_refused = 0;  // blocks not prefetched: max_prefetch_bytes reached
  std::int64_t held_bytes = 0;      // prefetched blocks held now (or reserved for them)
  std::vector<std::int64_t> loads_by_tier;  // [tier]
};

class kv_warehouse final : public kv_block_source {
 public:
  // tiers in lookup order (disk, then Redis); at least one.
  kv_warehouse(std::vector<std::unique_ptr<block_store>> tiers, const warehouse_options& options);
  ~kv_warehouse() override;  // close()
  kv_warehouse(const kv_warehouse&) = delete;
  kv_warehouse& operator=(const kv_warehouse&) = delete;

  // The engine's commit hook: a full block just entered the prefix cache.
  // Never blocks on I/O.
  void write(const cached_block& block);
  // Waits until every queued write is done (tests, shutdown).
  void flush();
  // Waits until none of these blocks of `tenant` is queued or being written
  // (/v1/kv/warm answers once its own blocks are stored, whatever else waits).
  void flush(std::string_view tenant, std::span<const stored_block_ref> refs);
  // Waits until no fetch and no lookup is queued or running (tests: what was
  // prefetched or asked is then answered).
  void quiesce();
  // Drains the queue and stops the threads; blocks still to fetch become
  // misses. Idempotent.
  void close();

  // kv_block_source (the engine thread; never waits on I/O)
  int n_available(std::string_view tenant, std::span<const stored_block_ref> refs) override;
  void prefetch(std::string_view tenant, std::span<const stored_block_ref> refs) override;
  bool settled(std::string_view tenant, std::span<const stored_block_ref> refs) override;
  int read(std::string_view tenant, const stored_block_ref& ref, std::span<std::byte> out) override;
  void release(std::string_view tenant, std::span<const stored_block_ref> refs) override;

  // How many of refs, from the first, the tiers hold, asking each tier now
  // (may wait on I/O: for HTTP handlers, never the engine thread).
  int n_stored(std::string_view tenant, std::span<const stored_block_ref> refs);
  // The key a block is stored under.
  store_key key_of(std::string_view tenant, const stored_block_ref& ref) const;

  // Erases a tenant's entries from every tier; returns how many.
  result<std::size_t> erase_tenant(std::string_view tenant);

  std::vector<store_tier_stats> tier_stats();
  warehouse_counters counters();
  // [tier]: seconds to fetch and verify one block found in that tier.
  std::vector<histogram_snapshot> load_seconds_by_tier();
  const std::vector<std::unique_ptr<block_store>>& tiers() const { return tiers_; }
  std::vector<std::string> tier_names() const;

 private:
  // A prefetched block, held for the loading sequences that asked for it.
  struct held {
    enum class state : std::uint8_t { queued, done, refused } st = state::queued;
    int holders = 0;      // prefetch() calls not yet released
    int tier = -1;        // done: where it was found; -1: nowhere (a miss)
    std::shared_ptr<const std::vector<std::byte>> bytes;  // done, tier >= 0: the block's KV
    std::size_t reserved = 0;  // its share of held_bytes_
  };
  // What a tier without an index said about a key, and when.
  struct known {
    enum class what : std::uint8_t { present, absent, asking } w = what::asking;
    std::int64_t at_us = 0;
  };
  struct lookup {
    std::size_t tier = 0;
    std::vector<store_key> keys;
  };
  void write_loop();
  void write_batch(std::vector<block_record>& batch);
  void fetch_loop();
  void lookup_loop();
  int fetch_one(const store_key& key, std::vector<std::byte>& out);  // the tier, or -1
  // How far keys continue in remote tier t from what is known; -1 when a
  // lookup must run first (queued here). REQUIRES: mu_ held.
  int known_run_locked(std::size_t t, std::span<const store_key> keys, std::int64_t now_us);
  void forget_known_locked(std::size_t t, std::int64_t now_us);
  const clock_source& clock() const { return o_.clock ? *o_.clock : system_clock_source(); }

  std::vector<std::unique_ptr<block_store>> tiers_;
  warehouse_options o_;

  std::mutex mu_;  // everything below; never held across I/O
  std::condition_variable cv_write_, cv_fetch_, cv_lookup_, cv_idle_;
  std::deque<block_record> write_queue_;
  std::size_t queue_bytes_ = 0;
  std::vector<store_key> writing_;  // sorted: the batch being written
  bool writing_batch_ = false;
  int flushing_ = 0;  // flush() calls waiting: the writer does not linger
  std::deque<store_key> fetch_queue_;
  std::map<store_key, held> held_;
  std::size_t held_bytes_ = 0;
  std::size_t block_bytes_estimate_ = 0;  // the largest block seen: what a queued fetch reserves
  std::vector<std::map<store_key, known>> known_;  // [tier]; tiers without an index only
  std::vector<std::int64_t> down_until_us_;        // [tier]
  std::deque<lookup> lookup_queue_;
  bool fetching_ = false, looking_ = false;  // the fetcher / looker is at work outside mu_
  bool stopping_ = false;
  warehouse_counters c_;
  std::vector<histogram> load_seconds_;  // [tier]
  std::thread writer_, fetcher_, looker_;
};

// Where a request's cached prompt tokens came from: ("memory", n) first, then
// one entry per warehouse tier (tier_names: "disk", "redis", in lookup order).
std::vector<std::pair<std::string, int>> cached_tokens_by_tier(const request_usage& usage,
                                                               const std::vector<std::string>& tier_names);

}  // namespace pagoda
