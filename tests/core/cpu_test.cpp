// CPU dispatch: which level a feature set gets, and that forcing a level works.
#include "core/cpu.h"

#include <gtest/gtest.h>

#include "core/simd_levels.h"

namespace pagoda {
namespace {

cpu_features haswell() {
  cpu_features f;
  f.avx2 = f.fma = f.f16c = f.bmi2 = true;
  return f;
}

// Skylake-X: AVX-512 F/BW/VL/DQ without VNNI.
cpu_features skylake_x() {
  cpu_features f = haswell();
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = true;
  return f;
}

// Cascade Lake and Ice Lake servers: Skylake-X plus VNNI, no AVX512-BF16. No
// kernel uses BF16 instructions, so they must get the avx512 level.
cpu_features cascade_lake() {
  cpu_features f = skylake_x();
  f.avx512vnni = true;
  return f;
}

TEST(cpu, avx512_level_needs_exactly_what_its_kernels_use) {
  EXPECT_EQ(best_simd_level(cascade_lake()), simd_level::avx512);
  // The integer KV and q8_0 matmul kernels use vpdpbusd: no VNNI, no avx512.
  EXPECT_EQ(best_simd_level(skylake_x()), simd_level::avx2);
  for (bool cpu_features::*need : {&cpu_features::avx512f, &cpu_features::avx512bw, &cpu_features::avx512vl,
                                   &cpu_features::avx512dq, &cpu_features::avx512vnni, &cpu_features::avx2,
                                   &cpu_features::fma, &cpu_features::f16c, &cpu_features::bmi2}) {
    cpu_features f = cascade_lake();
    f.*need = false;
    EXPECT_NE(best_simd_level(f), simd_level::avx512);
  }
}

TEST(cpu, avx2_level_needs_avx2_fma_f16c_bmi2) {
  EXPECT_EQ(best_simd_level(haswell()), simd_level::avx2);
  for (bool cpu_features::*need : {&cpu_features::avx2, &cpu_features::fma, &cpu_features::f16c, &cpu_features::bmi2}) {
    cpu_features f = haswell();
    f.*need = false;
    EXPECT_EQ(best_simd_level(f), simd_level::scalar);
  }
  EXPECT_EQ(best_simd_level(cpu_features{}), simd_level::scalar);
}

TEST(cpu, level_names_round_trip) {
  for (simd_level l : {simd_level::scalar, simd_level::avx2, simd_level::avx512})
    EXPECT_EQ(parse_simd_level(simd_level_name(l)), l);
  EXPECT_FALSE(parse_simd_level("avx").has_value());
  EXPECT_FALSE(parse_simd_level("").has_value());
}

class cpu_level : public ::testing::TestWithParam<simd_level> {};

// Every level under test can be forced and is then the active one; raising the
// level past what the CPU has is clamped, never taken.
TEST_P(cpu_level, set_simd_level_takes_effect) {
  test::simd_level_guard guard;
  PAGODA_USE_SIMD_LEVEL(GetParam());
  EXPECT_EQ(active_simd_level(), GetParam());
  set_simd_level(simd_level::avx512);
  EXPECT_EQ(active_simd_level(), best_simd_level(detect_cpu()));
}

INSTANTIATE_TEST_SUITE_P(levels, cpu_level, ::testing::ValuesIn(test::simd_levels_under_test()),
                         test::level_param_name);

}  // namespace
}  // namespace pagoda
