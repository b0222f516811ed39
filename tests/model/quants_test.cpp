// Weight formats decode what was packed: for each format, random integer fields
// (values, scales, mins, high bits, signs, grid indices) are packed into a block
// the way ggml's quantizers lay them out (written here from ggml-common.h's
// layouts, independently of model/quants.cpp), and decode_int_block must give
// them back. The oracle tests prove the same decoders against llama.cpp end to
// end; these name the field that is wrong when one breaks.
#include "model/quants.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/ggml_blocks.h"
#include "core/half.h"

namespace pagoda {
namespace {

using gguf::tensor_type;

struct fixture {
  std::mt19937 rng{2024};
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
  fp16_t half() { return f32_to_fp16(std::ldexp(static_cast<float>(uniform(512, 1023)), -uniform(12, 18))); }
};

template <typename B>
int_block decode(tensor_type t, const B& b) {
  int_block out;
  decode_int_block(t, reinterpret_cast<const std::byte*>(&b), out);
  return out;
}

void expect_groups(const int_block& got, const std::vector<int>& sc, const std::vector<int>& mn) {
  for (int g = 0; g < got.n / 16; ++g) {
    EXPECT_EQ(got.sc[g], sc[g]) << "scale of group " << g;
    EXPECT_EQ(got.mn[g], mn[g]) << "min of group " << g;
  }
}

TEST(WeightFormats, Iq3sGridAndIq4nlTableHaveGgmlsShape) {
  for (int i = 0; i < 512; ++i) {
    if (i > 0) {
      EXPECT_LT(k_iq3s_grid[i - 1], k_iq3s_grid[i]) << i;
    }
    for (int k = 0; k < 4; ++k) {
      const unsigned v = (k_iq3s_grid[i] >> (8 * k)) & 0xff;
      EXPECT_TRUE(v % 2 == 1 && v <= 15) << "entry " << i << " byte " << k;
    }
  }
  EXPECT_EQ(k_iq3s_grid[0], 0x01010101u);
  EXPECT_EQ(k_iq3s_grid[511], 0x0f0f0101u);
  for (int i = 1; i < 16; ++i) EXPECT_LT(k_iq4nl_values[i - 1], k_iq4nl_values[i]);
}

TEST(WeightFormats, LegacyBlocksDecodeWhatWasPacked) {
  fixture f;
  for (int rep = 0; rep < 20; ++rep) {
    int q[32];
    for (int& v : q) v = f.uniform(0, 31);
    // q5_0 / q5_1: low nibbles as q4, bit e of qh is element e's fifth bit.
    block_q5_1 b51{};
    block_q5_0 b50{};
    b51.d = b50.d = f.half();
    b51.m = f.half();
    std::uint32_t qh = 0;
    for (int j = 0; j < 16; ++j) {
      b51.qs[j] = b50.qs[j] = static_cast<std::uint8_t>((q[j] & 15) | (q[j + 16] & 15) << 4);
      qh |= static_cast<std::uint32_t>(q[j] >> 4) << j | static_cast<std::uint32_t>(q[j + 16] >> 4) << (j + 16);
    }
    std::memcpy(b51.qh, &qh, 4);
    std::memcpy(b50.qh, &qh, 4);
    const int_block d51 = decode(tensor_type::q5_1, b51), d50 = decode(tensor_type::q5_0, b50);
    EXPECT_EQ(d51.da, fp16_to_f32(b51.d));
    EXPECT_EQ(d51.db, -fp16_to_f32(b51.m));  // x = d q + m = d q - (-m) * 1
    expect_groups(d51, {1, 1}, {1, 1});
    expect_groups(d50, {1, 1}, {0, 0});
    for (int e = 0; e < 32; ++e) {
      EXPECT_EQ(d51.q[e], q[e]) << e;
      EXPECT_EQ(d50.q[e], q[e] - 16) << e;
    }
    // q4_1 and iq4_nl: nibble j is element j, nibble j + 16 the high one.
    block_q4_1 b41{};
    block_iq4_nl bnl{};
    b41.d = bnl.d = f.half();
    b41.m = f.half();
    for (int j = 0; j < 16; ++j)
      b41.qs[j] = bnl.qs[j] = static_cast<std::uint8_t>((q[j] & 15) | (q[j + 16] & 15) << 4);
    const int_block d41 = decode(tensor_type::q4_1, b41), dnl = decode(tensor_type::iq4_nl, bnl);
    for (int e = 0; e < 32; ++e) {
      EXPECT_EQ(d41.q[e], q[e] & 15) << e;
      EXPECT_EQ(dnl.q[e], k_iq4nl_values[q[e] & 15]) << e;
    }
  }
}

// q2_K / q3_K: value L of element 128n + 32j + l sits at bits 2j of qs[32n + l].
void pack_two_bit(const std::vector<int>& L, std::uint8_t* qs) {
  for (int n = 0; n < 2; ++n)
    for (int l = 0; l < 32; ++l)
      qs[32 * n + l] = static_cast<std::uint8_t>(L[128 * n + l] | L[128 * n + 32 + l] << 2 | L[128 * n + 64 + l] << 4 |
                                                 L[128 * n + 96 + l] << 6);
}

TEST(WeightFormats, TwoAndThreeBitSuperBlocksDecodeWhatWasPacked) {
  fixture f;
  for (int rep = 0; rep < 20; ++rep) {
    std::vector<int> q(256), sc(16), mn(16);
    for (int& v : q) v = f.uniform(0, 7);
    for (int& v : sc) v = f.uniform(0, 15);
    for (int& v : mn) v = f.uniform(0, 15);
    block_q2_k b2{};
    b2.d = f.half();
    b2.dmin = f.half();
    for (int g = 0; g < 16; ++g) b2.scales[g] = static_cast<std::uint8_t>(sc[g] | mn[g] << 4);
    std::vector<int> low(256);
    for (int e = 0; e < 256; ++e) low[e] = q[e] & 3;
    pack_two_bit(low, b2.qs);
    const int_block d2 = decode(tensor_type::q2_k, b2);
    EXPECT_EQ(d2.da, fp16_to_f32(b2.d));
    EXPECT_EQ(d2.db, fp16_to_f32(b2.dmin));
    expect_groups(d2, sc, mn);
    for (int e = 0; e < 256; ++e) ASSERT_EQ(d2.q[e], q[e] & 3) << "q2_K element " << e;

    // q3_K: the third bit of element e in bit e / 32 of hmask[e % 32]; 6-bit
    // scales (stored + 32): low nibbles in scales[0..7], high 2 bits in 8..11.
    std::vector<int> s6(16);
    for (int& v : s6) v = f.uniform(-32, 31);
    block_q3_k b3{};
    b3.d = f.half();
    pack_two_bit(low, b3.qs);
    for (int e = 0; e < 256; ++e)
      if (q[e] >= 4) b3.hmask[e % 32] |= static_cast<std::uint8_t>(1 << (e / 32));
    for (int j = 0; j < 16; ++j) {
      const int l = s6[j] + 32;
      if (j < 8) b3.scales[j] = static_cast<std::uint8_t>(l & 15);
      else b3.scales[j - 8] |= static_cast<std::uint8_t>((l & 15) << 4);
      b3.scales[8 + j % 4] |= static_cast<std::uint8_t>((l >> 4) << (2 * (j / 4)));
    }
    const int_block d3 = decode(tensor_type::q3_k, b3);
    expect_groups(d3, s6, std::vector<int>(16, 0));
    for (int e = 0; e < 256; ++e) ASSERT_EQ(d3.q[e], q[e] - 4) << "q3_K element " << e;
  }
}

TEST(WeightFormats, FourFiveAndSixBitSuperBlocksDecodeWhatWasPacked) {
  fixture f;
  for (int rep = 0; rep < 20; ++rep) {
    std::vector<int> q(256), sc(8), mn(8);
    for (int& v : q) v = f.uniform(0, 63);
    for (int& v : sc) v = f.uniform(0, 63);
    for (int& v : mn) v = f.uniform(0, 63);
    // q4_K / q5_K: 6-bit scales and mins, j < 4 whole in bytes j and j + 4;
    // j >= 4 split between byte j + 4 (low nibbles) and the top bits of j - 4 / j.
    std::uint8_t scales[12] = {};
    for (int j = 0; j < 8; ++j) {
      if (j < 4) {
        scales[j] = static_cast<std::uint8_t>(sc[j]);
        scales[j + 4] = static_cast<std::uint8_t>(mn[j]);
      } else {
        scales[j + 4] = static_cast<std::uint8_t>((sc[j] & 15) | (mn[j] & 15) << 4);
        scales[j - 4] |= static_cast<std::uint8_t>((sc[j] >> 4) << 6);
        scales[j] |= static_cast<std::uint8_t>((mn[j] >> 4) << 6);
      }
    }
    std::vector<int> sc16(16), mn16(16);
    for (int g = 0; g < 16; ++g) sc16[g] = sc[g / 2], mn16[g] = mn[g / 2];
    block_q4_k b4{};
    block_q5_k b5{};
    b4.d = b5.d = f.half();
    b4.dmin = b5.dmin = f.half();
    std::memcpy(b4.scales, scales, 12);
    std::memcpy(b5.scales, scales, 12);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        const int lo = q[64 * c + l] & 31, hi = q[64 * c + 32 + l] & 31;
        b4.qs[32 * c + l] = b5.qs[32 * c + l] = static_cast<std::uint8_t>((lo & 15) | (hi & 15) << 4);
        b5.qh[l] |= static_cast<std::uint8_t>((lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1));
      }
    const int_block d4 = decode(tensor_type::q4_k, b4), d5 = decode(tensor_type::q5_k, b5);
    expect_groups(d4, sc16, mn16);
    expect_groups(d5, sc16, mn16);
    EXPECT_EQ(d5.db, fp16_to_f32(b5.dmin));
    for (int e = 0; e < 256; ++e) {
      ASSERT_EQ(d4.q[e], q[e] & 15) << "q4_K element " << e;
      ASSERT_EQ(d5.q[e], q[e] & 31) << "q5_K element " << e;
    }

    // q6_K: per half of 128, ql[l] holds elements l (low) and 64 + l (high),
    // ql[32 + l] elements 32 + l and 96 + l; qh[l] their top 2 bits, 2 each.
    block_q6_k b6{};
    b6.d = f.half();
    std::vector<int> s8(16);
    for (int g = 0; g < 16; ++g) b6.scales[g] = static_cast<std::int8_t>(s8[g] = f.uniform(-128, 127));
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const int* L = q.data() + 128 * h;
        b6.ql[64 * h + l] = static_cast<std::uint8_t>((L[l] & 15) | (L[64 + l] & 15) << 4);
        b6.ql[64 * h + 32 + l] = static_cast<std::uint8_t>((L[32 + l] & 15) | (L[96 + l] & 15) << 4);
        b6.qh[32 * h + l] =
            static_cast<std::uint8_t>(L[l] >> 4 | (L[32 + l] >> 4) << 2 | (L[64 + l] >> 4) << 4 | (L[96 + l] >> 4) << 6);
      }
    const int_block d6 = decode(tensor_type::q6_k, b6);
    expect_groups(d6, s8, std::vector<int>(16, 0));
    for (int e = 0; e < 256; ++e) ASSERT_EQ(d6.q[e], q[e] - 32) << "q6_K element " << e;
  }
}

