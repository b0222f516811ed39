// The SIMD levels kernel tests run at, and the check that the level a test
// claims is the level that ran. Shared by the kernel suites (tests/quant,
// tests/attention, tests/model/matmul_test.cpp, tests/core).
//
// A test that compares a SIMD kernel with its reference twin is parameterised
// over simd_levels_under_test() and starts with PAGODA_USE_SIMD_LEVEL(level):
// that sets the level, records it (the gtest property "simd_level" and a line
// on stdout) and fails the test when the level did not take effect. So a level
// never passes vacuously by silently running another one:
//   - the list holds the levels this CPU runs, plus the one PAGODA_SIMD names
//     (CI's per-level ctest entries, tests/CMakeLists.txt): a CPU without the
//     named level fails its tests;
//   - with PAGODA_SIMD set, the tests of the other levels are skipped (shown
//     as skipped, not passed), since that run is about the named level.
// Tests that loop over levels instead iterate simd_levels_to_run().
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/cpu.h"

namespace pagoda::test {

// The level PAGODA_SIMD names; nullopt when it is unset. An unknown name
// counts as avx512 here, and use_simd_level rejects it.
inline std::optional<simd_level> env_simd_level() {
  const char* env = std::getenv("PAGODA_SIMD");
  if (!env) return std::nullopt;
  return parse_simd_level(env).value_or(simd_level::avx512);
}

inline std::vector<simd_level> cpu_simd_levels() {
  std::vector<simd_level> levels;
  for (int l = 0; l <= static_cast<int>(best_simd_level(detect_cpu())); ++l) levels.push_back(static_cast<simd_level>(l));
  return levels;
}

// For parameter lists: the CPU's levels and PAGODA_SIMD's.
inline std::vector<simd_level> simd_levels_under_test() {
  std::vector<simd_level> levels = cpu_simd_levels();
  if (auto e = env_simd_level(); e && std::find(levels.begin(), levels.end(), *e) == levels.end()) levels.push_back(*e);
  return levels;
}

// For loops inside one test: PAGODA_SIMD's level alone when it is set, else the CPU's.
inline std::vector<simd_level> simd_levels_to_run() {
  if (auto e = env_simd_level()) return {*e};
  return cpu_simd_levels();
}

// For parameterised test names: "scalar", "avx2", "avx512".
inline std::string level_param_name(const ::testing::TestParamInfo<simd_level>& info) {
  return simd_level_name(info.param);
}

// Restores the process-wide level when a test ends.
class simd_level_guard {
 public:
  simd_level_guard() : saved_(active_simd_level()) {}
  ~simd_level_guard() { set_simd_level(saved_); }
  simd_level_guard(const simd_level_guard&) = delete;
  simd_level_guard& operator=(const simd_level_guard&) = delete;

 private:
  simd_level saved_;
};

// Use through PAGODA_USE_SIMD_LEVEL, which stops the test on failure or skip.
inline void use_simd_level(simd_level level) {
  if (const char* env = std::getenv("PAGODA_SIMD")) {
    ASSERT_TRUE(parse_simd_level(env).has_value()) << "PAGODA_SIMD=" << env << " names no level (scalar, avx2, avx512)";
    if (*parse_simd_level(env) != level) GTEST_SKIP() << "PAGODA_SIMD=" << env << " runs that level only";
  }
  set_simd_level(level);
  ::testing::Test::RecordProperty("simd_level", simd_level_name(level));
  std::printf("[ simd     ] level %s\n", simd_level_name(level));
  ASSERT_EQ(active_simd_level(), level) << "SIMD level " << simd_level_name(level)
                                        << " was asked for but this CPU runs at most "
                                        << simd_level_name(best_simd_level(detect_cpu()));
}

}  // namespace pagoda::test

#define PAGODA_USE_SIMD_LEVEL(level)                                   \
  do {                                                                 \
    ASSERT_NO_FATAL_FAILURE(::pagoda::test::use_simd_level(level));    \
    if (::testing::Test::IsSkipped()) return;                          \
  } while (0)
