#include "attention/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "core/cpu.h"

namespace pagoda {

float softmax_unnormalized_avx512(float* s, int n);  // paged_attention_avx512.cpp

namespace {
// Query rows computed together: enough to reuse each tile from L1 many times,
// few enough that scores stay in L2 at long contexts.
constexpr int k_max_rows_per_group = 64;
}  // namespace

float softmax_unnormalized_ref(float* s, int n) {
  float mx = -INFINITY;
  for (int i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sum;
}

float softmax_unnormalized(float* s, int n) {
  if (active_simd_level() == simd_level::avx512) return softmax_unnormalized_avx512(s, n);
  return softmax_unnormalized_ref(s, n);
}

void paged_attention(const attention_task& t, attention_scratch& sc) {
  const paged_kv_view& k = *t.k;
  const paged_kv_view& v = *t.v;
  const int hd = t.head_dim;
  const int bs = k.shape.block_size;
  PAGODA_DASSERT(k.shape.head_dim == hd && v.shape.head_dim == hd && v.shape.block_size == bs);
  PAGODA_DASSERT(k.n_tokens >= t.pos0 + t.n_tokens);
  const int tokens_per_group = std::max(1, k_max_rows_per_group / t.n_rep);

  for (int g0 = 0; g0 < t.n_tokens; g0 += tokens_per_group) {
    const int gn = std::min(tokens_per_group, t.n_tokens - g0);
    const int rows = gn * t.n_rep;
    const int n_ctx = t.pos0 + g0 + gn;
    const int n_blocks = (n_ctx + bs - 1) / bs;
    const int ld = n_blocks * bs;
    sc.q.resize(static_cast<std::size_t>(rows) * hd);
    sc.scores.resize(static_cast<std::size_t>(rows) * ld);
    sc.acc.assign(static_cast<std::size_t>(rows) * hd, 0.0f);
    sc.row_sum.resize(rows);

    for (int i = 0; i < gn; ++i)
      for (int j = 0; j < t.n_rep; ++j) {
        const float* src = t.q + static_cast<std::size_t>(g0 + i) * t.q_stride +
                           static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
        float* dst = sc.q.data() + static_cast<std::size_t>(i * t.n_rep + j) * hd;
        for (int d = 0; d < hd; ++d) dst[d] = src[d] * t.scale;
      }

    for (int b = 0; b < n_blocks; ++b) {
      int nt = std::min(bs, n_ctx - b * bs);
      k.codec->qk(k.format, k.shape, k.tile(b, t.kv_head), nt, sc.q.data(), rows, sc.scores.data() + b * bs, ld);
    }
    for (int r = 0; r < rows; ++r) {
      int len = t.pos0 + g0 + r / t.n_rep + 1;
      float* s = sc.scores.data() + static_cast<std::size_t>(r) * ld;
      sc.row_sum[r] = softmax_unnormalized(s, len);
      std::fill(s + len, s + ld, 0.0f);
    }
    for (int b = 0; b < n_blocks; ++b) {
      int nt = std::min(bs, n_ctx - b * bs);
      v.codec->av(v.format, v.shape, v.tile(b, t.kv_head), nt, sc.scores.data() + b * bs, ld, rows, sc.acc.data());
    }
    for (int i = 0; i < gn; ++i)
      for (int j = 0; j < t.n_rep; ++j) {
        int r = i * t.n_rep + j;
        float inv = 1.0f / sc.row_sum[r];
        const float* a = sc.acc.data() + static_cast<std::size_t>(r) * hd;
        float* dst = t.out + static_cast<std::size_t>(g0 + i) * t.out_stride +
                     static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
        for (int d = 0; d < hd; ++d) dst[d] = a[d] * inv;
      }
  }
}

void paged_attention_ref(const attention_task& t) {
  const paged_kv_view& k = *t.k;
  const paged_kv_view& v = *t.v;
  const int hd = t.head_dim;
  const int bs = k.shape.block_size;
  const int n_ctx = t.pos0 + t.n_tokens;
  std::vector<float> keys(static_cast<std::size_t>(n_ctx) * hd), values(static_cast<std::size_t>(n_ctx) * hd);
  for (int p = 0; p < n_ctx; ++p) {
    int b = p / bs, slot = p % bs;
    k.codec->decode(k.format, k.shape, k.tile(b, t.kv_head), slot, 1, &keys[static_cast<std::size_t>(p) * hd]);
    v.codec->decode(v.format, v.shape, v.tile(b, t.kv_head), slot, 1, &values[static_cast<std::size_t>(p) * hd]);
  }
  std::vector<double> w(n_ctx), o(hd);
  for (int i = 0; i < t.n_tokens; ++i)
    for (int j = 0; j < t.n_rep; ++j) {
      const float* q = t.q + static_cast<std::size_t>(i) * t.q_stride + static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      int len = t.pos0 + i + 1;
      double mx = -INFINITY;
      for (int p = 0; p < len; ++p) {
        double s = 0;
        for (int d = 0; d < hd; ++d) s += static_cast<double>(q[d]) * keys[static_cast<std::size_t>(p) * hd + d];
        w[p] = s * t.scale;
        mx = std::max(mx, w[p]);
      }
      double sum = 0;
      for (int p = 0; p < len; ++p) sum += (w[p] = std::exp(w[p] - mx));
      std::fill(o.begin(), o.end(), 0.0);
      for (int p = 0; p < len; ++p)
        for (int d = 0; d < hd; ++d) o[d] += w[p] / sum * values[static_cast<std::size_t>(p) * hd + d];
      float* dst = t.out + static_cast<std::size_t>(i) * t.out_stride + static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = static_cast<float>(o[d]);
    }
}

}  // namespace pagoda
