// Weight matmul: every SIMD level against the reference twin, batch invariance
// (bitwise), ggml quantizers, round-trip bounds and exact integer cases.
#include "model/matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/cpu.h"
#include "core/ggml_blocks.h"
#include "core/half.h"
#include "core/simd_levels.h"
#include "model/matmul_internal.h"

namespace pagoda {
namespace {

using gguf::tensor_type;

constexpr tensor_type k_types[] = {tensor_type::f32, tensor_type::f16, tensor_type::bf16, tensor_type::q8_0,
                                   tensor_type::q4_0};
// The levels to run (core/simd_levels.h): every level this CPU runs, or the
// one PAGODA_SIMD names. PAGODA_USE_SIMD_LEVEL fails a test whose level did
// not take effect, rather than skipping it.
const std::vector<simd_level> k_levels = test::simd_levels_to_run();

const char* type_name(tensor_type t) { return gguf::tensor_type_name(t); }

bool is_q(tensor_type t) { return t == tensor_type::q8_0 || t == tensor_type::q4_0; }

using level_guard = test::simd_level_guard;

// A weight matrix owning its bytes. row_bytes may exceed the dense row size
// (padding between rows), which the kernels must honour.
struct weights {
  std::vector<std::byte> bytes;
  weight_view view;
};

weights encode(tensor_type t, const std::vector<float>& w, std::int64_t n_out, std::int64_t n_in,
               std::size_t pad_bytes = 0) {
  weights out;
  const std::size_t dense = row_size_bytes(t, n_in), stride = dense + pad_bytes;
  out.bytes.assign(stride * static_cast<std::size_t>(n_out) + 64, std::byte{0x5a});
  for (std::int64_t j = 0; j < n_out; ++j) {
    std::byte* row = out.bytes.data() + stride * static_cast<std::size_t>(j);
    const float* src = w.data() + j * n_in;
    switch (t) {
      case tensor_type::f32: std::memcpy(row, src, dense); break;
      case tensor_type::f16:
        for (std::int64_t k = 0; k < n_in; ++k) {
          fp16_t h = f32_to_fp16(src[k]);
          std::memcpy(row + 2 * k, &h, 2);
        }
        break;
      case tensor_type::bf16:
        for (std::int64_t k = 0; k < n_in; ++k) {
          bf16_t h = f32_to_bf16(src[k]);
          std::memcpy(row + 2 * k, &h, 2);
        }
        break;
      case tensor_type::q8_0: quantize_row_q8_0(src, n_in, row); break;
      case tensor_type::q4_0: quantize_row_q4_0(src, n_in, row); break;
      default: ADD_FAILURE();
    }
  }
  out.view = weight_view{t, out.bytes.data(), n_in, n_out, stride};
  return out;
}

std::vector<float> random_floats(std::mt19937& rng, std::size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& f : v) f = dist(rng);
  return v;
}

// Error bound for one output. Every level sums each lane's terms in a fixed
// order: float types at least 8 lanes of ceil(n_in / 8) products each; q types
// at most n_blocks terms per lane (the scalar level uses one lane), each term
// float(isum) * dw * dx with two roundings. Then a reduction tree of depth <= 4.
// The classic recursive-summation bound gives |y - exact| <= gamma_(n + 6) *
// sum|terms| with n the terms per lane and gamma_k ~ k * 2^-24; the double
// reference is within 2^-24 * |y| of exact. So
//   |y - y_ref| <= (n + 8) * 2^-24 * S,  S = sum_k |x_k * w_k|,
// with x the (quantized, for q types) activations and w the dequantized weights.
// This is far below what a real bug moves: dropping one of 4096 terms costs about
// S / 4096 = 2.4e-4 S against a bound of 3.1e-5 S.
float tolerance(tensor_type t, const std::vector<float>& xr, const std::vector<float>& wr) {
  double s = 0;
  for (std::size_t k = 0; k < xr.size(); ++k) s += std::fabs(static_cast<double>(xr[k]) * wr[k]);
  const double n_terms = is_q(t) ? static_cast<double>(xr.size() / 32) : std::ceil(xr.size() / 8.0);
  return static_cast<float>((n_terms + 8) * std::ldexp(1.0, -24) * s + 1e-30);
}

// The activation row as the kernels see it: dequantized q8_0 for q weight types.
std::vector<float> effective_x(tensor_type t, const float* x, std::int64_t n) {
  std::vector<float> v(x, x + n);
  if (!is_q(t)) return v;
  std::vector<block_q8_0> q(static_cast<std::size_t>(n / 32));
  quantize_row_q8_0(x, n, q.data());
  weight_view wv{tensor_type::q8_0, q.data(), n, 1, row_size_bytes(tensor_type::q8_0, n)};
  dequantize_row(wv, 0, v.data());
  return v;
}

void check_against_ref(tensor_type t, std::int64_t m, std::int64_t n_in, std::int64_t n_out, thread_pool& pool,
                       std::mt19937& rng, std::size_t pad = 0) {
  SCOPED_TRACE(testing::Message() << type_name(t) << " m=" << m << " n_in=" << n_in << " n_out=" << n_out
                                  << " level=" << simd_level_name(active_simd_level()) << " pad=" << pad);
  const std::vector<float> wf = random_floats(rng, static_cast<std::size_t>(n_out * n_in));
  const std::vector<float> x = random_floats(rng, static_cast<std::size_t>(m * n_in), -2.0f, 2.0f);
  weights w = encode(t, wf, n_out, n_in, pad);
  std::vector<float> y(static_cast<std::size_t>(m * n_out), NAN), y_ref(y.size(), NAN);
  matmul_scratch scratch;
  matmul(w.view, x.data(), m, y.data(), pool, scratch);
  matmul_ref(w.view, x.data(), m, y_ref.data());
  std::vector<float> wrow(static_cast<std::size_t>(n_in));
  int failures = 0;
  for (std::int64_t i = 0; i < m; ++i) {
    const std::vector<float> xr = effective_x(t, x.data() + i * n_in, n_in);
    for (std::int64_t j = 0; j < n_out; ++j) {
      dequantize_row(w.view, j, wrow.data());
      const float tol = tolerance(t, xr, wrow);
      const float got = y[i * n_out + j], want = y_ref[i * n_out + j];
      if (!(std::fabs(got - want) <= tol) && failures++ < 5)
        ADD_FAILURE() << "y[" << i << "][" << j << "] = " << got << ", reference " << want << ", tolerance " << tol;
    }
  }
}

TEST(Matmul, RowSizes) {
  EXPECT_EQ(row_size_bytes(tensor_type::f32, 64), 256u);
  EXPECT_EQ(row_size_bytes(tensor_type::f16, 64), 128u);
  EXPECT_EQ(row_size_bytes(tensor_type::bf16, 172), 344u);
  EXPECT_EQ(row_size_bytes(tensor_type::q8_0, 4096), 4096u / 32 * 34);
  EXPECT_EQ(row_size_bytes(tensor_type::q4_0, 4096), 4096u / 32 * 18);
}

TEST(Matmul, EveryLevelMatchesReferenceOnRandomShapes) {
  level_guard guard;
  std::mt19937 rng(1234);
  thread_pool pool1(1), pool2(2);
  const std::vector<std::int64_t> q_n_in = {32, 64, 96, 256, 288, 544, 992, 1024, 4096};
  const std::vector<std::int64_t> f_n_in = {1, 7, 64, 100, 172, 256, 1000, 4096};
  const std::int64_t n_outs[] = {1, 7, 33, 172};
  const std::int64_t ms[] = {1, 5, 13};
  for (simd_level level : k_levels) {
    PAGODA_USE_SIMD_LEVEL(level);
    for (tensor_type t : k_types) {
      for (std::int64_t n_in : is_q(t) ? q_n_in : f_n_in) {
        for (std::int64_t n_out : n_outs) {
          const std::int64_t m = ms[(n_in + n_out) % 3];
          if (n_in == 4096 && n_out > 33) continue;  // keeps the double reference quick
          check_against_ref(t, m, n_in, n_out, (n_out % 2) ? pool2 : pool1, rng);
        }
      }
    }
  }
}

TEST(Matmul, StoriesShapesAndPaddedRows) {
  level_guard guard;
  std::mt19937 rng(99);
  thread_pool pool(2);
  for (simd_level level : k_levels) {
    PAGODA_USE_SIMD_LEVEL(level);
    for (tensor_type t : k_types) {
      check_against_ref(t, 1, 64, 64, pool, rng);
      check_against_ref(t, 1, 64, 172, pool, rng);
      check_against_ref(t, 1, 64, 512, pool, rng);
      check_against_ref(t, 7, 64, 172, pool, rng, 6);  // rows 6 bytes apart from dense
      if (!is_q(t)) check_against_ref(t, 3, 172, 64, pool, rng, 2);
    }
  }
}

// The CONTRACT: a row's outputs are bitwise the same alone or anywhere in a
// batch of any size, on any number of threads.
TEST(Matmul, BatchInvariantBitwise) {
  level_guard guard;
  std::mt19937 rng(7);
  constexpr std::int64_t k_rows = 40, n_out = 37;
  thread_pool pools[] = {thread_pool(1), thread_pool(2), thread_pool(3)};
  for (simd_level level : k_levels) {
    PAGODA_USE_SIMD_LEVEL(level);
    for (tensor_type t : k_types) {
      const std::int64_t n_in = is_q(t) ? 928 : 100;  // 29 blocks: a partial group; a tail chunk
      SCOPED_TRACE(testing::Message() << type_name(t) << " level " << simd_level_name(level));
      weights w = encode(t, random_floats(rng, static_cast<std::size_t>(n_out * n_in)), n_out, n_in);
      const std::vector<float> x = random_floats(rng, static_cast<std::size_t>(2 * k_rows * n_in), -3.0f, 3.0f);
      matmul_scratch scratch;
      std::vector<float> alone(static_cast<std::size_t>(2 * k_rows * n_out));
      for (std::int64_t i = 0; i < 2 * k_rows; ++i)
        matmul(w.view, x.data() + i * n_in, 1, alone.data() + i * n_out, pools[0], scratch);
      std::vector<float> y(static_cast<std::size_t>(k_rows * n_out));
      for (thread_pool& pool : pools) {
        for (std::int64_t m = 1; m <= k_rows; ++m) {
          const std::int64_t start = (m * 7) % (k_rows + 1);  // row i sits at a different batch position
          matmul(w.view, x.data() + start * n_in, m, y.data(), pool, scratch);
          for (std::int64_t i = 0; i < m; ++i)
            ASSERT_EQ(0, std::memcmp(y.data() + i * n_out, alone.data() + (start + i) * n_out, n_out * sizeof(float)))
                << "row " << start + i << " at position " << i << " of m=" << m << " with " << pool.size()
                << " threads";
        }
      }
    }
  }
}

// Threads split columns on multiples of the column tile, so through matmul() a
// column always lands in the same tile shape. The kernels promise more (a pair's
// arithmetic never depends on its tile); check it by running every level's
// column kernel on ranges that start and end anywhere.
TEST(Matmul, ColumnTileShapeDoesNotChangeResults) {
  using namespace matmul_detail;
  level_guard guard;
  std::mt19937 rng(21);
  constexpr std::int64_t n_out = 23, m = 7;
  const kernel_set* sets[] = {&kernels_scalar(), &kernels_avx2(), &kernels_avx512()};
  for (simd_level lv : k_levels) {
    PAGODA_USE_SIMD_LEVEL(lv);
    const int level = static_cast<int>(lv);
    const kernel_set& ks = *sets[level];
    for (tensor_type t : k_types) {
      const std::int64_t n_in = is_q(t) ? 96 : 37;
      weights w = encode(t, random_floats(rng, static_cast<std::size_t>(n_out * n_in)), n_out, n_in);
      const std::vector<float> x = random_floats(rng, static_cast<std::size_t>(m * n_in));
      const std::size_t row_bytes = is_q(t) ? ks.act_row_bytes(t, n_in) : 0;
      aligned_buffer act(row_bytes * m + 64), pack(ks.pack_bytes(t, n_in) + 64);
      if (is_q(t)) ks.prepare(t, x.data(), m, n_in, act.data(), row_bytes);
      std::vector<float> whole(static_cast<std::size_t>(m * n_out)), part(whole.size());
      const job jw{&w.view, x.data(), act.data(), row_bytes, m, whole.data()};
      ks.cols(jw, 0, n_out, pack.data());
      const job jp{&w.view, x.data(), act.data(), row_bytes, m, part.data()};
      for (std::int64_t c0 = 0; c0 < n_out; c0 += 3) {
        const std::int64_t c1 = c0 + 1 + (c0 * 5) % 6 < n_out ? c0 + 1 + (c0 * 5) % 6 : n_out;
        ks.cols(jp, c0, c1, pack.data());
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = c0; j < c1; ++j)
            ASSERT_EQ(0, std::memcmp(&part[i * n_out + j], &whole[i * n_out + j], sizeof(float)))
                << type_name(t) << " level " << level << " columns [" << c0 << ", " << c1 << ") y[" << i << "][" << j
                << "]";
      }
    }
  }
}

