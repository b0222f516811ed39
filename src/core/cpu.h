// Run-time CPU feature detection and the SIMD level kernels dispatch on.
#pragma once

#include <optional>
#include <string_view>

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
};

const cpu_features& detect_cpu();

// The level a CPU with features f can run: each level needs exactly what its
// kernels use (the flags of *_avx2.cpp / *_avx512.cpp in CMakeLists.txt).
//   avx2:   AVX2, FMA, F16C (fp16 loads), BMI2 (GCC emits shlx/shrx in the
//           kernels' address arithmetic under -mbmi2).
//   avx512: F, BW, VL (byte/word and masked 256/128-bit loads), DQ (32x8
//           extracts, mask-byte ops), VNNI (vpdpbusd in the integer KV and q8_0
//           matmul kernels), plus FMA, F16C, BMI2 as above. No kernel uses
//           AVX512-BF16, so it is not required: Cascade Lake and Ice Lake
//           servers get this level. Skylake-X (no VNNI) gets avx2.
simd_level best_simd_level(const cpu_features& f);

// The best level this CPU supports, lowered by the environment variable
// PAGODA_SIMD=scalar|avx2|avx512 (never raised above what the CPU has).
simd_level active_simd_level();
// For tests and benchmarks: force a level (clamped to what the CPU supports;
// read active_simd_level() to see whether it took effect).
void set_simd_level(simd_level level);
const char* simd_level_name(simd_level level);
// "scalar", "avx2", "avx512" (simd_level_name's spellings); nullopt otherwise.
std::optional<simd_level> parse_simd_level(std::string_view name);

}  // namespace pagoda
