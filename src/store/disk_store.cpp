// The disk tier on LMDB. Why LMDB rather than one file per block: a write is
// one transaction (atomic: a kill -9 at any moment leaves every entry whole
// or absent, never torn), readers never block the writer, and a block is
// one B-tree lookup and a memcpy from the map, without a file open per block.
//
// Two databases: "blocks" (store key -> encoded record) and "meta" (store key
// -> size, hits, last use), so eviction scores entries without reading their
// values. An in-memory copy of meta (the index) answers lookups; hit counts
// reach "meta" with the next write transaction (a crash loses recent hit counts only).
//
// Locks: index_mu_ guards the index, the pending hit counts and the counters,
// and is never held across an LMDB call: a lookup (count_present, the start
// of get) waits at most for another thread's in-memory work. write_mu_
// serialises the writers (put_many, erase, the hit-count flush), each one
// LMDB write transaction; it is the only lock held across a commit and its
// sync, and nothing that answers a lookup takes it.
#include <fcntl.h>
#include <lmdb.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <tuple>

#include "core/reuse_worth.h"
#include "store/block_store.h"
#include "store/lmdb_check.h"

#include <fmt/format.h>

namespace pagoda {
namespace {

struct entry_meta {
  std::uint32_t size = 0;
  std::uint32_t hits = 0;
  std::int64_t last_use = 0;  // unix milliseconds
};

// LMDB's answers that mean the file is damaged, not that a call failed.
bool lmdb_damage(int rc) {
  return rc == MDB_CORRUPTED || rc == MDB_PAGE_NOTFOUND || rc == MDB_PANIC || rc == MDB_INVALID ||
         rc == MDB_VERSION_MISMATCH || rc == MDB_INCOMPATIBLE;
}

status lmdb_error(int rc, const char* what, const std::string& path) {
  const errc code = rc == MDB_MAP_FULL || rc == ENOSPC ? errc::resource_exhausted
                    : lmdb_damage(rc)                  ? errc::corrupt
                                                       : errc::io_error;
  return error(code, "KV store {}: {}: {}", path, what, mdb_strerror(rc));
}

MDB_val val_of(std::span<const std::byte> s) { return {s.size(), const_cast<std::byte*>(s.data())}; }

// Expired entries are swept out with a write at most this often (between
// sweeps they are misses already).
constexpr std::int64_t k_sweep_interval_ms = 60'000;

// Creates the missing directories of `path` readable by this user only (the
// store holds every tenant's token ids). Existing directories keep their mode.
status make_private_directories(const std::string& path) {
  std::filesystem::path so_far;
  for (const auto& part : std::filesystem::path(path)) {
    so_far /= part;
    if (::mkdir(so_far.c_str(), 0700) != 0 && errno != EEXIST)
      return error(errc::io_error, "KV store {}: cannot create {}: {}", path, so_far.string(), std::strerror(errno));
  }
  if (!std::filesystem::is_directory(path))
    return error(errc::invalid_argument, "KV store {}: not a directory", path);
  return {};
}

// "20240131T235959Z" for unix milliseconds (UTC).
std::string utc_stamp(std::int64_t unix_ms) {
  const std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}


// Opens (creating if need be) an LMDB environment in `dir` with the store's
// two databases. Returns an LMDB error code, 0 on success; env is set either
// way (close it).
int open_lmdb(MDB_env*& env, const std::string& dir, std::size_t map_bytes, unsigned flags, MDB_dbi& blocks,
              MDB_dbi& meta) {
  int rc = mdb_env_create(&env);
  if (rc) return rc;
  mdb_env_set_maxdbs(env, 2);
  if ((rc = mdb_env_set_mapsize(env, map_bytes))) return rc;
  // 0600: the files hold every tenant's token ids.
  if ((rc = mdb_env_open(env, dir.c_str(), flags, 0600))) return rc;
  MDB_txn* txn = nullptr;
  if ((rc = mdb_txn_begin(env, nullptr, 0, &txn))) return rc;
  if ((rc = mdb_dbi_open(txn, "blocks", MDB_CREATE, &blocks)) || (rc = mdb_dbi_open(txn, "meta", MDB_CREATE, &meta))) {
    mdb_txn_abort(txn);
    return rc;
  }
  return mdb_txn_commit(txn);
}

// Copies every entry of database `from_db` into the empty `to_db`, key by key
// (in key order, so appended), one write transaction per k_copy_batch_bytes.
// Only keys and values are copied, never pages: the copy's pages hold nothing
// but live entries (LMDB zeroes the pages it allocates). Returns an LMDB error code.
constexpr std::size_t k_copy_batch_bytes = std::size_t{64} << 20;
int copy_entries(MDB_txn* from, MDB_dbi from_db, MDB_env* to, MDB_dbi to_db) {
  MDB_cursor* cur = nullptr;
  int rc = mdb_cursor_open(from, from_db, &cur);
  if (rc) return rc;
  MDB_txn* w = nullptr;
  std::size_t batch = 0;
  MDB_val k, v;
  int r = mdb_cursor_get(cur, &k, &v, MDB_FIRST);
  for (; r == 0 && rc == 0; r = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
    if (!w && (rc = mdb_txn_begin(to, nullptr, 0, &w))) break;
    if ((rc = mdb_put(w, to_db, &k, &v, MDB_APPEND))) break;
    if ((batch += v.mv_size) >= k_copy_batch_bytes) {
      rc = mdb_txn_commit(w);
      w = nullptr;
      batch = 0;
    }
  }
  mdb_cursor_close(cur);
  if (rc == 0 && r != MDB_NOTFOUND) rc = r;
  if (w && rc) mdb_txn_abort(w);
  if (w && !rc) rc = mdb_txn_commit(w);
  return rc;
}

class disk_store final : public block_store {
 public:
  disk_store(disk_store_options o, const clock_source& clock) : o_(std::move(o)), clock_(clock) {}
  ~disk_store() override {
    {
      std::lock_guard w(write_mu_);
      (void)flush_hits();
    }
    close_env();
    if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock
  }

