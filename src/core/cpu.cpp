#include "core/cpu.h"

#include <atomic>
#include <cstdlib>

#include <cpuid.h>

namespace pagoda {
namespace {

cpu_features probe() {
  cpu_features f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  bool osxsave = c & bit_OSXSAVE;
  f.fma = c & bit_FMA;
  f.f16c = c & bit_F16C;
  if (!osxsave) return f;
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  bool ymm_ok = (xcr0_lo & 0x6) == 0x6;
  bool zmm_ok = (xcr0_lo & 0xe6) == 0xe6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.avx2 = ymm_ok && (b & bit_AVX2);
  f.bmi2 = b & bit_BMI2;
  f.avx512f = zmm_ok && (b & bit_AVX512F);
  f.avx512bw = zmm_ok && (b & bit_AVX512BW);
  f.avx512vl = zmm_ok && (b & bit_AVX512VL);
  f.avx512dq = zmm_ok && (b & bit_AVX512DQ);
  f.avx512vnni = zmm_ok && (c & bit_AVX512VNNI);
  if (!ymm_ok) f.fma = f.f16c = false;
  return f;
}

simd_level initial_level() {
  simd_level best = best_simd_level(detect_cpu());
  const char* env = std::getenv("PAGODA_SIMD");
  if (!env) return best;
  const simd_level want = parse_simd_level(env).value_or(best);
  return want < best ? want : best;
}

std::atomic<int>& level_slot() {
  static std::atomic<int> level{static_cast<int>(initial_level())};
  return level;
}

}  // namespace

simd_level best_simd_level(const cpu_features& f) {
  const bool avx2 = f.avx2 && f.fma && f.f16c && f.bmi2;
  if (avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni) return simd_level::avx512;
  if (avx2) return simd_level::avx2;
  return simd_level::scalar;
}

const cpu_features& detect_cpu() {
  static const cpu_features f = probe();
  return f;
}

simd_level active_simd_level() { return static_cast<simd_level>(level_slot().load(std::memory_order_relaxed)); }

void set_simd_level(simd_level level) {
  simd_level best = best_simd_level(detect_cpu());
  level_slot().store(static_cast<int>(level < best ? level : best), std::memory_order_relaxed);
}

const char* simd_level_name(simd_level level) {
  switch (level) {
    case simd_level::scalar: return "scalar";
    case simd_level::avx2: return "avx2";
    case simd_level::avx512: return "avx512";
  }
  return "?";
}

std::optional<simd_level> parse_simd_level(std::string_view name) {
  for (simd_level l : {simd_level::scalar, simd_level::avx2, simd_level::avx512})
    if (name == simd_level_name(l)) return l;
  return std::nullopt;
}

}  // namespace pagoda
