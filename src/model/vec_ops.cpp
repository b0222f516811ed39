#include "model/vec_ops.h"

#include <algorithm>
#include <cmath>

#include "core/cpu.h"

namespace pagoda {

void rms_norm_avx512(const float* x, const float* w, int n, float eps, float* out);  // vec_ops_avx512.cpp
void silu_mul_avx512(const float* g, const float* u, std::int64_t n, float* out);
void rms_norm_avx2(const float* x, const float* w, int n, float eps, float* out);  // vec_ops_avx2.cpp
void silu_mul_avx2(const float* g, const float* u, std::int64_t n, float* out);

void rms_norm_ref(const float* x, const float* w, int n, float eps, float* out) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  float scale = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

void rms_norm(const float* x, const float* w, int n, float eps, float* out) {
  if (active_simd_level() == simd_level::avx512) return rms_norm_avx512(x, w, n, eps, out);
  if (active_simd_level() == simd_level::avx2) return rms_norm_avx2(x, w, n, eps, out);
  rms_norm_ref(x, w, n, eps, out);
}

void silu_mul_ref(const float* g, const float* u, std::int64_t n, float* out) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void silu_mul(const float* g, const float* u, std::int64_t n, float* out) {
  if (active_simd_level() == simd_level::avx512) return silu_mul_avx512(g, u, n, out);
  if (active_simd_level() == simd_level::avx2) return silu_mul_avx2(g, u, n, out);
  silu_mul_ref(g, u, n, out);
}

void gelu_mul(const float* g, const float* u, std::int64_t n, float* out) {
  constexpr float k_sqrt_2_over_pi = 0.79788456080286535588f;
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(k_sqrt_2_over_pi * x * (1.0f + 0.044715f * x * x))) * u[i];
  }
}

void swiglu_oai_mul(const float* g, const float* u, std::int64_t n, float* out) {
  constexpr float k_alpha = 1.702f, k_limit = 7.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = std::min(g[i], k_limit);
    const float y = std::clamp(u[i], -k_limit, k_limit);
    out[i] = x / (1.0f + std::exp(k_alpha * -x)) * (y + 1.0f);
  }
}

void add_inplace(float* x, const float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace pagoda
