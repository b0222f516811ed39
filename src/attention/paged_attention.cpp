#include "attention/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "core/cpu.h"

namespace pagoda {

float softmax_unnormalized_avx2(float* s, int n);    // paged_attention_avx2.cpp
float softmax_unnormalized_avx512(float* s, int n);  // paged_attention_avx512.cpp
void softcap_inplace_avx2(float* s, int n, float cap);    // paged_attention_avx2.cpp
void softcap_inplace_avx512(float* s, int n, float cap);  // paged_attention_avx512.cpp

namespace {
// Query rows computed together: enough to reuse each tile from L1 many times,
// few enough that scores stay in L2 at long contexts.
constexpr int k_max_rows_per_group = 64;

// The tiles of head h covering slots [b0 * bs, n_ctx), minus a staged last
// block; returns the number of slots they hold.
int gather_tiles(const paged_kv_view& v, int h, int b0, int n_ctx, std::vector<const void*>& tiles) {
  const int bs = v.shape.block_size;
  int n_blocks = (n_ctx + bs - 1) / bs;
  int end = n_ctx;
  if (n_blocks > b0 && v.is_staged(n_blocks - 1)) {
    --n_blocks;
    end = n_blocks * bs;
  }
  tiles.resize(std::max(0, n_blocks - b0));
  for (int b = b0; b < n_blocks; ++b) tiles[b - b0] = v.tile(b, h);
  return std::max(0, end - b0 * bs);
}

// scores[r * ld + j] = q_r . k(slot b0 * bs + j) for slots below n_ctx.
void run_qk(const paged_kv_view& k, int h, int b0, int n_ctx, const float* q, int rows, float* scores, int ld,
            std::vector<const void*>& tiles) {
  const int base = b0 * k.shape.block_size;
  const int n_tok = gather_tiles(k, h, b0, n_ctx, tiles);
  if (n_tok > 0) k.codec->qk(k.format, k.shape, k.params(h), tiles.data(), n_tok, q, rows, scores, ld);
  if (base + n_tok < n_ctx) {
    const void* staged = k.staged_tile(h);
    k.staged_codec->qk(k.staged_format, k.shape, nullptr, &staged, n_ctx - base - n_tok, q, rows, scores + n_tok, ld);
  }
}

void run_av(const paged_kv_view& v, int h, int b0, int n_ctx, const float* w, int ld, int rows, float* acc,
            std::vector<const void*>& tiles) {
  const int base = b0 * v.shape.block_size;
  const int n_tok = gather_tiles(v, h, b0, n_ctx, tiles);
  if (n_tok > 0) v.codec->av(v.format, v.shape, v.params(h), tiles.data(), n_tok, w, ld, rows, acc);
  if (base + n_tok < n_ctx) {
    const void* staged = v.staged_tile(h);
    v.staged_codec->av(v.staged_format, v.shape, nullptr, &staged, n_ctx - base - n_tok, w + n_tok, ld, rows, acc);
  }
}
}  // namespace

void visible_slots(const std::int32_t* kv_pos, int n_kv, std::int32_t q_pos, int window, int& lo, int& hi) {
  hi = static_cast<int>(std::upper_bound(kv_pos, kv_pos + n_kv, q_pos) - kv_pos);
  // Dead slots (negative positions) lead the row: the first seen slot is past them.
  const std::int32_t below = window > 0 ? std::max<std::int32_t>(q_pos - window, -1) : -1;
  lo = static_cast<int>(std::upper_bound(kv_pos, kv_pos + hi, below) - kv_pos);
}

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

void softcap_inplace_ref(float* s, int n, float cap) {
  for (int i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

void softcap_inplace(float* s, int n, float cap) {
  switch (active_simd_level()) {
    case simd_level::avx512: return softcap_inplace_avx512(s, n, cap);
    case simd_level::avx2: return softcap_inplace_avx2(s, n, cap);
    case simd_level::scalar: break;
  }
  softcap_inplace_ref(s, n, cap);
}

void paged_attention(const attention_task& t, attention_scratch& sc) {
  const paged_kv_view& k = *t.k;
  const paged_kv_view& v = *t.v;
  const int hd = t.head_dim;
  const int bs = k.shape.block_size;
  PAGODA_DASSERT(k.shape.head_dim == hd && v.shape.head_dim == hd && v.shape.block_size == bs);
  PAGODA_DASSERT(k.n_tokens >= t.n_kv && v.n_tokens >= t.n_kv);
  const int tokens_per_group = std::max(1, k_max_rows_per_group / t.n_rep);
  sc.lo.resize(t.n_tokens);
  sc.hi.resize(t.n_tokens);
  for (int i = 0; i < t.n_tokens; ++i) visible_slots(t.kv_pos, t.n_kv, t.q_pos[i], t.window, sc.lo[i], sc.hi[i]);
  const int first_window_token = t.n_tokens - t.stats.n_window;

  for (int g0 = 0; g0 < t.n_tokens; g0 += tokens_per_group) {
    const int gn = std::min(tokens_per_group, t.n_tokens - g0);
    const int rows = gn * t.n_rep;
    // The slots the group sees: from the first block any row sees to the last slot.
    int lo_min = t.n_kv, n_ctx = 0;
    for (int i = g0; i < g0 + gn; ++i) {
      PAGODA_DASSERT(sc.lo[i] < sc.hi[i], "a query sees no KV slot");
      lo_min = std::min(lo_min, sc.lo[i]);
      n_ctx = std::max(n_ctx, sc.hi[i]);
    }
    const int b0 = lo_min / bs;
    const int base = b0 * bs;
    const int ld = (n_ctx + bs - 1) / bs * bs - base;
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

    run_qk(k, t.kv_head, b0, n_ctx, sc.q.data(), rows, sc.scores.data(), ld, sc.tiles);
    for (int r = 0; r < rows; ++r) {
      const int i = g0 + r / t.n_rep;
      const int lo = sc.lo[i] - base, hi = sc.hi[i] - base;
      float* s = sc.scores.data() + static_cast<std::size_t>(r) * ld;
      if (t.softcap > 0) softcap_inplace(s + lo, hi - lo, t.softcap);
      sc.row_sum[r] = softmax_unnormalized(s + lo, hi - lo);
      std::fill(s, s + lo, 0.0f);
      std::fill(s + hi, s + ld, 0.0f);
      if (t.stats.accumulated || t.stats.window) {
        const float inv = 1.0f / sc.row_sum[r];
        float* acc = t.stats.accumulated ? t.stats.accumulated + base : nullptr;
        float* win = t.stats.window && i >= first_window_token
                         ? t.stats.window + static_cast<std::size_t>(i - first_window_token) * t.n_kv + base
                         : nullptr;
        for (int j = lo; j < hi; ++j) {
          const float w = s[j] * inv;
          if (acc) acc[j] += w;
          if (win) win[j] += w;
        }
      }
    }
    run_av(v, t.kv_head, b0, n_ctx, sc.scores.data(), ld, rows, sc.acc.data(), sc.tiles);
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
  const int n_ctx = t.n_kv;
  std::vector<float> keys(static_cast<std::size_t>(n_ctx) * hd), values(static_cast<std::size_t>(n_ctx) * hd);
  for (int p = 0; p < n_ctx; ++p) {
    int b = p / bs, slot = p % bs;
    for (const paged_kv_view* x : {&k, &v}) {
      float* dst = &(x == &k ? keys : values)[static_cast<std::size_t>(p) * hd];
      if (x->is_staged(b)) x->staged_codec->decode(x->staged_format, x->shape, nullptr, x->staged_tile(t.kv_head), slot, 1, dst);
      else x->codec->decode(x->format, x->shape, x->params(t.kv_head), x->tile(b, t.kv_head), slot, 1, dst);
    }
  }
  const int first_window_token = t.n_tokens - t.stats.n_window;
  std::vector<double> w(n_ctx), o(hd);
  for (int i = 0; i < t.n_tokens; ++i)
    for (int j = 0; j < t.n_rep; ++j) {
      const float* q = t.q + static_cast<std::size_t>(i) * t.q_stride + static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      // The mask, spelled out slot by slot from the positions.
      std::vector<bool> seen(n_ctx);
      for (int p = 0; p < n_ctx; ++p)
        seen[p] = t.kv_pos[p] >= 0 && t.kv_pos[p] <= t.q_pos[i] && (t.window <= 0 || t.kv_pos[p] > t.q_pos[i] - t.window);
      double mx = -INFINITY;
      for (int p = 0; p < n_ctx; ++p) {
        if (!seen[p]) continue;
        double s = 0;
        for (int d = 0; d < hd; ++d) s += static_cast<double>(q[d]) * keys[static_cast<std::size_t>(p) * hd + d];
        w[p] = s * t.scale;
        if (t.softcap > 0) w[p] = t.softcap * std::tanh(w[p] / t.softcap);
        mx = std::max(mx, w[p]);
      }
      double sum = 0;
      for (int p = 0; p < n_ctx; ++p) sum += seen[p] ? (w[p] = std::exp(w[p] - mx)) : (w[p] = 0);
      std::fill(o.begin(), o.end(), 0.0);
      for (int p = 0; p < n_ctx; ++p)
        for (int d = 0; d < hd; ++d) o[d] += w[p] / sum * values[static_cast<std::size_t>(p) * hd + d];
      float* dst = t.out + static_cast<std::size_t>(i) * t.out_stride + static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = static_cast<float>(o[d]);
      for (int p = 0; p < n_ctx; ++p) {
        if (t.stats.accumulated) t.stats.accumulated[p] += static_cast<float>(w[p] / sum);
        if (t.stats.window && i >= first_window_token)
          t.stats.window[static_cast<std::size_t>(i - first_window_token) * n_ctx + p] += static_cast<float>(w[p] / sum);
      }
    }
}

}  // namespace pagoda
