// The mixture-of-experts FFN: routing, the per-expert batched products and
// their weighted sum (model/moe.h states the semantics).
#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/assert.h"
#include "model/vec_ops.h"

namespace pagoda {
namespace {

// ggml clamps the sum of the chosen probabilities to the smallest normal f16
// before dividing by it (llama.cpp's build_moe_ffn).
constexpr float k_min_weight_sum = 6.103515625e-5f;

// aligned_buffer::resize reallocates: buffers only grow, to the largest step.
void grow(aligned_buffer& b, std::size_t size_bytes) {
  if (b.size() < size_bytes) b.resize(size_bytes, false);
}

// Adds bias row e (width n) to m rows of width n; nothing when the bias is absent.
void add_expert_bias(const std::vector<float>& bias, int e, std::int64_t n, float* rows, std::int64_t m) {
  if (bias.empty()) return;
  const float* b = bias.data() + static_cast<std::size_t>(e) * n;
  for (std::int64_t r = 0; r < m; ++r) add_inplace(rows + r * n, b, n);
}

void activate(const moe_config& c, float* g, const float* u, std::int64_t n) {
  if (c.activation == moe_activation::swiglu_oai) swiglu_oai_mul(g, u, n, g);
  else silu_mul(g, u, n, g);
}

// The router's logits of n_tok rows, biased.
void router_logits(const moe_weights& w, const float* xn, int n_tok, float* logits, thread_pool* pool,
                   matmul_scratch* mm) {
  if (pool) matmul(w.router, xn, n_tok, logits, *pool, *mm);
  else matmul_ref(w.router, xn, n_tok, logits);
  if (!w.router_bias.empty())
    for (int t = 0; t < n_tok; ++t)
      add_inplace(logits + static_cast<std::size_t>(t) * w.router.n_out, w.router_bias.data(), w.router.n_out);
}

}  // namespace

weight_view expert_weights::expert(int e) const {
  PAGODA_ASSERT(e >= 0 && e < n_expert, "expert {} of {}", e, n_expert);
  weight_view w = first;
  w.data = static_cast<const std::byte*>(first.data) + static_cast<std::size_t>(e) * expert_bytes;
  return w;
}

void moe_route(const moe_config& c, const float* logits, int n_tok, std::int32_t* experts, float* weights) {
  const int n = c.n_expert, k = c.n_expert_used;
  PAGODA_ASSERT(n > 0 && k > 0 && k <= n, "moe_route: {} of {} experts", k, n);
  std::vector<float> p(static_cast<std::size_t>(n));
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  const bool weight_gating = c.gating == moe_gating::softmax_weight;
  for (int t = 0; t < n_tok; ++t) {
    const float* l = logits + static_cast<std::size_t>(t) * n;
    if (weight_gating) {  // choose by logit, then the softmax of the chosen
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](std::int32_t a, std::int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
      std::int32_t* ex = experts + static_cast<std::size_t>(t) * k;
      float* w = weights + static_cast<std::size_t>(t) * k;
      const float top = l[order[0]];
      double sum = 0;
      for (int j = 0; j < k; ++j) {
        ex[j] = order[j];
        w[j] = std::exp(l[order[j]] - top);
        sum += w[j];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int j = 0; j < k; ++j) w[j] *= inv;
      if (c.weights_scale != 0.0f && c.weights_scale != 1.0f)
        for (int j = 0; j < k; ++j) w[j] *= c.weights_scale;
      continue;
    }
    const float mx = *std::max_element(l, l + n);
    double sum = 0;
    for (int e = 0; e < n; ++e) {
      p[e] = std::exp(l[e] - mx);
      sum += p[e];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int e = 0; e < n; ++e) p[e] *= inv;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](std::int32_t a, std::int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    std::int32_t* ex = experts + static_cast<std::size_t>(t) * k;
    float* w = weights + static_cast<std::size_t>(t) * k;
    double chosen = 0;
    for (int j = 0; j < k; ++j) {
      ex[j] = order[j];
      w[j] = p[order[j]];
      chosen += w[j];
    }
    if (c.norm_weights) {
      const float div = std::max(static_cast<float>(chosen), k_min_weight_sum);
      for (int j = 0; j < k; ++j) w[j] /= div;
    }
    if (c.weights_scale != 0.0f && c.weights_scale != 1.0f)
      for (int j = 0; j < k; ++j) w[j] *= c.weights_scale;
  }
}

int moe_ffn(const moe_config& c, const moe_weights& w, const float* xn, int n_tok, float* out, thread_pool& pool,
            matmul_scratch& mm, moe_scratch& s) {
  PAGODA_ASSERT(c.n_expert > 0 && !w.empty(), "moe_ffn on a dense layer");
  const int n_exp = c.n_expert, k = c.n_expert_used;
  const std::int64_t n_embd = w.router.n_in, n_ff = c.n_ff_exp;
  const std::size_t rows = static_cast<std::size_t>(n_tok) * k;

  s.logits.resize(static_cast<std::size_t>(n_tok) * n_exp);
  router_logits(w, xn, n_tok, s.logits.data(), &pool, &mm);
  s.experts.resize(rows);
  s.weights.resize(rows);
  moe_route(c, s.logits.data(), n_tok, s.experts.data(), s.weights.data());

  // Rows grouped by expert (a counting sort): expert e's are offset[e] .. offset[e + 1].
  s.offset.assign(static_cast<std::size_t>(n_exp) + 1, 0);
  for (std::int32_t e : s.experts) ++s.offset[static_cast<std::size_t>(e) + 1];
  std::partial_sum(s.offset.begin(), s.offset.end(), s.offset.begin());
  s.row_of.resize(rows);
  {
    std::vector<std::int32_t>& next = s.cursor;
    next.assign(s.offset.begin(), s.offset.end() - 1);
    for (std::size_t r = 0; r < rows; ++r) s.row_of[r] = next[static_cast<std::size_t>(s.experts[r])]++;
  }
  grow(s.xg, rows * static_cast<std::size_t>(n_embd) * sizeof(float));
  grow(s.g, rows * static_cast<std::size_t>(n_ff) * sizeof(float));
  grow(s.u, rows * static_cast<std::size_t>(n_ff) * sizeof(float));
  float* xg = s.xg.as<float>();
  float* g = s.g.as<float>();
  float* u = s.u.as<float>();
  // Gathering and the weighted sum below are copies and axpys, a few percent
  // of a step's products even for a long prompt: they run on this thread.
  const std::size_t row_bytes = static_cast<std::size_t>(n_embd) * sizeof(float);
  for (std::size_t r = 0; r < rows; ++r)
    std::memcpy(xg + static_cast<std::size_t>(s.row_of[r]) * n_embd, xn + r / k * n_embd, row_bytes);

  // One product per active expert and matrix, over all of its rows.
  int active = 0;
  for (int e = 0; e < n_exp; ++e) {
    const std::int64_t r0 = s.offset[e], m = s.offset[e + 1] - r0;
    if (m == 0) continue;
    ++active;
    matmul(w.gate.expert(e), xg + r0 * n_embd, m, g + r0 * n_ff, pool, mm);
    matmul(w.up.expert(e), xg + r0 * n_embd, m, u + r0 * n_ff, pool, mm);
    add_expert_bias(w.gate_bias, e, n_ff, g + r0 * n_ff, m);
    add_expert_bias(w.up_bias, e, n_ff, u + r0 * n_ff, m);
  }
  activate(c, g, u, static_cast<std::int64_t>(rows) * n_ff);
  // The inputs are no longer needed: the experts' outputs take their rows.
  for (int e = 0; e < n_exp; ++e) {
    const std::int64_t r0 = s.offset[e], m = s.offset[e + 1] - r0;
    if (m == 0) continue;
    matmul(w.down.expert(e), g + r0 * n_ff, m, xg + r0 * n_embd, pool, mm);
    add_expert_bias(w.down_bias, e, n_embd, xg + r0 * n_embd, m);
  }

  // out = sum over j, in order, of w_j x expert output (each product rounded
  // to f32, then added: ggml's mul and adds).
  for (int t = 0; t < n_tok; ++t) {
    float* o = out + static_cast<std::size_t>(t) * n_embd;
    for (int j = 0; j < k; ++j) {
      const std::size_t r = static_cast<std::size_t>(t) * k + j;
      const float wj = s.weights[r];
      const float* d = xg + static_cast<std::size_t>(s.row_of[r]) * n_embd;
      if (j == 0)
        for (std::int64_t i = 0; i < n_embd; ++i) o[i] = wj * d[i];
      else
        for (std::int64_t i = 0; i < n_embd; ++i) o[i] += wj * d[i];
    }
  }
  s.expert_runs += active;
  return active;
}

void moe_ffn_ref(const moe_config& c, const moe_weights& w, const float* xn, int n_tok, float* out) {
  const int k = c.n_expert_used;
  const std::int64_t n_embd = w.router.n_in, n_ff = c.n_ff_exp;
  std::vector<float> logits(static_cast<std::size_t>(c.n_expert)), weights(static_cast<std::size_t>(k));
  std::vector<std::int32_t> experts(static_cast<std::size_t>(k));
  std::vector<float> g(static_cast<std::size_t>(n_ff)), u(g.size()), d(static_cast<std::size_t>(n_embd));
  std::vector<double> acc(static_cast<std::size_t>(n_embd));
  for (int t = 0; t < n_tok; ++t) {
    const float* x = xn + static_cast<std::size_t>(t) * n_embd;
    router_logits(w, x, 1, logits.data(), nullptr, nullptr);
    moe_route(c, logits.data(), 1, experts.data(), weights.data());
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j < k; ++j) {
      const int e = experts[j];
      matmul_ref(w.gate.expert(e), x, 1, g.data());
      matmul_ref(w.up.expert(e), x, 1, u.data());
      add_expert_bias(w.gate_bias, e, n_ff, g.data(), 1);
      add_expert_bias(w.up_bias, e, n_ff, u.data(), 1);
      if (c.activation == moe_activation::swiglu_oai) swiglu_oai_mul(g.data(), u.data(), n_ff, g.data());
      else silu_mul_ref(g.data(), u.data(), n_ff, g.data());
      matmul_ref(w.down.expert(e), g.data(), 1, d.data());
      add_expert_bias(w.down_bias, e, n_embd, d.data(), 1);
      for (std::int64_t i = 0; i < n_embd; ++i) acc[i] += static_cast<double>(weights[j]) * d[i];
    }
    for (std::int64_t i = 0; i < n_embd; ++i) out[static_cast<std::size_t>(t) * n_embd + i] = static_cast<float>(acc[i]);
  }
}

}  // namespace pagoda
