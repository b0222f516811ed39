// Weight matmul: every SIMD level against the reference twin for every weight
// format, batch invariance (bitwise), exact integer cases, and the activation
// quantizers every level must reproduce byte for byte.
#include "model/matmul.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/cpu.h"
#include "core/ggml_blocks.h"
#include "core/half.h"
#include "model/matmul_internal.h"
#include "model/simd_level_util.h"

namespace pagoda {
namespace {

using gguf::tensor_type;

constexpr tensor_type k_float_types[] = {tensor_type::f32, tensor_type::f16, tensor_type::bf16};
constexpr tensor_type k_quant_types[] = {tensor_type::q8_0, tensor_type::q4_0,   tensor_type::q4_1, tensor_type::q5_0,
                                         tensor_type::q5_1, tensor_type::iq4_nl, tensor_type::q2_k, tensor_type::q3_k,
                                         tensor_type::q4_k, tensor_type::q5_k,   tensor_type::q6_k, tensor_type::iq4_xs,
                                         tensor_type::iq3_s, tensor_type::mxfp4};
// The levels to run (core/simd_levels.h): every level this CPU runs, or the
// one PAGODA_SIMD names; use_level fails a test whose level did not take effect.
const std::vector<simd_level> k_levels = test::simd_levels_to_run();

std::vector<tensor_type> all_types() {
  std::vector<tensor_type> v(std::begin(k_float_types), std::end(k_float_types));
  v.insert(v.end(), std::begin(k_quant_types), std::end(k_quant_types));
  return v;
}

const char* type_name(tensor_type t) { return gguf::tensor_type_name(t); }
bool is_q(tensor_type t) { return is_quantized_weight(t); }
bool is_k(tensor_type t) { return act_format_of(t) == act_format::q8_k; }

using test::level_guard;
using test::use_level;

// The kernels of one SIMD level (indexed as simd_level).
const matmul_detail::kernel_set& level_kernels(simd_level level) {
  const matmul_detail::kernel_set* sets[] = {&matmul_detail::kernels_scalar(), &matmul_detail::kernels_avx2(),
                                             &matmul_detail::kernels_avx512()};
  return *sets[static_cast<int>(level)];
}

// A weight matrix owning its bytes. row_bytes may exceed the dense row size
// (padding between rows), which the kernels must honour.
struct weights {
  std::vector<std::byte> bytes;
  weight_view view;
};

std::vector<float> random_floats(std::mt19937& rng, std::size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& f : v) f = dist(rng);
  return v;
}

// Byte offsets of the scale fields of one block (d first, then m / dmin): fp16,
// but for mxfp4's E8M0 byte.
std::vector<int> scale_fields(tensor_type t) {
  switch (t) {
    case tensor_type::q4_1:
    case tensor_type::q5_1:
    case tensor_type::q4_k:
    case tensor_type::q5_k: return {0, 2};
    case tensor_type::q2_k: return {80, 82};
    case tensor_type::q3_k: return {108};
    case tensor_type::q6_k: return {208};
    default: return {0};
  }
}

std::size_t block_bytes(tensor_type t) { return row_size_bytes(t, weight_block_elems(t)); }

// Overwrites every block's scales with `value(rng)`; mxfp4's unsigned
// power-of-two scale gets 2^floor(log2 |value|) (da = 1 for value 1).
template <typename F>
void set_scales(weights& w, std::mt19937& rng, F&& value) {
  const std::int64_t be = weight_block_elems(w.view.type);
  const std::size_t bb = block_bytes(w.view.type);
  for (std::int64_t j = 0; j < w.view.n_out; ++j)
    for (std::int64_t b = 0; b < w.view.n_in / be; ++b)
      for (int off : scale_fields(w.view.type)) {
        std::byte* dst = w.bytes.data() + w.view.row_bytes * j + bb * b + off;
        if (w.view.type == tensor_type::mxfp4) {
          *dst = static_cast<std::byte>(128 + std::ilogb(value(rng)));
          continue;
        }
        const fp16_t h = f32_to_fp16(value(rng));
        std::memcpy(dst, &h, 2);
      }
}

// Float types and q8_0 / q4_0 are encoded from random floats; the other
// formats are random bytes (every bit pattern of values, scales, mins, high
// bits, signs and grid indices is a valid block) with fp16 scales of random
// sign and magnitude 2^-8 .. 2^-4, so every decoding path is exercised.
weights make_weights(tensor_type t, std::int64_t n_out, std::int64_t n_in, std::mt19937& rng,
                     std::size_t pad_bytes = 0) {
  weights out;
  const std::size_t dense = row_size_bytes(t, n_in), stride = dense + pad_bytes;
  out.bytes.assign(stride * static_cast<std::size_t>(n_out) + 64, std::byte{0x5a});
  out.view = weight_view{t, out.bytes.data(), n_in, n_out, stride};
  const std::vector<float> w = random_floats(rng, static_cast<std::size_t>(n_out * n_in));
  std::uniform_int_distribution<int> byte(0, 255);
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
      default:
        for (std::size_t k = 0; k < dense; ++k) row[k] = static_cast<std::byte>(byte(rng));
    }
  }
  if (is_q(t) && t != tensor_type::q8_0 && t != tensor_type::q4_0) {
    std::uniform_real_distribution<float> mant(0.5f, 1.0f);
    std::uniform_int_distribution<int> expo(4, 8), sign(0, 1);
    set_scales(out, rng, [&](std::mt19937&) { return (sign(rng) ? -1.0f : 1.0f) * std::ldexp(mant(rng), -expo(rng)); });
  }
  return out;
}

