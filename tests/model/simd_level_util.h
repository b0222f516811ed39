// Running a weight-kernel test at each SIMD level, on top of
// core/simd_levels.h (which says which levels a run covers).
#pragma once

#include "core/cpu.h"
#include "core/simd_levels.h"

namespace pagoda::test {

using level_guard = simd_level_guard;

// Sets `level` and records it. A level that does not take effect fails the
// test (it is in the list only because the CPU or PAGODA_SIMD claims it);
// true when the test should go on at this level.
inline bool use_level(simd_level level) {
  use_simd_level(level);
  return !::testing::Test::HasFatalFailure() && !::testing::Test::IsSkipped();
}

}  // namespace pagoda::test
