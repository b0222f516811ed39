// Internals of the weight matmul (model/matmul.h): the per-SIMD-level kernel
// table, the activation layouts each level prepares, and the scalar pieces that
// every level must reproduce bit for bit (activation quantization). Included by
// matmul*.cpp and the matmul tests only.
//
// How batch invariance is kept (the CONTRACT in matmul.h): every kernel computes
// y[i][j] with its own accumulator, in a sequence of operations fixed by n_in
// alone: the same lane structure, the same k order, the same tail padding, the
// same horizontal reduction, whatever tile (i, j) lands in. Tiles only decide
// which pairs run side by side, and threads only decide which columns a tile
// covers; neither changes a pair's arithmetic. Float code here relies on the
// compiler not contracting a*b+c into fma on its own (-std=c++20 is strict ISO,
// where GCC and Clang default to -ffp-contract=off); kernels call fma explicitly.
#pragma once

#include <xmmintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "core/ggml_blocks.h"
#include "core/half.h"
#include "model/matmul.h"
#include "model/quants.h"

namespace pagoda::matmul_detail {

using gguf::tensor_type;

// One call's arguments, read-only and shared by all threads.
struct job {
  const weight_view* w = nullptr;
  const float* x = nullptr;        // [m][n_in] f32: read directly for float weights
  const std::byte* act = nullptr;  // quantized rows of x (quantized weights), the level's layout
  std::size_t act_row_bytes = 0;   // stride of `act` between rows
  std::int64_t m = 0;
  float* y = nullptr;  // [m][n_out]
};

// What one SIMD level provides. All pointers are non-null.
struct kernel_set {
  // Columns per tile for weights of type t; thread ranges are cut on multiples
  // of it so tiles stay whole.
  std::int64_t (*col_tile)(tensor_type t);
  // Bytes of one prepared activation row (0 for float weights, which read x).
  std::size_t (*act_row_bytes)(tensor_type t, std::int64_t n_in);
  // Quantizes m rows of x into `act` (stride act_row_bytes) in the activation
  // format of t (act_format_of). Only for quantized weights.
  void (*prepare)(tensor_type t, const float* x, std::int64_t m, std::int64_t n_in, std::byte* act,
                  std::size_t act_row_bytes);
  // Per-thread packing buffer for one column tile (0 when the level packs nothing).
  std::size_t (*pack_bytes)(tensor_type t, std::int64_t n_in);
  // Computes y[0..m)[col_begin..col_end) for all rows. `pack` is this thread's
  // buffer of pack_bytes (64-byte aligned).
  void (*cols)(const job& j, std::int64_t col_begin, std::int64_t col_end, std::byte* pack);
};

const kernel_set& kernels_scalar();
const kernel_set& kernels_avx2();
const kernel_set& kernels_avx512();

// A batch's quantized activations are taken in blocks of rows that fit in L2
// with room to spare (1 MiB per core here): every column tile reads all of a
// block's rows, so with one block of 512 rows (2.4 MiB at n_in 4096) each
// tile streamed them from the last-level cache, and a 512-token Q4_K_M prompt
// ran 1.25x faster in steps of 128 tokens than in one of 512 (bench/RESULTS.md,
// "Row blocks"). The weights are read once per block instead of once; no
// chunk of columns a thread claims spans two blocks.
// Blocks are multiples of 12 rows, so every kernel's row tile (2 or 3)
// stays whole. Float weights read f32 rows directly and are not blocked.
inline constexpr std::size_t k_row_block_bytes = std::size_t{512} << 10;
inline constexpr std::int64_t k_row_block_multiple = 12;
// Rows per block for activation rows of act_row bytes (act_row 0: float
// weights, one block of m); matmul() runs a batch block by block.
std::int64_t row_block_of(std::size_t act_row, std::int64_t m);

// ---------------------------------------------------------------------------
// The portable quantized kernel (the scalar level; the AVX2 and AVX-512 levels
// have kernels of their own for every quantized format). Each column's weights are decoded once into this
// thread's pack buffer in integer form (model/quants.h: q, group scales and
// mins, per-block da, db), then dotted against every prepared row:
//   S = sum_g sc[g] * isum_g, M = sum_g mn[g] * bsums[g]   (exact integers)
//   q8_0: acc = acc + (dx * da) * float(S)
//   q8_1: acc = acc + ((dx * da) * float(S) - db * s)
//   q8_K: acc = acc + dx * (da * float(S) - db * float(M))
// blocks in order. Plain activation layout.
// ---------------------------------------------------------------------------
std::size_t generic_pack_bytes(tensor_type t, std::int64_t n_in);
void generic_quant_cols(const job& j, std::int64_t col_begin, std::int64_t col_end, std::byte* pack);

// Super-block formats (q8_K activations) at the AVX-512 level
// (matmul_kquants_avx512.cpp) and the AVX2 level (matmul_kquants_avx2.cpp);
// the kernel_set entries of those levels call them.
std::size_t kq_act_row_bytes_avx512(tensor_type t, std::int64_t n_in);
void kq_prepare_avx512(tensor_type t, const float* x, std::int64_t m, std::int64_t n_in, std::byte* act,
                       std::size_t row_bytes);
std::int64_t kq_col_tile_avx512(tensor_type t);
// The natural index of the value stored at byte p (p < 256) of a prepared
// super-block (tests). REQUIRES: the CPU runs the AVX-512 level.
int kq_act_element_avx512(tensor_type t, int p);
void kq_cols_avx512(const job& j, std::int64_t col_begin, std::int64_t col_end);
bool has_kq_kernel_avx2(tensor_type t);
// One q8_K super-block, bit-exact with quantize_row_q8_k, at the AVX2 level.
void quantize_q8_k_avx2(const float* x, block_q8_k& out);
void kq_cols_avx2(const job& j, std::int64_t col_begin, std::int64_t col_end);

// The helpers below are included by files compiled with different ISA flags
// (baseline, -mavx2, -mavx512*). An inline function with external linkage could
// be emitted by an AVX-512 file and picked by the linker for a baseline caller,
// so they get internal linkage (one copy per file). For the same reason the SIMD
// files avoid code that instantiates shared templates (fmt, std containers).
namespace {

inline constexpr std::int64_t k_block = 32;  // elements per block-32 activation block (q8_0, q8_1)

inline bool is_quantized(tensor_type t) { return is_quantized_weight(t); }

// Formats whose AVX-512 kernel uses the grouped layout below (block-32 activations).
inline bool uses_groups(tensor_type t) {
  const act_format a = act_format_of(t);
  return a == act_format::q8_0 || a == act_format::q8_1;
}

inline std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// ---------------------------------------------------------------------------
// Plain activation layout (scalar and AVX2 levels). One row, each section
// starting on a 64-byte boundary:
//   int8  qs[n_in]          quantized values, natural order
//   float d[n_in / B]       the scale of each activation block (B = 32 for q8_0
//                           and q8_1, 256 for q8_K), fp16 scales as f32
//   float s[n_in / 32]      q8_1 only: each block's stored fp16 s, as f32
//   int16 bsums[n_in / 16]  q8_K only: sums of 16 values
// The bytes are those of quantize_row_q8_0/_1/_k (model/quants.h): every
// level's quantizer must produce them exactly.
// ---------------------------------------------------------------------------
struct plain_layout {
  std::size_t d_off = 0, s_off = 0, bsums_off = 0, row_bytes = 0;
};
inline std::size_t plain_qs_bytes(std::int64_t n_in) { return round_up(static_cast<std::size_t>(n_in), 64); }
inline plain_layout plain_layout_of(act_format a, std::int64_t n_in) {
  const auto n = static_cast<std::size_t>(n_in);
  plain_layout l;
  l.d_off = plain_qs_bytes(n_in);
  l.s_off = l.d_off + round_up(n / static_cast<std::size_t>(act_block_elems(a)) * sizeof(float), 64);
  l.bsums_off = l.s_off + (a == act_format::q8_1 ? round_up(n / 32 * sizeof(float), 64) : 0);
  l.row_bytes = l.bsums_off + (a == act_format::q8_k ? round_up(n / 16 * sizeof(std::int16_t), 64) : 0);
  return l;
}
inline std::size_t plain_act_row_bytes(act_format a, std::int64_t n_in) { return plain_layout_of(a, n_in).row_bytes; }

// Fills m rows of the plain layout for activation format a. For q8_0 / q8_1,
// quantize(x, q, &d_f32) quantizes one block of 32 floats into q and returns
// its fp16 scale (bit-exact with quantize_block_q8); for q8_K,
// quantize_k(x, block) quantizes one super-block of 256 (bit-exact with
// quantize_row_q8_k).
template <typename Q, typename QK>
inline void prepare_plain(act_format a, const float* x, std::int64_t m, std::int64_t n_in, std::byte* act,
                          std::size_t row_bytes, Q&& quantize, QK&& quantize_k) {
  const plain_layout l = plain_layout_of(a, n_in);
  for (std::int64_t i = 0; i < m; ++i) {
    std::byte* row = act + static_cast<std::size_t>(i) * row_bytes;
    auto* qs = reinterpret_cast<std::int8_t*>(row);
    auto* d = reinterpret_cast<float*>(row + l.d_off);
    const float* xr = x + i * n_in;
    if (a == act_format::q8_k) {
      auto* bsums = reinterpret_cast<std::int16_t*>(row + l.bsums_off);
      block_q8_k blk;
      for (std::int64_t b = 0; b < n_in / k_qk_k; ++b) {
        quantize_k(xr + b * k_qk_k, blk);
        d[b] = blk.d;
        std::memcpy(qs + b * k_qk_k, blk.qs, k_qk_k);
        std::memcpy(bsums + b * 16, blk.bsums, sizeof blk.bsums);
      }
      continue;
    }
    auto* s = reinterpret_cast<float*>(row + l.s_off);
    for (std::int64_t b = 0; b < n_in / k_block; ++b) {
      float d_f32;
      const fp16_t d16 = quantize(xr + b * k_block, qs + b * k_block, &d_f32);
      d[b] = fp16_to_f32(d16);
      if (a == act_format::q8_1) {
        int sum = 0;
        for (int j = 0; j < k_block; ++j) sum += qs[b * k_block + j];
        s[b] = fp16_to_f32(f32_to_fp16(d_f32 * static_cast<float>(sum)));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Grouped activation layout (AVX-512 level, block-32 formats), built for
// vpdpbusd. Blocks go in groups of 16 (the last group padded with zero blocks,
// d = 0), one int32 lane per block. One group, 640 bytes (704 for q8_1):
//   int8  xq[8][64]   xq[j][4p + i] = q of block p, element 4j + i (j < 8, p < 16,
//                     i < 4): int32 lane p of vector j is the j-th 4-byte slice of
//                     block p, so eight vpdpbusd steps sum a whole block per lane
//                     and the scales are applied once per 16 blocks.
//   int32 init[16]    -C * (sum of block p's 32 values), where C is the offset of
//                     the unsigned weight operand (group_weight_offset: 128 for
//                     q8_0 as w ^ 0x80, 8 for q4_0's raw nibble, ...), so that
//                     starting the integer accumulator at init cancels it exactly.
//   float dx[16]      lane p = scale of block p.
//   float sx[16]      q8_1 only: lane p = block p's stored s (fp16 as f32).
// Weights are packed per column tile into the same shape (see matmul_avx512.cpp)
// for calls of three rows or more. Calls of one or two rows (decode) store xq in
// block order instead (block p at bytes 32p..32p+31; init, dx, sx unchanged) and
// read the weights in place.
// ---------------------------------------------------------------------------
inline constexpr std::int64_t k_group_blocks = 16;
inline constexpr std::size_t k_group_init_off = 512, k_group_d_off = 576, k_group_s_off = 640;
inline std::size_t group_act_bytes(act_format a) { return a == act_format::q8_1 ? 704 : 640; }
// C above: the unsigned weight byte the grouped kernel multiplies is w + C.
inline int group_weight_offset(tensor_type t) {
  switch (t) {
    case tensor_type::q8_0:
    case tensor_type::iq4_nl:
    case tensor_type::mxfp4: return 128;
    case tensor_type::q4_0: return 8;
    case tensor_type::q5_0: return 16;
    default: return 0;  // q4_1, q5_1: unsigned values and a separate min
  }
}
inline std::int64_t n_groups(std::int64_t n_in) {
  return (n_in / k_block + k_group_blocks - 1) / k_group_blocks;
}

// ---------------------------------------------------------------------------
// Tiling helpers shared by the SIMD levels
// ---------------------------------------------------------------------------

// The kernel for every tile shape up to R x C: tiles<K, R, C>.at(nr, nc) is
// &K<nr, nc>::run (the full tile and each edge tile of one kernel). A plain
// array, not std::array, so no shared template is instantiated (see above).
template <typename Fn, std::size_t N, int C>
struct tile_fns {
  Fn fns[N];
  Fn at(int nr, int nc) const { return fns[(nr - 1) * C + (nc - 1)]; }
};
template <template <int, int> class K, int C, std::size_t... I>
constexpr auto make_tiles(std::index_sequence<I...>) {
  using fn = decltype(&K<1, 1>::run);
  return tile_fns<fn, sizeof...(I), C>{{&K<static_cast<int>(I / C) + 1, static_cast<int>(I % C) + 1>::run...}};
}
template <template <int, int> class K, int R, int C>
inline constexpr auto tiles = make_tiles<K, C>(std::make_index_sequence<R * C>{});

// Calls fn(r0, nr, c0, nc) for tiles of at most R rows x C columns covering rows
// [0, m) x columns [col_begin, col_end), column tiles outermost so a tile's
// weights stay in cache while every row passes over them.
template <int R, int C, typename F>
inline void for_each_tile(std::int64_t m, std::int64_t col_begin, std::int64_t col_end, F&& fn) {
  for (std::int64_t c0 = col_begin; c0 < col_end; c0 += C) {
    const int nc = static_cast<int>(col_end - c0 < C ? col_end - c0 : C);
    for (std::int64_t r0 = 0; r0 < m; r0 += R) fn(r0, static_cast<int>(m - r0 < R ? m - r0 : R), c0, nc);
  }
}

// Zeroes a tile's accumulators; stores each one's horizontal sum (the kernel's
// fixed reduction) to y[r * ldy + c].
template <int R, int C, typename V>
inline void zero_tile(V (&acc)[R][C], V zero) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = zero;
}
template <int R, int C, typename V, typename H>
inline void store_tile(const V (&acc)[R][C], float* y, std::int64_t ldy, H&& hsum) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) y[r * ldy + c] = hsum(acc[r][c]);
}

// Decode (one activation row) reads every weight once, so its speed is the
// memory's. Its tiles take one weight row (column) at a time: a column range's
// rows are adjacent, so the kernel reads a single sequential stream, and it
// prefetches into L1 this many bytes ahead in that stream as it goes. Four
// columns read side by side with the next tile prefetched (the earlier decode
// tiles) made four interleaved streams, which this VM served 15-30% slower at
// one and two threads (bench/RESULTS.md, "Decode tiles read one stream").
inline constexpr std::size_t k_decode_prefetch_bytes = 8192;

// Fetches into L2 this row tile's share of the next column tile's weight rows, so
// that the next tile's memory traffic overlaps this tile's arithmetic: each of
// the ceil(m / R) row tiles of column tile c0 fetches its slice. With m <= R this
// is simply "one tile ahead".
inline void prefetch_next_tile(const std::byte* wbase, std::size_t row_bytes, std::int64_t c0, int C,
                               std::int64_t col_end, std::int64_t r0, int R, std::int64_t m) {
  const std::int64_t next = c0 + C;
  if (next >= col_end) return;
  const std::int64_t next_end = next + C < col_end ? next + C : col_end;
  const std::size_t begin = static_cast<std::size_t>(next) * row_bytes;
  const std::size_t len = static_cast<std::size_t>(next_end - next) * row_bytes;
  const auto n_slices = static_cast<std::size_t>((m + R - 1) / R), slice = static_cast<std::size_t>(r0 / R);
  const std::size_t s0 = begin + len * slice / n_slices, s1 = begin + len * (slice + 1) / n_slices;
  for (std::size_t o = s0 & ~std::size_t{63}; o < s1; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(wbase + o), _MM_HINT_T1);
}

// Column kernel for float weights, the same at every level: tiles of at most
// R x C, each running K<nr, nc>::run(x rows, ldx, weight rows, row stride, n_in,
// y, ldy) straight from the weights; with Prefetch, the next tile's rows are
// fetched into L2 meanwhile (decode tiles, which prefetch as they go, pass
// false).
template <template <int, int> class K, int R, int C, bool Prefetch = true>
void float_cols(const job& jb, std::int64_t col_begin, std::int64_t col_end) {
  const weight_view& w = *jb.w;
  const auto* wbase = static_cast<const std::byte*>(w.data);
  for_each_tile<R, C>(jb.m, col_begin, col_end, [&](std::int64_t r0, int nr, std::int64_t c0, int nc) {
    if constexpr (Prefetch) prefetch_next_tile(wbase, w.row_bytes, c0, C, col_end, r0, R, jb.m);
    tiles<K, R, C>.at(nr, nc)(jb.x + r0 * w.n_in, w.n_in, wbase + static_cast<std::size_t>(c0) * w.row_bytes,
                              w.row_bytes, w.n_in, jb.y + r0 * w.n_out + c0, w.n_out);
  });
}

// Column kernel for block-32 weights read in place (AVX2's block-32 tiles,
// AVX-512's decode tiles): tiles of at most R x C, each running
// K<nr, nc>::run(activation rows, row stride, n_in, weight rows, row stride, y,
// ldy) on the file's bytes; with Prefetch, the next tile's rows are fetched
// into L2 meanwhile (kernels that prefetch as they go pass false).
template <template <int, int> class K, int R, int C, bool Prefetch>
void block_cols(const job& jb, std::int64_t col_begin, std::int64_t col_end) {
  const weight_view& w = *jb.w;
  const auto* wbase = static_cast<const std::byte*>(w.data);
  for_each_tile<R, C>(jb.m, col_begin, col_end, [&](std::int64_t r0, int nr, std::int64_t c0, int nc) {
    if constexpr (Prefetch) prefetch_next_tile(wbase, w.row_bytes, c0, C, col_end, r0, R, jb.m);
    tiles<K, R, C>.at(nr, nc)(jb.act + static_cast<std::size_t>(r0) * jb.act_row_bytes, jb.act_row_bytes, w.n_in,
                              wbase + static_cast<std::size_t>(c0) * w.row_bytes, w.row_bytes,
                              jb.y + r0 * w.n_out + c0, w.n_out);
  });
}

// Prepared q8_K activation rows as the super-block kernels read them (plain
// layout, matmul_internal.h; AVX-512 permutes each super-block's values).
struct kq_act_rows {
  const std::byte* base;  // row 0 of the tile
  std::size_t stride;     // bytes between rows
  std::size_t d_off, bsums_off;
  const std::byte* qs(int r, std::int64_t b, int offset) const {
    return base + r * stride + static_cast<std::size_t>(b) * k_qk_k + offset;
  }
  const std::byte* bsums(int r, std::int64_t b) const { return base + r * stride + bsums_off + static_cast<std::size_t>(b) * 32; }
  float dx(int r, std::int64_t b) const { return reinterpret_cast<const float*>(base + r * stride + d_off)[b]; }
};

// Column kernel for super-block weights, every level the same: tiles of at
// most R x C, each running K<nr, nc>::run(rows, weight rows, row stride,
// super-blocks, y, ldy) straight from the file's bytes (the kernels prefetch
// as they go).
template <template <int, int> class K, int R, int C>
void kq_cols(const job& jb, std::int64_t col_begin, std::int64_t col_end) {
  const weight_view& w = *jb.w;
  const plain_layout l = plain_layout_of(act_format::q8_k, w.n_in);
  const auto* wbase = static_cast<const std::byte*>(w.data);
  const std::int64_t nsb = w.n_in / k_qk_k;
  for_each_tile<R, C>(jb.m, col_begin, col_end, [&](std::int64_t r0, int nr, std::int64_t c0, int nc) {
    const kq_act_rows a{jb.act + static_cast<std::size_t>(r0) * jb.act_row_bytes, jb.act_row_bytes, l.d_off,
                        l.bsums_off};
    tiles<K, R, C>.at(nr, nc)(a, wbase + static_cast<std::size_t>(c0) * w.row_bytes, w.row_bytes, nsb,
                              jb.y + r0 * w.n_out + c0, w.n_out);
  });
}

}  // namespace

// Horizontal-sum orders are part of the per-pair sequence; they live with the
// kernels (fixed trees, the same for every tile shape).

}  // namespace pagoda::matmul_detail
