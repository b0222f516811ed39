// Monotonic time. Policies take a clock so tests can control time.
#pragma once

#include <chrono>
#include <cstdint>

namespace pagoda {

inline std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline double now_seconds() { return static_cast<double>(now_us()) * 1e-6; }

}  // namespace pagoda
