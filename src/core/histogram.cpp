#include "core/histogram.h"

#include <algorithm>
#include <cmath>

namespace pagoda {

double histogram::quantile(double q) const {
  if (samples_.empty()) return 0;
  std::vector<double> s = samples_;
  std::size_t k = static_cast<std::size_t>(std::clamp(q, 0.0, 1.0) * (s.size() - 1) + 0.5);
  std::nth_element(s.begin(), s.begin() + k, s.end());
  return s[k];
}

std::vector<double> latency_buckets_seconds() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
}

std::vector<double> load_buckets_seconds() {
  return {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0};
}

}  // namespace pagoda
