#include "attention/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "core/cpu.h"

namespace pagoda {

float softmax_unnormalized_avx2(float* s, int n);    // paged_attention_avx2.cpp
float softmax_unnormalized_avx512(float* s, int n);  // paged_attention_avx512.cpp

namespace {
// Query rows computed together: enough to reuse each tile from L1 many times,
// few enough that scores stay in L2 at long contexts.
constexpr int k_max_rows_per_group = 64;

// The tiles of head h covering tokens [0, n_ctx), minus a staged last block;
// returns the number of tokens they hold.
int gather_tiles(const paged_kv_view& v, int h, int n_ctx, std::vector<const void*>& tiles) {
  const int bs = v.shape.block_size;
  int n_blocks = (n_ctx + bs - 1) / bs;
  int n_tok = n_ctx;
  if (n_blocks > 0 && v.is_staged(n_blocks - 1)) {
    --n_blocks;
    n_tok = n_blocks * bs;
  }
  tiles.resize(n_blocks);
  for (int b = 0; b < n_blocks; ++b) tiles[b] = v.tile(b, h);
  return n_tok;
}

void run_qk(const paged_kv_view& k, int h, int n_ctx, const float* q, int rows, float* scores, int ld,
            std::vector<const void*>& tiles) {
  const int n_tok = gather_tiles(k, h, n_ctx, tiles);
  if (n_tok > 0) k.codec->qk(k.format, k.shape, k.params(h), tiles.data(), n_tok, q, rows, scores, ld);
  if (n_tok < n_ctx) {
    const void* staged = k.staged_tile(h);
    k.staged_codec->qk(k.staged_format, k.shape, nullptr, &staged, n_ctx - n_tok, q, rows, scores + n_tok, ld);
  }
}

void run_av(const paged_kv_view& v, int h, int n_ctx, const float* w, int ld, int rows, float* acc,
            std::vector<const void*>& tiles) {
  const int n_tok = gather_tiles(v, h, n_ctx, tiles);
  if (n_tok > 0) v.codec->av(v.format, v.shape, v.params(h), tiles.data(), n_tok, w, ld, rows, acc);
  if (n_tok < n_ctx) {
    const void* staged = v.staged_tile(h);
    v.staged_codec->av(v.staged_format, v.shape, nullptr, &staged, n_ctx - n_tok, w + n_tok, ld, rows, acc);
  }
}
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
  switch (active_simd_level()) {
    case simd_level::avx512: return softmax_unnormalized_avx512(s, n);
    case simd_level::avx2: return softmax_unnormalized_avx2(s, n);
    case simd_level::scalar: break;
  }
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

    run_qk(k, t.kv_head, n_ctx, sc.q.data(), rows, sc.scores.data(), ld, sc.tiles);
    for (int r = 0; r < rows; ++r) {
      int len = t.pos0 + g0 + r / t.n_rep + 1;
      float* s = sc.scores.data() + static_cast<std::size_t>(r) * ld;
      sc.row_sum[r] = softmax_unnormalized(s, len);
      std::fill(s + len, s + ld, 0.0f);
    }
    run_av(v, t.kv_head, n_ctx, sc.scores.data(), ld, rows, sc.acc.data(), sc.tiles);
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
    for (const paged_kv_view* x : {&k, &v}) {
      float* dst = &(x == &k ? keys : values)[static_cast<std::size_t>(p) * hd];
      if (x->is_staged(b)) x->staged_codec->decode(x->staged_format, x->shape, nullptr, x->staged_tile(t.kv_head), slot, 1, dst);
      else x->codec->decode(x->format, x->shape, x->params(t.kv_head), x->tile(b, t.kv_head), slot, 1, dst);
    }
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
