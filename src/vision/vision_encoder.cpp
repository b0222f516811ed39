#include "vision/vision_encoder.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "core/half.h"
#include "model/vec_ops.h"

namespace pagoda::vision {

namespace {

constexpr float k_gelu_coef_a = 0.044715f;
constexpr float k_sqrt_2_over_pi = 0.79788456080286535587989211986876f;

// fn(begin, end) over ranges of [0, n) on the pool's threads. Used only for
// work that is independent per item (rows, elements), so the results do not
// depend on the number of threads.
void for_rows(thread_pool& pool, std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& fn,
              std::size_t grain = 1) {
  pool.parallel_for(
      static_cast<std::size_t>(n),
      [&](std::size_t b, std::size_t e) { fn(static_cast<std::int64_t>(b), static_cast<std::int64_t>(e)); }, grain);
}

// x[i] += y[i] for i < n, on the pool.
void add_rows(thread_pool& pool, float* x, const float* y, std::int64_t n) {
  for_rows(pool, n, [&](std::int64_t b, std::int64_t e) { add_inplace(x + b, y + b, e - b); }, 4096);
}

// Y[m][n_out] = X W^T + b over the pool: the model's kernels at every SIMD level.
void linear(const weight_view& w, const float* bias, const float* x, std::int64_t m, float* y, thread_pool& pool,
            matmul_scratch& scratch) {
  matmul(w, x, m, y, pool, scratch);
  if (bias == nullptr) return;
  for_rows(pool, m, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) add_inplace(y + i * w.n_out, bias, w.n_out);
  });
}

// A dense f32 matrix [n_out][n_in] as the matmul's weight.
weight_view dense(const float* data, std::int64_t n_in, std::int64_t n_out) {
  return weight_view{gguf::tensor_type::f32, data, n_in, n_out, static_cast<std::size_t>(n_in) * sizeof(float)};
}

// Softmax of scale * row, in place (ggml's order: scale, max, exp, sum in double, divide).
void softmax_scaled(float* row, std::int64_t n, float scale) {
  float max = -INFINITY;
  for (std::int64_t j = 0; j < n; ++j) {
    row[j] *= scale;
    max = std::max(max, row[j]);
  }
  double sum = 0;
  for (std::int64_t j = 0; j < n; ++j) {
    row[j] = std::exp(row[j] - max);
    sum += row[j];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (std::int64_t j = 0; j < n; ++j) row[j] *= inv;
}

// Patch p of a planar image as a row in the patch embedding's (channel, y, x) order.
void gather_patches(const float* pixels, int nx, int ny, int patch, float* rows) {
  const int px = nx / patch;
  const int py = ny / patch;
  const std::size_t plane = static_cast<std::size_t>(nx) * ny;
  float* out = rows;
  for (int by = 0; by < py; ++by) {
    for (int bx = 0; bx < px; ++bx) {
      for (int c = 0; c < 3; ++c) {
        for (int y = 0; y < patch; ++y) {
          const float* src = pixels + c * plane + static_cast<std::size_t>(by * patch + y) * nx + bx * patch;
          out = std::copy(src, src + patch, out);
        }
      }
    }
  }
}

// Pixel shuffle: token (by, bx) gathers patches (by*s+dy, bx*s+dx) as feature
// blocks (dy*s+dx) of n_embd (llama.cpp's build_patch_merge_permute).
void pixel_shuffle(const float* x, int px, int py, int n_embd, int s, float* out) {
  for (int by = 0; by < py / s; ++by) {
    for (int bx = 0; bx < px / s; ++bx) {
      for (int dy = 0; dy < s; ++dy) {
        for (int dx = 0; dx < s; ++dx) {
          const float* src = x + static_cast<std::size_t>((by * s + dy) * px + bx * s + dx) * n_embd;
          out = std::copy(src, src + n_embd, out);
        }
      }
    }
  }
}

// Average pool: token (by, bx) of (py/s) x (px/s) is the mean of patches
// (by*s+ky, bx*s+kx), summed in float ky-major then divided by s*s (ggml's
// pool_2d on the CPU).
void average_pool(const float* x, int px, int py, int n_embd, int s, float* out) {
  const float area = static_cast<float>(s * s);
  for (int by = 0; by < py / s; ++by) {
    for (int bx = 0; bx < px / s; ++bx) {
      for (int c = 0; c < n_embd; ++c) {
        float sum = 0;
        for (int ky = 0; ky < s; ++ky)
          for (int kx = 0; kx < s; ++kx) sum += x[static_cast<std::size_t>((by * s + ky) * px + bx * s + kx) * n_embd + c];
        *out++ = sum / area;
      }
    }
  }
}

// RMS norm of each row times w (ggml's rms_norm: squares summed in double,
// scale 1/sqrt(mean + eps) in float; then ggml_mul by the weight).
void rms_norm_weighted(float* x, std::int64_t n_rows, int n, const float* w, float eps) {
  for (std::int64_t r = 0; r < n_rows; ++r) {
    float* row = x + r * n;
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += static_cast<double>(row[i] * row[i]);
    const float mean = static_cast<float>(sum / n);
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int i = 0; i < n; ++i) row[i] = row[i] * scale * w[i];
  }
}