// The activation row as the kernels see it: dequantized q8_0 / q8_1 / q8_K for
// quantized weight types. Also returns each block's q8_1 s (for the tolerance).
std::vector<float> effective_x(tensor_type t, const float* x, std::int64_t n, std::vector<float>* s = nullptr) {
  std::vector<float> v(x, x + n);
  const act_format af = act_format_of(t);
  if (af == act_format::q8_0 || af == act_format::q8_1) {
    std::vector<block_q8_1> q(static_cast<std::size_t>(n / 32));
    quantize_row_q8_1(x, n, q.data());
    for (std::int64_t b = 0; b < n / 32; ++b) {
      for (int e = 0; e < 32; ++e) v[b * 32 + e] = fp16_to_f32(q[b].d) * static_cast<float>(q[b].qs[e]);
      if (s) s->push_back(fp16_to_f32(q[b].s));
    }
  } else if (af == act_format::q8_k) {
    std::vector<block_q8_k> q(static_cast<std::size_t>(n / 256));
    quantize_row_q8_k(x, n, q.data());
    for (std::int64_t b = 0; b < n / 256; ++b)
      for (int e = 0; e < 256; ++e) v[b * 256 + e] = q[b].d * static_cast<float>(q[b].qs[e]);
  }
  return v;
}

// Error bound for one output. Every level sums each lane's terms in a fixed
// order: float types at least 8 lanes of ceil(n_in / 8) products each;
// quantized types at most one term per block per lane (the scalar level uses
// one lane), each term dx * (da * S - db * M) with S, M exact integers and a
// few roundings (int to float, products, the difference). Then a reduction
// tree of depth <= 4. The classic recursive-summation bound gives |y - exact|
// <= gamma_(n + 6) * T with n the terms per lane, gamma_k ~ k * 2^-24 and T the
// sum of the terms' magnitudes; the double reference is within 2^-24 |y| of
// exact. So |y - y_ref| <= (n + 8) * 2^-24 * T, where
//   T = sum_e |x_e| (|da sc_e q_e| + |db mn_e|)  (+ |m * s| per q8_1 block)
// with x the effective activations. This is far below what a real bug moves:
// dropping one of 16 blocks costs about T / 16 against a bound of 1.4e-6 T.
float tolerance(tensor_type t, const float* x, const weight_view& w, std::int64_t row) {
  const std::int64_t n = w.n_in;
  std::vector<float> s;
  const std::vector<float> xe = effective_x(t, x, n, &s);
  double total = 0, n_terms;
  if (!is_q(t)) {
    std::vector<float> wr(static_cast<std::size_t>(n));
    dequantize_row(w, row, wr.data());
    for (std::int64_t k = 0; k < n; ++k) total += std::fabs(static_cast<double>(xe[k]) * wr[k]);
    n_terms = std::ceil(n / 8.0);
  } else {
    const std::int64_t be = weight_block_elems(t);
    const std::byte* p = static_cast<const std::byte*>(w.data) + w.row_bytes * static_cast<std::size_t>(row);
    int_block ib;
    for (std::int64_t b = 0; b < n / be; ++b) {
      decode_int_block(t, p + block_bytes(t) * static_cast<std::size_t>(b), ib);
      for (std::int64_t e = 0; e < be; ++e)
        total += std::fabs(xe[b * be + e]) * (std::fabs(static_cast<double>(ib.da) * ib.sc[e / 16] * ib.q[e]) +
                                              std::fabs(static_cast<double>(ib.db) * ib.mn[e / 16]));
      if (act_format_of(t) == act_format::q8_1) total += std::fabs(static_cast<double>(ib.db) * s[b]);
    }
    n_terms = static_cast<double>(n / be);
  }
  return static_cast<float>((n_terms + 8) * std::ldexp(1.0, -24) * total + 1e-30);
}

