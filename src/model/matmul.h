// Matrix products for the forward pass: Y = X · Wᵀ with weights in GGUF formats.
//
// CONTRACT (batch invariance): y[i][j] depends only on row i of X and row j of W.
// It is bitwise identical whatever m (the number of rows in the batch), whatever
// the position of row i in the batch, and whatever the thread count. Kernels may
// tile over rows and columns for speed, but every (i, j) dot product follows one
// fixed sequence of operations. The scheduler's batch-invariance guarantee rests
// on this.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/aligned_buffer.h"
#include "core/thread_pool.h"
#include "model/gguf.h"
#include "model/quants.h"

namespace pagoda {

// W is [n_out][n_in] row-major in ggml layout (n_in = ne[0] contiguous).
struct weight_view {
  gguf::tensor_type type = gguf::tensor_type::f32;
  const void* data = nullptr;
  std::int64_t n_in = 0;
  std::int64_t n_out = 0;
  std::size_t row_bytes = 0;  // bytes of one row of n_in elements
};

// Bytes of one row of n elements of type t (n must be a multiple of the block size;
// t one Pagoda computes with).
std::size_t row_size_bytes(gguf::tensor_type t, std::int64_t n);

// Reusable scratch for activation quantization (quantized copies of X) and
// per-thread weight packing.
struct matmul_scratch {
  aligned_buffer buf;
  void* reserve(std::size_t size_bytes) {
    if (buf.size() < size_bytes) buf.resize(size_bytes, false);
    return buf.data();
  }
};

// y[m][w.n_out] = x[m][w.n_in] · Wᵀ. x and y are f32, row-major, dense.
// Dispatches on active_simd_level(); parallel over columns of Y, except jobs
// under about 2^18 multiply-adds (e.g. stories260K at m = 1), which run on the
// calling thread. Quantized weights: x is first quantized into `scratch` to
// the weight type's activation format (ggml's vec_dot_type: q8_0, q8_1 or q8_K,
// see model/quants.h), then dot products run on integers. Weights are read in
// the file's layout (nothing is repacked at load). `scratch` grows to the
// largest call it has served and is reused: no allocation in steady state.
// REQUIRES: w.n_in a multiple of the type's block size; y does not overlap x;
// not called from inside a job of `pool`.
void matmul(const weight_view& w, const float* x, std::int64_t m, float* y, thread_pool& pool,
            matmul_scratch& scratch);

// Plain reference twin: f64 accumulation, no SIMD, single thread. Same
// activation quantization as the fast path for quantized weights (the exact
// integer sums of model/quants.h), so the two agree to float rounding.
void matmul_ref(const weight_view& w, const float* x, std::int64_t m, float* y);

// Converts row r of W to f32 (embedding lookup, tests).
void dequantize_row(const weight_view& w, std::int64_t r, float* out);

}  // namespace pagoda