TEST(WeightFormats, IqSuperBlocksDecodeWhatWasPacked) {
  fixture f;
  for (int rep = 0; rep < 20; ++rep) {
    // iq4_xs: sub-block b's 6-bit scale, low nibble in scales_l[b / 2], high 2
    // bits at 2b of scales_h; its 32 indices as iq4_nl's block.
    block_iq4_xs bx{};
    bx.d = f.half();
    std::vector<int> idx(256), ls(8), sc16(16);
    for (int& v : idx) v = f.uniform(0, 15);
    for (int b = 0; b < 8; ++b) {
      ls[b] = f.uniform(0, 63);
      bx.scales_l[b / 2] |= static_cast<std::uint8_t>((ls[b] & 15) << (4 * (b % 2)));
      bx.scales_h |= static_cast<std::uint16_t>((ls[b] >> 4) << (2 * b));
      sc16[2 * b] = sc16[2 * b + 1] = ls[b] - 32;
      for (int j = 0; j < 16; ++j)
        bx.qs[16 * b + j] = static_cast<std::uint8_t>(idx[32 * b + j] | idx[32 * b + 16 + j] << 4);
    }
    const int_block dx = decode(tensor_type::iq4_xs, bx);
    expect_groups(dx, sc16, std::vector<int>(16, 0));
    for (int e = 0; e < 256; ++e) ASSERT_EQ(dx.q[e], k_iq4nl_values[idx[e]]) << "iq4_xs element " << e;

    // iq3_s: group g of 4 values takes grid entry qs[g] + 256 * bit g % 8 of
    // qh[g / 8]; element e is negated by bit e % 8 of signs[e / 8]; sub-block b
    // has scale 1 + 2 * nibble b % 2 of scales[b / 2].
    block_iq3_s bs{};
    bs.d = f.half();
    std::vector<int> entry(64), neg(256), s4(8), sc(16);
    for (int g = 0; g < 64; ++g) {
      entry[g] = f.uniform(0, 511);
      bs.qs[g] = static_cast<std::uint8_t>(entry[g] & 255);
      bs.qh[g / 8] |= static_cast<std::uint8_t>((entry[g] >> 8) << (g % 8));
    }
    for (int e = 0; e < 256; ++e) {
      neg[e] = f.uniform(0, 1);
      bs.signs[e / 8] |= static_cast<std::uint8_t>(neg[e] << (e % 8));
    }
    for (int b = 0; b < 8; ++b) {
      s4[b] = f.uniform(0, 15);
      bs.scales[b / 2] |= static_cast<std::uint8_t>(s4[b] << (4 * (b % 2)));
      sc[2 * b] = sc[2 * b + 1] = 1 + 2 * s4[b];
    }
    const int_block ds = decode(tensor_type::iq3_s, bs);
    expect_groups(ds, sc, std::vector<int>(16, 0));
    for (int e = 0; e < 256; ++e) {
      const int v = static_cast<int>((k_iq3s_grid[entry[e / 4]] >> (8 * (e % 4))) & 0xff);
      ASSERT_EQ(ds.q[e], neg[e] ? -v : v) << "iq3_s element " << e;
    }
  }
}

// dequantize_quantized_row evaluates ggml's float formula, (da * sc) * q - db * mn.
TEST(WeightFormats, DequantizeFollowsTheIntegerForm) {
  fixture f;
  std::vector<std::byte> row(sizeof(block_q4_k) * 2);
  for (auto& b : row) b = static_cast<std::byte>(f.uniform(0, 255));
  for (int k = 0; k < 2; ++k) {
    auto* b = reinterpret_cast<block_q4_k*>(row.data() + k * sizeof(block_q4_k));
    b->d = f.half();
    b->dmin = f.half();
  }
  std::vector<float> out(512);
  dequantize_quantized_row(tensor_type::q4_k, row.data(), 512, out.data());
  for (int k = 0; k < 2; ++k) {
    int_block ib;
    decode_int_block(tensor_type::q4_k, row.data() + k * sizeof(block_q4_k), ib);
    for (int e = 0; e < 256; ++e)
      EXPECT_EQ(out[256 * k + e], (ib.da * ib.sc[e / 16]) * ib.q[e] - ib.db * ib.mn[e / 16]) << k << " " << e;
  }
}

}  // namespace
}  // namespace pagoda
