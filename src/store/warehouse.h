// The KV warehouse: the persistent tiers behind the in-memory pool, chained
// disk -> Redis, seen by the engine as a kv_block_source (the load path) and
// fed by its commits (write-through).
//
// Write path: every full block the engine commits is handed to write() with
// its bytes; a background thread encodes it (block_record: checksum, zstd
// when it pays) and puts it into every tier that lacks it. The queue is
// bounded (blocks and bytes): when it is full the block is dropped and
// counted, so an engine step never waits on a disk or a network. close() (and
// the destructor) drains what is queued: a graceful shutdown loses nothing.
//
// Read path: n_available() finds how far a prompt's chain of blocks continues
// in the tiers (disk first, then Redis); prefetch() fetches and verifies them
// on a second background thread while the sequence waits in the loading
// state; read() hands them over. A block that is missing, fails its checksum,
// belongs to another key or comes from a failed tier is a miss: counted, the
// sequence computes it instead, and nothing unverified is ever returned.
// A block found only in Redis is also written to the disk tier.
//
// Keys: store_key (the chained key plus model and KV layout fingerprints, and
// the tenant), so tenants never share an entry in any tier.
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

#include "core/histogram.h"
#include "kv/kv_hooks.h"
#include "pagoda/events.h"
#include "store/block_record.h"
#include "store/block_store.h"
#include "store/store_key.h"

namespace pagoda {

struct warehouse_options {
  kv_space space;
  std::size_t max_queue_blocks = 1024;
  std::size_t max_queue_bytes = std::size_t{256} << 20;
  bool compress = true;
};

struct warehouse_counters {
  std::int64_t queued = 0;          // blocks handed to write()
  std::int64_t written = 0;         // blocks put into at least one tier
  std::int64_t already_stored = 0;  // skipped: every tier had them
  std::int64_t dropped = 0;         // the queue was full
  std::int64_t write_errors = 0;    // a tier refused a put (down, full)
  std::int64_t queue_blocks = 0;    // waiting now
  std::int64_t lookups = 0;         // n_available calls
  std::int64_t loads = 0;           // blocks served to the engine
  std::int64_t load_misses = 0;     // announced but not delivered (gone, failed tier)
  std::int64_t corrupt = 0;         // failed verification
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
  // Never blocks.
  void write(const cached_block& block);
  // Waits until every queued write is done (tests, shutdown).
  void flush();
  // Waits until none of these blocks of `tenant` is queued or being written
  // (/v1/kv/warm answers once its own blocks are stored, whatever else waits).
  void flush(std::string_view tenant, std::span<const block_key> keys);
  // Drains the queue and stops the threads. Idempotent.
  void close();

  // kv_block_source
  int n_available(std::string_view tenant, std::span<const block_key> keys) override;
  void prefetch(std::string_view tenant, std::span<const block_key> keys) override;
  bool settled(std::string_view tenant, std::span<const block_key> keys) override;
  int read(std::string_view tenant, block_key key, std::span<std::byte> out) override;

  // Erases a tenant's entries from every tier; returns how many.
  result<std::size_t> erase_tenant(std::string_view tenant);

  std::vector<store_tier_stats> tier_stats();
  warehouse_counters counters();
  // [tier]: seconds to fetch and verify one block found in that tier.
  std::vector<histogram_snapshot> load_seconds_by_tier();
  const std::vector<std::unique_ptr<block_store>>& tiers() const { return tiers_; }
  std::vector<std::string> tier_names() const;
  const kv_space& space() const { return o_.space; }

 private:
  struct fetched {
    bool done = false;
    int tier = -1;  // where it was found; -1: nowhere
    std::vector<std::byte> bytes;
  };
  void write_loop();
  void fetch_loop();
  int fetch_one(const store_key& key, std::vector<std::byte>& out);  // the tier, or -1

  std::vector<std::unique_ptr<block_store>> tiers_;
  warehouse_options o_;

  std::mutex mu_;
  std::condition_variable cv_write_, cv_fetch_, cv_idle_;
  std::deque<block_record> write_queue_;
  std::size_t queue_bytes_ = 0;
  bool writing_ = false;
  store_key writing_key_;  // the record being written, while writing_
  std::deque<store_key> fetch_queue_;
  std::map<store_key, fetched> fetched_;
  bool stopping_ = false;
  warehouse_counters c_;
  std::vector<histogram> load_seconds_;  // [tier], guarded by mu_
  std::thread writer_, fetcher_;
};

// Where a request's cached prompt tokens came from: ("memory", n) first, then
// one entry per warehouse tier (tier_names: "disk", "redis", in lookup order).
std::vector<std::pair<std::string, int>> cached_tokens_by_tier(const request_usage& usage,
                                                               const std::vector<std::string>& tier_names);

}  // namespace pagoda
