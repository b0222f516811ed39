#include "core/half.h"

#include <bit>
#include <cmath>
#include <cstring>

#include <gtest/gtest.h>

#include "core/cpu.h"

namespace pagoda {
namespace {

// Reference: the F16C hardware conversion, where the CPU has it, is the
// independent oracle for the bit-twiddling scalar code.
TEST(half, fp16_round_trips_every_half) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    float f = fp16_to_f32(static_cast<fp16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_fp16(f), h) << "h=" << h;
  }
}

TEST(half, fp16_known_values) {
  EXPECT_EQ(f32_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_fp16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_fp16(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(f32_to_fp16(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_fp16(2.98023223876953125e-08f), 0x0000);  // half of it: ties to even (0)
  EXPECT_EQ(f32_to_fp16(1.0f + 1.0f / 2048), 0x3c00);  // tie rounds to even
  EXPECT_EQ(f32_to_fp16(1.0f + 3.0f / 2048), 0x3c02);
  EXPECT_TRUE(std::isnan(fp16_to_f32(f32_to_fp16(NAN))));
}

TEST(half, bf16_rounding) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa (1) wins.
  EXPECT_EQ(f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

}  // namespace
}  // namespace pagoda