// Small integers: every product and partial sum is an integer below 2^24, so
// every level and the reference must give the exact answer.
TEST(Matmul, ExactOnSmallIntegers) {
  level_guard guard;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> xi(-127, 127), wi(-8, 7);
  constexpr std::int64_t n_in = 512, n_out = 13, m = 9;  // one full group of 16 blocks at AVX-512
  thread_pool pool(2);
  std::vector<float> x(static_cast<std::size_t>(m * n_in)), wf(static_cast<std::size_t>(n_out * n_in));
  for (std::int64_t i = 0; i < m * n_in; ++i) x[i] = static_cast<float>(i % 32 == 5 ? 127 : xi(rng));  // d = 1
  for (std::int64_t i = 0; i < n_out * n_in; ++i) wf[i] = static_cast<float>(i % 32 == 3 ? -8 : wi(rng));
  std::vector<double> exact(static_cast<std::size_t>(m * n_out));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n_out; ++j) {
      double s = 0;
      for (std::int64_t k = 0; k < n_in; ++k) s += static_cast<double>(x[i * n_in + k]) * wf[j * n_in + k];
      exact[i * n_out + j] = s;
    }
  for (tensor_type t : k_types) {
    // q4_0 blocks whose extreme is -8 get d = 1 exactly. q8_0 would need +-127 for
    // d = 1, so its blocks are written directly: d = 1, qs = w.
    weights w = encode(t, wf, n_out, n_in);
    if (t == tensor_type::q8_0) {
      for (std::int64_t j = 0; j < n_out; ++j) {
        auto* b = reinterpret_cast<block_q8_0*>(w.bytes.data() + w.view.row_bytes * j);
        for (std::int64_t q = 0; q < n_in / 32; ++q) {
          b[q].d = f32_to_fp16(1.0f);
          for (int e = 0; e < 32; ++e) b[q].qs[e] = static_cast<std::int8_t>(wf[j * n_in + q * 32 + e]);
        }
      }
    }
    std::vector<float> y_ref(static_cast<std::size_t>(m * n_out));
    matmul_ref(w.view, x.data(), m, y_ref.data());
    for (std::int64_t i = 0; i < m * n_out; ++i)
      ASSERT_EQ(y_ref[i], exact[i]) << type_name(t) << " reference, output " << i;
    for (simd_level level : k_levels) {
      PAGODA_USE_SIMD_LEVEL(level);
      std::vector<float> y(static_cast<std::size_t>(m * n_out), NAN);
      matmul_scratch scratch;
      matmul(w.view, x.data(), m, y.data(), pool, scratch);
      for (std::int64_t i = 0; i < m * n_out; ++i)
        ASSERT_EQ(y[i], exact[i]) << type_name(t) << " " << simd_level_name(level) << ", output " << i;
    }
  }
}