  // Opens the environment. A file that fails the structural check (or that
  // LMDB itself refuses as damaged) is quarantined when the options say so:
  // moved aside under a timestamped name, and the store starts empty.
  status open() {
    PAGODA_RETURN_IF_ERROR(make_private_directories(o_.path));
    if (o_.owner) PAGODA_RETURN_IF_ERROR(take_lock());
    PAGODA_RETURN_IF_ERROR(o_.owner ? record_capacity() : read_recorded_capacity());
    const std::string data = o_.path + "/data.mdb";
    PAGODA_ASSIGN_OR_RETURN(const lmdb_check_report rep, check_lmdb_file(data));
    if (!rep.ok()) {
      if (!o_.quarantine_damaged)
        return error(errc::corrupt, "KV store {}: damaged: {}", o_.path, rep.summary());
      PAGODA_RETURN_IF_ERROR(quarantine(rep.summary()));
    }
    status st = open_env();
    if (!st.ok() && st.code() == errc::corrupt && o_.quarantine_damaged) {
      close_env();
      PAGODA_RETURN_IF_ERROR(quarantine(st.message()));
      st = open_env();
    }
    return st;
  }

  // The directory's lock: flock on <dir>/lock, which holds the owner's PID.
  status take_lock() {
    const std::string path = o_.path + "/lock";
    lock_fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lock_fd_ < 0) return error(errc::io_error, "KV store {}: cannot open {}: {}", o_.path, path, std::strerror(errno));
    if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      char pid[32] = {};
      const ssize_t n = ::pread(lock_fd_, pid, sizeof(pid) - 1, 0);
      std::string holder(pid, n > 0 ? static_cast<std::size_t>(n) : 0);
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
      ::close(lock_fd_);
      lock_fd_ = -1;
      if (e == EWOULDBLOCK)
        return error(errc::resource_exhausted,
                     "KV store {} is in use by process {} (another pagoda serve?): give each server its own --kv-store "
                     "directory; servers share KV through --kv-store-remote (Redis)",
                     o_.path, holder.empty() ? std::string("?") : holder);
      return error(errc::io_error, "KV store {}: cannot lock {}: {}", o_.path, path, std::strerror(e));
    }
    const std::string me = fmt::format("{}\n", ::getpid());
    if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size()))
      return error(errc::io_error, "KV store {}: cannot write {}: {}", o_.path, path, std::strerror(errno));
    return {};
  }

  // <dir>/capacity: the owner's size cap in bytes, for the tools (`pagoda kv stats`).
  status record_capacity() const {
    const std::string path = o_.path + "/capacity";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);  // private, as the store
    const std::string text = fmt::format("{}\n", o_.capacity_bytes);
    const bool ok = fd >= 0 && ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
    const int e = errno;
    if (fd >= 0) ::close(fd);
    if (!ok) return error(errc::io_error, "KV store {}: cannot write {}: {}", o_.path, path, std::strerror(e));
    return {};
  }
  status read_recorded_capacity() {
    if (!o_.use_recorded_capacity) return {};
    std::FILE* f = std::fopen((o_.path + "/capacity").c_str(), "r");
    if (!f) return {};  // never served from: the tool's own cap
    long long bytes = 0;
    if (std::fscanf(f, "%lld", &bytes) == 1 && bytes >= (1 << 20)) o_.capacity_bytes = bytes;
    std::fclose(f);
    return {};
  }

  const char* tier() const override { return "disk"; }
  bool indexed() const override { return true; }

  result<std::optional<std::vector<std::byte>>> get(const store_key& key) override {
    {
      std::lock_guard lock(index_mu_);
      if (!live(key)) {
        ++stats_.misses;
        return std::optional<std::vector<std::byte>>();
      }
    }
    std::shared_lock env_lock(env_mu_);
    PAGODA_RETURN_IF_ERROR(check_usable());
    MDB_txn* txn = nullptr;
    int rc = mdb_txn_begin(env_, nullptr, MDB_RDONLY, &txn);
    if (rc) return lmdb_fail(rc, "read");
    const auto kb = key.bytes();
    MDB_val k = val_of(kb), v;
    rc = mdb_get(txn, blocks_, &k, &v);
    std::optional<std::vector<std::byte>> out;
    if (rc == 0) {
      const auto* p = static_cast<const std::byte*>(v.mv_data);
      out.emplace(p, p + v.mv_size);
    }
    mdb_txn_abort(txn);
    if (rc != 0 && rc != MDB_NOTFOUND) return lmdb_fail(rc, "get");
    std::lock_guard lock(index_mu_);
    if (!out) {
      ++stats_.misses;
      return out;
    }
    ++stats_.hits;
    if (auto it = index_.find(key); it != index_.end()) {
      ++it->second.hits;
      it->second.last_use = clock_.wall_ms();
      touched_[key] = it->second;
    }
    return out;
  }

  result<std::size_t> count_present(std::span<const store_key> keys) override {
    std::lock_guard lock(index_mu_);
    std::size_t n = 0;
    while (n < keys.size() && live(keys[n])) ++n;
    return n;
  }

  result<std::vector<bool>> contains_each(std::span<const store_key> keys) override {
    std::lock_guard lock(index_mu_);
    std::vector<bool> out;
    out.reserve(keys.size());
    for (const store_key& k : keys) out.push_back(live(k));
    return out;
  }

  status put(const store_key& key, std::span<const std::byte> value) override {
    const store_entry e{key, value};
    return put_many(std::span<const store_entry>(&e, 1));
  }

  status put_many(std::span<const store_entry> entries) override {
    std::lock_guard w(write_mu_);
    PAGODA_RETURN_IF_ERROR(check_usable());
    const std::int64_t now = clock_.wall_ms();
    // What to write: entries whose key is absent or expired (an expired entry
    // is a miss, so it must be stored again: same key, fresh bytes and age).
    std::vector<const store_entry*> fresh;
    std::map<store_key, entry_meta> hits;  // pending hit counts, written in this transaction
    std::vector<store_key> doomed;
    bool sweep = false;
    std::int64_t incoming = 0, replaced = 0;
    {
      std::lock_guard lock(index_mu_);
      std::set<store_key> seen;
      for (const store_entry& e : entries) {
        if (live(e.key) || !seen.insert(e.key).second) continue;
        fresh.push_back(&e);
        incoming += static_cast<std::int64_t>(e.value.size());
        if (const auto it = index_.find(e.key); it != index_.end()) replaced += it->second.size;
      }
      if (fresh.empty()) return {};  // pending hit counts wait for a write that stores something
      hits.swap(touched_);
      sweep = o_.ttl_seconds > 0 && now - last_sweep_ms_ >= k_sweep_interval_ms;
      if (sweep) last_sweep_ms_ = now;
    }
    // Room first: expired entries (at a sweep) and, over the cap, the coldest.
    std::size_t n_fit = fresh.size();
    doomed = pick_victims(sweep, bytes_after(incoming - replaced), fresh, incoming, n_fit);
    for (const store_key& k : doomed) hits.erase(k);
    for (const store_entry* e : fresh) hits.erase(e->key);  // written afresh, hits 0
    const int rc = in_write_txn([&](MDB_txn* txn) {
      for (const store_key& key : doomed)
        if (int r = del(txn, key)) return r;
      for (std::size_t i = 0; i < n_fit; ++i) {
        const store_entry& e = *fresh[i];
        const auto kb = e.key.bytes();
        entry_meta m{static_cast<std::uint32_t>(e.value.size()), 0, now};
        MDB_val k = val_of(kb), v = val_of(e.value), mv{sizeof m, &m};
        if (int r = mdb_put(txn, blocks_, &k, &v, 0)) return r;
        if (int r = mdb_put(txn, meta_, &k, &mv, 0)) return r;
      }
      return write_meta(txn, hits);
    });
    std::lock_guard lock(index_mu_);
    if (rc) {
      for (auto& [k, m] : hits) touched_.try_emplace(k, m);  // kept for the next write
      if (lmdb_damage(rc)) mark_broken(mdb_strerror(rc));
      return fail_locked(lmdb_error(rc, "write", o_.path));
    }
    forget_locked(doomed);
    stats_.evictions += static_cast<std::int64_t>(doomed.size());
    for (std::size_t i = 0; i < n_fit; ++i) {
      const store_entry& e = *fresh[i];
      if (const auto it = index_.find(e.key); it != index_.end()) bytes_ -= it->second.size;
      index_[e.key] = entry_meta{static_cast<std::uint32_t>(e.value.size()), 0, now};
      bytes_ += static_cast<std::int64_t>(e.value.size());
      ++stats_.writes;
    }
    if (n_fit < fresh.size())
      return fail_locked(error(errc::resource_exhausted,
                               "KV store {}: {} of {} blocks do not fit under its cap of {} bytes", o_.path,
                               fresh.size() - n_fit, fresh.size(), o_.capacity_bytes));
    return {};
  }

  status erase(const store_key& key) override {
    std::lock_guard w(write_mu_);
    return erase_keys({key});
  }

  result<std::size_t> erase_tenant(std::uint64_t tenant) override {
    std::lock_guard w(write_mu_);
    std::vector<store_key> doomed;
    {
      std::lock_guard lock(index_mu_);
      for (auto it = index_.lower_bound({tenant, 0}); it != index_.end() && it->first.tenant == tenant; ++it)
        doomed.push_back(it->first);
    }
    PAGODA_RETURN_IF_ERROR(erase_keys(doomed));
    // LMDB frees pages without clearing them, and copies of erased entries
    // stay in freed pages and in the unused parts of live ones: only a fresh
    // file holding nothing but the live entries leaves none of the tenant's bytes.
    if (!doomed.empty()) PAGODA_RETURN_IF_ERROR(compact());
    return doomed.size();
  }

  status for_each(const std::function<bool(const store_key&, std::span<const std::byte>)>& fn) override {
    std::shared_lock env_lock(env_mu_);
    PAGODA_RETURN_IF_ERROR(check_usable());
    MDB_txn* txn = nullptr;
    int rc = mdb_txn_begin(env_, nullptr, MDB_RDONLY, &txn);
    if (rc) return lmdb_fail(rc, "read");
    MDB_cursor* cur = nullptr;
    if ((rc = mdb_cursor_open(txn, blocks_, &cur))) {
      mdb_txn_abort(txn);
      return lmdb_fail(rc, "read");
    }
    MDB_val k, v;
    int r = mdb_cursor_get(cur, &k, &v, MDB_FIRST);
    for (; r == 0; r = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
      if (k.mv_size != 16) continue;
      if (!fn(store_key::from_bytes(static_cast<const std::byte*>(k.mv_data)),
              std::span<const std::byte>(static_cast<const std::byte*>(v.mv_data), v.mv_size)))
        break;
    }
    mdb_cursor_close(cur);
    mdb_txn_abort(txn);
    if (r != 0 && r != MDB_NOTFOUND) return lmdb_fail(r, "read");
    return {};
  }

  store_tier_stats stats() override {
    std::lock_guard lock(index_mu_);
    store_tier_stats s = stats_;
    s.tier = tier();
    s.entries = static_cast<std::int64_t>(index_.size());
    s.bytes = bytes_;
    s.capacity_bytes = o_.capacity_bytes;
    return s;
  }

 private:
  std::size_t map_bytes() const {
    // The map is a reservation of address space, not of disk: the file grows as it fills.
    return static_cast<std::size_t>(o_.capacity_bytes) + static_cast<std::size_t>(o_.capacity_bytes) / 4 +
           (std::size_t{64} << 20);
  }

  status open_env() {
    MDB_txn* txn = nullptr;
    int rc = open_lmdb(env_, o_.path, map_bytes(), MDB_NOTLS, blocks_, meta_);
    if (rc) return lmdb_error(rc, "open", o_.path);
    // Files an older build made 0644 are tightened.
    for (const char* f : {"/data.mdb", "/lock.mdb"}) ::chmod((o_.path + f).c_str(), 0600);
    if ((rc = mdb_txn_begin(env_, nullptr, MDB_RDONLY, &txn))) return lmdb_error(rc, "begin", o_.path);
    // The index: every key of "meta" (the scan of the directory's keys).
    index_.clear();
    bytes_ = 0;
    MDB_cursor* cur = nullptr;
    if ((rc = mdb_cursor_open(txn, meta_, &cur))) {
      mdb_txn_abort(txn);
      return lmdb_error(rc, "read the index", o_.path);
    }
    MDB_val k, v;
    int r = mdb_cursor_get(cur, &k, &v, MDB_FIRST);
    for (; r == 0; r = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
      if (k.mv_size != 16 || v.mv_size != sizeof(entry_meta)) continue;
      entry_meta m;
      std::memcpy(&m, v.mv_data, sizeof m);
      index_[store_key::from_bytes(static_cast<const std::byte*>(k.mv_data))] = m;
      bytes_ += m.size;
    }
    mdb_cursor_close(cur);
    mdb_txn_abort(txn);
    if (r != MDB_NOTFOUND) return lmdb_error(r, "read the index", o_.path);
    last_sweep_ms_ = clock_.wall_ms();
    file_bytes_seen_ = file_bytes();
    return {};
  }

  // Rewrites the store as a fresh file holding only its live entries (see
  // copy_entries), then swaps it in: the old file, with every byte of erased
  // entries in it, is unlinked. Readers wait for the swap only (env_mu_);
  // the copy runs beside them. A process that has the old file open (`pagoda
  // kv`) keeps reading its snapshot. Cost: one read and one write of the live
  // entries (docs/kv-store.md). REQUIRES: write_mu_ held.
  status compact() {
    PAGODA_RETURN_IF_ERROR(check_usable());
    PAGODA_RETURN_IF_ERROR(flush_hits());  // pending hit counts go along
    const std::string tmp = o_.path + "/compact.tmp";
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);
    if (::mkdir(tmp.c_str(), 0700) != 0)
      return fail(error(errc::io_error, "KV store {}: cannot create {}: {}", o_.path, tmp, std::strerror(errno)));
    MDB_env* fresh = nullptr;
    MDB_dbi to_blocks = 0, to_meta = 0;
    int rc = open_lmdb(fresh, tmp, map_bytes(), MDB_NOTLS | MDB_NOSYNC, to_blocks, to_meta);
    if (!rc) {
      MDB_txn* from = nullptr;
      rc = mdb_txn_begin(env_, nullptr, MDB_RDONLY, &from);
      if (!rc) rc = copy_entries(from, blocks_, fresh, to_blocks);
      if (!rc) rc = copy_entries(from, meta_, fresh, to_meta);
      if (from) mdb_txn_abort(from);
    }
    if (!rc) rc = mdb_env_sync(fresh, 1);
    if (fresh) mdb_env_close(fresh);
    if (rc) {
      std::filesystem::remove_all(tmp, ec);
      return lmdb_fail(rc, "compact");
    }
    std::unique_lock env_lock(env_mu_);
    close_env();
    std::filesystem::remove(o_.path + "/lock.mdb", ec);  // the old file's reader table; LMDB makes a new one
    std::filesystem::rename(tmp + "/data.mdb", o_.path + "/data.mdb", ec);
    const std::error_code moved = ec;
    std::filesystem::remove_all(tmp, ec);
    if (const int dir = ::open(o_.path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dir >= 0) {
      ::fsync(dir);  // the rename is durable
      ::close(dir);
    }
    if ((rc = open_lmdb(env_, o_.path, map_bytes(), MDB_NOTLS, blocks_, meta_))) {
      mark_broken(fmt::format("reopening after a compaction: {}", mdb_strerror(rc)));
      return lmdb_fail(rc, "reopen after compacting");
    }
    file_bytes_seen_ = file_bytes();  // smaller now: not a truncation
    if (moved) return fail(error(errc::io_error, "KV store {}: compacting: {}", o_.path, moved.message()));
    std::lock_guard lock(index_mu_);
    ++stats_.compactions;
    return {};
  }

  void close_env() {
    if (env_) mdb_env_close(env_);
    env_ = nullptr;
  }

  // Moves a damaged data file aside as data.mdb.damaged-<UTC time> (kept for
  // inspection, readable by this user only; outside the size cap) and drops
  // the lock file, so that LMDB starts an empty store. Logged and counted
  // (an error of the tier, and `quarantined`).
  status quarantine(const std::string& why) {
    const std::string data = o_.path + "/data.mdb";
    std::string dest = data + ".damaged-" + utc_stamp(clock_.wall_ms());
    for (int i = 2; std::filesystem::exists(dest); ++i) dest = data + ".damaged-" + utc_stamp(clock_.wall_ms()) + "-" + std::to_string(i);
    std::error_code ec;
    if (std::filesystem::exists(data)) {
      std::filesystem::rename(data, dest, ec);
      if (ec) return error(errc::io_error, "KV store {}: damaged ({}), and moving it aside failed: {}", o_.path, why, ec.message());
      ::chmod(dest.c_str(), 0600);
    }
    std::filesystem::remove(o_.path + "/lock.mdb", ec);
    std::fprintf(stderr, "pagoda: KV store %s is damaged (%s); moved it to %s and starting with an empty store\n",
                 o_.path.c_str(), why.c_str(), dest.c_str());
    std::lock_guard lock(index_mu_);
    ++stats_.errors;
    ++stats_.quarantined;
    return {};
  }

  std::int64_t file_bytes() const {
    int fd = -1;
    struct stat st {};
    if (!env_ || mdb_env_get_fd(env_, &fd) != 0 || ::fstat(fd, &st) != 0) return -1;
    return st.st_size;
  }

  // Before any call that reads the map: LMDB never shrinks its file, so a
  // file smaller than it was is truncated, and a read past its end would be a
  // bus error. Such a store, or one LMDB found damaged, is out of use (every
  // call fails, counted) until a restart quarantines it. A truncation racing
  // with a read already past this check is not caught.
  status check_usable() {
    if (!broken_.load(std::memory_order_acquire)) {
      const std::int64_t now = file_bytes();
      std::int64_t seen = file_bytes_seen_.load(std::memory_order_relaxed);
      while (now > seen && !file_bytes_seen_.compare_exchange_weak(seen, now)) {
      }
      if (now >= seen) return {};
      mark_broken(fmt::format("its file shrank from {} to {} bytes", seen, now));
    }
    return fail(error(errc::corrupt, "KV store {}: damaged, out of use until a restart quarantines it", o_.path));
  }

  void mark_broken(const std::string& why) {
    if (broken_.exchange(true)) return;
    std::fprintf(stderr, "pagoda: KV store %s is damaged (%s); not using it until a restart\n", o_.path.c_str(),
                 why.c_str());
  }

  // An LMDB error: counted, and a damaged file takes the store out of use.
  status lmdb_fail(int rc, const char* what) {
    status st = lmdb_error(rc, what, o_.path);
    if (lmdb_damage(rc)) mark_broken(st.message());
    return fail(std::move(st));
  }

  // REQUIRES: index_mu_ held.
  bool expired(const entry_meta& m) const {
    return o_.ttl_seconds > 0 && clock_.wall_ms() - m.last_use > o_.ttl_seconds * 1000;
  }
  bool live(const store_key& key) const {
    const auto it = index_.find(key);
    return it != index_.end() && !expired(it->second);
  }

  std::int64_t bytes_after(std::int64_t delta) {
    std::lock_guard lock(index_mu_);
    return bytes_ + delta;
  }

  status fail(status st) {
    std::lock_guard lock(index_mu_);
    return fail_locked(std::move(st));
  }
  status fail_locked(status st) {
    ++stats_.errors;
    return st;
  }

  // What put_many drops to make room, chosen from a copy of the index so
  // that index_mu_ is held only for the copy: at a sweep, every expired
  // entry; when the store would pass its cap, expired ones and then the lowest
  // scores down to 90% of the cap with the new entries in. Score: the worth
  // rule the memory tier evicts by (core/reuse_worth.h), (1 + hits) halved
  // every hour since the last use (an entry read many times a while ago
  // outranks one written once just now, and fades). n_fit: how many of the
  // fresh entries fit (all but for a batch larger than the cap).
  // REQUIRES: write_mu_ held (the index changes only under it).
  std::vector<store_key> pick_victims(bool sweep, std::int64_t bytes_then, const std::vector<const store_entry*>& fresh,
                                      std::int64_t incoming, std::size_t& n_fit) {
    const bool over = bytes_then > o_.capacity_bytes;
    if (!sweep && !over) return {};
    std::vector<std::pair<store_key, entry_meta>> all;
    std::vector<bool> dead;
    {
      std::lock_guard lock(index_mu_);
      all.assign(index_.begin(), index_.end());
      dead.reserve(all.size());
      for (const auto& [k, m] : all) dead.push_back(expired(m));
    }
    const std::int64_t now = clock_.wall_ms();
    std::set<store_key> replacing;
    for (const store_entry* e : fresh) replacing.insert(e->key);
    // (score, last use, key): equal scores go least recently used first; expired ones first of all.
    std::vector<std::tuple<double, std::int64_t, store_key, std::uint32_t>> ranked;
    std::int64_t bytes = bytes_then - incoming;  // without the new entries
    for (std::size_t i = 0; i < all.size(); ++i) {
      const auto& [key, m] = all[i];
      if (replacing.contains(key)) continue;  // overwritten anyway
      const double age_h = static_cast<double>(std::max<std::int64_t>(now - m.last_use, 0)) / 3.6e6;
      ranked.emplace_back(dead[i] ? -1.0 : reuse::worth(m.hits, age_h), m.last_use, key, m.size);
    }
    std::sort(ranked.begin(), ranked.end());
    // Over the cap, a batch larger than the target is trimmed to what fits into an emptied store.
    const std::int64_t target = o_.capacity_bytes - o_.capacity_bytes / 10;
    std::int64_t in = 0;
    n_fit = 0;
    while (n_fit < fresh.size() && (!over || in + static_cast<std::int64_t>(fresh[n_fit]->value.size()) <= target))
      in += static_cast<std::int64_t>(fresh[n_fit++]->value.size());
    std::vector<store_key> doomed;
    for (const auto& [score, last_use, key, size] : ranked) {
      if (score >= 0 && (!over || bytes + in <= target)) break;
      doomed.push_back(key);
      bytes -= size;
    }
    return doomed;
  }

  int del(MDB_txn* txn, const store_key& key) {
    const auto kb = key.bytes();
    MDB_val k = val_of(kb);
    for (MDB_dbi db : {blocks_, meta_}) {
      const int r = mdb_del(txn, db, &k, nullptr);
      if (r && r != MDB_NOTFOUND) return r;
    }
    return 0;
  }

  int write_meta(MDB_txn* txn, const std::map<store_key, entry_meta>& metas) {
    for (const auto& [key, m] : metas) {
      const auto kb = key.bytes();
      MDB_val k = val_of(kb), mv{sizeof m, const_cast<entry_meta*>(&m)};
      if (int rc = mdb_put(txn, meta_, &k, &mv, 0)) return rc;
    }
    return 0;
  }

  // Runs body in a write transaction and commits it; aborts on body's error.
  // Returns the LMDB error code, 0 on success. REQUIRES: write_mu_ held, index_mu_ not.
  template <typename F>
  int in_write_txn(F&& body) {
    MDB_txn* txn = nullptr;
    int rc = mdb_txn_begin(env_, nullptr, 0, &txn);
    if (rc) return rc;
    if ((rc = body(txn))) {
      mdb_txn_abort(txn);
      return rc;
    }
    if (o_.before_commit) o_.before_commit();
    return mdb_txn_commit(txn);  // frees txn, committed or not
  }

  // REQUIRES: write_mu_ held.
  status flush_hits() {
    if (!env_ || !check_usable().ok()) return {};
    std::map<store_key, entry_meta> hits;
    {
      std::lock_guard lock(index_mu_);
      hits.swap(touched_);
    }
    if (hits.empty()) return {};
    if (int rc = in_write_txn([&](MDB_txn* txn) { return write_meta(txn, hits); }))
      return lmdb_error(rc, "write", o_.path);
    return {};
  }

  // REQUIRES: index_mu_ held.
  void forget_locked(const std::vector<store_key>& keys) {
    for (const store_key& key : keys) {
      if (auto it = index_.find(key); it != index_.end()) {
        bytes_ -= it->second.size;
        index_.erase(it);
      }
      touched_.erase(key);
    }
  }

  // REQUIRES: write_mu_ held.
  status erase_keys(const std::vector<store_key>& keys) {
    if (keys.empty()) return {};
    PAGODA_RETURN_IF_ERROR(check_usable());
    const int rc = in_write_txn([&](MDB_txn* txn) {
      for (const store_key& key : keys)
        if (int r = del(txn, key)) return r;
      return 0;
    });
    if (rc && lmdb_damage(rc)) mark_broken(mdb_strerror(rc));
    std::lock_guard lock(index_mu_);
    if (rc) return fail_locked(lmdb_error(rc, "erase", o_.path));
    forget_locked(keys);
    return {};
  }

  disk_store_options o_;
  const clock_source& clock_;
  int lock_fd_ = -1;  // the directory's lock, held while open (owner only)
  MDB_env* env_ = nullptr;
  MDB_dbi blocks_ = 0, meta_ = 0;
  std::mutex write_mu_;  // one writer at a time; held across LMDB write transactions
  std::mutex index_mu_;  // never held across LMDB calls
  // Readers (get, for_each) hold it shared while they use env_; a compaction
  // holds it alone while it swaps the environment (writers are kept out by write_mu_).
  std::shared_mutex env_mu_;
  std::map<store_key, entry_meta> index_;
  std::map<store_key, entry_meta> touched_;  // hit counts not yet written to "meta"
  std::int64_t bytes_ = 0;
  std::int64_t last_sweep_ms_ = 0;
  store_tier_stats stats_;
  std::atomic<std::int64_t> file_bytes_seen_{0};  // the largest size of data.mdb seen
  std::atomic<bool> broken_{false};               // found damaged while open
};

}  // namespace

result<std::unique_ptr<block_store>> make_disk_store(const disk_store_options& options, const clock_source& clock) {
  if (options.path.empty()) return error(errc::invalid_argument, "KV store: no directory given");
  if (options.capacity_bytes < (std::int64_t{1} << 20))
    return error(errc::invalid_argument, "KV store {}: a size cap of {} bytes is below 1 MiB", options.path,
                 options.capacity_bytes);
  auto s = std::make_unique<disk_store>(options, clock);
  PAGODA_RETURN_IF_ERROR(s->open());
  return std::unique_ptr<block_store>(std::move(s));
}

}  // namespace pagoda
