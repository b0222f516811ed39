// The disk tier on LMDB. Why LMDB rather than one file per block: a write is
// one transaction (atomic: a kill -9 at any moment leaves every entry whole
// or absent, never torn), readers never block the writer, and a block is
// one B-tree lookup and a memcpy from the map, without a file open per block.
//
// Two databases: "blocks" (store key -> encoded record) and "meta" (store key
// -> size, hits, last use), so eviction scores entries without reading their
// values. An in-memory copy of meta answers lookups; hit counts reach "meta"
// with the next write transaction (a crash loses recent hit counts only).
#include <lmdb.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <tuple>
#include <mutex>

#include "store/block_store.h"

namespace pagoda {
namespace {

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct entry_meta {
  std::uint32_t size = 0;
  std::uint32_t hits = 0;
  std::int64_t last_use = 0;  // unix milliseconds
};

status lmdb_error(int rc, const char* what, const std::string& path) {
  const errc code = rc == MDB_MAP_FULL || rc == ENOSPC ? errc::resource_exhausted : errc::io_error;
  return error(code, "KV store {}: {}: {}", path, what, mdb_strerror(rc));
}

MDB_val val_of(std::span<const std::byte> s) { return {s.size(), const_cast<std::byte*>(s.data())}; }

class disk_store final : public block_store {
 public:
  explicit disk_store(disk_store_options o) : o_(std::move(o)) {}
  ~disk_store() override {
    {
      std::lock_guard lock(mu_);
      (void)flush_hits_locked();
    }
    if (env_) mdb_env_close(env_);
  }

  status open() {
    std::error_code ec;
    std::filesystem::create_directories(o_.path, ec);  // a per-user cache dir may not exist yet
    if (ec) return error(errc::io_error, "KV store {}: cannot create the directory: {}", o_.path, ec.message());
    int rc = mdb_env_create(&env_);
    if (rc) return lmdb_error(rc, "create", o_.path);
    mdb_env_set_maxdbs(env_, 2);
    // The map is a reservation of address space, not of disk: the file grows as it fills.
    const std::size_t map = static_cast<std::size_t>(o_.capacity_bytes) + static_cast<std::size_t>(o_.capacity_bytes) / 4 +
                            (std::size_t{64} << 20);
    if ((rc = mdb_env_set_mapsize(env_, map))) return lmdb_error(rc, "set map size", o_.path);
    if ((rc = mdb_env_open(env_, o_.path.c_str(), MDB_NOTLS, 0644))) return lmdb_error(rc, "open", o_.path);
    MDB_txn* txn = nullptr;
    if ((rc = mdb_txn_begin(env_, nullptr, 0, &txn))) return lmdb_error(rc, "begin", o_.path);
    if ((rc = mdb_dbi_open(txn, "blocks", MDB_CREATE, &blocks_)) || (rc = mdb_dbi_open(txn, "meta", MDB_CREATE, &meta_))) {
      mdb_txn_abort(txn);
      return lmdb_error(rc, "open databases", o_.path);
    }
    // Load the meta index.
    MDB_cursor* cur = nullptr;
    mdb_cursor_open(txn, meta_, &cur);
    MDB_val k, v;
    for (int r = mdb_cursor_get(cur, &k, &v, MDB_FIRST); r == 0; r = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
      if (k.mv_size != 16 || v.mv_size != sizeof(entry_meta)) continue;
      entry_meta m;
      std::memcpy(&m, v.mv_data, sizeof m);
      index_[store_key::from_bytes(static_cast<const std::byte*>(k.mv_data))] = m;
      bytes_ += m.size;
    }
    mdb_cursor_close(cur);
    if ((rc = mdb_txn_commit(txn))) return lmdb_error(rc, "commit", o_.path);
    return {};
  }

  const char* tier() const override { return "disk"; }

