#include "store/warehouse.h"

#include <algorithm>
#include <chrono>

#include "core/assert.h"
#include "core/clock.h"

namespace pagoda {

kv_warehouse::kv_warehouse(std::vector<std::unique_ptr<block_store>> tiers, const warehouse_options& options)
    : tiers_(std::move(tiers)), o_(options) {
  PAGODA_ASSERT(!tiers_.empty(), "a KV warehouse needs at least one tier");
  c_.loads_by_tier.assign(tiers_.size(), 0);
  load_seconds_.assign(tiers_.size(), histogram(load_buckets_seconds()));
  writer_ = std::thread([this] { write_loop(); });
  fetcher_ = std::thread([this] { fetch_loop(); });
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
  if (writer_.joinable()) writer_.join();  // drains the write queue first
  if (fetcher_.joinable()) fetcher_.join();
}

// --- write path ------------------------------------------------------------------

void kv_warehouse::write(const cached_block& b) {
  std::lock_guard lock(mu_);
  ++c_.queued;
  if (stopping_ || write_queue_.size() >= o_.max_queue_blocks || queue_bytes_ + b.bytes.size() > o_.max_queue_bytes) {
    ++c_.dropped;
    return;
  }
  block_record r;
  r.key = make_store_key(o_.space, b.tenant, b.key);
  r.chain = b.key;
  r.parent = b.parent;
  r.tenant.assign(b.tenant);
  r.tokens.assign(b.tokens.begin(), b.tokens.end());
  r.bytes.assign(b.bytes.begin(), b.bytes.end());
  queue_bytes_ += r.bytes.size();
  write_queue_.push_back(std::move(r));
  c_.queue_blocks = static_cast<std::int64_t>(write_queue_.size());
  cv_write_.notify_one();
}

void kv_warehouse::flush() {
  std::unique_lock lock(mu_);
  cv_idle_.wait(lock, [&] { return write_queue_.empty() && !writing_; });
}

void kv_warehouse::flush(std::string_view tenant, std::span<const block_key> keys) {
  std::vector<store_key> wanted;
  wanted.reserve(keys.size());
  for (const block_key k : keys) wanted.push_back(make_store_key(o_.space, tenant, k));
  std::sort(wanted.begin(), wanted.end());
  const auto is_wanted = [&](const store_key& k) { return std::binary_search(wanted.begin(), wanted.end(), k); };
  std::unique_lock lock(mu_);
  cv_idle_.wait(lock, [&] {
    if (writing_ && is_wanted(writing_key_)) return false;
    return std::none_of(write_queue_.begin(), write_queue_.end(), [&](const block_record& r) { return is_wanted(r.key); });
  });
}

void kv_warehouse::write_loop() {
  for (;;) {
    block_record r;
    {
      std::unique_lock lock(mu_);
      cv_write_.wait(lock, [&] { return !write_queue_.empty() || stopping_; });
      if (write_queue_.empty()) return;  // stopping, and drained
      r = std::move(write_queue_.front());
      write_queue_.pop_front();
      queue_bytes_ -= r.bytes.size();
      c_.queue_blocks = static_cast<std::int64_t>(write_queue_.size());
      writing_ = true;
      writing_key_ = r.key;
    }
    std::vector<std::byte> encoded;
    bool any = false, failed = false;
    for (const auto& tier : tiers_) {
      const store_key k[] = {r.key};
      auto present = tier->count_present(k);
      if (present.ok() && *present == 1) continue;
      if (encoded.empty()) encoded = encode_block_record(r, o_.compress);
      if (tier->put(r.key, encoded).ok()) any = true;
      else failed = true;
    }
    std::lock_guard lock(mu_);
    if (any) ++c_.written;
    else if (!failed) ++c_.already_stored;
    if (failed) ++c_.write_errors;
    writing_ = false;
    cv_idle_.notify_all();  // flush() of everything, or of some keys
  }
}

// --- read path -------------------------------------------------------------------

int kv_warehouse::n_available(std::string_view tenant, std::span<const block_key> keys) {
  std::vector<store_key> sk;
  sk.reserve(keys.size());
  for (const block_key k : keys) sk.push_back(make_store_key(o_.space, tenant, k));
  {
    std::lock_guard lock(mu_);
    ++c_.lookups;
  }
  // The run continues from tier to tier: blocks 0..a-1 on disk, a..b-1 in Redis, ...
  std::size_t n = 0;
  for (const auto& tier : tiers_) {
    if (n == sk.size()) break;
    auto present = tier->count_present(std::span<const store_key>(sk).subspan(n));
    if (present.ok()) n += *present;
  }
  return static_cast<int>(n);
}

int kv_warehouse::fetch_one(const store_key& key, std::vector<std::byte>& out) {
  for (std::size_t t = 0; t < tiers_.size(); ++t) {
    const std::int64_t t0 = now_us();
    auto got = tiers_[t]->get(key);
    if (!got.ok() || !got->has_value()) continue;  // a failed tier is a miss, counted by the tier
    auto rec = decode_block_record(**got, key);
    if (!rec.ok()) {
      std::lock_guard lock(mu_);
      ++c_.corrupt;
      (void)tiers_[t]->erase(key);  // never served, and not found again
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

void kv_warehouse::prefetch(std::string_view tenant, std::span<const block_key> keys) {
  std::lock_guard lock(mu_);
  // Fetched blocks nobody read (their sequence was preempted or aborted while
  // loading) are dropped once too many pile up; a later read fetches again.
  constexpr std::size_t k_max_fetched = 4096;
  if (fetched_.size() > k_max_fetched)
    std::erase_if(fetched_, [](const auto& kv) { return kv.second.done; });
  for (const block_key k : keys) {
    const store_key sk = make_store_key(o_.space, tenant, k);
    if (fetched_.contains(sk)) continue;
    fetched_[sk];
    fetch_queue_.push_back(sk);
  }
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
    }
    for (const store_key& k : batch) {
      std::vector<std::byte> bytes;
      const int tier = fetch_one(k, bytes);
      std::lock_guard lock(mu_);
      fetched& f = fetched_[k];
      f.tier = tier;
      f.bytes = std::move(bytes);
      f.done = true;
    }
  }
}

bool kv_warehouse::settled(std::string_view tenant, std::span<const block_key> keys) {
  std::lock_guard lock(mu_);
  for (const block_key k : keys) {
    const auto it = fetched_.find(make_store_key(o_.space, tenant, k));
    if (it != fetched_.end() && !it->second.done) return false;
  }
  return true;
}

int kv_warehouse::read(std::string_view tenant, block_key key, std::span<std::byte> out) {
  const store_key sk = make_store_key(o_.space, tenant, key);
  std::vector<std::byte> bytes;
  int tier = -1;
  bool fetch_now = false;
  {
    std::lock_guard lock(mu_);
    const auto it = fetched_.find(sk);
    if (it != fetched_.end() && it->second.done) {
      tier = it->second.tier;
      bytes = std::move(it->second.bytes);
      fetched_.erase(it);
    } else if (it == fetched_.end()) {
      fetch_now = true;  // not prefetched: fetch now, below
    }
  }
  if (fetch_now) tier = fetch_one(sk, bytes);
  if (bytes.size() != out.size()) tier = -1;
  std::lock_guard lock(mu_);
  if (tier < 0) {
    ++c_.load_misses;
    return -1;
  }
  std::copy(bytes.begin(), bytes.end(), out.begin());
  ++c_.loads;
  return tier;
}

// --- admin -----------------------------------------------------------------------

result<std::size_t> kv_warehouse::erase_tenant(std::string_view tenant) {
  flush();  // nothing of the tenant may land after the erase
  std::size_t n = 0;
  for (const auto& tier : tiers_) {
    PAGODA_ASSIGN_OR_RETURN(std::size_t k, tier->erase_tenant(tenant_hash(tenant)));
    n += k;
  }
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
