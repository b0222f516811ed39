// Weight matmul: dispatch, the reference twin and the portable (scalar) level.
// SIMD levels live in matmul_avx2.cpp / matmul_avx512.cpp and the matmul_k*
// files; formats and activation quantizers in model/quants.cpp.
#include "model/matmul.h"

#include <algorithm>
#include <atomic>
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
  const gguf::tensor_type_traits* tr = gguf::get_tensor_type_traits(static_cast<std::uint32_t>(t));
  PAGODA_ASSERT(tr && tr->supported, "row_size_bytes: unsupported tensor type {}", static_cast<unsigned>(t));
  PAGODA_ASSERT(n % tr->block_size == 0, "{} row of {} elements is not a multiple of its block size {}", tr->name, n,
                tr->block_size);
  return static_cast<std::size_t>(n) / tr->block_size * tr->block_bytes;
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
    default: break;
  }
  dequantize_quantized_row(w.type, row, n, out);
}

namespace {

void check_view(const weight_view& w, std::int64_t m) {
  PAGODA_ASSERT(m >= 0 && w.n_in > 0 && w.n_out >= 0, "matmul: bad shape m={} n_in={} n_out={}", m, w.n_in,
                w.n_out);
  PAGODA_ASSERT(w.data != nullptr || w.n_out == 0, "matmul: null weights");
  PAGODA_ASSERT(w.row_bytes >= row_size_bytes(w.type, w.n_in), "matmul: row_bytes {} below {} for n_in {}",
                w.row_bytes, row_size_bytes(w.type, w.n_in), w.n_in);
}

// ---------------------------------------------------------------------------
// Scalar level. Float weights: each column is converted to f32 in this
// thread's buffer, then dotted against every row: 8 lanes, lane l accumulates
// k = l, l+8, ... (acc = acc + x*w), then ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
// Quantized weights: generic_quant_cols (matmul_internal.h).
// ---------------------------------------------------------------------------

std::size_t scalar_act_row_bytes(tensor_type t, std::int64_t n_in) {
  return is_quantized(t) ? plain_act_row_bytes(act_format_of(t), n_in) : 0;
}

void scalar_prepare(tensor_type t, const float* x, std::int64_t m, std::int64_t n_in, std::byte* act,
                    std::size_t row_bytes) {
  prepare_plain(act_format_of(t), x, m, n_in, act, row_bytes, quantize_block_q8,
                [](const float* xb, block_q8_k& out) { quantize_row_q8_k(xb, k_qk_k, &out); });
}

std::size_t scalar_pack_bytes(tensor_type t, std::int64_t n_in) {
  return is_quantized(t) ? generic_pack_bytes(t, n_in) : static_cast<std::size_t>(n_in) * sizeof(float);
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
  if (is_quantized(w.type)) return generic_quant_cols(jb, c0, c1, pack);
  const std::int64_t n = w.n_in;
  auto* wf = reinterpret_cast<float*>(pack);
  for (std::int64_t c = c0; c < c1; ++c) {
    dequantize_row(w, c, wf);
    for (std::int64_t i = 0; i < jb.m; ++i) jb.y[i * w.n_out + c] = dot_f32_lanes(jb.x + i * n, wf, n);
  }
}

std::int64_t scalar_col_tile(tensor_type) { return 4; }

const kernel_set k_scalar_kernels{scalar_col_tile, scalar_act_row_bytes, scalar_prepare, scalar_pack_bytes, scalar_cols};

// The kernels for one weight matrix. The choice depends on the level, the type
// and n_in only (never on m or threads), so it cannot break batch invariance.
// AVX-512 kernels for block-32 formats work on groups of 16 blocks; when padding
// the last group would add more than a quarter to the work (n_in < 512 and the
// like, e.g. tiny models), the AVX2 kernels of q8_0 and q4_0, which need no
// padding, were measured faster. The other block-32 formats (q4_1, q5_0,
// q5_1, iq4_nl, mxfp4) have AVX2 kernels too now, but whether they beat padded
// AVX-512 groups there has not been measured (it needs an AVX-512 machine),
// so they stay on AVX-512.
const kernel_set& kernels_for(simd_level level, tensor_type t, std::int64_t n_in) {
  switch (level) {
    case simd_level::avx512: {
      const std::int64_t nb = n_in / k_block, padded = n_groups(n_in) * k_group_blocks;
      const bool avx2_kernel = t == tensor_type::q8_0 || t == tensor_type::q4_0;
      if (avx2_kernel && 4 * padded > 5 * nb && detect_cpu().avx2) return kernels_avx2();
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

// Columns are handed out in chunks, each thread taking the next free one
// (llama.cpp's mul_mat does the same): on this shared machine a thread that
// loses its core for a while leaves its share to the others instead of
// holding up the whole call, which a static split did (at 2 threads, a
// quarter of a decode's samples were waits). Chunks are whole column tiles,
// so the per-pair arithmetic, and so every result, is what one thread
// computes alone. The pool runs this as a shared job: a worker that has not
// started when the calling thread runs out of chunks is not waited for (a
// barrier per matmul made every call wait for a descheduled worker).
//
// Chunks shrink as the call nears its end (guided scheduling): each takes
// 1 / (k_guided_divisor x threads) of the tiles left, at least one, and none
// crosses a row block. With equal chunks (8 per thread) the thread that
// finished first waited half a chunk on average at every call's end, about
// 15 us of a 2-thread decode matmul's 250 (bench/RESULTS.md, "Guided
// chunks"); the last chunks are now one tile.
constexpr std::int64_t k_guided_divisor = 2;

// The job's rows r0 .. r0 + rows.
job rows_of(const job& jb, std::int64_t r0, std::int64_t rows) {
  const std::int64_t n_in = jb.w->n_in, n_out = jb.w->n_out;
  return job{jb.w, jb.x + r0 * n_in, jb.act + static_cast<std::size_t>(r0) * jb.act_row_bytes,
             jb.act_row_bytes, std::min(rows, jb.m - r0), jb.y + r0 * n_out};
}

struct run_ctx {
  const kernel_set* ks;
  job jb;
  std::byte* pack_base;
  std::size_t pack_stride;
  std::int64_t col_tile;
  std::int64_t n_tiles;     // column tiles per row block
  std::int64_t block_rows;  // rows per row block
  std::int64_t total;       // row blocks x n_tiles
  std::int64_t nth;
  alignas(64) std::atomic<std::int64_t> next_tile;  // over row blocks x column tiles
};

// Claims the next chunk, tiles [g, g + take) of the index over row blocks x
// column tiles; false when none are left.
bool claim(run_ctx& c, std::int64_t& g, std::int64_t& take) {
  g = c.next_tile.load(std::memory_order_relaxed);
  do {
    if (g >= c.total) return false;
    take = std::clamp<std::int64_t>((c.total - g) / (k_guided_divisor * c.nth), 1, c.n_tiles - g % c.n_tiles);
  } while (!c.next_tile.compare_exchange_weak(g, g + take, std::memory_order_relaxed));
  return true;
}

}  // namespace

namespace matmul_detail {

const kernel_set& kernels_scalar() { return k_scalar_kernels; }

std::int64_t row_block_of(std::size_t act_row, std::int64_t m) {
  if (act_row == 0) return m;
  const auto rows = static_cast<std::int64_t>(k_row_block_bytes / act_row) / k_row_block_multiple;
  return std::min(m, std::max<std::int64_t>(1, rows) * k_row_block_multiple);
}

namespace {

// One column decoded to integer form, in a thread's pack buffer.
struct generic_pack {
  std::int8_t* q;    // [n_in]
  std::int16_t* sc;  // [n_in / 16]
  std::int16_t* mn;  // [n_in / 16]
  float* da;         // [n_in / block]
  float* db;         // [n_in / block]
};

// Byte offsets of generic_pack's arrays after q; `total` is the buffer size.
struct generic_offsets {
  std::size_t sc, mn, da, db, total;
};

generic_offsets generic_offsets_of(std::int64_t n_in, std::int64_t n_blocks) {
  const auto n = static_cast<std::size_t>(n_in), groups = round_up(n / 16 * sizeof(std::int16_t), 64);
  const std::size_t blocks = round_up(static_cast<std::size_t>(n_blocks) * sizeof(float), 64);
  generic_offsets o;
  o.sc = round_up(n, 64);
  o.mn = o.sc + groups;
  o.da = o.mn + groups;
  o.db = o.da + blocks;
  o.total = o.db + blocks;
  return o;
}

generic_pack generic_pack_at(std::byte* pack, std::int64_t n_in, std::int64_t n_blocks) {
  const generic_offsets o = generic_offsets_of(n_in, n_blocks);
  return {reinterpret_cast<std::int8_t*>(pack), reinterpret_cast<std::int16_t*>(pack + o.sc),
          reinterpret_cast<std::int16_t*>(pack + o.mn), reinterpret_cast<float*>(pack + o.da),
          reinterpret_cast<float*>(pack + o.db)};
}

}  // namespace

std::size_t generic_pack_bytes(tensor_type t, std::int64_t n_in) {
  return generic_offsets_of(n_in, n_in / weight_block_elems(t)).total;
}

void generic_quant_cols(const job& jb, std::int64_t c0, std::int64_t c1, std::byte* pack) {
  const weight_view& w = *jb.w;
  const act_format af = act_format_of(w.type);
  const std::int64_t n = w.n_in, be = weight_block_elems(w.type), nb = n / be, ng = be / 16;
  const std::size_t block_bytes = row_size_bytes(w.type, be);
  const plain_layout al = plain_layout_of(af, n);
  const generic_pack p = generic_pack_at(pack, n, nb);
  int_block ib;
  for (std::int64_t c = c0; c < c1; ++c) {
    const std::byte* row = static_cast<const std::byte*>(w.data) + static_cast<std::size_t>(c) * w.row_bytes;
    for (std::int64_t b = 0; b < nb; ++b) {
      decode_int_block(w.type, row + static_cast<std::size_t>(b) * block_bytes, ib);
      std::memcpy(p.q + b * be, ib.q, static_cast<std::size_t>(be));
      std::memcpy(p.sc + b * ng, ib.sc, static_cast<std::size_t>(ng) * sizeof(std::int16_t));
      std::memcpy(p.mn + b * ng, ib.mn, static_cast<std::size_t>(ng) * sizeof(std::int16_t));
      p.da[b] = ib.da;
      p.db[b] = ib.db;
    }
    for (std::int64_t i = 0; i < jb.m; ++i) {
      const std::byte* arow = jb.act + static_cast<std::size_t>(i) * jb.act_row_bytes;
      const auto* xq = reinterpret_cast<const std::int8_t*>(arow);
      const auto* xd = reinterpret_cast<const float*>(arow + al.d_off);
      const auto* xs = reinterpret_cast<const float*>(arow + al.s_off);
      const auto* bsums = reinterpret_cast<const std::int16_t*>(arow + al.bsums_off);
      float acc = 0.0f;
      for (std::int64_t b = 0; b < nb; ++b) {
        std::int32_t sum = 0, mins = 0;
        for (std::int64_t g = b * ng; g < (b + 1) * ng; ++g) {
          std::int32_t isum = 0;
          for (std::int64_t e = 16 * g; e < 16 * g + 16; ++e) isum += p.q[e] * xq[e];
          sum += p.sc[g] * isum;
          if (af == act_format::q8_k) mins += p.mn[g] * bsums[g];
        }
        switch (af) {
          case act_format::q8_0: acc = acc + (xd[b] * p.da[b]) * static_cast<float>(sum); break;
          case act_format::q8_1: acc = acc + ((xd[b] * p.da[b]) * static_cast<float>(sum) - p.db[b] * xs[b]); break;
          default:
            acc = acc + xd[b] * (p.da[b] * static_cast<float>(sum) - p.db[b] * static_cast<float>(mins));
            break;
        }
      }
      jb.y[i * w.n_out + c] = acc;
    }
  }
}

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
  const job all{&w, x, base, act_row, m, y};
  const std::int64_t block_rows = row_block_of(act_row, m);
  if (nth == 1) {
    for (std::int64_t r0 = 0; r0 < m; r0 += block_rows)
      ks.cols(rows_of(all, r0, block_rows), 0, w.n_out, base + act_bytes);
    return;
  }
  run_ctx ctx{&ks, all, base + act_bytes, pack_stride, col_tile, n_tiles, block_rows,
              n_tiles * ((m + block_rows - 1) / block_rows), nth, {0}};
  // Capture one pointer: std::function keeps it inline, with no allocation.
  run_ctx* c = &ctx;
  pool.run_shared([c](int ith, int) {
    std::byte* pack = c->pack_base + c->pack_stride * static_cast<std::size_t>(ith);
    std::int64_t g = 0, take = 0;
    while (claim(*c, g, take)) {
      const std::int64_t t = g % c->n_tiles;
      c->ks->cols(rows_of(c->jb, g / c->n_tiles * c->block_rows, c->block_rows), t * c->col_tile,
                  std::min((t + take) * c->col_tile, c->jb.w->n_out), pack);
    }
  });
}

// ---------------------------------------------------------------------------
// Reference twin: one pair at a time, accumulation in double. Quantized
// weights: each row of x goes through quantize_row_q8_0 / _q8_1 / _q8_k (the
// quantization every level reproduces), each weight block through
// decode_int_block, the block's integer sums S and M are exact, and the terms
// dx * (da * S - db * M) (q8_1: dx * da * S - db * s) are summed in double.
// ---------------------------------------------------------------------------
namespace {

// One activation block as the reference sees it: values, scale, and the sums
// the min terms use (per 16 values; q8_1's stored s).
struct ref_act_block {
  const std::int8_t* q;
  double d;
  double s;                   // q8_1 only
  const std::int16_t* bsums;  // q8_K only
};

std::vector<std::byte> quantize_ref_rows(act_format af, const float* x, std::int64_t m, std::int64_t n) {
  const std::size_t block_bytes = af == act_format::q8_k   ? sizeof(block_q8_k)
                                  : af == act_format::q8_1 ? sizeof(block_q8_1)
                                                           : sizeof(block_q8_0);
  const std::int64_t nb = n / act_block_elems(af);
  std::vector<std::byte> out(static_cast<std::size_t>(m * nb) * block_bytes);
  for (std::int64_t i = 0; i < m; ++i) {
    std::byte* dst = out.data() + static_cast<std::size_t>(i * nb) * block_bytes;
    if (af == act_format::q8_k) quantize_row_q8_k(x + i * n, n, dst);
    else if (af == act_format::q8_1) quantize_row_q8_1(x + i * n, n, dst);
    else quantize_row_q8_0(x + i * n, n, dst);
  }
  return out;
}

ref_act_block ref_act_at(act_format af, const std::vector<std::byte>& rows, std::int64_t index) {
  const std::byte* p = rows.data();
  switch (af) {
    case act_format::q8_k: {
      const auto& b = reinterpret_cast<const block_q8_k*>(p)[index];
      return {b.qs, b.d, 0, b.bsums};
    }
    case act_format::q8_1: {
      const auto& b = reinterpret_cast<const block_q8_1*>(p)[index];
      return {b.qs, fp16_to_f32(b.d), fp16_to_f32(b.s), nullptr};
    }
    default: {
      const auto& b = reinterpret_cast<const block_q8_0*>(p)[index];
      return {b.qs, fp16_to_f32(b.d), 0, nullptr};
    }
  }
}

double ref_block_dot(act_format af, const int_block& w, const ref_act_block& a) {
  std::int64_t sum = 0, mins = 0;
  for (int g = 0; g < w.n / 16; ++g) {
    std::int64_t isum = 0;
    for (int e = 16 * g; e < 16 * g + 16; ++e) isum += w.q[e] * a.q[e];
    sum += w.sc[g] * isum;
    if (af == act_format::q8_k) mins += static_cast<std::int64_t>(w.mn[g]) * a.bsums[g];
  }
  const double main = a.d * static_cast<double>(w.da) * static_cast<double>(sum);
  if (af == act_format::q8_1) return main - static_cast<double>(w.db) * a.s;
  return main - a.d * static_cast<double>(w.db) * static_cast<double>(mins);
}

}  // namespace

void matmul_ref(const weight_view& w, const float* x, std::int64_t m, float* y) {
  check_view(w, m);
  const std::int64_t n = w.n_in;
  if (!is_quantized(w.type)) {
    std::vector<float> wf(static_cast<std::size_t>(n));
    for (std::int64_t j = 0; j < w.n_out; ++j) {
      dequantize_row(w, j, wf.data());
      for (std::int64_t i = 0; i < m; ++i) {
        double acc = 0.0;
        for (std::int64_t k = 0; k < n; ++k) acc += static_cast<double>(x[i * n + k]) * wf[k];
        y[i * w.n_out + j] = static_cast<float>(acc);
      }
    }
    return;
  }
  const act_format af = act_format_of(w.type);
  const std::int64_t be = weight_block_elems(w.type), nb = n / be;
  const std::size_t block_bytes = row_size_bytes(w.type, be);
  const std::vector<std::byte> xq = quantize_ref_rows(af, x, m, n);
  int_block ib;
  for (std::int64_t j = 0; j < w.n_out; ++j) {
    const std::byte* row = static_cast<const std::byte*>(w.data) + static_cast<std::size_t>(j) * w.row_bytes;
    for (std::int64_t i = 0; i < m; ++i) {
      double acc = 0.0;
      for (std::int64_t b = 0; b < nb; ++b) {
        decode_int_block(w.type, row + static_cast<std::size_t>(b) * block_bytes, ib);
        acc += ref_block_dot(af, ib, ref_act_at(af, xq, i * nb + b));
      }
      y[i * w.n_out + j] = static_cast<float>(acc);
    }
  }
}

}  // namespace pagoda