// ---------------------------------------------------------------------------
// Quantizers
// ---------------------------------------------------------------------------

TEST(Quantize, Q8_0MatchesGgmlOnAKnownBlock) {
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j) - 12.0f;  // amax 19
  block_q8_0 b;
  quantize_row_q8_0(x, 32, &b);
  EXPECT_EQ(b.d, f32_to_fp16(19.0f / 127.0f));
  for (int j = 0; j < 32; ++j) EXPECT_EQ(b.qs[j], static_cast<int>(std::lround((j - 12.0) * 127.0 / 19.0))) << j;
  // Exact halves round away from zero (roundf), not to even: with amax = 127,
  // d = 1 and 2.5 -> 3, -2.5 -> -3, 0.5 -> 1.
  float h[32] = {127.0f, 2.5f, -2.5f, 0.5f, -0.5f, 1.5f};
  quantize_row_q8_0(h, 32, &b);
  EXPECT_EQ(b.qs[0], 127);
  EXPECT_EQ(b.qs[1], 3);
  EXPECT_EQ(b.qs[2], -3);
  EXPECT_EQ(b.qs[3], 1);
  EXPECT_EQ(b.qs[4], -1);
  EXPECT_EQ(b.qs[5], 2);
}

TEST(Quantize, Q4_0MatchesGgmlOnAKnownBlock) {
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j) - 16.0f;  // extreme -16: d = 2, id = 0.5
  block_q4_0 b;
  quantize_row_q4_0(x, 32, &b);
  EXPECT_EQ(b.d, f32_to_fp16(2.0f));
  for (int j = 0; j < 16; ++j) {
    const int lo = std::min(15, static_cast<int>((j - 16) * 0.5 + 8.5));
    const int hi = std::min(15, static_cast<int>((j + 16 - 16) * 0.5 + 8.5));
    EXPECT_EQ(b.qs[j] & 15, lo) << j;
    EXPECT_EQ(b.qs[j] >> 4, hi) << j;
  }
}

