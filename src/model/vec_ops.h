// Row-wise vector operations of the forward pass; rms_norm and silu_mul have
// AVX-512 and AVX2 versions and plain reference twins. Each works on one row at
// a time, so a row's result never depends on the batch around it.
#pragma once

#include <cstdint>

namespace pagoda {

// out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i]. out may alias x.
void rms_norm(const float* x, const float* w, int n, float eps, float* out);
void rms_norm_ref(const float* x, const float* w, int n, float eps, float* out);

// out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u. out may alias g or u.
void silu_mul(const float* g, const float* u, std::int64_t n, float* out);
void silu_mul_ref(const float* g, const float* u, std::int64_t n, float* out);

// out[i] = gelu(g[i]) * u[i], GELU in its tanh form
// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (Gemma's FFN). out may alias g or u.
void gelu_mul(const float* g, const float* u, std::int64_t n, float* out);

// gpt-oss's clamped SwiGLU (ggml's swiglu_oai with gpt-oss's constants):
// x = min(g, 7), y = clamp(u, -7, 7), out = x / (1 + exp(-1.702 x)) * (y + 1).
// out may alias g or u.
void swiglu_oai_mul(const float* g, const float* u, std::int64_t n, float* out);

// x[i] += y[i].
void add_inplace(float* x, const float* y, std::int64_t n);

}  // namespace pagoda
