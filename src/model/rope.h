// RoPE angles with the scaling a GGUF file asks for, as llama.cpp computes
// them (ggml's rope operator). Pair i of the rope_dim rotated dimensions turns
// by pos x base^(-2i / rope_dim), with three optional changes:
//   frequency factors  (Llama 3.1-3.3's `rope_freqs.weight`): pair i's
//                      frequency divided by factor i;
//   linear scaling     the angle x freq_scale (1 / rope.scaling.factor);
//   YaRN               per pair a mix of the linearly scaled angle and the
//                      unscaled one: pairs that turn fewer than beta_slow times
//                      over the original context are interpolated, those that
//                      turn more than beta_fast times keep their angle, with a
//                      linear ramp between; and cos and sin are multiplied by a
//                      magnitude factor (0.1 ln(factor) + 1, times
//                      rope.scaling.attn_factor), so attention scores grow by
//                      its square.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace pagoda {

enum class rope_scaling_type : std::uint8_t { none, linear, yarn };
std::string_view rope_scaling_type_name(rope_scaling_type t);

// What a file's metadata and rope_freqs tensor set beyond the base and the
// linear factor (llama_hparams::rope_freq_scale), for every layer.
struct rope_scaling_config {
  rope_scaling_type type = rope_scaling_type::none;  // as read (`info`); linear with factor 1 is none
  float factor = 1.0f;      // rope.scaling.factor (or the older rope.scale_linear); 1 when absent
  int n_ctx_orig = 0;       // rope.scaling.original_context_length (default: the trained context)
  // llama.cpp's yarn_ext_factor: how much of YaRN's ramp applies; 1 for
  // YaRN, 0 otherwise (then the angles are linear scaling's alone).
  float ext_factor = 0.0f;
  // llama.cpp's yarn_attn_factor: rope.scaling.attn_factor (default 1), which
  // multiplies cos and sin under every scaling type; with YaRN, each layer
  // multiplies it by 0.1 ln(1 / freq_scale) + 1 (rope_angles::magnitude).
  float attn_factor = 1.0f;
  float beta_fast = 32.0f;  // rope.scaling.yarn_beta_fast (llama.cpp's default)
  float beta_slow = 1.0f;   // rope.scaling.yarn_beta_slow
  std::vector<float> freq_factors;  // [rope_dim / 2] from rope_freqs.weight; empty: none
};

// The angles of one kind of layer (its base and linear scale: the global
// layers, or gemma's sliding-window ones), ready to evaluate at any position.
class rope_angles {
 public:
  // REQUIRES: rope_dim even and > 0; freq_factors empty or rope_dim / 2 long.
  rope_angles(const rope_scaling_config& s, int rope_dim, float base, float freq_scale);

  // cos_t, sin_t [rope_dim / 2]: pair i's cos and sin at position pos,
  // times magnitude() when `with_magnitude` (the forward pass); without it
  // a pure rotation, which composes: turning a key computed at p by delta
  // gives the key at p + delta (rotate_keys).
  void at(std::int64_t pos, bool with_magnitude, float* cos_t, float* sin_t) const;

  float magnitude() const { return mscale_; }
  int n_pairs() const { return static_cast<int>(freq_.size()); }

 private:
  std::vector<float> freq_;  // [pairs]: base^(-2i / rope_dim) / factor i
  std::vector<float> ramp_;  // [pairs]: YaRN's share of the unscaled angle (0 without YaRN)
  float freq_scale_ = 1.0f;
  float mscale_ = 1.0f;
};

}  // namespace pagoda