// |x - x'| per element. q8_0: the rounding step costs d/2, computing x/d as
// x * (1/d) can move a value across a .5 boundary by 2 * 127 * 2^-24 d, and
// storing d as fp16 costs 127 * |d - fp16(d)|. q4_0 (ggml): d = max / -8 maps
// the extreme to -8 exactly, so the opposite side reaches at most 7 * |d| and an
// element beyond 7.5 |d| is clipped (error up to |d|); the others are within
// |d| / 2, plus 8 * |d - fp16(d)| for the stored scale.
TEST(Quantize, RoundTripBounds) {
  std::mt19937 rng(3);
  for (float scale : {1e-3f, 1.0f, 37.0f, 6e4f}) {
    constexpr std::int64_t n = 32 * 64;
    std::vector<float> x = random_floats(rng, n, -scale, scale);
    x[40] = 0.0f;
    for (int j = 64; j < 96; ++j) x[j] = 0.0f;  // an all-zero block: d = 0
    std::vector<block_q8_0> q8(n / 32);
    std::vector<block_q4_0> q4(n / 32);
    quantize_row_q8_0(x.data(), n, q8.data());
    quantize_row_q4_0(x.data(), n, q4.data());
    std::vector<float> y8(n), y4(n);
    dequantize_row({tensor_type::q8_0, q8.data(), n, 1, row_size_bytes(tensor_type::q8_0, n)}, 0, y8.data());
    dequantize_row({tensor_type::q4_0, q4.data(), n, 1, row_size_bytes(tensor_type::q4_0, n)}, 0, y4.data());
    for (std::int64_t b = 0; b < n / 32; ++b) {
      float amax = 0, max = 0;
      for (int j = 0; j < 32; ++j)
        if (std::fabs(x[b * 32 + j]) > amax) amax = std::fabs(x[b * 32 + j]), max = x[b * 32 + j];
      const double d8 = amax / 127.0, d8h = fp16_to_f32(q8[b].d);
      const double d4 = std::fabs(max / 8.0), d4h = std::fabs(fp16_to_f32(q4[b].d));
      for (int j = 0; j < 32; ++j) {
        const double v = x[b * 32 + j];
        const double b8 = d8 / 2 + 127 * std::fabs(d8 - d8h) + 254 * d8 * std::ldexp(1.0, -24);
        EXPECT_LE(std::fabs(v - y8[b * 32 + j]), b8) << "q8_0 scale " << scale << " element " << b * 32 + j;
        const bool clipped = d4 > 0 && v * (max < 0 ? 1 : -1) / d4 > 7.5;
        const double b4 = (clipped ? d4 : d4 / 2) + 8 * std::fabs(d4 - d4h) + 16 * d4 * std::ldexp(1.0, -24);
        EXPECT_LE(std::fabs(v - y4[b * 32 + j]), b4) << "q4_0 scale " << scale << " element " << b * 32 + j;
      }
    }
  }
}