  result<std::optional<std::vector<std::byte>>> get(const store_key& key) override {
    {
      std::lock_guard lock(mu_);
      const auto it = index_.find(key);
      if (it == index_.end() || expired(it->second)) {
        ++stats_.misses;
        return std::optional<std::vector<std::byte>>();
      }
    }
    MDB_txn* txn = nullptr;
    int rc = mdb_txn_begin(env_, nullptr, MDB_RDONLY, &txn);
    if (rc) return fail(lmdb_error(rc, "read", o_.path));
    const auto kb = key.bytes();
    MDB_val k = val_of(kb), v;
    rc = mdb_get(txn, blocks_, &k, &v);
    std::optional<std::vector<std::byte>> out;
    if (rc == 0) {
      const auto* p = static_cast<const std::byte*>(v.mv_data);
      out.emplace(p, p + v.mv_size);
    }
    mdb_txn_abort(txn);
    if (rc != 0 && rc != MDB_NOTFOUND) return fail(lmdb_error(rc, "get", o_.path));
    std::lock_guard lock(mu_);
    if (!out) {
      ++stats_.misses;
      return out;
    }
    ++stats_.hits;
    if (auto it = index_.find(key); it != index_.end()) {
      ++it->second.hits;
      it->second.last_use = now_ms();
      touched_[key] = it->second;
    }
    return out;
  }

  result<std::size_t> count_present(std::span<const store_key> keys) override {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    while (n < keys.size()) {
      const auto it = index_.find(keys[n]);
      if (it == index_.end() || expired(it->second)) break;
      ++n;
    }
    return n;
  }

  status put(const store_key& key, std::span<const std::byte> value) override {
    std::lock_guard lock(mu_);
    if (index_.contains(key)) return {};
    entry_meta m{static_cast<std::uint32_t>(value.size()), 0, now_ms()};
    const auto kb = key.bytes();
    const int rc = in_write_txn([&](MDB_txn* txn) {
      MDB_val k = val_of(kb), v = val_of(value);
      MDB_val mv{sizeof m, &m};
      int r = mdb_put(txn, blocks_, &k, &v, 0);
      if (!r) r = mdb_put(txn, meta_, &k, &mv, 0);
      if (!r) r = write_touched(txn);
      return r;
    });
    if (rc) return fail_locked(lmdb_error(rc, "write", o_.path));
    touched_.clear();
    index_[key] = m;
    bytes_ += m.size;
    ++stats_.writes;
    if (bytes_ > o_.capacity_bytes) return evict_locked();
    return {};
  }

  status erase(const store_key& key) override {
    std::lock_guard lock(mu_);
    return erase_locked({key});
  }

  result<std::size_t> erase_tenant(std::uint64_t tenant) override {
    std::lock_guard lock(mu_);
    std::vector<store_key> doomed;
    for (auto it = index_.lower_bound({tenant, 0}); it != index_.end() && it->first.tenant == tenant; ++it)
      doomed.push_back(it->first);
    PAGODA_RETURN_IF_ERROR(erase_locked(doomed));
    return doomed.size();
  }

  status for_each(const std::function<bool(const store_key&, std::span<const std::byte>)>& fn) override {
    MDB_txn* txn = nullptr;
    int rc = mdb_txn_begin(env_, nullptr, MDB_RDONLY, &txn);
    if (rc) return lmdb_error(rc, "read", o_.path);
    MDB_cursor* cur = nullptr;
    mdb_cursor_open(txn, blocks_, &cur);
    MDB_val k, v;
    for (int r = mdb_cursor_get(cur, &k, &v, MDB_FIRST); r == 0; r = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
      if (k.mv_size != 16) continue;
      if (!fn(store_key::from_bytes(static_cast<const std::byte*>(k.mv_data)),
              std::span<const std::byte>(static_cast<const std::byte*>(v.mv_data), v.mv_size)))
        break;
    }
    mdb_cursor_close(cur);
    mdb_txn_abort(txn);
    return {};
  }

  store_tier_stats stats() override {
    std::lock_guard lock(mu_);
    store_tier_stats s = stats_;
    s.tier = tier();
    s.entries = static_cast<std::int64_t>(index_.size());
    s.bytes = bytes_;
    s.capacity_bytes = o_.capacity_bytes;
    return s;
  }

 private:
  bool expired(const entry_meta& m) const {
    return o_.ttl_seconds > 0 && now_ms() - m.last_use > o_.ttl_seconds * 1000;
  }

  status fail(status st) {
    std::lock_guard lock(mu_);
    return fail_locked(std::move(st));
  }
  status fail_locked(status st) {
    ++stats_.errors;
    return st;
  }

