// FP8 scalar conversions, exhaustively, and the SIMD loads against them.
#include "quant/fp8.h"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "core/aligned_buffer.h"
#include "core/cpu.h"
#include "quant/kv_codec.h"

namespace pagoda {
namespace {

TEST(fp8, known_values) {
  EXPECT_EQ(f32_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(1e9f), 0x7e);  // saturates, never NaN
  EXPECT_EQ(f32_to_e4m3(-1e9f), 0xfe);
  EXPECT_EQ(f32_to_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(f32_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_e4m3(0x1p-9f), 0x01);  // smallest subnormal
  EXPECT_EQ(f32_to_e4m3(0x1p-11f), 0x00);  // below half of it
  EXPECT_EQ(f32_to_e5m2(57344.0f), 0x7b);
  EXPECT_EQ(f32_to_e5m2(1e9f), 0x7b);
  EXPECT_EQ(f32_to_e5m2(1.0f), 0x3c);
  EXPECT_EQ(f32_to_e5m2(0x1p-16f), 0x01);
  EXPECT_FLOAT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_FLOAT_EQ(e5m2_to_f32(0x7b), 57344.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
}

// Every finite code decodes and encodes back to itself; every midpoint between
// neighbours rounds to the even one; values just inside a neighbour go there.
TEST(fp8, round_trip_and_round_to_nearest_even) {
  for (int fmt = 0; fmt < 2; ++fmt) {
    auto enc = fmt == 0 ? f32_to_e4m3 : f32_to_e5m2;
    auto dec = fmt == 0 ? e4m3_to_f32 : e5m2_to_f32;
    int max_code = fmt == 0 ? 0x7e : 0x7b;
    for (int sign = 0; sign < 2; ++sign)
      for (int c = 0; c <= max_code; ++c) {
        auto code = static_cast<std::uint8_t>(c | (sign << 7));
        float v = dec(code);
        ASSERT_EQ(enc(v), c == 0 ? code & 0x80 ? 0x80 : 0x00 : code) << fmt << " code " << c;
        if (c == max_code) continue;
        float next = dec(static_cast<std::uint8_t>((c + 1) | (sign << 7)));
        float mid = 0.5f * (v + next);  // exact in f32
        int even = (c % 2 == 0) ? c : c + 1;
        ASSERT_EQ(enc(mid) & 0x7f, even) << fmt << " midpoint above code " << c;
        ASSERT_EQ(enc(std::nextafter(mid, v)) & 0x7f, c);
        ASSERT_EQ(enc(std::nextafter(mid, next)) & 0x7f, c + 1);
      }
  }
}

// Every byte (NaN excepted) through the AVX-512 loads: fp8 "none" tiles filled
// with raw codes, q.k against the reference that uses the scalar tables.
TEST(fp8, simd_loads_match_the_tables) {
  for (kv_type type : {kv_type::fp8_e4m3, kv_type::fp8_e5m2}) {
    const kv_codec* c = get_kv_codec(type);
    kv_format f{type, kv_role::key, kv_scale_mode::none, 0};
    kv_tile_shape shape{16, 16};  // 256 bytes: every code once
    aligned_buffer tile(c->tile_bytes(f, shape));
    auto* b = reinterpret_cast<std::uint8_t*>(tile.data());
    for (int i = 0; i < 256; ++i) {
      bool nan = type == kv_type::fp8_e4m3 ? (i & 0x7f) == 0x7f : (i & 0x7f) >= 0x7c;
      b[i] = nan ? 0 : static_cast<std::uint8_t>(i);
    }
    // One-hot queries pick single codes out of each token: scores are the values.
    const void* tiles[] = {tile.data()};
    for (int d = 0; d < 16; ++d) {
      std::vector<float> q(16, 0.0f), ref(16), simd(16);
      q[d] = 1.0f;
      c->qk_ref(f, shape, nullptr, tiles, 16, q.data(), 1, ref.data(), 16);
      set_simd_level(simd_level::avx512);
      c->qk(f, shape, nullptr, tiles, 16, q.data(), 1, simd.data(), 16);
      for (int t = 0; t < 16; ++t) ASSERT_EQ(simd[t], ref[t]) << kv_type_name(type) << " byte " << d * 16 + t;
    }
  }
}

}  // namespace
}  // namespace pagoda