void round_to_fp16(std::span<float> v) {
  for (float& x : v) x = fp16_to_f32(f32_to_fp16(x));
}

}  // namespace

float gelu_exact(float x) {
  return 0.5f * x * (1.0f + std::tanh(k_sqrt_2_over_pi * x * (1.0f + k_gelu_coef_a * x * x)));
}

namespace {

// gelu_exact of every fp16 value, rounded to fp16: ggml's table, built once
// (65,536 tanh evaluations, about a millisecond) instead of one tanh per
// activation (a chunk of SmolVLM's tower has 38 million).
const std::vector<fp16_t>& gelu_fp16_table() {
  static const std::vector<fp16_t> table = [] {
    std::vector<fp16_t> t(65536);
    for (std::size_t h = 0; h < t.size(); ++h)
      t[h] = f32_to_fp16(gelu_exact(fp16_to_f32(static_cast<fp16_t>(h))));
    return t;
  }();
  return table;
}

}  // namespace

float gelu_ggml(float x) {
  if (x <= -10.0f) return 0.0f;
  if (x >= 10.0f) return x;
  return fp16_to_f32(gelu_fp16_table()[f32_to_fp16(x)]);
}

vision_encoder::vision_encoder(const mmproj& model, thread_pool& pool, encoder_options options)
    : model_(model), pool_(pool), options_(options) {
  const weight_view w = model_.patch_embd();
  const auto* data = static_cast<const float*>(w.data);
  patch_w_.assign(data, data + w.n_in * w.n_out);
  if (options_.patch_f16) round_to_fp16(patch_w_);
}

int vision_encoder::n_output_tokens(int nx, int ny) const {
  const vision_hparams& hp = model_.hparams();
  const int s = hp.scale_factor;
  return (nx / hp.patch_size) * (ny / hp.patch_size) / (s * s);
}

// LayerNorm of each of n_rows rows of x_ into h_ (mean and variance in double).
void vision_encoder::layer_norm(const float* w, const float* b, std::int64_t n_rows) {
  const int n = model_.hparams().n_embd;
  const float eps = model_.hparams().eps;
  for_rows(pool_, n_rows, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const float* x = x_.data() + r * n;
      float* y = h_.data() + r * n;
      double sum = 0;
      for (int i = 0; i < n; ++i) sum += x[i];
      const float mean = static_cast<float>(sum / n);
      double var = 0;
      for (int i = 0; i < n; ++i) {
        y[i] = x[i] - mean;
        var += static_cast<double>(y[i]) * y[i];
      }
      const float scale = 1.0f / std::sqrt(static_cast<float>(var / n) + eps);
      for (int i = 0; i < n; ++i) y[i] = y[i] * scale * w[i] + b[i];
    }
  });
}

