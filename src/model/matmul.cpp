// Weight matmul: dispatch, the reference twin, the portable (scalar) level, and
// ggml's row quantizers. SIMD levels live in matmul_avx2.cpp / matmul_avx512.cpp.
#include "model/matmul.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/assert.h"
#include "core/cpu.h"
#include "model/matmul_internal.h"

namespace pagoda {

using gguf::tensor_type;
using namespace matmul_detail;

std::size_t row_size_bytes(tensor_type t, std::int64_t n) {
  PAGODA_ASSERT(n >= 0, "negative row length {}", n);
  const auto un = static_cast<std::size_t>(n);
  switch (t) {
    case tensor_type::f32: return un * 4;
    case tensor_type::f16:
    case tensor_type::bf16: return un * 2;
    case tensor_type::q8_0:
      PAGODA_ASSERT(n % k_qk8_0 == 0, "q8_0 row of {} elements is not a multiple of 32", n);
      return un / k_qk8_0 * sizeof(block_q8_0);
    case tensor_type::q4_0:
      PAGODA_ASSERT(n % k_qk4_0 == 0, "q4_0 row of {} elements is not a multiple of 32", n);
      return un / k_qk4_0 * sizeof(block_q4_0);
    default: break;
  }
  PAGODA_ASSERT(false, "row_size_bytes: unsupported tensor type {}", static_cast<unsigned>(t));
  return 0;
}

// ---------------------------------------------------------------------------
// ggml row quantizers and dequantization
// ---------------------------------------------------------------------------

void quantize_row_q8_0(const float* x, std::int64_t n, void* out) {
  PAGODA_ASSERT(n % k_qk8_0 == 0, "quantize_row_q8_0: n = {} is not a multiple of 32", n);
  auto* y = static_cast<block_q8_0*>(out);
  for (std::int64_t b = 0; b < n / k_qk8_0; ++b) y[b].d = quantize_block_q8_0(x + b * k_qk8_0, y[b].qs);
}

// ggml's quantize_row_q4_0_ref: the element of largest magnitude (first one on
// ties) maps to -8 exactly, d = max / -8, q = min(15, trunc(x/d + 8.5)). Values
// are clamped before the integer conversion so NaN/inf cannot be undefined
// behaviour; finite inputs give ggml's bytes.
void quantize_row_q4_0(const float* x, std::int64_t n, void* out) {
  PAGODA_ASSERT(n % k_qk4_0 == 0, "quantize_row_q4_0: n = {} is not a multiple of 32", n);
  auto* y = static_cast<block_q4_0*>(out);
  for (std::int64_t b = 0; b < n / k_qk4_0; ++b) {
    const float* xb = x + b * k_qk4_0;
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < k_qk4_0; ++j) {
      if (amax < std::fabs(xb[j])) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    for (int j = 0; j < k_qk4_0 / 2; ++j) {
      auto nib = [&](float v) {
        float t = v * id + 8.5f;
        t = t > 0.0f ? t : 0.0f;
        t = t < 15.0f ? t : 15.0f;
        return static_cast<std::uint8_t>(t);  // truncation, as ggml's (int8_t) cast
      };
      y[b].qs[j] = static_cast<std::uint8_t>(nib(xb[j]) | nib(xb[j + k_qk4_0 / 2]) << 4);
    }
  }
}

void dequantize_row(const weight_view& w, std::int64_t r, float* out) {
  PAGODA_ASSERT(r >= 0 && r < w.n_out, "dequantize_row: row {} of {}", r, w.n_out);
  const std::byte* row = static_cast<const std::byte*>(w.data) + static_cast<std::size_t>(r) * w.row_bytes;
  const std::int64_t n = w.n_in;
  switch (w.type) {
    case tensor_type::f32: std::memcpy(out, row, static_cast<std::size_t>(n) * 4); return;
    case tensor_type::f16: {
      const auto* h = reinterpret_cast<const fp16_t*>(row);
      for (std::int64_t k = 0; k < n; ++k) out[k] = fp16_to_f32(h[k]);
      return;
    }
    case tensor_type::bf16: {
      const auto* h = reinterpret_cast<const bf16_t*>(row);
      for (std::int64_t k = 0; k < n; ++k) out[k] = bf16_to_f32(h[k]);
      return;
    }
    case tensor_type::q8_0: {
      const auto* b = reinterpret_cast<const block_q8_0*>(row);
      for (std::int64_t i = 0; i < n / k_qk8_0; ++i) {
        const float d = fp16_to_f32(b[i].d);
        for (int j = 0; j < k_qk8_0; ++j) out[i * k_qk8_0 + j] = d * static_cast<float>(b[i].qs[j]);
      }
      return;
    }
    case tensor_type::q4_0: {
      const auto* b = reinterpret_cast<const block_q4_0*>(row);
      for (std::int64_t i = 0; i < n / k_qk4_0; ++i) {
        const float d = fp16_to_f32(b[i].d);
        for (int j = 0; j < k_qk4_0 / 2; ++j) {
          out[i * k_qk4_0 + j] = d * static_cast<float>((b[i].qs[j] & 15) - 8);
          out[i * k_qk4_0 + j + k_qk4_0 / 2] = d * static_cast<float>((b[i].qs[j] >> 4) - 8);
        }
      }
      return;
    }
    default: break;
  }
  PAGODA_ASSERT(false, "dequantize_row: unsupported tensor type {}", static_cast<unsigned>(w.type));
}

namespace {

void check_view(const weight_view& w, std::int64_t m) {
  PAGODA_ASSERT(m >= 0 && w.n_in > 0 && w.n_out >= 0, "matmul: bad shape m={} n_in={} n_out={}", m, w.n_in,
                w.n_out);
  PAGODA_ASSERT(w.data != nullptr || w.n_out == 0, "matmul: null weights");
  PAGODA_ASSERT(w.row_bytes >= row_size_bytes(w.type, w.n_in), "matmul: row_bytes {} below {} for n_in {}",
                w.row_bytes, row_size_bytes(w.type, w.n_in), w.n_in);
}

// Integer dot of one 32-element block: q8 activations against the weight block.
int block_dot_q8_0(const std::int8_t* xq, const block_q8_0& b) {
  int s = 0;
  for (int j = 0; j < k_qk8_0; ++j) s += xq[j] * b.qs[j];
  return s;
}
int block_dot_q4_0(const std::int8_t* xq, const block_q4_0& b) {
  int s = 0;
  for (int j = 0; j < k_qk4_0 / 2; ++j) {
    s += xq[j] * ((b.qs[j] & 15) - 8);
    s += xq[j + k_qk4_0 / 2] * ((b.qs[j] >> 4) - 8);
  }
  return s;
}

// ---------------------------------------------------------------------------
// Scalar level. Each column's weights are first unpacked into this thread's
// buffer (f32 for float types; int8 + float scales for q types), then dotted
// against every row. Per-pair sequences:
//   float types: 8 lanes, lane l accumulates k = l, l+8, ... (acc = acc + x*w),
//                then ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
//   q types:     acc = acc + (dx_b * dw_b) * float(isum_b), blocks in order.
// ---------------------------------------------------------------------------

std::size_t scalar_act_row_bytes(tensor_type t, std::int64_t n_in) {
  return is_quantized(t) ? plain_act_row_bytes(n_in) : 0;
}

void scalar_prepare(tensor_type, const float* x, std::int64_t m, std::int64_t n_in, std::byte* act,
                    std::size_t row_bytes) {
  prepare_plain(x, m, n_in, act, row_bytes,
                [](const float* xb, std::int8_t* q) { return fp16_to_f32(quantize_block_q8_0(xb, q)); });
}

std::size_t scalar_pack_bytes(tensor_type t, std::int64_t n_in) {
  return is_quantized(t) ? plain_act_row_bytes(n_in) : static_cast<std::size_t>(n_in) * sizeof(float);
}

float dot_f32_lanes(const float* x, const float* w, std::int64_t n) {
  float l[8] = {};
  std::int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) l[j] = l[j] + x[k + j] * w[k + j];
  for (int j = 0; k + j < n; ++j) l[j] = l[j] + x[k + j] * w[k + j];
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

void scalar_cols(const job& jb, std::int64_t c0, std::int64_t c1, std::byte* pack) {
  const weight_view& w = *jb.w;
  const std::int64_t n = w.n_in, nb = n / k_block;
  for (std::int64_t c = c0; c < c1; ++c) {
    const std::byte* row = static_cast<const std::byte*>(w.data) + static_cast<std::size_t>(c) * w.row_bytes;
    if (!is_quantized(w.type)) {
      auto* wf = reinterpret_cast<float*>(pack);
      weight_view one = w;
      one.data = row;
      one.n_out = 1;
      dequantize_row(one, 0, wf);
      for (std::int64_t i = 0; i < jb.m; ++i) jb.y[i * w.n_out + c] = dot_f32_lanes(jb.x + i * n, wf, n);
      continue;
    }
    auto* wq = reinterpret_cast<std::int8_t*>(pack);
    auto* wd = reinterpret_cast<float*>(pack + plain_qs_bytes(n));
    for (std::int64_t b = 0; b < nb; ++b) {
      if (w.type == tensor_type::q8_0) {
        const auto& blk = reinterpret_cast<const block_q8_0*>(row)[b];
        wd[b] = fp16_to_f32(blk.d);
        std::memcpy(wq + b * k_block, blk.qs, k_block);
      } else {
        const auto& blk = reinterpret_cast<const block_q4_0*>(row)[b];
        wd[b] = fp16_to_f32(blk.d);
        for (int j = 0; j < 16; ++j) {
          wq[b * k_block + j] = static_cast<std::int8_t>((blk.qs[j] & 15) - 8);
          wq[b * k_block + j + 16] = static_cast<std::int8_t>((blk.qs[j] >> 4) - 8);
        }
      }
    }
    for (std::int64_t i = 0; i < jb.m; ++i) {
      const std::byte* arow = jb.act + static_cast<std::size_t>(i) * jb.act_row_bytes;
      const auto* xq = reinterpret_cast<const std::int8_t*>(arow);
      const auto* xd = reinterpret_cast<const float*>(arow + plain_qs_bytes(n));
      float acc = 0.0f;
      for (std::int64_t b = 0; b < nb; ++b) {
        int s = 0;
        for (int j = 0; j < k_block; ++j) s += xq[b * k_block + j] * wq[b * k_block + j];
        acc = acc + (xd[b] * wd[b]) * static_cast<float>(s);
      }
      jb.y[i * w.n_out + c] = acc;
    }
  }
}

std::int64_t scalar_col_tile(tensor_type) { return 4; }

const kernel_set k_scalar_kernels{scalar_col_tile, scalar_act_row_bytes, scalar_prepare, scalar_pack_bytes, scalar_cols};

// The kernels for one weight matrix. The choice depends on the level, the type
// and n_in only (never on m or threads), so it cannot break batch invariance.
// AVX-512 q kernels work on groups of 16 blocks; when padding the last group
// would add more than a quarter to the work (n_in < 512 and the like, e.g. tiny
// models), the AVX2 kernels, which need no padding, are faster.
const kernel_set& kernels_for(simd_level level, tensor_type t, std::int64_t n_in) {
  switch (level) {
    case simd_level::avx512: {
      const std::int64_t nb = n_in / k_block, padded = n_groups(n_in) * k_group_blocks;
      if (is_quantized(t) && 4 * padded > 5 * nb && detect_cpu().avx2) return kernels_avx2();
      return kernels_avx512();
    }
    case simd_level::avx2: return kernels_avx2();
    case simd_level::scalar: break;
  }
  return kernels_scalar();
}

// Jobs below this many multiply-adds run on the calling thread: waking the pool
// costs a few microseconds, more than e.g. a whole stories260K projection.
constexpr std::int64_t k_parallel_min_macs = std::int64_t{1} << 18;

struct run_ctx {
  const kernel_set* ks;
  job jb;
  std::byte* pack_base;
  std::size_t pack_stride;
  std::int64_t col_tile;
};

}  // namespace

namespace matmul_detail {
const kernel_set& kernels_scalar() { return k_scalar_kernels; }
}  // namespace matmul_detail

void matmul(const weight_view& w, const float* x, std::int64_t m, float* y, thread_pool& pool,
            matmul_scratch& scratch) {
  check_view(w, m);
  if (m == 0 || w.n_out == 0) return;
  const kernel_set& ks = kernels_for(active_simd_level(), w.type, w.n_in);
  const bool quant = is_quantized(w.type);
  const std::size_t act_row = quant ? ks.act_row_bytes(w.type, w.n_in) : 0;
  const std::size_t act_bytes = round_up(act_row * static_cast<std::size_t>(m), k_simd_alignment);
  const std::size_t pack_stride = round_up(ks.pack_bytes(w.type, w.n_in), k_simd_alignment);
  const std::int64_t macs = m * w.n_out * w.n_in;
  const std::int64_t col_tile = ks.col_tile(w.type);
  const std::int64_t n_tiles = (w.n_out + col_tile - 1) / col_tile;
  const int nth = macs < k_parallel_min_macs || n_tiles < 2 ? 1 : pool.size();

  auto* base = static_cast<std::byte*>(scratch.reserve(act_bytes + pack_stride * static_cast<std::size_t>(nth)));
  if (quant) ks.prepare(w.type, x, m, w.n_in, base, act_row);
  run_ctx ctx{&ks, job{&w, x, base, act_row, m, y}, base + act_bytes, pack_stride, col_tile};
  if (nth == 1) {
    ks.cols(ctx.jb, 0, w.n_out, ctx.pack_base);
    return;
  }
  // Capture one pointer: std::function keeps it inline, with no allocation.
  const run_ctx* c = &ctx;
  pool.run([c](int ith, int nth_run) {
    std::size_t b, e;
    split_range(static_cast<std::size_t>(c->jb.w->n_out), ith, nth_run, static_cast<std::size_t>(c->col_tile), b, e);
    if (b < e)
      c->ks->cols(c->jb, static_cast<std::int64_t>(b), static_cast<std::int64_t>(e),
                  c->pack_base + c->pack_stride * static_cast<std::size_t>(ith));
  });
}

// ---------------------------------------------------------------------------
// Reference twin: one pair at a time, accumulation in double. For q types the
// activations go through quantize_row_q8_0 (the same quantization the fast path
// uses), each block's integer dot is exact, and the terms dx * dw * isum are
// summed in double.
// ---------------------------------------------------------------------------
void matmul_ref(const weight_view& w, const float* x, std::int64_t m, float* y) {
  check_view(w, m);
  const std::int64_t n = w.n_in;
  std::vector<float> wf(static_cast<std::size_t>(n));
  std::vector<block_q8_0> xq;
  if (is_quantized(w.type)) xq.resize(static_cast<std::size_t>(m * (n / k_qk8_0)));
  for (std::int64_t i = 0; is_quantized(w.type) && i < m; ++i) quantize_row_q8_0(x + i * n, n, &xq[i * (n / k_qk8_0)]);
  for (std::int64_t j = 0; j < w.n_out; ++j) {
    const std::byte* row = static_cast<const std::byte*>(w.data) + static_cast<std::size_t>(j) * w.row_bytes;
    if (!is_quantized(w.type)) dequantize_row(w, j, wf.data());
    for (std::int64_t i = 0; i < m; ++i) {
      double acc = 0.0;
      if (!is_quantized(w.type)) {
        for (std::int64_t k = 0; k < n; ++k) acc += static_cast<double>(x[i * n + k]) * wf[k];
      } else {
        for (std::int64_t b = 0; b < n / k_qk8_0; ++b) {
          const block_q8_0& xb = xq[i * (n / k_qk8_0) + b];
          int s;
          double dw;
          if (w.type == tensor_type::q8_0) {
            const auto& wb = reinterpret_cast<const block_q8_0*>(row)[b];
            s = block_dot_q8_0(xb.qs, wb);
            dw = fp16_to_f32(wb.d);
          } else {
            const auto& wb = reinterpret_cast<const block_q4_0*>(row)[b];
            s = block_dot_q4_0(xb.qs, wb);
            dw = fp16_to_f32(wb.d);
          }
          acc += static_cast<double>(fp16_to_f32(xb.d)) * dw * s;
        }
      }
      y[i * w.n_out + j] = static_cast<float>(acc);
    }
  }
}

}  // namespace pagoda
