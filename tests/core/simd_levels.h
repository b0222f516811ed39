// The SIMD levels kernel tests run at, and the check that the level a test
// claims is the level that ran. Shared by the kernel suites (tests/quant,
// tests/attention, tests/model/matmul_test.cpp, tests/core).
//
// A test that compares a SIMD kernel with its reference twin is parameterised
// over simd_levels_under_test() and starts with PAGODA_USE_SIMD_LEVEL(level):
// that sets the level, records it (the gtest property "simd_level" and a line on
// stdout) and fails the test when the level did not take effect. So a level can
// never pass vacuously by silently running another one:
//   - without PAGODA_SIMD, the list holds the levels this CPU runs;
//   - with PAGODA_SIMD=name (CI's per-level ctest entries, tests/CMakeLists.txt),
//     it holds exactly that level, and a CPU without it fails.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/cpu.h"

namespace pagoda::test {

inline std::vector<simd_level> simd_levels_under_test() {
  if (const char* env = std::getenv("PAGODA_SIMD")) {
    // An unknown name keeps a level that use_simd_level then rejects.
    if (auto l = parse_simd_level(env)) return {*l};
    return {simd_level::avx512};
  }
  std::vector<simd_level> levels;
  for (int l = 0; l <= static_cast<int>(best_simd_level(detect_cpu())); ++l) levels.push_back(static_cast<simd_level>(l));
  return levels;
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

// Use through PAGODA_USE_SIMD_LEVEL, which stops the test on failure.
inline void use_simd_level(simd_level level) {
  if (const char* env = std::getenv("PAGODA_SIMD")) {
    ASSERT_TRUE(parse_simd_level(env).has_value()) << "PAGODA_SIMD=" << env << " names no level (scalar, avx2, avx512)";
  }
  set_simd_level(level);
  ::testing::Test::RecordProperty("simd_level", simd_level_name(level));
  std::printf("[ simd     ] level %s\n", simd_level_name(level));
  ASSERT_EQ(active_simd_level(), level) << "SIMD level " << simd_level_name(level)
                                        << " was asked for but this CPU runs at most "
                                        << simd_level_name(best_simd_level(detect_cpu()));
}

}  // namespace pagoda::test

#define PAGODA_USE_SIMD_LEVEL(level) ASSERT_NO_FATAL_FAILURE(::pagoda::test::use_simd_level(level))