// x_ += attention(LN1(x_)) with every head seeing every position.
void vision_encoder::attention(const vit_block& blk, std::int64_t n_pos) {
  const vision_hparams& hp = model_.hparams();
  const int n = hp.n_embd;
  const int d = hp.head_dim();
  layer_norm(blk.ln1_w, blk.ln1_b, n_pos);
  linear(blk.q, blk.q_b, h_.data(), n_pos, q_.data(), pool_, scratch_);
  linear(blk.k, blk.k_b, h_.data(), n_pos, k_.data(), pool_, scratch_);
  linear(blk.v, blk.v_b, h_.data(), n_pos, v_.data(), pool_, scratch_);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int head = 0; head < hp.n_head; ++head) {
    // One head's Q and K as [n_pos][d] and V transposed to [d][n_pos], so
    // scores = Q Kᵀ and out = P V are two matrix products on the same kernels.
    for_rows(pool_, n_pos, [&](std::int64_t p0, std::int64_t p1) {
      for (std::int64_t p = p0; p < p1; ++p) {
        const std::size_t src = static_cast<std::size_t>(p) * n + static_cast<std::size_t>(head) * d;
        std::copy_n(q_.data() + src, d, qh_.data() + p * d);
        std::copy_n(k_.data() + src, d, kh_.data() + p * d);
        for (int i = 0; i < d; ++i) vt_[static_cast<std::size_t>(i) * n_pos + p] = v_[src + i];
      }
    });
    matmul(dense(kh_.data(), d, n_pos), qh_.data(), n_pos, scores_.data(), pool_, scratch_);
    for_rows(pool_, n_pos, [&](std::int64_t p0, std::int64_t p1) {
      for (std::int64_t p = p0; p < p1; ++p) softmax_scaled(scores_.data() + p * n_pos, n_pos, scale);
    });
    matmul(dense(vt_.data(), n_pos, d), scores_.data(), n_pos, oh_.data(), pool_, scratch_);
    for_rows(pool_, n_pos, [&](std::int64_t p0, std::int64_t p1) {
      for (std::int64_t p = p0; p < p1; ++p)
        std::copy_n(oh_.data() + p * d, d,
                    attn_.data() + static_cast<std::size_t>(p) * n + static_cast<std::size_t>(head) * d);
    });
  }
  linear(blk.o, blk.o_b, attn_.data(), n_pos, q_.data(), pool_, scratch_);
  add_rows(pool_, x_.data(), q_.data(), n_pos * n);
}

// x_ += down(GELU(up(LN2(x_)))).
void vision_encoder::mlp(const vit_block& blk, std::int64_t n_pos) {
  const vision_hparams& hp = model_.hparams();
  layer_norm(blk.ln2_w, blk.ln2_b, n_pos);
  std::vector<float>& hidden = scores_;  // [n_pos][n_ff]: sized for both uses
  linear(blk.up, blk.up_b, h_.data(), n_pos, hidden.data(), pool_, scratch_);
  const std::int64_t n_hidden = n_pos * hp.n_ff;
  const bool table = options_.gelu == gelu_mode::ggml_f16_table;
  for_rows(
      pool_, n_hidden,
      [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t i = b; i < e; ++i) hidden[i] = table ? gelu_ggml(hidden[i]) : gelu_exact(hidden[i]);
      },
      4096);
  linear(blk.down, blk.down_b, hidden.data(), n_pos, q_.data(), pool_, scratch_);
  add_rows(pool_, x_.data(), q_.data(), n_pos * hp.n_embd);
}

