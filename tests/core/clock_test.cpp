#include "core/clock.h"

#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace pagoda {
namespace {

TEST(clock, manual_clock_moves_only_when_advanced_and_both_readings_together) {
  manual_clock c(5'000, 2'000'000);
  EXPECT_EQ(c.monotonic_us(), 5'000);
  EXPECT_EQ(c.wall_ms(), 2'000'000);
  c.advance_seconds(1.5);
  EXPECT_EQ(c.monotonic_us(), 1'505'000);
  EXPECT_EQ(c.wall_ms(), 2'001'500);
}

TEST(clock, manual_clock_advances_from_several_threads_without_losing_a_step) {
  manual_clock c(0, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) c.advance_us(1000);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.monotonic_us(), 4'000'000);
  EXPECT_EQ(c.wall_ms(), 4'000);
}

TEST(clock, system_clock_is_monotonic_and_near_the_process_clocks) {
  const clock_source& c = system_clock_source();
  const std::int64_t a = c.monotonic_us();
  const std::int64_t b = c.monotonic_us();
  EXPECT_LE(a, b);
  EXPECT_LE(std::abs(c.monotonic_us() - now_us()), 1'000'000);
  // 2023-11-14 or later: a wall clock in milliseconds, not seconds or microseconds.
  EXPECT_GT(c.wall_ms(), 1'700'000'000'000);
  EXPECT_LT(c.wall_ms(), 100'000'000'000'000);
}

}  // namespace
}  // namespace pagoda