void check_against_ref(tensor_type t, std::int64_t m, std::int64_t n_in, std::int64_t n_out, thread_pool& pool,
                       std::mt19937& rng, std::size_t pad = 0) {
  SCOPED_TRACE(testing::Message() << type_name(t) << " m=" << m << " n_in=" << n_in << " n_out=" << n_out
                                  << " level=" << simd_level_name(active_simd_level()) << " pad=" << pad);
  weights w = make_weights(t, n_out, n_in, rng, pad);
  const std::vector<float> x = random_floats(rng, static_cast<std::size_t>(m * n_in), -2.0f, 2.0f);
  std::vector<float> y(static_cast<std::size_t>(m * n_out), NAN), y_ref(y.size(), NAN);
  matmul_scratch scratch;
  matmul(w.view, x.data(), m, y.data(), pool, scratch);
  matmul_ref(w.view, x.data(), m, y_ref.data());
  int failures = 0;
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n_out; ++j) {
      const float tol = tolerance(t, x.data() + i * n_in, w.view, j);
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
  EXPECT_EQ(row_size_bytes(tensor_type::q4_1, 4096), 4096u / 32 * 20);
  EXPECT_EQ(row_size_bytes(tensor_type::q5_0, 4096), 4096u / 32 * 22);
  EXPECT_EQ(row_size_bytes(tensor_type::q5_1, 4096), 4096u / 32 * 24);
  EXPECT_EQ(row_size_bytes(tensor_type::iq4_nl, 4096), 4096u / 32 * 18);
  EXPECT_EQ(row_size_bytes(tensor_type::mxfp4, 4096), 4096u / 32 * 17);
  EXPECT_EQ(row_size_bytes(tensor_type::q2_k, 4096), 4096u / 256 * 84);
  EXPECT_EQ(row_size_bytes(tensor_type::q3_k, 4096), 4096u / 256 * 110);
  EXPECT_EQ(row_size_bytes(tensor_type::q4_k, 4096), 4096u / 256 * 144);
  EXPECT_EQ(row_size_bytes(tensor_type::q5_k, 4096), 4096u / 256 * 176);
  EXPECT_EQ(row_size_bytes(tensor_type::q6_k, 4096), 4096u / 256 * 210);
  EXPECT_EQ(row_size_bytes(tensor_type::iq4_xs, 4096), 4096u / 256 * 136);
  EXPECT_EQ(row_size_bytes(tensor_type::iq3_s, 4096), 4096u / 256 * 110);
}

TEST(Matmul, ActivationFormatsAreGgmlVecDotTypes) {
  for (tensor_type t : {tensor_type::q8_0, tensor_type::q4_0, tensor_type::q5_0, tensor_type::iq4_nl, tensor_type::mxfp4})
    EXPECT_EQ(act_format_of(t), act_format::q8_0) << type_name(t);
  for (tensor_type t : {tensor_type::q4_1, tensor_type::q5_1}) EXPECT_EQ(act_format_of(t), act_format::q8_1) << type_name(t);
  for (tensor_type t : {tensor_type::q2_k, tensor_type::q3_k, tensor_type::q4_k, tensor_type::q5_k, tensor_type::q6_k,
                        tensor_type::iq4_xs, tensor_type::iq3_s})
    EXPECT_EQ(act_format_of(t), act_format::q8_k) << type_name(t);
  for (tensor_type t : k_float_types) EXPECT_EQ(act_format_of(t), act_format::f32) << type_name(t);
}

