// MXFP4 (gpt-oss's expert weights): the code table and the E8M0 scale from the
// OCP definitions, the decoder bit for bit against ggml's own decoding of
// ggml-quantized and hand-made blocks (tests/data/mxfp4, made by a program
// linked against llama.cpp's libggml), and Pagoda's quantizer's error bound.
// The matmul kernels run mxfp4 with every other format in matmul_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/ggml_blocks.h"
#include "core/thread_pool.h"
#include "model/matmul.h"
#include "model/quants.h"
#include "model/simd_level_util.h"

namespace pagoda {
namespace {

using gguf::tensor_type;

// E2M1 (OCP MX spec): bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa;
// exponent 0 is subnormal (0.5 * mantissa). Written from the spec, not from a table.
double e2m1_value(int code) {
  const int sign = code >> 3, exp = (code >> 1) & 3, mant = code & 1;
  const double mag = exp == 0 ? 0.5 * mant : std::ldexp(1.0 + 0.5 * mant, exp - 1);
  return sign ? -mag : mag;
}

TEST(Mxfp4, TableIsDoubledE2M1) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(k_mxfp4_values[c], 2.0 * e2m1_value(c)) << "code " << c;
}

TEST(Mxfp4, HalfScaleIsTwoToTheEMinus128) {
  for (int e = 0; e < 256; ++e)
    EXPECT_EQ(e8m0_half_to_f32(static_cast<std::uint8_t>(e)), std::ldexp(1.0f, e - 128)) << "e " << e;
}

// Element j is the low nibble of qs[j], element j + 16 its high nibble (iq4_nl's layout).
TEST(Mxfp4, BlockDecodesWhatWasPacked) {
  std::mt19937 rng(8);
  std::uniform_int_distribution<int> code(0, 15), expo(100, 150);
  for (int rep = 0; rep < 20; ++rep) {
    block_mxfp4 b{};
    int codes[32];
    for (int& c : codes) c = code(rng);
    b.e = static_cast<std::uint8_t>(expo(rng));
    for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<std::uint8_t>(codes[j] | codes[j + 16] << 4);
    int_block ib;
    decode_int_block(tensor_type::mxfp4, reinterpret_cast<const std::byte*>(&b), ib);
    EXPECT_EQ(ib.n, 32);
    EXPECT_EQ(ib.da, std::ldexp(1.0f, b.e - 128));
    EXPECT_EQ(ib.db, 0.0f);
    for (int e = 0; e < 32; ++e) {
      EXPECT_EQ(ib.q[e], 2.0 * e2m1_value(codes[e])) << "element " << e;
      EXPECT_EQ(ib.sc[e / 16], 1);
      EXPECT_EQ(ib.mn[e / 16], 0);
    }
  }
}

// tests/data/mxfp4/ggml_mxfp4.bin (see tests/data/README.md): "MXFP4REF", n,
// n blocks of 17 bytes, then ggml's dequantize_row_mxfp4 of them (n * 32 f32).
struct ggml_reference {
  std::vector<std::byte> blocks;
  std::vector<float> values;
};

ggml_reference load_reference() {
  std::ifstream in(std::string(PAGODA_SOURCE_DIR) + "/tests/data/mxfp4/ggml_mxfp4.bin", std::ios::binary);
  const std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ggml_reference r;
  std::uint32_t n = 0;
  if (raw.size() < 12 || std::memcmp(raw.data(), "MXFP4REF", 8) != 0) return r;
  std::memcpy(&n, raw.data() + 8, 4);
  if (raw.size() != 12 + std::size_t{n} * (17 + 32 * 4)) return r;
  r.blocks.resize(std::size_t{n} * 17);
  r.values.resize(std::size_t{n} * 32);
  std::memcpy(r.blocks.data(), raw.data() + 12, r.blocks.size());
  std::memcpy(r.values.data(), raw.data() + 12 + r.blocks.size(), r.values.size() * 4);
  return r;
}

TEST(Mxfp4, DecodesEveryBlockBitwiseAsGgml) {
  const ggml_reference ref = load_reference();
  ASSERT_EQ(ref.blocks.size(), 256u * 17) << "missing or malformed tests/data/mxfp4/ggml_mxfp4.bin";
  // The file covers what it claims: every exponent byte class and all 16 codes.
  bool seen_e[256] = {}, seen_code[16] = {};
  for (std::size_t b = 0; b < 256; ++b) {
    seen_e[static_cast<std::uint8_t>(ref.blocks[17 * b])] = true;
    for (int j = 1; j < 17; ++j) {
      const auto byte = static_cast<std::uint8_t>(ref.blocks[17 * b + j]);
      seen_code[byte & 15] = seen_code[byte >> 4] = true;
    }
  }
  for (int e : {0, 1, 2, 127, 128, 252, 254, 255}) EXPECT_TRUE(seen_e[e]) << "exponent " << e;
  for (int c = 0; c < 16; ++c) EXPECT_TRUE(seen_code[c]) << "code " << c;

  const std::int64_t n = 256 * 32;
  std::vector<float> got(n);
  const weight_view w{tensor_type::mxfp4, ref.blocks.data(), n, 1, ref.blocks.size()};
  dequantize_row(w, 0, got.data());
  for (std::int64_t i = 0; i < n; ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(ref.values[i]))
        << "block " << i / 32 << " (e " << static_cast<int>(ref.blocks[17 * (i / 32)]) << ") element " << i % 32
        << ": " << got[i] << " vs ggml " << ref.values[i];
}

// Every level's product equals the exact one when all arithmetic is exact:
// activations that quantize with scale 1 (integers, each block's first value
// 127) and one exponent per weight row, so y = 2^(e - 128) * (an integer below
// 2^24). Rows with e = 0 and 1 take the subnormal half scales 2^-128 and
// 2^-127 (the AVX-512 kernels decode E8M0 in vector registers). 17 blocks: a
// full group of 16 and a partial one at AVX-512; m = 1 and 2 read the weights
// in place there, m = 5 packs them.
TEST(Mxfp4, ExtremeExponentsMultiplyExactlyAtEveryLevel) {
  test::level_guard guard;
  std::mt19937 rng(13);
  std::uniform_int_distribution<int> xi(-15, 15), byte(0, 255);
  constexpr std::int64_t n_in = 544, nb = n_in / 32;
  const std::uint8_t exponents[] = {0, 1, 2, 3, 100, 127, 128, 129, 160, 200};
  constexpr std::int64_t n_out = std::size(exponents);
  std::vector<block_mxfp4> w(static_cast<std::size_t>(n_out * nb));
  for (std::int64_t j = 0; j < n_out; ++j)
    for (std::int64_t b = 0; b < nb; ++b) {
      block_mxfp4& blk = w[j * nb + b];
      blk.e = exponents[j];
      for (auto& q : blk.qs) q = static_cast<std::uint8_t>(byte(rng));
    }
  const weight_view wv{tensor_type::mxfp4, w.data(), n_in, n_out, nb * sizeof(block_mxfp4)};
  constexpr std::int64_t m = 5;
  std::vector<float> x(m * n_in);
  for (std::int64_t i = 0; i < m * n_in; ++i) x[i] = static_cast<float>(i % 32 == 0 ? 127 : xi(rng));
  std::vector<float> exact(m * n_out), wr(n_in);
  for (std::int64_t j = 0; j < n_out; ++j) {
    dequantize_row(wv, j, wr.data());
    for (std::int64_t i = 0; i < m; ++i) {
      double s = 0;
      for (std::int64_t k = 0; k < n_in; ++k) s += static_cast<double>(x[i * n_in + k]) * wr[k];
      exact[i * n_out + j] = static_cast<float>(s);
      ASSERT_EQ(static_cast<double>(exact[i * n_out + j]), s) << "not exact in f32";
    }
  }
  std::vector<float> y(m * n_out);
  matmul_ref(wv, x.data(), m, y.data());
  for (std::int64_t i = 0; i < m * n_out; ++i) ASSERT_EQ(y[i], exact[i]) << "reference, output " << i;
  thread_pool pool(2);
  for (simd_level level : test::simd_levels_to_run()) {
    if (!test::use_level(level)) continue;
    for (std::int64_t rows : {1, 2, 5}) {
      matmul_scratch scratch;
      std::fill(y.begin(), y.end(), NAN);
      matmul(wv, x.data(), rows, y.data(), pool, scratch);
      for (std::int64_t i = 0; i < rows * n_out; ++i)
        ASSERT_EQ(y[i], exact[i]) << simd_level_name(level) << " m " << rows << " row " << i / n_out << " e "
                                  << static_cast<int>(exponents[i % n_out]);
    }
  }
}

// Pagoda's quantizer: the smallest exponent that covers max |x|, each value the
// nearest code (ties to the even code), so the error is at most 2^(e - 127),
// below max |x| / 3.
TEST(Mxfp4, QuantizerPicksTheSmallestCoveringExponentAndNearestCodes) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> scale(-60, 60);
  constexpr int k_blocks = 400;
  std::vector<float> x(k_blocks * 32);
  for (int b = 0; b < k_blocks; ++b) {
    const int s = b < 2 ? 126 - 124 * b : scale(rng);  // 2^126 and 2^-122 first
    for (int j = 0; j < 32; ++j) x[32 * b + j] = std::ldexp(u(rng), s);
  }
  for (int j = 64; j < 96; ++j) x[j] = (j % 2) ? -0.0f : 0.0f;  // an all-zero block
  for (int j = 96; j < 128; ++j) x[j] = 0.25f * static_cast<float>(j - 112);  // exact codes and ties at e = 127
  std::vector<block_mxfp4> q(k_blocks);
  quantize_row_mxfp4(x.data(), static_cast<std::int64_t>(x.size()), q.data());
  std::vector<float> y(x.size());
  dequantize_row({tensor_type::mxfp4, q.data(), static_cast<std::int64_t>(x.size()), 1, x.size() / 32 * 17}, 0,
                 y.data());
  for (int b = 0; b < k_blocks; ++b) {
    SCOPED_TRACE(testing::Message() << "block " << b << " e " << static_cast<int>(q[b].e));
    double amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(static_cast<double>(x[32 * b + j])));
    const double s = std::ldexp(1.0, q[b].e - 127);  // one E2M1 unit
    if (amax == 0) {
      EXPECT_EQ(q[b].e, 0);
    } else {
      EXPECT_GE(6 * s, amax);
      if (q[b].e > 0) {
        EXPECT_LT(3 * s, amax) << "a smaller exponent covers the block";
      }
    }
    for (int j = 0; j < 32; ++j) {
      const double v = x[32 * b + j], err = std::fabs(v - y[32 * b + j]);
      EXPECT_LE(err, s) << "element " << j;
      EXPECT_LT(err, amax / 3 + 1e-300) << "element " << j;
      for (int c = 0; c < 16; ++c)  // no code is nearer
        EXPECT_LE(err, std::fabs(v - e2m1_value(c) * s)) << "element " << j << " code " << c;
    }
  }
  // Ties at e = 127 (s = 1): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4 (even codes).
  EXPECT_EQ(q[3].e, 127);
  const float ties[][2] = {{0.25f, 0.0f}, {0.75f, 1.0f}, {1.25f, 1.0f}, {1.75f, 2.0f}, {2.5f, 2.0f}, {3.5f, 4.0f}};
  for (const auto& t : ties) {
    const int j = static_cast<int>(t[0] / 0.25f) + 112 - 96;
    EXPECT_EQ(y[96 + j], t[1]) << t[0];
    EXPECT_EQ(y[96 + 32 - j], -t[1]) << -t[0];
  }
}

TEST(Mxfp4, QuantizerGivesValidBlocksForNonFiniteInput) {
  float x[32] = {};
  x[0] = NAN;
  x[1] = INFINITY;
  x[2] = -1.0f;
  block_mxfp4 q;
  quantize_row_mxfp4(x, 32, &q);
  EXPECT_EQ(q.e, 254);
  EXPECT_EQ(q.qs[0] & 15, 0);  // NaN -> code 0
  EXPECT_EQ(q.qs[1] & 15, 7);  // inf -> the largest code
}

}  // namespace
}  // namespace pagoda
