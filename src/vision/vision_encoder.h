// The vision encoder: a preprocessed image in, embeddings in the text
// model's input space out, computed as llama.cpp's mtmd computes them for the
// family (tools/mtmd/clip.cpp: build_vit, models/siglip.cpp), on the model's
// matrix products (model/matmul.h, every SIMD level they have) and threads.
//
// idefics3, for an image of nx x ny pixels (multiples of the patch size, with
// as many patches as the position table has rows):
//   patches     x[p] = W_patch · pixels of patch p (channel, y, x order) + b_patch + pos[p]
//               (the stride-patch convolution as one matrix product)
//   n_layer x   h = LN1(x); q, k, v = h·Wqᵀ+bq, ...; per head softmax(q kᵀ / sqrt(d)) v
//               (no mask: every patch sees every patch); x += attn·Woᵀ + bo
//               h = LN2(x); x += GELU(h·W_upᵀ + b_up)·W_downᵀ + b_down
//   post-LN     x = LN_post(x)
//   projector   pixel shuffle: token (by, bx) of (H/s) x (W/s) gathers the
//               s x s patches (by*s+dy, bx*s+dx), feature (dy*s+dx)*n_embd + c;
//               out = shuffled · W_fcᵀ (no bias)
// gemma3: the same ViT and post-LN, then
//   pool        token (by, bx) of (H/s) x (W/s) = mean of the s x s patches
//               (by*s+ky, bx*s+kx) (ggml's avg pool_2d, kernel = stride = s)
//   norm        x = RMSNorm(x) * w_soft_emb_norm (eps from the file; the
//               weight as stored: Gemma's +1 is in the file already)
//   projector   out = x · W_projᵀ with W_proj the file's
//               mm.input_projection transposed (llama.cpp's ggml_transpose)
// LN is LayerNorm with weight and bias (eps from the file). GELU is the tanh
// form evaluated as ggml's CPU backend does: through a table indexed by the
// input rounded to fp16, whose entries are fp16 (gelu_mode::ggml_f16_table);
// gelu_mode::exact is the plain formula (it differs by up to about 1e-3
// relative per activation).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "model/matmul.h"
#include "pagoda/status.h"
#include "vision/mmproj.h"

namespace pagoda::vision {

enum class gelu_mode : std::uint8_t { ggml_f16_table, exact };

struct encoder_options {
  gelu_mode gelu = gelu_mode::ggml_f16_table;
  // The patch embedding with pixels and kernel rounded to fp16, as ggml's
  // conv_2d does on the CPU (its im2col is F16 for an F32 kernel; fp16
  // products are exact in f32). false: both as they are.
  bool patch_f16 = true;
};

class vision_encoder {
 public:
  // REQUIRES: `model` and `pool` outlive the encoder.
  vision_encoder(const mmproj& model, thread_pool& pool, encoder_options options = {});

  // Embeddings for an nx x ny image: (nx / patch) * (ny / patch) / scale^2.
  int n_output_tokens(int nx, int ny) const;

  // pixels: planar [3][ny][nx], normalised (vision/image_preprocess.h);
  // out: [n_output_tokens][projection_dim]. errc::invalid_argument when the
  // size does not fit the model or a span has the wrong size.
  status encode(std::span<const float> pixels, int nx, int ny, std::span<float> out);

 private:
  void layer_norm(const float* w, const float* b, std::int64_t n_rows);
  void attention(const vit_block& blk, std::int64_t n_pos);
  void mlp(const vit_block& blk, std::int64_t n_pos);

  const mmproj& model_;
  thread_pool& pool_;
  encoder_options options_;
  matmul_scratch scratch_;
  std::vector<float> patch_w_;  // [n_embd][3 * patch * patch], fp16-rounded when patch_f16
  // Activations of one image, reused across calls.
  std::vector<float> x_;     // [n_pos][n_embd] residual stream
  std::vector<float> h_;     // [n_pos][max(n_embd, n_ff)] normed input / MLP hidden
  std::vector<float> q_, k_, v_, attn_;  // [n_pos][n_embd]
  std::vector<float> qh_, kh_, vt_, scores_, oh_;  // one head
};

// GELU (tanh form) as ggml's CPU backend evaluates it: exact for |x| >= 10,
// else the fp16 rounding of gelu(fp16 rounding of x).
float gelu_ggml(float x);
float gelu_exact(float x);

}  // namespace pagoda::vision
