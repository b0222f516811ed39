// Running a test at each SIMD level.
#pragma once

#include "core/cpu.h"

namespace pagoda::test {

// Restores the process-wide SIMD level when a test ends.
class level_guard {
 public:
  level_guard() : saved_(active_simd_level()) {}
  ~level_guard() { set_simd_level(saved_); }
  level_guard(const level_guard&) = delete;
  level_guard& operator=(const level_guard&) = delete;

 private:
  simd_level saved_;
};

// Sets `level`; false when this CPU cannot run it (the test then skips it).
inline bool use_level(simd_level level) {
  set_simd_level(level);
  return active_simd_level() == level;
}

}  // namespace pagoda::test