TEST(Quantize, DequantizeFloatTypesIsExact) {
  const float vals[] = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 1e-7f, 3.0e38f};
  for (float v : vals) {
    fp16_t h = f32_to_fp16(v);
    bf16_t b = f32_to_bf16(v);
    float out = 0;
    dequantize_row({tensor_type::f16, &h, 1, 1, 2}, 0, &out);
    EXPECT_EQ(out, fp16_to_f32(h));
    dequantize_row({tensor_type::bf16, &b, 1, 1, 2}, 0, &out);
    EXPECT_EQ(out, bf16_to_f32(b));
  }
}

// Every level's activation quantizer must give quantize_row_q8_0's bytes and
// scales (the reference twin quantizes with it), including exact .5 ties.
TEST(Quantize, SimdActivationQuantizersAreBitExact) {
  using namespace matmul_detail;
  level_guard guard;
  std::mt19937 rng(11);
  constexpr std::int64_t n = 32 * 19, m = 3;  // 19 blocks: one full group of 16 and a partial one
  std::vector<float> x = random_floats(rng, m * n, -5.0f, 5.0f);
  for (int j = 0; j < 32; ++j) x[j] = (j == 0) ? 127.0f : static_cast<float>(j % 9) - 4.5f;  // d = 1, ties
  for (int j = 32; j < 64; ++j) x[j] = 0.0f;                                                  // d = 0
  std::vector<block_q8_0> want(static_cast<std::size_t>(m * n / 32));
  for (std::int64_t i = 0; i < m; ++i) quantize_row_q8_0(x.data() + i * n, n, want.data() + i * (n / 32));

  for (tensor_type t : {tensor_type::q8_0, tensor_type::q4_0}) {
    const kernel_set* sets[] = {&kernels_scalar(), &kernels_avx2(), &kernels_avx512()};
    for (simd_level lv : k_levels) {
      PAGODA_USE_SIMD_LEVEL(lv);
      const int level = static_cast<int>(lv);
      const kernel_set& ks = *sets[level];
      const std::size_t row_bytes = ks.act_row_bytes(t, n);
      aligned_buffer act(row_bytes * m);
      ks.prepare(t, x.data(), m, n, act.data(), row_bytes);
      for (std::int64_t i = 0; i < m; ++i) {
        const std::byte* row = act.data() + i * row_bytes;
        for (std::int64_t b = 0; b < n / 32; ++b) {
          const block_q8_0& wb = want[i * (n / 32) + b];
          std::int8_t q[32];
          float d;
          if (level < 2) {  // plain layout
            std::memcpy(q, row + b * 32, 32);
            std::memcpy(&d, row + plain_qs_bytes(n) + b * 4, 4);
          } else {  // grouped layout: one int32 lane per block
            const std::byte* g = row + (b / k_group_blocks) * k_group_act_bytes;
            const int p = static_cast<int>(b % k_group_blocks);
            for (int j = 0; j < 8; ++j) std::memcpy(q + 4 * j, g + 64 * j + 4 * p, 4);
            std::memcpy(&d, g + 576 + 4 * p, 4);
            std::int32_t init;
            std::memcpy(&init, g + 512 + 4 * p, 4);
            int s = 0;
            for (int e = 0; e < 32; ++e) s += wb.qs[e];
            EXPECT_EQ(init, -(t == tensor_type::q8_0 ? 128 : 8) * s) << "block " << b;
          }
          EXPECT_EQ(d, fp16_to_f32(wb.d)) << "level " << level << " row " << i << " block " << b;
          EXPECT_EQ(0, std::memcmp(q, wb.qs, 32)) << "level " << level << " row " << i << " block " << b;
        }
      }
    }
  }
}

}  // namespace
}  // namespace pagoda
