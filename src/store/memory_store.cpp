#include <map>
#include <mutex>

#include "store/block_store.h"

namespace pagoda {
namespace {

class memory_store final : public block_store {
 public:
  const char* tier() const override { return "memory"; }
  bool indexed() const override { return true; }

  result<std::optional<std::vector<std::byte>>> get(const store_key& key) override {
    std::lock_guard lock(mu_);
    const auto it = entries_.find(key);
    if (it == entries_.end()) {
      ++stats_.misses;
      return std::optional<std::vector<std::byte>>();
    }
    ++stats_.hits;
    return std::optional<std::vector<std::byte>>(it->second);
  }

  result<std::size_t> count_present(std::span<const store_key> keys) override {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    while (n < keys.size() && entries_.contains(keys[n])) ++n;
    return n;
  }

  status put(const store_key& key, std::span<const std::byte> value) override {
    std::lock_guard lock(mu_);
    if (entries_.emplace(key, std::vector<std::byte>(value.begin(), value.end())).second) ++stats_.writes;
    return {};
  }

  status erase(const store_key& key) override {
    std::lock_guard lock(mu_);
    entries_.erase(key);
    return {};
  }

  result<std::size_t> erase_tenant(std::uint64_t tenant) override {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (auto it = entries_.lower_bound({tenant, 0}); it != entries_.end() && it->first.tenant == tenant;) {
      it = entries_.erase(it);
      ++n;
    }
    return n;
  }

  status for_each(const std::function<bool(const store_key&, std::span<const std::byte>)>& fn) override {
    std::lock_guard lock(mu_);
    for (const auto& [k, v] : entries_)
      if (!fn(k, v)) break;
    return {};
  }

  store_tier_stats stats() override {
    std::lock_guard lock(mu_);
    store_tier_stats s = stats_;
    s.tier = tier();
    s.entries = static_cast<std::int64_t>(entries_.size());
    s.bytes = 0;
    for (const auto& [k, v] : entries_) s.bytes += static_cast<std::int64_t>(v.size());
    return s;
  }

 private:
  std::mutex mu_;
  std::map<store_key, std::vector<std::byte>> entries_;
  store_tier_stats stats_;
};

}  // namespace

std::unique_ptr<block_store> make_memory_store() { return std::make_unique<memory_store>(); }

}  // namespace pagoda
