// Time, injected (DESIGN.md: tests control time instead of sleeping).
//
// now_us() / now_seconds() read the process's monotonic clock directly: for
// figures a user reads (tokens/s of a run) and nothing a test waits on. Code
// whose behaviour depends on time (scheduler timestamps, a store's entry
// ages, a reconnect back-off) takes a `const clock_source&` instead, the
// system one by default; tests pass a manual_clock and advance it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace pagoda {

inline std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline double now_seconds() { return static_cast<double>(now_us()) * 1e-6; }

class clock_source {
 public:
  virtual ~clock_source() = default;
  // Monotonic microseconds (durations, deadlines, latency histograms).
  virtual std::int64_t monotonic_us() const = 0;
  // Milliseconds since the Unix epoch (ages stored on disk, which must mean
  // the same after a restart). Safe to call from any thread.
  virtual std::int64_t wall_ms() const = 0;
};

// The process's clocks: steady_clock and system_clock.
const clock_source& system_clock_source();

// A clock that moves only when told to (tests). Both readings start at the
// given values and advance together; safe to read and advance from any thread.
class manual_clock final : public clock_source {
 public:
  explicit manual_clock(std::int64_t start_us = 1'000'000, std::int64_t start_wall_ms = 1'700'000'000'000)
      : us_(start_us), wall_ms_(start_wall_ms) {}
  std::int64_t monotonic_us() const override { return us_.load(std::memory_order_acquire); }
  std::int64_t wall_ms() const override { return wall_ms_.load(std::memory_order_acquire); }
  void advance_us(std::int64_t us) {
    us_.fetch_add(us, std::memory_order_acq_rel);
    wall_ms_.fetch_add(us / 1000, std::memory_order_acq_rel);
  }
  void advance_seconds(double s) { advance_us(static_cast<std::int64_t>(s * 1e6)); }

 private:
  std::atomic<std::int64_t> us_;
  std::atomic<std::int64_t> wall_ms_;
};

}  // namespace pagoda
