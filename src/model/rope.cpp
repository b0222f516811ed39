// RoPE angles with linear, frequency-factor and YaRN scaling (rope.h).
#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/assert.h"

namespace pagoda {
namespace {

// YaRN's correction dimension for n turns: the (fractional) pair index whose
// frequency turns exactly n times over the original context,
// rope_dim ln(n_ctx_orig / (2 pi n)) / (2 ln base). Float arithmetic as
// llama.cpp's, so the floor and ceil below land on the same pairs.
float yarn_correction_dim(int rope_dim, int n_ctx_orig, float n_turns, float base) {
  return static_cast<float>(rope_dim) *
         std::log(static_cast<float>(n_ctx_orig) / (n_turns * 2.0f * std::numbers::pi_v<float>)) /
         (2.0f * std::log(base));
}

}  // namespace

std::string_view rope_scaling_type_name(rope_scaling_type t) {
  switch (t) {
    case rope_scaling_type::none: return "none";
    case rope_scaling_type::linear: return "linear";
    case rope_scaling_type::yarn: return "yarn";
  }
  return "?";
}

rope_angles::rope_angles(const rope_scaling_config& s, int rope_dim, float base, float freq_scale)
    : freq_scale_(freq_scale) {
  PAGODA_ASSERT(rope_dim > 0 && rope_dim % 2 == 0, "rope_dim {} must be even and positive", rope_dim);
  const int pairs = rope_dim / 2;
  PAGODA_ASSERT(s.freq_factors.empty() || static_cast<int>(s.freq_factors.size()) == pairs,
                "{} frequency factors for {} rotated pairs", s.freq_factors.size(), pairs);
  freq_.resize(pairs);
  ramp_.assign(pairs, 0.0f);
  for (int i = 0; i < pairs; ++i) {
    freq_[i] = 1.0f / std::pow(base, static_cast<float>(2 * i) / static_cast<float>(rope_dim));
    if (!s.freq_factors.empty()) freq_[i] /= s.freq_factors[i];
  }
  mscale_ = s.attn_factor;
  if (s.ext_factor == 0.0f) return;
  // Pairs up to `low` keep their unscaled angle, pairs from `high` on are
  // interpolated, a linear ramp between (the pair index i, as llama.cpp).
  const float low = std::max(0.0f, std::floor(yarn_correction_dim(rope_dim, s.n_ctx_orig, s.beta_fast, base)));
  const float high = std::min(static_cast<float>(rope_dim - 1),
                              std::ceil(yarn_correction_dim(rope_dim, s.n_ctx_orig, s.beta_slow, base)));
  for (int i = 0; i < pairs; ++i) {
    const float y = (static_cast<float>(i) - low) / std::max(0.001f, high - low);
    ramp_[i] = (1.0f - std::clamp(y, 0.0f, 1.0f)) * s.ext_factor;
  }
  mscale_ *= 1.0f + 0.1f * std::log(1.0f / freq_scale);
}

void rope_angles::at(std::int64_t pos, bool with_magnitude, float* cos_t, float* sin_t) const {
  const float m = with_magnitude ? mscale_ : 1.0f;
  for (std::size_t i = 0; i < freq_.size(); ++i) {
    const float extrapolated = static_cast<float>(pos) * freq_[i];
    const float interpolated = freq_scale_ * extrapolated;
    const float theta = interpolated * (1.0f - ramp_[i]) + extrapolated * ramp_[i];
    cos_t[i] = std::cos(theta) * m;
    sin_t[i] = std::sin(theta) * m;
  }
}

}  // namespace pagoda