  int write_touched(MDB_txn* txn) {
    for (auto& [key, m] : touched_) {
      if (!index_.contains(key)) continue;
      const auto kb = key.bytes();
      MDB_val k = val_of(kb), mv{sizeof m, &m};
      if (int rc = mdb_put(txn, meta_, &k, &mv, 0)) return rc;
    }
    return 0;
  }

  // Runs body in a write transaction and commits it; aborts on body's error.
  // Returns the LMDB error code, 0 on success.
  template <typename F>
  int in_write_txn(F&& body) {
    MDB_txn* txn = nullptr;
    int rc = mdb_txn_begin(env_, nullptr, 0, &txn);
    if (rc) return rc;
    if ((rc = body(txn))) {
      mdb_txn_abort(txn);
      return rc;
    }
    return mdb_txn_commit(txn);  // frees txn, committed or not
  }

  status flush_hits_locked() {
    if (touched_.empty() || !env_) return {};
    if (int rc = in_write_txn([&](MDB_txn* txn) { return write_touched(txn); })) return lmdb_error(rc, "write", o_.path);
    touched_.clear();
    return {};
  }

  status erase_locked(const std::vector<store_key>& keys) {
    if (keys.empty()) return {};
    const int rc = in_write_txn([&](MDB_txn* txn) {
      for (const store_key& key : keys) {
        const auto kb = key.bytes();
        MDB_val k = val_of(kb);
        for (MDB_dbi db : {blocks_, meta_}) {
          const int r = mdb_del(txn, db, &k, nullptr);
          if (r && r != MDB_NOTFOUND) return r;
        }
      }
      return 0;
    });
    if (rc) return fail_locked(lmdb_error(rc, "erase", o_.path));
    for (const store_key& key : keys) {
      if (auto it = index_.find(key); it != index_.end()) {
        bytes_ -= it->second.size;
        index_.erase(it);
      }
      touched_.erase(key);
    }
    return {};
  }

  // Over the cap: drop expired entries, then the lowest scores, down to 90% of
  // the cap. Score: hits, halved every hour since the last use (an entry read
  // many times a while ago outranks one written once just now, and fades).
  status evict_locked() {
    const std::int64_t now = now_ms();
    // (score, last use, key): equal scores go least recently used first.
    std::vector<std::tuple<double, std::int64_t, store_key>> ranked;
    ranked.reserve(index_.size());
    for (const auto& [key, m] : index_) {
      const double age_h = static_cast<double>(std::max<std::int64_t>(now - m.last_use, 0)) / 3.6e6;
      const double score = expired(m) ? -1.0 : (1.0 + m.hits) * std::exp2(-age_h);
      ranked.emplace_back(score, m.last_use, key);
    }
    std::sort(ranked.begin(), ranked.end());
    const std::int64_t target = o_.capacity_bytes - o_.capacity_bytes / 10;
    std::vector<store_key> doomed;
    std::int64_t bytes = bytes_;
    for (const auto& [score, last_use, key] : ranked) {
      if (bytes <= target && score >= 0) break;
      doomed.push_back(key);
      bytes -= index_.at(key).size;
    }
    stats_.evictions += static_cast<std::int64_t>(doomed.size());
    return erase_locked(doomed);
  }

  disk_store_options o_;
  MDB_env* env_ = nullptr;
  MDB_dbi blocks_ = 0, meta_ = 0;
  std::mutex mu_;
  std::map<store_key, entry_meta> index_;
  std::map<store_key, entry_meta> touched_;  // hit counts not yet written to "meta"
  std::int64_t bytes_ = 0;
  store_tier_stats stats_;
};

}  // namespace

result<std::unique_ptr<block_store>> make_disk_store(const disk_store_options& options) {
  if (options.path.empty()) return error(errc::invalid_argument, "KV store: no directory given");
  if (options.capacity_bytes < (std::int64_t{1} << 20))
    return error(errc::invalid_argument, "KV store {}: a size cap of {} bytes is below 1 MiB", options.path,
                 options.capacity_bytes);
  auto s = std::make_unique<disk_store>(options);
  PAGODA_RETURN_IF_ERROR(s->open());
  return std::unique_ptr<block_store>(std::move(s));
}

}  // namespace pagoda
