// llama.cpp's mmproj GGUF files (`--mmproj FILE`): the vision tower and the
// projector that turn an image into embeddings in the text model's input
// space. Families implemented (clip.projector_type):
//   idefics3 (SmolVLM): a SigLIP ViT and a pixel-shuffle projector;
//   gemma3 (Gemma 3): the same SigLIP ViT, then an average pool of
//   scale x scale patches, an RMS norm (mm.soft_emb_norm.weight) and a
//   projection (mm.input_projection.weight, stored [n_embd][projection_dim],
//   transposed at load); tensor names and shapes in vision/mmproj_synth.h.
// Loading is strict: every key the encoder reads must be there with a
// sensible value, every tensor it uses must have the shape the hyperparameters
// give, and a tensor it does not use (a part of another family or variant:
// a fused QKV, a pre-LN, layer scales, Q/K norms, ...) is refused by name
// rather than silently ignored, as is an FFN activation other than GELU.
// Errors name the file's key or tensor and what was expected.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/matmul.h"
#include "pagoda/status.h"

namespace pagoda::vision {

enum class projector_kind : std::uint8_t { idefics3, gemma3 };

// "idefics3", "gemma3": clip.projector_type's value.
const char* projector_name(projector_kind k);

struct vision_hparams {
  projector_kind projector = projector_kind::idefics3;
  int image_size = 0;      // clip.vision.image_size: the encoder's square input
  int patch_size = 0;
  int n_embd = 0;          // ViT width
  int n_head = 0;
  int n_ff = 0;
  int n_layer = 0;
  int projection_dim = 0;  // output width (= the text model's n_embd)
  // idefics3: the pixel shuffle's factor (clip.vision.projector.scale_factor);
  // gemma3: the average pool's kernel and stride (the same key, default 4).
  int scale_factor = 1;
  int longest_edge = 0;    // idefics3 preprocessing (clip.vision.preproc_image_size, default image_size)
  float eps = 1e-6f;       // LayerNorm epsilon (gemma3: the soft-embedding RMS norm's too)
  std::array<float, 3> image_mean{};
  std::array<float, 3> image_std{};

  int head_dim() const { return n_embd / n_head; }
  int patches_per_side() const { return image_size / patch_size; }
  int n_patches() const { return patches_per_side() * patches_per_side(); }
  // Embeddings per image_size x image_size image.
  int n_output_tokens() const { return n_patches() / (scale_factor * scale_factor); }
};

// A ViT block. Vectors are f32 [n]; matrices are [n_out][n_in] views into the file.
struct vit_block {
  const float* ln1_w = nullptr;  // [n_embd]
  const float* ln1_b = nullptr;
  weight_view q, k, v, o;        // [n_embd][n_embd]
  const float* q_b = nullptr;    // [n_embd] each
  const float* k_b = nullptr;
  const float* v_b = nullptr;
  const float* o_b = nullptr;
  const float* ln2_w = nullptr;
  const float* ln2_b = nullptr;
  weight_view up;                // [n_ff][n_embd]
  const float* up_b = nullptr;   // [n_ff]
  weight_view down;              // [n_embd][n_ff]
  const float* down_b = nullptr; // [n_embd]
};

class mmproj {
 public:
  static result<std::unique_ptr<mmproj>> open(const std::string& path);
  // Takes a parsed file (tests build malformed ones in memory).
  static result<std::unique_ptr<mmproj>> load(std::unique_ptr<gguf::file> file);

  const vision_hparams& hparams() const { return hp_; }
  // errc::invalid_argument when the projection width is not the text model's
  // embedding width (the embeddings could not stand in for its tokens).
  status check_text_model(int text_n_embd) const;
  // What names this mmproj in image content hashes (image_span::content_hash):
  // a hash of its hyperparameters and every tensor's name, shape, type and
  // bytes, so two files that encode differently never share an image's KV.
  // Computed at load (one pass over the tensors).
  std::uint64_t fingerprint() const { return fingerprint_; }

  weight_view patch_embd() const { return patch_embd_; }  // [n_embd][3 * patch * patch], (channel, y, x) order
  const float* patch_bias() const { return patch_bias_; } // [n_embd]
  const float* position_embd() const { return pos_; }     // [n_patches][n_embd]
  const std::vector<vit_block>& blocks() const { return blocks_; }
  const float* post_ln_w() const { return post_ln_w_; }
  const float* post_ln_b() const { return post_ln_b_; }
  weight_view projector() const { return fc_; }           // idefics3: [projection_dim][n_embd * scale^2];
                                                          // gemma3: [projection_dim][n_embd] (transposed at load)
  const float* soft_emb_norm() const { return soft_emb_norm_; }  // gemma3: [n_embd], no +1 (the converter added it)

 private:
  class loader;
  mmproj() = default;

  std::unique_ptr<gguf::file> file_;
  vision_hparams hp_;
  weight_view patch_embd_;
  const float* patch_bias_ = nullptr;
  const float* pos_ = nullptr;
  std::vector<vit_block> blocks_;
  const float* post_ln_w_ = nullptr;
  const float* post_ln_b_ = nullptr;
  weight_view fc_;
  const float* soft_emb_norm_ = nullptr;
  std::vector<std::uint8_t> fc_transposed_;  // gemma3: the projection as [projection_dim][n_embd]
  std::uint64_t fingerprint_ = 0;
};

}  // namespace pagoda::vision