TEST(Matmul, EveryLevelMatchesReferenceOnRandomShapes) {
  level_guard guard;
  std::mt19937 rng(1234);
  thread_pool pool1(1), pool2(2);
  const std::vector<std::int64_t> legacy_n_in = {32, 64, 96, 256, 288, 544, 992, 1024, 4096};
  const std::vector<std::int64_t> k_n_in = {256, 512, 768, 1024, 2304, 4096};
  const std::vector<std::int64_t> f_n_in = {1, 7, 64, 100, 172, 256, 1000, 4096};
  const std::int64_t n_outs[] = {1, 7, 33, 172};
  const std::int64_t ms[] = {1, 5, 13};
  for (simd_level level : k_levels) {
    if (!use_level(level)) continue;
    for (tensor_type t : all_types()) {
      for (std::int64_t n_in : !is_q(t) ? f_n_in : is_k(t) ? k_n_in : legacy_n_in) {
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
    if (!use_level(level)) continue;
    for (tensor_type t : all_types()) {
      const std::int64_t n = is_k(t) ? 256 : 64;
      check_against_ref(t, 1, n, 64, pool, rng);
      check_against_ref(t, 1, n, 172, pool, rng);
      check_against_ref(t, 1, n, 512, pool, rng);
      check_against_ref(t, 7, n, 172, pool, rng, 6);  // rows 6 bytes apart from dense
      if (!is_q(t)) check_against_ref(t, 3, 172, 64, pool, rng, 2);
    }
  }
}

// The outputs of x's first m rows, each row multiplied alone (m = 1).
std::vector<float> rows_alone(const weight_view& w, const std::vector<float>& x, std::int64_t m, thread_pool& pool,
                              matmul_scratch& scratch) {
  std::vector<float> out(static_cast<std::size_t>(m * w.n_out));
  for (std::int64_t i = 0; i < m; ++i) matmul(w, x.data() + i * w.n_in, 1, out.data() + i * w.n_out, pool, scratch);
  return out;
}

// The CONTRACT: a row's outputs are bitwise the same alone or anywhere in a
// batch of any size, on any number of threads.
TEST(Matmul, BatchInvariantBitwise) {
  level_guard guard;
  std::mt19937 rng(7);
  constexpr std::int64_t k_rows = 40, n_out = 37;
  thread_pool pools[] = {thread_pool(1), thread_pool(2), thread_pool(3)};
  for (simd_level level : k_levels) {
    if (!use_level(level)) continue;
    for (tensor_type t : all_types()) {
      // 29 blocks: a partial group of 16 at AVX-512; 3 super-blocks; a tail chunk.
      const std::int64_t n_in = !is_q(t) ? 100 : is_k(t) ? 768 : 928;
      SCOPED_TRACE(testing::Message() << type_name(t) << " level " << simd_level_name(level));
      weights w = make_weights(t, n_out, n_in, rng);
      const std::vector<float> x = random_floats(rng, static_cast<std::size_t>(2 * k_rows * n_in), -3.0f, 3.0f);
      matmul_scratch scratch;
      const std::vector<float> alone = rows_alone(w.view, x, 2 * k_rows, pools[0], scratch);
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

// A batch runs in row blocks that fit in L2 (matmul_detail::row_block_of): a
// batch spanning several blocks, on 1-3 threads, gives each row the bits it
// gets alone, and stays within the reference's bound.
TEST(Matmul, RowBlocksKeepBatchInvariance) {
  level_guard guard;
  std::mt19937 rng(29);
  constexpr std::int64_t n_in = 4096, n_out = 21;
  thread_pool pools[] = {thread_pool(1), thread_pool(2), thread_pool(3)};
  for (simd_level level : k_levels) {
    if (!use_level(level)) continue;
    for (tensor_type t : k_quant_types) {
      SCOPED_TRACE(testing::Message() << type_name(t) << " level " << simd_level_name(level));
      const std::size_t act_row = level_kernels(level).act_row_bytes(t, n_in);
      const std::int64_t block = matmul_detail::row_block_of(act_row, std::int64_t{1} << 20);
      const std::int64_t m = 2 * block + 7;  // two whole blocks and a partial one
      ASSERT_EQ(matmul_detail::row_block_of(act_row, m), block);
      weights w = make_weights(t, n_out, n_in, rng);
      const std::vector<float> x = random_floats(rng, static_cast<std::size_t>(m * n_in), -3.0f, 3.0f);
      matmul_scratch scratch;
      const std::vector<float> alone = rows_alone(w.view, x, m, pools[0], scratch);
      std::vector<float> y(alone.size());
      for (thread_pool& pool : pools) {
        std::fill(y.begin(), y.end(), NAN);
        matmul(w.view, x.data(), m, y.data(), pool, scratch);
        for (std::int64_t i = 0; i < m; ++i)
          ASSERT_EQ(0, std::memcmp(y.data() + i * n_out, alone.data() + i * n_out, n_out * sizeof(float)))
              << "row " << i << " of m=" << m << " (blocks of " << block << ") with " << pool.size() << " threads";
      }
      check_against_ref(t, m, n_in, n_out, pools[1], rng);
    }
  }
}

// Block-32 formats at AVX-512 read the weights in place below three rows
// (decode) and pack them per column tile above: the two kernels must give the
// same bits. Row lengths with whole groups of 16 blocks, a partial last group
// (1, 2, 13 or 15 blocks in it) and several groups; n_out not a multiple of the
// column tile.
TEST(Matmul, DecodeKernelMatchesBatchKernelBitwise) {
  level_guard guard;
  std::mt19937 rng(17);
  thread_pool pool(1);
  constexpr std::int64_t n_out = 11, m_batch = 5;
  const std::int64_t n_ins[] = {512, 544, 576, 928, 992, 1024, 4096};
  for (simd_level level : k_levels) {
    if (!use_level(level)) continue;
    for (tensor_type t : k_quant_types) {
      if (is_k(t)) continue;
      for (std::int64_t n_in : n_ins) {
        SCOPED_TRACE(testing::Message() << type_name(t) << " n_in " << n_in << " level " << simd_level_name(level));
        weights w = make_weights(t, n_out, n_in, rng);
        const std::vector<float> x = random_floats(rng, static_cast<std::size_t>(m_batch * n_in), -3.0f, 3.0f);
        matmul_scratch scratch;
        std::vector<float> batch(static_cast<std::size_t>(m_batch * n_out)), small(batch.size());
        matmul(w.view, x.data(), m_batch, batch.data(), pool, scratch);
        for (std::int64_t m : {1, 2})
          for (std::int64_t r0 = 0; r0 + m <= m_batch; r0 += m) {
            matmul(w.view, x.data() + r0 * n_in, m, small.data(), pool, scratch);
            ASSERT_EQ(0, std::memcmp(small.data(), batch.data() + r0 * n_out, m * n_out * sizeof(float)))
                << "rows " << r0 << ".." << r0 + m - 1 << " at m=" << m;
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
  for (simd_level lv : k_levels) {
    const int level = static_cast<int>(lv);
    if (!use_level(lv)) continue;
    const kernel_set& ks = level_kernels(lv);
    for (tensor_type t : all_types()) {
      const std::int64_t n_in = !is_q(t) ? 37 : is_k(t) ? 512 : 96;
      weights w = make_weights(t, n_out, n_in, rng);
      const std::vector<float> x = random_floats(rng, static_cast<std::size_t>(m * n_in));
      const std::size_t row_bytes = is_q(t) ? ks.act_row_bytes(t, n_in) : 0;
      aligned_buffer act(row_bytes * m + 64), pack(ks.pack_bytes(t, n_in) * 4 + 64);
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

// Every level's matmul of w and x equals `exact` (every output, bitwise).
void expect_every_level_exact(const weights& w, const std::vector<float>& x, std::int64_t m,
                              const std::vector<double>& exact, thread_pool& pool) {
  for (simd_level level : k_levels) {
    if (!use_level(level)) continue;
    std::vector<float> y(static_cast<std::size_t>(m * w.view.n_out), NAN);
    matmul_scratch scratch;
    matmul(w.view, x.data(), m, y.data(), pool, scratch);
    for (std::size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], exact[i]) << simd_level_name(level) << ", output " << i;
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
  for (tensor_type t : {tensor_type::q8_0, tensor_type::q4_0}) {
    // q4_0 blocks whose extreme is -8 get d = 1 exactly. q8_0 would need +-127 for
    // d = 1, so its blocks are written directly: d = 1, qs = w.
    weights w;
    w.bytes.assign(row_size_bytes(t, n_in) * n_out, std::byte{0});
    w.view = weight_view{t, w.bytes.data(), n_in, n_out, row_size_bytes(t, n_in)};
    for (std::int64_t j = 0; j < n_out; ++j) {
      std::byte* row = w.bytes.data() + w.view.row_bytes * j;
      if (t == tensor_type::q4_0) {
        quantize_row_q4_0(wf.data() + j * n_in, n_in, row);
        continue;
      }
      auto* b = reinterpret_cast<block_q8_0*>(row);
      for (std::int64_t q = 0; q < n_in / 32; ++q) {
        b[q].d = f32_to_fp16(1.0f);
        for (int e = 0; e < 32; ++e) b[q].qs[e] = static_cast<std::int8_t>(wf[j * n_in + q * 32 + e]);
      }
    }
    std::vector<float> y_ref(static_cast<std::size_t>(m * n_out));
    matmul_ref(w.view, x.data(), m, y_ref.data());
    for (std::int64_t i = 0; i < m * n_out; ++i)
      ASSERT_EQ(y_ref[i], exact[i]) << type_name(t) << " reference, output " << i;
    SCOPED_TRACE(type_name(t));
    expect_every_level_exact(w, x, m, exact, pool);
  }
}

// Every format with its fp16 scales set to 1 (d, dmin, m) and activations that
// quantize with scale +-1 (integers, the block's first value 127, the rest
// within +-15, so q8_1's s stays exact in fp16): every level's result and the
// reference are sum_e w[e] x[e] exactly, with w = sc * q - mn from the block.
TEST(Matmul, ExactForEveryFormatWhenAllArithmeticIsInteger) {
  level_guard guard;
  std::mt19937 rng(55);
  std::uniform_int_distribution<int> xi(-15, 15);
  constexpr std::int64_t n_out = 11, m = 5;
  thread_pool pool(2);
  for (tensor_type t : k_quant_types) {
    const std::int64_t n_in = is_k(t) ? 256 : 512, ab = act_block_elems(act_format_of(t));
    SCOPED_TRACE(type_name(t));
    weights w = make_weights(t, n_out, n_in, rng);
    set_scales(w, rng, [](std::mt19937&) { return 1.0f; });
    std::vector<float> x(static_cast<std::size_t>(m * n_in));
    for (std::int64_t i = 0; i < m * n_in; ++i) x[i] = static_cast<float>(i % ab == 0 ? 127 : xi(rng));
    std::vector<double> exact(static_cast<std::size_t>(m * n_out));
    std::vector<float> wr(static_cast<std::size_t>(n_in));
    for (std::int64_t j = 0; j < n_out; ++j) {
      dequantize_row(w.view, j, wr.data());
      for (std::int64_t i = 0; i < m; ++i) {
        double s = 0;
        for (std::int64_t k = 0; k < n_in; ++k) s += static_cast<double>(x[i * n_in + k]) * wr[k];
        ASSERT_LT(std::fabs(s), 1 << 24);
        exact[i * n_out + j] = s;
      }
    }
    std::vector<float> y_ref(static_cast<std::size_t>(m * n_out));
    matmul_ref(w.view, x.data(), m, y_ref.data());
    for (std::int64_t i = 0; i < m * n_out; ++i) ASSERT_EQ(y_ref[i], exact[i]) << "reference, output " << i;
    expect_every_level_exact(w, x, m, exact, pool);
  }
}

// ---------------------------------------------------------------------------
// Activation quantizers
// ---------------------------------------------------------------------------

// ggml's x86 q8_0 (what llama.cpp runs on this machine; its C reference
// differs): d = amax / 127, q = round-half-even(x * (127 / amax)), the
// multiplier 127 / amax rather than 1 / d.
TEST(Quantize, Q8_0MatchesGgmlX86OnKnownBlocks) {
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j) - 12.0f;  // amax 19
  block_q8_0 b;
  quantize_row_q8_0(x, 32, &b);
  EXPECT_EQ(b.d, f32_to_fp16(19.0f / 127.0f));
  for (int j = 0; j < 32; ++j) EXPECT_EQ(b.qs[j], static_cast<int>(std::nearbyint(x[j] * (127.0f / 19.0f)))) << j;
  // Exact halves round to even (x86's _mm256_round_ps), not away from zero:
  // with amax = 127 the multiplier is 1, and 2.5 -> 2, -2.5 -> -2, 0.5 -> 0.
  float h[32] = {127.0f, 2.5f, -2.5f, 0.5f, -0.5f, 1.5f, -3.5f};
  quantize_row_q8_0(h, 32, &b);
  EXPECT_EQ(b.d, f32_to_fp16(1.0f));
  EXPECT_EQ(b.qs[0], 127);
  EXPECT_EQ(b.qs[1], 2);
  EXPECT_EQ(b.qs[2], -2);
  EXPECT_EQ(b.qs[3], 0);
  EXPECT_EQ(b.qs[4], 0);
  EXPECT_EQ(b.qs[5], 2);
  EXPECT_EQ(b.qs[6], -4);
  // A zero block: d = 0 and q = 0.
  float z[32] = {};
  quantize_row_q8_0(z, 32, &b);
  EXPECT_EQ(b.d, 0);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(b.qs[j], 0);
}

// q8_1 = q8_0 plus s = fp16(d * sum(q)) with d the f32 scale before rounding.
TEST(Quantize, Q8_1StoresTheScaledSum) {
  float x[64];
  for (int j = 0; j < 64; ++j) x[j] = std::sin(0.37f * static_cast<float>(j)) * (j < 32 ? 3.0f : 0.01f);
  block_q8_1 b[2];
  block_q8_0 r[2];
  quantize_row_q8_1(x, 64, b);
  quantize_row_q8_0(x, 64, r);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(b[k].d, r[k].d);
    EXPECT_EQ(0, std::memcmp(b[k].qs, r[k].qs, 32));
    float amax = 0;
    int sum = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * k + j])), sum += b[k].qs[j];
    EXPECT_EQ(b[k].s, f32_to_fp16(amax / 127.0f * static_cast<float>(sum))) << k;
  }
}

// q8_K: the largest-magnitude element, the first one on ties, sets the scale
// -127 / m, so it quantizes to -127 exactly whatever its sign; d = 1 / iscale.
TEST(Quantize, Q8_KMatchesGgmlOnAKnownBlock) {
  std::vector<float> x(256, 0.0f);
  for (int j = 0; j < 256; ++j) x[j] = static_cast<float>((j * 37) % 101 - 50) / 10.0f;  // within +-5
  x[3] = 5.5f;
  x[200] = -5.5f;  // same magnitude, later: x[3] decides the sign
  block_q8_k b;
  quantize_row_q8_k(x.data(), 256, &b);
  const float iscale = -127.0f / 5.5f;
  EXPECT_EQ(b.d, 1.0f / iscale);
  EXPECT_EQ(b.qs[3], -127);
  EXPECT_EQ(b.qs[200], 127);
  for (int j = 0; j < 256; ++j) EXPECT_EQ(b.qs[j], static_cast<int>(std::nearbyint(iscale * x[j]))) << j;
  for (int g = 0; g < 16; ++g) {
    int sum = 0;
    for (int j = 0; j < 16; ++j) sum += b.qs[16 * g + j];
    EXPECT_EQ(b.bsums[g], sum) << g;
  }
  // Ties round to even: with m = -127 the scale is 1.
  std::vector<float> h(256, 0.0f);
  h[0] = -127.0f;
  h[1] = 2.5f;
  h[2] = -0.5f;
  h[3] = 3.5f;
  quantize_row_q8_k(h.data(), 256, &b);
  EXPECT_EQ(b.d, 1.0f);
  EXPECT_EQ(b.qs[0], -127);
  EXPECT_EQ(b.qs[1], 2);
  EXPECT_EQ(b.qs[2], 0);
  EXPECT_EQ(b.qs[3], 4);
  std::vector<float> z(256, 0.0f);
  quantize_row_q8_k(z.data(), 256, &b);
  EXPECT_EQ(b.d, 0.0f);
  for (int g = 0; g < 16; ++g) EXPECT_EQ(b.bsums[g], 0);
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
// x * (127/amax) can move a value across a .5 boundary by 2 * 127 * 2^-24 d, and
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

// Every level's activation quantizer must give the reference quantizers'
// bytes and scales (the reference twin quantizes with them), including exact
// .5 ties, for each activation format and the layout that level uses.
TEST(Quantize, SimdActivationQuantizersAreBitExact) {
  using namespace matmul_detail;
  level_guard guard;
  std::mt19937 rng(11);
  constexpr std::int64_t m = 3;
  for (tensor_type t : {tensor_type::q8_0, tensor_type::q4_0, tensor_type::q5_0, tensor_type::iq4_nl, tensor_type::q4_1,
                        tensor_type::q5_1, tensor_type::q2_k, tensor_type::q3_k, tensor_type::q4_k, tensor_type::q5_k,
                        tensor_type::q6_k, tensor_type::iq4_xs, tensor_type::iq3_s, tensor_type::mxfp4}) {
    const act_format af = act_format_of(t);
    // 19 blocks of 32: one full group of 16 and a partial one; 3 super-blocks.
    const std::int64_t n = af == act_format::q8_k ? 768 : 32 * 19;
    std::vector<float> x = random_floats(rng, m * n, -5.0f, 5.0f);
    for (int j = 0; j < 32; ++j) x[j] = (j == 0) ? 127.0f : static_cast<float>(j % 9) - 4.5f;  // scale 1, ties
    for (int j = 32; j < 64; ++j) x[j] = 0.0f;
    if (af == act_format::q8_k)
      for (int j = 256; j < 512; ++j) x[j] = 0.0f;  // a zero super-block
    // The reference bytes, as block_q8_1 (a superset of q8_0) or block_q8_k.
    std::vector<block_q8_1> want1(static_cast<std::size_t>(m * n / 32));
    std::vector<block_q8_k> wantk(static_cast<std::size_t>(m * n / 256 + 1));
    for (std::int64_t i = 0; i < m; ++i) {
      if (af == act_format::q8_k) quantize_row_q8_k(x.data() + i * n, n, wantk.data() + i * (n / 256));
      else quantize_row_q8_1(x.data() + i * n, n, want1.data() + i * (n / 32));
    }
    for (simd_level lv : k_levels) {
      const int level = static_cast<int>(lv);
      if (!use_level(lv)) continue;
      SCOPED_TRACE(testing::Message() << type_name(t) << " level " << level);
      const kernel_set& ks = level_kernels(lv);
      const std::size_t row_bytes = ks.act_row_bytes(t, n);
      aligned_buffer act(row_bytes * m);
      ks.prepare(t, x.data(), m, n, act.data(), row_bytes);
      for (std::int64_t i = 0; i < m; ++i) {
        const std::byte* row = act.data() + i * row_bytes;
        if (af == act_format::q8_k) {
          const plain_layout l = plain_layout_of(af, n);
          for (std::int64_t b = 0; b < n / 256; ++b) {
            const block_q8_k& wb = wantk[i * (n / 256) + b];
            float d;
            std::memcpy(&d, row + l.d_off + 4 * b, 4);
            EXPECT_EQ(d, wb.d) << "row " << i << " super-block " << b;
            EXPECT_EQ(0, std::memcmp(row + l.bsums_off + 32 * b, wb.bsums, 32)) << "row " << i << " super-block " << b;
            // AVX-512 stores each super-block's values in the format's order.
            for (int p = 0; p < 256; ++p) {
              const int e = level == 2 ? kq_act_element_avx512(t, p) : p;
              ASSERT_EQ(static_cast<std::int8_t>(row[256 * b + p]), wb.qs[e]) << "row " << i << " byte " << p;
            }
          }
          continue;
        }
        const bool grouped = level == 2 && uses_groups(t);
        for (std::int64_t b = 0; b < n / 32; ++b) {
          const block_q8_1& wb = want1[i * (n / 32) + b];
          std::int8_t q[32];
          float d, s = 0;
          if (!grouped) {  // plain layout
            const plain_layout l = plain_layout_of(af, n);
            std::memcpy(q, row + b * 32, 32);
            std::memcpy(&d, row + l.d_off + b * 4, 4);
            if (af == act_format::q8_1) std::memcpy(&s, row + l.s_off + b * 4, 4);
          } else {  // grouped layout: one int32 lane per block
            const std::byte* g = row + (b / k_group_blocks) * group_act_bytes(af);
            const int p = static_cast<int>(b % k_group_blocks);
            for (int j = 0; j < 8; ++j) std::memcpy(q + 4 * j, g + 64 * j + 4 * p, 4);
            std::memcpy(&d, g + k_group_d_off + 4 * p, 4);
            if (af == act_format::q8_1) std::memcpy(&s, g + k_group_s_off + 4 * p, 4);
            std::int32_t init;
            std::memcpy(&init, g + k_group_init_off + 4 * p, 4);
            int sum = 0;
            for (int e = 0; e < 32; ++e) sum += wb.qs[e];
            EXPECT_EQ(init, -group_weight_offset(t) * sum) << "block " << b;
          }
          EXPECT_EQ(d, fp16_to_f32(wb.d)) << "row " << i << " block " << b;
          if (af == act_format::q8_1) {
            EXPECT_EQ(s, fp16_to_f32(wb.s)) << "row " << i << " block " << b;
          }
          EXPECT_EQ(0, std::memcmp(q, wb.qs, 32)) << "row " << i << " block " << b;
        }
      }
    }
  }
}

// The AVX-512 super-block kernels read activations in a per-format order: each
// must be a permutation of the 256 values.
TEST(Quantize, SuperBlockActivationOrdersArePermutations) {
  level_guard guard;
  // A property of the AVX-512 code's tables, whatever level this run is about.
  if (best_simd_level(detect_cpu()) < simd_level::avx512) GTEST_SKIP() << "no AVX-512 on this CPU";
  set_simd_level(simd_level::avx512);
  for (tensor_type t : {tensor_type::q2_k, tensor_type::q3_k, tensor_type::q4_k, tensor_type::q5_k, tensor_type::q6_k,
                        tensor_type::iq4_xs, tensor_type::iq3_s}) {
    std::vector<int> seen(256, 0);
    for (int p = 0; p < 256; ++p) ++seen[matmul_detail::kq_act_element_avx512(t, p)];
    for (int e = 0; e < 256; ++e) EXPECT_EQ(seen[e], 1) << type_name(t) << " element " << e;
  }
}

}  // namespace
}  // namespace pagoda
