// A cumulative histogram with fixed bucket bounds (Prometheus semantics), plus
// the raw observations' count and sum. Not thread-safe: the engine thread owns it.
#pragma once

#include <cstdint>
#include <vector>

namespace pagoda {

// A histogram's Prometheus data without its raw samples (cheap to copy).
struct histogram_snapshot {
  std::vector<double> bounds;
  std::vector<std::uint64_t> cumulative_counts;  // observations <= bounds[i]
  std::uint64_t count = 0;
  double sum = 0;
};

class histogram {
 public:
  explicit histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)), counts_(bounds_.size(), 0) {}

  void observe(double v) {
    for (std::size_t i = 0; i < bounds_.size(); ++i)
      if (v <= bounds_[i]) ++counts_[i];
    ++count_;
    sum_ += v;
    // Quantiles come from the most recent observations only, so memory stays bounded.
    if (samples_.size() < k_max_samples) samples_.push_back(v);
    else samples_[count_ % k_max_samples] = v;
  }
  const std::vector<double>& bounds() const { return bounds_; }
  // Cumulative: observations <= bounds()[i].
  const std::vector<std::uint64_t>& cumulative_counts() const { return counts_; }
  std::uint64_t count() const { return count_; }
  double sum() const { return sum_; }
  // The q-quantile (0..1) of the latest (up to 65,536) observations; 0 when empty.
  double quantile(double q) const;
  histogram_snapshot snapshot() const { return {bounds_, counts_, count_, sum_}; }

 private:
  static constexpr std::size_t k_max_samples = 65536;
  std::vector<double> bounds_;
  std::vector<std::uint64_t> counts_;
  std::uint64_t count_ = 0;
  double sum_ = 0;
  std::vector<double> samples_;
};

// vLLM's bucket bounds for latencies in seconds.
std::vector<double> latency_buckets_seconds();
// Finer bounds for one KV block's load from a store tier (tens of microseconds
// from the page cache to milliseconds over a network).
std::vector<double> load_buckets_seconds();

}  // namespace pagoda
