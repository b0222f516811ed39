// Random-weight mmproj files (`pagoda synth --mmproj`): a vision tower and
// projector of a family llama.cpp's mtmd loads, with its metadata keys and
// tensor names, sized to pair with a synthetic text model (the projection
// width is the text model's n_embd). Like model/synth.h, the numbers mean
// nothing; the files exist so Pagoda's encoder can be checked against
// llama.cpp's on the same weights (tests/data/oracle/README.md, "Vision").
//
// Family idefics3 (SmolVLM): a SigLIP ViT (patch embedding with bias, learned
// position embeddings, pre-norm blocks with LayerNorm, biased Q/K/V/output,
// a GELU MLP, a post-LayerNorm) and the pixel-shuffle projector
// (mm.model.fc.weight, no bias). Tensors written (ggml ne order):
//   v.patch_embd.weight [patch, patch, 3, n_embd]  v.patch_embd.bias [n_embd]
//   v.position_embd.weight [n_embd, n_patches]
//   v.blk.L.{ln1,ln2}.{weight,bias} [n_embd]
//   v.blk.L.attn_{q,k,v,out}.weight [n_embd, n_embd], .bias [n_embd]
//   v.blk.L.ffn_up.weight [n_embd, n_ff] .bias [n_ff]
//   v.blk.L.ffn_down.weight [n_ff, n_embd] .bias [n_embd]
//   v.post_ln.{weight,bias} [n_embd]
//   mm.model.fc.weight [n_embd * scale^2, projection_dim]
// Family gemma3 (Gemma 3): the same ViT, then (no preprocessing size key;
// clip.vision.projector.scale_factor, the pool's kernel, only when it is not
// llama.cpp's default 4, as its converter writes it)
//   mm.soft_emb_norm.weight [n_embd]                 (F32)
//   mm.input_projection.weight [projection_dim, n_embd] (F32 with f32
//   weights, else F16, as the converter forces it)
// Norm weights are 1 + U(-0.2, 0.2) and biases U(-0.1, 0.1), so a norm or a
// bias that is skipped shows; matrices have standard deviation 1/sqrt(n_in).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "model/gguf.h"
#include "pagoda/status.h"
#include "vision/mmproj.h"

namespace pagoda::vision {

struct mmproj_synth_options {
  projector_kind projector = projector_kind::idefics3;
  int projection_dim = 128;  // the text model's n_embd
  int image_size = 64;       // clip.vision.image_size (the encoder's square input)
  int patch_size = 8;
  int n_embd = 64;
  int n_head = 2;
  int n_ff = 128;            // must differ from n_embd (llama.cpp swaps up/down when ffn_down's rows are n_embd wide)
  int n_layer = 2;
  int scale_factor = 2;      // pixel shuffle (idefics3) or average pool (gemma3): scale x scale patches per token
  int longest_edge = 64;     // clip.vision.preproc_image_size (idefics3's resize target)
  float eps = 1e-6f;
  // Distinct per channel so a channel mix-up shows.
  std::array<float, 3> image_mean = {0.48f, 0.46f, 0.41f};
  std::array<float, 3> image_std = {0.27f, 0.26f, 0.28f};
  // Type of the block and projector matrices: f32, f16 or q8_0 (the patch and
  // position embeddings, norms and biases stay F32, as llama.cpp's converter
  // writes them for SmolVLM).
  gguf::tensor_type weight_type = gguf::tensor_type::f32;
  std::uint64_t seed = 42;
  int n_threads = 0;  // threads generating weights (<= 0: every hardware thread)
  // Bad files for tests: leave this tensor out; add an F32 [n_embd] tensor of this name.
  std::string omit_tensor;
  std::string extra_tensor;
};

// errc::invalid_argument naming the first size that does not fit (image not a
// multiple of the patch, patches per side not a multiple of the scale factor,
// n_embd not a multiple of n_head, n_ff == n_embd, an unsupported weight type).
status validate(const mmproj_synth_options& o);

// Writes the file through a temporary renamed into place.
status write_synth_mmproj(const mmproj_synth_options& o, const std::string& path);

}  // namespace pagoda::vision
