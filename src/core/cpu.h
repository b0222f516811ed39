// Run-time CPU feature detection and the SIMD level kernels dispatch on.
#pragma once

namespace pagoda {

enum class simd_level { scalar = 0, avx2 = 1, avx512 = 2 };

struct cpu_features {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool bmi2 = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512vnni = false;
  bool avx512bf16 = false;
};

const cpu_features& detect_cpu();

// The best level this CPU supports, lowered by the environment variable
// PAGODA_SIMD=scalar|avx2|avx512 (never raised above what the CPU has).
simd_level active_simd_level();
// For tests and benchmarks: force a level (clamped to what the CPU supports).
void set_simd_level(simd_level level);
const char* simd_level_name(simd_level level);

}  // namespace pagoda
