// Prints the best SIMD level of this machine (scalar, avx2 or avx512): run by
// tests/CMakeLists.txt at configure time to register one ctest entry per
// level the machine has.
#include <cstdio>

#include "core/cpu.h"

int main() {
  std::printf("%s", pagoda::simd_level_name(pagoda::best_simd_level(pagoda::detect_cpu())));
  return 0;
}
