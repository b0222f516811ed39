#include "store/warehouse.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "core/assert.h"

namespace pagoda {

namespace {

// Remembered answers of remote tiers, per tier, at most this many (past it
// the stale ones go, then all): a bound on memory, not a cache size to tune.
constexpr std::size_t k_max_known = 1 << 16;

// The calling thread yields the CPU to normal-priority ones when they contend
// (nice 10); a failure leaves it as it was.
void lower_priority() { (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 10); }

}  // namespace

kv_warehouse::kv_warehouse(std::vector<std::unique_ptr<block_store>> tiers, const warehouse_options& options)
    : tiers_(std::move(tiers)), o_(options) {
  PAGODA_ASSERT(!tiers_.empty(), "a KV warehouse needs at least one tier");
  c_.loads_by_tier.assign(tiers_.size(), 0);
  load_seconds_.assign(tiers_.size(), histogram(load_buckets_seconds()));
  known_.resize(tiers_.size());
  down_until_us_.assign(tiers_.size(), INT64_MIN);
  writer_ = std::thread([this] {
    lower_priority();
    write_loop();
  });
  fetcher_ = std::thread([this] { fetch_loop(); });
  if (std::any_of(tiers_.begin(), tiers_.end(), [](const auto& t) { return !t->indexed(); }))
    looker_ = std::thread([this] { lookup_loop(); });
}

kv_warehouse::~kv_warehouse() { close(); }

void kv_warehouse::close() {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_write_.notify_all();
  cv_fetch_.notify_all();
  cv_lookup_.notify_all();
  if (writer_.joinable()) writer_.join();  // drains the write queue first
  if (fetcher_.joinable()) fetcher_.join();
  if (looker_.joinable()) looker_.join();
  // What was never fetched is a miss: a loading sequence computes it.
  std::lock_guard lock(mu_);
  for (auto& [key, h] : held_)
    if (h.st == held::state::queued) h.st = held::state::done;
  fetch_queue_.clear();
}

void kv_warehouse::quiesce() {
  std::unique_lock lock(mu_);
  cv_idle_.wait(lock, [&] {
    return stopping_ || (fetch_queue_.empty() && lookup_queue_.empty() && !fetching_ && !looking_);
  });
}

store_key kv_warehouse::key_of(std::string_view tenant, const stored_block_ref& ref) const {
  return make_store_key(kv_space{o_.model, ref.layout}, tenant, ref.key);
}

// --- write path ------------------------------------------------------------------

void kv_warehouse::write(const cached_block& b) {
  // The copy is made before taking the lock: the other threads wait for mu_
  // only as long as a queue operation takes.
  block_record r;
  r.key = key_of(b.tenant, {b.layout, b.key});
  r.chain = b.key;
  r.parent = b.parent;
  r.tenant.assign(b.tenant);
  r.tokens.assign(b.tokens.begin(), b.tokens.end());
  r.bytes.assign(b.bytes.begin(), b.bytes.end());
  std::lock_guard lock(mu_);
  ++c_.queued;
  block_bytes_estimate_ = std::max(block_bytes_estimate_, r.bytes.size());
  if (stopping_ || write_queue_.size() >= o_.max_queue_blocks || queue_bytes_ + r.bytes.size() > o_.max_queue_bytes) {
    ++c_.dropped;
    return;
  }
  const bool was_empty = write_queue_.empty();
  queue_bytes_ += r.bytes.size();
  write_queue_.push_back(std::move(r));
  c_.queue_blocks = static_cast<std::int64_t>(write_queue_.size());
  // The writer sleeps on an empty queue or lingers for a full batch: woken
  // for those only, not once per block.
  if (was_empty || queue_bytes_ >= o_.batch_bytes) cv_write_.notify_one();
}

void kv_warehouse::flush() {
  std::unique_lock lock(mu_);
  ++flushing_;
  cv_write_.notify_one();
  cv_idle_.wait(lock, [&] { return write_queue_.empty() && !writing_batch_; });
  --flushing_;
}

void kv_warehouse::flush(std::string_view tenant, std::span<const stored_block_ref> refs) {
  std::vector<store_key> wanted;
  wanted.reserve(refs.size());
  for (const stored_block_ref& r : refs) wanted.push_back(key_of(tenant, r));
  std::sort(wanted.begin(), wanted.end());
  const auto is_wanted = [&](const store_key& k) { return std::binary_search(wanted.begin(), wanted.end(), k); };
  std::unique_lock lock(mu_);
  ++flushing_;
  cv_write_.notify_one();
  cv_idle_.wait(lock, [&] {
    if (std::any_of(writing_.begin(), writing_.end(), is_wanted)) return false;
    return std::none_of(write_queue_.begin(), write_queue_.end(), [&](const block_record& r) { return is_wanted(r.key); });
  });
  --flushing_;
}

void kv_warehouse::write_loop() {
  for (;;) {
    std::vector<block_record> batch;
    {
      std::unique_lock lock(mu_);
      cv_write_.wait(lock, [&] { return !write_queue_.empty() || stopping_; });
      if (write_queue_.empty()) return;  // stopping, and drained
      cv_write_.wait_for(lock, std::chrono::microseconds(o_.write_linger_us),
                         [&] { return stopping_ || flushing_ > 0 || queue_bytes_ >= o_.batch_bytes; });
      // Everything queued, as one batch: one transaction (and one sync) per tier.
      batch.reserve(write_queue_.size());
      writing_.clear();
      for (block_record& r : write_queue_) {
        writing_.push_back(r.key);
        batch.push_back(std::move(r));
      }
      write_queue_.clear();
      queue_bytes_ = 0;
      c_.queue_blocks = 0;
      std::sort(writing_.begin(), writing_.end());
      writing_batch_ = true;
    }
    write_batch(batch);
  }
}

void kv_warehouse::write_batch(std::vector<block_record>& batch) {
  // No lock of the warehouse is held here: the tiers' I/O (and the disk
  // tier's write lock, held across its commit and sync) never stands between
  // the engine thread and mu_.
  const std::size_t n = batch.size();
  std::vector<store_key> keys(n);
  for (std::size_t i = 0; i < n; ++i) keys[i] = batch[i].key;
  std::vector<std::vector<std::byte>> encoded(n);
  std::vector<std::uint8_t> stored(n, 0), failed(n, 0);
  std::vector<std::pair<std::size_t, store_key>> now_known;  // (tier, key) stored in a tier without an index
  for (std::size_t t = 0; t < tiers_.size(); ++t) {
    block_store& tier = *tiers_[t];
    // Keys already there are skipped (a tier that cannot say gets them all: a put keeps what it has).
    auto present = tier.contains_each(keys);
    std::vector<store_entry> entries;
    std::vector<std::size_t> which;
    for (std::size_t i = 0; i < n; ++i) {
      if (present.ok() && i < present->size() && (*present)[i]) continue;
      if (encoded[i].empty()) encoded[i] = encode_block_record(batch[i], o_.compress, o_.secret.get());
      entries.push_back({keys[i], encoded[i]});
      which.push_back(i);
    }
    if (entries.empty()) continue;
    const bool ok = tier.put_many(entries).ok();
    for (const std::size_t i : which) (ok ? stored : failed)[i] = 1;
    if (ok && !tier.indexed())
      for (const std::size_t i : which) now_known.emplace_back(t, keys[i]);
  }
  std::lock_guard lock(mu_);
  ++c_.write_batches;
  for (std::size_t i = 0; i < n; ++i) {
    if (stored[i]) ++c_.written;
    else if (!failed[i]) ++c_.already_stored;
    if (failed[i]) ++c_.write_errors;
  }
  const std::int64_t now = clock().monotonic_us();
  for (const auto& [t, k] : now_known) known_[t][k] = {known::what::present, now};
  writing_.clear();
  writing_batch_ = false;
  cv_idle_.notify_all();  // flush() of everything, or of some keys
}

// --- lookups -----------------------------------------------------------------------

int kv_warehouse::known_run_locked(std::size_t t, std::span<const store_key> keys, std::int64_t now) {
  auto& kn = known_[t];
  std::size_t m = 0;
  for (; m < keys.size(); ++m) {
    const auto it = kn.find(keys[m]);
    const bool stale =
        it == kn.end() || (it->second.w != known::what::asking && now - it->second.at_us > o_.lookup_ttl_us);
    if (stale) {
      // Ask for the rest of the run at once; until the answer, these keys are being asked.
      lookup l{t, std::vector<store_key>(keys.begin() + static_cast<std::ptrdiff_t>(m), keys.end())};
      for (const store_key& k : l.keys) kn[k] = {known::what::asking, now};
      lookup_queue_.push_back(std::move(l));
      cv_lookup_.notify_one();
      return -1;
    }
    if (it->second.w == known::what::asking) {
      if (now - it->second.at_us > o_.lookup_timeout_us) break;  // stuck: "none" from here on
      return -1;
    }
    if (it->second.w == known::what::absent) break;
  }
  return static_cast<int>(m);
}

int kv_warehouse::n_available(std::string_view tenant, std::span<const stored_block_ref> refs) {
  std::vector<store_key> keys;
  keys.reserve(refs.size());
  for (const stored_block_ref& r : refs) keys.push_back(key_of(tenant, r));
  const std::int64_t now = clock().monotonic_us();
  // The run continues from tier to tier: blocks 0..a-1 on disk, a..b-1 in Redis, ...
  std::size_t n = 0;
  for (std::size_t t = 0; t < tiers_.size() && n < keys.size(); ++t) {
    const auto rest = std::span<const store_key>(keys).subspan(n);
    if (tiers_[t]->indexed()) {
      // From the tier's index: its lock is never held across I/O.
      auto present = tiers_[t]->count_present(rest);
      if (present.ok()) n += *present;
      continue;
    }
    std::lock_guard lock(mu_);
    if (stopping_ || now < down_until_us_[t]) continue;  // down: holds nothing for now
    const int m = known_run_locked(t, rest, now);
    if (m < 0) {
      ++c_.lookups;
      ++c_.lookups_pending;
      return k_source_pending;
    }
    n += static_cast<std::size_t>(m);
  }
  std::lock_guard lock(mu_);
  ++c_.lookups;
  return static_cast<int>(n);
}

void kv_warehouse::forget_known_locked(std::size_t t, std::int64_t now) {
  auto& kn = known_[t];
  if (kn.size() <= k_max_known) return;
  std::erase_if(kn, [&](const auto& e) {
    const known& k = e.second;
    return k.w == known::what::asking ? now - k.at_us > o_.lookup_timeout_us : now - k.at_us > o_.lookup_ttl_us;
  });
  if (kn.size() > k_max_known) kn.clear();  // answers are asked again; nothing else depends on them
}

void kv_warehouse::lookup_loop() {
  for (;;) {
    lookup l;
    {
      std::unique_lock lock(mu_);
      cv_lookup_.wait(lock, [&] { return !lookup_queue_.empty() || stopping_; });
      if (stopping_) return;
      l = std::move(lookup_queue_.front());
      lookup_queue_.pop_front();
      looking_ = true;
    }
    auto present = tiers_[l.tier]->count_present(l.keys);  // I/O, no lock held
    std::lock_guard lock(mu_);
    looking_ = false;
    cv_idle_.notify_all();
    const std::int64_t now = clock().monotonic_us();
    auto& kn = known_[l.tier];
    if (!present.ok()) {
      // Down (or failing): it holds nothing until asked again after lookup_ttl_us.
      down_until_us_[l.tier] = now + o_.lookup_ttl_us;
      for (const store_key& k : l.keys) kn.erase(k);
      continue;
    }
    const std::size_t c = std::min(*present, l.keys.size());
    for (std::size_t i = 0; i < c; ++i) kn[l.keys[i]] = {known::what::present, now};
    if (c < l.keys.size()) kn[l.keys[c]] = {known::what::absent, now};
    for (std::size_t i = c + 1; i < l.keys.size(); ++i)  // not asked past the first absent one
      if (auto it = kn.find(l.keys[i]); it != kn.end() && it->second.w == known::what::asking) kn.erase(it);
    forget_known_locked(l.tier, now);
  }
}

// --- fetching --------------------------------------------------------------------

int kv_warehouse::fetch_one(const store_key& key, std::vector<std::byte>& out) {
  for (std::size_t t = 0; t < tiers_.size(); ++t) {
    const std::int64_t t0 = now_us();
    auto got = tiers_[t]->get(key);
    if (!got.ok() || !got->has_value()) continue;  // a failed tier is a miss, counted by the tier
    auto rec = decode_block_record(**got, key, o_.secret.get());
    if (!rec.ok()) {
      const bool forged = rec.error().code() == errc::unauthenticated;
      {
        std::lock_guard lock(mu_);
        ++(forged ? c_.forged : c_.corrupt);
      }
      // Never served, and not found again; outside mu_ (it is I/O).
      if (!forged || o_.secret) (void)tiers_[t]->erase(key);
      continue;
    }
    out = std::move(rec->bytes);
    if (t > 0) {
      // Found further out: keep a copy in the nearer tiers.
      for (std::size_t n = 0; n < t; ++n) (void)tiers_[n]->put(key, **got);
    }
    std::lock_guard lock(mu_);
    ++c_.loads_by_tier[t];
    load_seconds_[t].observe(static_cast<double>(now_us() - t0) * 1e-6);
    return static_cast<int>(t);
  }
  return -1;
}

void kv_warehouse::prefetch(std::string_view tenant, std::span<const stored_block_ref> refs) {
  std::lock_guard lock(mu_);
  // Past the cap, new fetches are refused, and so is the rest of the run
  // (loads count only up to the first block that fails). Blocks already
  // held are shared (one more holder), whatever the cap.
  bool refusing = stopping_;
  for (const stored_block_ref& r : refs) {
    const store_key sk = key_of(tenant, r);
    auto [it, inserted] = held_.try_emplace(sk);
    held& h = it->second;
    ++h.holders;
    if (!inserted && h.st != held::state::refused) continue;
    if (!refusing && held_bytes_ > 0 && held_bytes_ + block_bytes_estimate_ > o_.max_prefetch_bytes) refusing = true;
    if (refusing) {
      h.st = held::state::refused;
      ++c_.prefetch_refused;
      continue;
    }
    h.st = held::state::queued;
    h.reserved = block_bytes_estimate_;
    held_bytes_ += h.reserved;
    fetch_queue_.push_back(sk);
  }
  c_.held_bytes = static_cast<std::int64_t>(held_bytes_);
  cv_fetch_.notify_one();
}

void kv_warehouse::fetch_loop() {
  for (;;) {
    std::vector<store_key> batch;
    {
      std::unique_lock lock(mu_);
      cv_fetch_.wait(lock, [&] { return !fetch_queue_.empty() || stopping_; });
      if (stopping_) return;
      batch.assign(fetch_queue_.begin(), fetch_queue_.end());
      fetch_queue_.clear();
      fetching_ = true;
    }
    for (const store_key& k : batch) {
      {
        std::lock_guard lock(mu_);
        const auto it = held_.find(k);
        if (it == held_.end() || it->second.st != held::state::queued) continue;  // released meanwhile
      }
      std::vector<std::byte> bytes;
      const int tier = fetch_one(k, bytes);
      std::lock_guard lock(mu_);
      const auto it = held_.find(k);
      if (it == held_.end()) continue;  // released while it was fetched
      held& h = it->second;
      h.st = held::state::done;
      h.tier = tier;
      held_bytes_ = held_bytes_ - h.reserved + bytes.size();
      h.reserved = bytes.size();
      block_bytes_estimate_ = std::max(block_bytes_estimate_, bytes.size());
      if (tier >= 0) h.bytes = std::make_shared<const std::vector<std::byte>>(std::move(bytes));
      c_.held_bytes = static_cast<std::int64_t>(held_bytes_);
    }
    std::lock_guard lock(mu_);
    fetching_ = false;
    cv_idle_.notify_all();
  }
}

bool kv_warehouse::settled(std::string_view tenant, std::span<const stored_block_ref> refs) {
  std::lock_guard lock(mu_);
  for (const stored_block_ref& r : refs) {
    const auto it = held_.find(key_of(tenant, r));
    if (it != held_.end() && it->second.st == held::state::queued) return false;
  }
  return true;
}

int kv_warehouse::read(std::string_view tenant, const stored_block_ref& ref, std::span<std::byte> out) {
  const store_key sk = key_of(tenant, ref);
  std::shared_ptr<const std::vector<std::byte>> bytes;
  int tier = -1;
  {
    std::lock_guard lock(mu_);
    const auto it = held_.find(sk);
    if (it != held_.end() && it->second.st == held::state::done && it->second.bytes) {
      bytes = it->second.bytes;
      tier = it->second.tier;
    }
    if (!bytes || bytes->size() != out.size()) {
      ++c_.load_misses;  // not prefetched, not found, or another size: computed instead
      return -1;
    }
    ++c_.loads;
  }
  std::copy(bytes->begin(), bytes->end(), out.begin());  // the holder keeps it alive until released
  return tier;
}

void kv_warehouse::release(std::string_view tenant, std::span<const stored_block_ref> refs) {
  std::lock_guard lock(mu_);
  for (const stored_block_ref& r : refs) {
    const auto it = held_.find(key_of(tenant, r));
    if (it == held_.end() || --it->second.holders > 0) continue;
    held_bytes_ -= it->second.reserved;
    held_.erase(it);  // a queued fetch of it is skipped
  }
  c_.held_bytes = static_cast<std::int64_t>(held_bytes_);
}

int kv_warehouse::n_stored(std::string_view tenant, std::span<const stored_block_ref> refs) {
  std::vector<store_key> keys;
  keys.reserve(refs.size());
  for (const stored_block_ref& r : refs) keys.push_back(key_of(tenant, r));
  std::size_t n = 0;
  for (const auto& tier : tiers_) {
    if (n == keys.size()) break;
    auto present = tier->count_present(std::span<const store_key>(keys).subspan(n));
    if (present.ok()) n += *present;
  }
  return static_cast<int>(n);
}

// --- admin -----------------------------------------------------------------------

result<std::size_t> kv_warehouse::erase_tenant(std::string_view tenant) {
  flush();  // nothing of the tenant may land after the erase
  std::size_t n = 0;
  const std::uint64_t th = tenant_hash(tenant);
  for (const auto& tier : tiers_) {
    PAGODA_ASSIGN_OR_RETURN(std::size_t k, tier->erase_tenant(th));
    n += k;
  }
  std::lock_guard lock(mu_);
  for (auto& kn : known_)  // what was said about its keys no longer holds
    for (auto it = kn.lower_bound({th, 0}); it != kn.end() && it->first.tenant == th;) it = kn.erase(it);
  return n;
}

std::vector<store_tier_stats> kv_warehouse::tier_stats() {
  std::vector<store_tier_stats> out;
  for (const auto& tier : tiers_) out.push_back(tier->stats());
  return out;
}

warehouse_counters kv_warehouse::counters() {
  std::lock_guard lock(mu_);
  return c_;
}

std::vector<histogram_snapshot> kv_warehouse::load_seconds_by_tier() {
  std::lock_guard lock(mu_);
  std::vector<histogram_snapshot> out;
  for (const histogram& h : load_seconds_) out.push_back(h.snapshot());
  return out;
}

std::vector<std::string> kv_warehouse::tier_names() const {
  std::vector<std::string> names;
  for (const auto& t : tiers_) names.emplace_back(t->tier());
  return names;
}

std::vector<std::pair<std::string, int>> cached_tokens_by_tier(const request_usage& usage,
                                                               const std::vector<std::string>& tier_names) {
  std::vector<std::pair<std::string, int>> out{{"memory", usage.cached_tokens}};
  for (std::size_t t = 0; t < tier_names.size(); ++t) {
    const int n = t < usage.loaded_tokens_by_tier.size() ? usage.loaded_tokens_by_tier[t] : 0;
    out.emplace_back(tier_names[t], n);
    out.front().second -= n;
  }
  out.front().second = std::max(out.front().second, 0);
  return out;
}

}  // namespace pagoda