status vision_encoder::encode(std::span<const float> pixels, int nx, int ny, std::span<float> out) {
  const vision_hparams& hp = model_.hparams();
  const int patch = hp.patch_size;
  if (nx <= 0 || ny <= 0 || nx % patch != 0 || ny % patch != 0)
    return error(errc::invalid_argument, "image of {}x{} pixels: each side must be a positive multiple of the patch size {}",
                 nx, ny, patch);
  const int px = nx / patch;
  const int py = ny / patch;
  const std::int64_t n_pos = static_cast<std::int64_t>(px) * py;
  if (n_pos != hp.n_patches())
    return error(errc::invalid_argument,
                 "image of {}x{} pixels has {} patches; the encoder's position table has {} ({}x{} pixels)", nx, ny,
                 n_pos, hp.n_patches(), hp.image_size, hp.image_size);
  if (px % hp.scale_factor != 0 || py % hp.scale_factor != 0)
    return error(errc::invalid_argument, "{}x{} patches are not a multiple of the {} factor {}", px, py,
                 hp.projector == projector_kind::gemma3 ? "average-pool" : "pixel-shuffle", hp.scale_factor);
  if (pixels.size() != static_cast<std::size_t>(3) * nx * ny)
    return error(errc::invalid_argument, "{} pixel values for a {}x{} RGB image", pixels.size(), nx, ny);
  const std::int64_t n_tokens = n_output_tokens(nx, ny);
  if (out.size() != static_cast<std::size_t>(n_tokens) * hp.projection_dim)
    return error(errc::invalid_argument, "output of {} floats for {} embeddings of {}", out.size(), n_tokens,
                 hp.projection_dim);

  const std::int64_t n = hp.n_embd;
  const std::size_t wide = static_cast<std::size_t>(std::max<std::int64_t>(n, std::int64_t{3} * patch * patch));
  x_.resize(static_cast<std::size_t>(n_pos * n));
  h_.resize(static_cast<std::size_t>(n_pos) * wide);
  for (auto* v : {&q_, &k_, &v_, &attn_}) v->resize(static_cast<std::size_t>(n_pos * n));
  const std::size_t d = static_cast<std::size_t>(hp.head_dim());
  for (auto* v : {&qh_, &kh_, &vt_, &oh_}) v->resize(static_cast<std::size_t>(n_pos) * d);
  scores_.resize(static_cast<std::size_t>(n_pos) * static_cast<std::size_t>(std::max<std::int64_t>(n_pos, hp.n_ff)));

  // Patch embedding: the patch-strided convolution as one product, then bias and positions.
  const std::size_t n_in = static_cast<std::size_t>(3) * patch * patch;
  gather_patches(pixels.data(), nx, ny, patch, h_.data());
  if (options_.patch_f16) round_to_fp16(std::span(h_.data(), n_in * static_cast<std::size_t>(n_pos)));
  linear(dense(patch_w_.data(), static_cast<std::int64_t>(n_in), n), model_.patch_bias(), h_.data(), n_pos, x_.data(),
         pool_, scratch_);
  add_inplace(x_.data(), model_.position_embd(), n_pos * n);

  for (const vit_block& blk : model_.blocks()) {
    attention(blk, n_pos);
    mlp(blk, n_pos);
  }
  layer_norm(model_.post_ln_w(), model_.post_ln_b(), n_pos);

  const int s = hp.scale_factor;
  std::vector<float>& merged = q_;  // n_pos * n values: enough for both
  if (hp.projector == projector_kind::gemma3) {
    average_pool(h_.data(), px, py, static_cast<int>(n), s, merged.data());
    rms_norm_weighted(merged.data(), n_tokens, static_cast<int>(n), model_.soft_emb_norm(), hp.eps);
  } else {
    pixel_shuffle(h_.data(), px, py, static_cast<int>(n), s, merged.data());
  }
  matmul(model_.projector(), merged.data(), n_tokens, out.data(), pool_, scratch_);
  return ok_status();
}

}  // namespace pagoda::vision
