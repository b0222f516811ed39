#include "attention/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "core/cpu.h"

namespace pagoda {

float softmax_unnormalized_avx2(float* s, int n, float sink);    // paged_attention_avx2.cpp
float softmax_unnormalized_avx512(float* s, int n, float sink);  // paged_attention_avx512.cpp
void softcap_inplace_avx2(float* s, int n, float cap);    // paged_attention_avx2.cpp
void softcap_inplace_avx512(float* s, int n, float cap);  // paged_attention_avx512.cpp

namespace {
// Query rows computed together: enough to reuse each tile from L1 many times,
// few enough that scores stay in L2 at long contexts.
constexpr int k_max_rows_per_group = 64;

// A group's scores are COLUMNS over the blocks it reads (attention_scratch::blocks):
// column c is slot blocks[c / bs] * bs + c % bs. Without ranges the blocks are
// consecutive and column = slot - first block's first slot.

// The first column whose slot is >= slot (blocks.size() * bs when none).
int column_of(std::span<const int> blocks, int bs, int slot) {
  const int b = slot / bs;
  const int c = static_cast<int>(std::lower_bound(blocks.begin(), blocks.end(), b) - blocks.begin());
  return c * bs + (c < static_cast<int>(blocks.size()) && blocks[c] == b ? slot % bs : 0);
}

// Ranges are sorted, disjoint, non-empty and within [0, n_kv): a selector
// that breaks this is a bug, and reading past it would read other tiles.
void check_ranges(const attention_task& t) {
  std::int32_t end = 0;
  for (const slot_range& r : t.ranges) {
    PAGODA_ASSERT(r.begin >= end && r.begin < r.end && r.end <= t.n_kv,
                  "attention ranges must be sorted, disjoint, non-empty and within [0, {}): [{}, {}) after {}", t.n_kv,
                  r.begin, r.end, end);
    end = r.end;
  }
}

// The blocks a group reads: every block of [lo_min, n_ctx), or those holding
// a selected slot of it; and the HOLES, the columns of read blocks whose slots
// in [lo_min, n_ctx) are not selected. Returns the number of columns.
int plan_reads(const attention_task& t, int lo_min, int n_ctx, attention_scratch& sc) {
  const int bs = t.k->shape.block_size;
  sc.blocks.clear();
  sc.holes.clear();
  if (t.ranges.empty()) {
    for (int b = lo_min / bs; b * bs < n_ctx; ++b) sc.blocks.push_back(b);
    return static_cast<int>(sc.blocks.size()) * bs;
  }
  for (const slot_range& r : t.ranges) {
    const int begin = std::max<int>(r.begin, lo_min), end = std::min<int>(r.end, n_ctx);
    for (int b = begin / bs; begin < end && b <= (end - 1) / bs; ++b)
      if (sc.blocks.empty() || sc.blocks.back() < b) sc.blocks.push_back(b);
  }
  auto add_hole = [&](int g0, int g1) {
    if (g0 >= g1) return;
    const int c0 = column_of(sc.blocks, bs, g0), c1 = column_of(sc.blocks, bs, g1);
    if (c0 < c1) sc.holes.push_back({c0, c1});
  };
  int gap = lo_min;  // the unselected slots are the gaps between clipped ranges
  for (const slot_range& r : t.ranges) {
    const int begin = std::max<int>(r.begin, lo_min), end = std::min<int>(r.end, n_ctx);
    if (begin >= end) continue;
    add_hole(gap, begin);
    gap = end;
  }
  add_hole(gap, n_ctx);
  return static_cast<int>(sc.blocks.size()) * bs;
}

// The tiles of head h of the read blocks, minus a staged last block; returns
// the number of slots they hold (every block is full but one ending at n_ctx).
int gather_tiles(const paged_kv_view& v, int h, std::span<const int> blocks, int n_ctx,
                 std::vector<const void*>& tiles) {
  const int bs = v.shape.block_size;
  std::size_t m = blocks.size();
  if (m > 0 && v.is_staged(blocks[m - 1])) --m;
  tiles.resize(m);
  for (std::size_t i = 0; i < m; ++i) tiles[i] = v.tile(blocks[i], h);
  return m == 0 ? 0 : static_cast<int>(m - 1) * bs + std::min(bs, n_ctx - blocks[m - 1] * bs);
}

// Calls f(codec, format, static params, tiles, n_tokens, first column) once
// per run of same-class tiles of head h of the read blocks (a codec reads one
// format; a run's columns start at its first block's), then once for a
// staged last block through the f16 codec. One class: one call for every
// sealed tile, as before classes.
template <class F>
void for_each_run(const paged_kv_view& v, int h, std::span<const int> blocks, int n_ctx,
                  std::vector<const void*>& tiles, F f) {
  const int bs = v.shape.block_size;
  const int n_tok = gather_tiles(v, h, blocks, n_ctx, tiles);
  const std::span<const int> sealed = blocks.first(tiles.size());
  for (std::size_t i = 0; i < sealed.size();) {
    const std::size_t j = v.class_run_end(sealed, i);
    const int first = static_cast<int>(i) * bs;
    const int end = j == sealed.size() ? n_tok : static_cast<int>(j) * bs;
    f(v.codec_of(sealed[i]), v.format_of(sealed[i]), v.params_of(sealed[i], h), tiles.data() + i, end - first, first);
    i = j;
  }
  if (tiles.size() < blocks.size()) {
    const void* staged = v.staged_tile(h);
    f(v.staged_codec, v.staged_format, nullptr, &staged, n_ctx - blocks.back() * bs, static_cast<int>(tiles.size()) * bs);
  }
}

// scores[r * ld + c] = q_r . k(slot of column c) for the read blocks' slots below n_ctx.
void run_qk(const paged_kv_view& k, int h, std::span<const int> blocks, int n_ctx, const float* q, int rows,
            float* scores, int ld, std::vector<const void*>& tiles) {
  for_each_run(k, h, blocks, n_ctx, tiles,
               [&](const kv_codec* codec, const kv_format& fmt, const kv_static_params* sp, const void* const* t,
                   int n, int first) { codec->qk(fmt, k.shape, sp, t, n, q, rows, scores + first, ld); });
}

// acc[r] += sum over columns c of w[r * ld + c] * v(slot of column c).
void run_av(const paged_kv_view& v, int h, std::span<const int> blocks, int n_ctx, const float* w, int ld, int rows,
            float* acc, std::vector<const void*>& tiles) {
  for_each_run(v, h, blocks, n_ctx, tiles,
               [&](const kv_codec* codec, const kv_format& fmt, const kv_static_params* sp, const void* const* t,
                   int n, int first) { codec->av(fmt, v.shape, sp, t, n, w + first, ld, rows, acc); });
}

// One row's scores s[0, ld) become unnormalised softmax weights over the
// visible columns [clo, chi) minus the holes: soft-capped, biased, exp(s -
// max); every other column exactly 0. Returns the sum of exponentials, 0 when
// the row sees no column. Holes are set to -inf for the softmax (their exp is
// at most 2^-149 at the SIMD levels, below the resolution of a sum whose
// largest term is 1) and to 0 after it.
float row_weights(const attention_task& t, const attention_scratch& sc, float* s, int ld, int clo, int chi, float sink) {
  const int bs = t.k->shape.block_size;
  int n_seen = chi - clo;
  for (const slot_range& hole : sc.holes) n_seen -= std::max(0, std::min<int>(hole.end, chi) - std::max<int>(hole.begin, clo));
  if (n_seen <= 0) {
    std::fill(s, s + ld, 0.0f);
    return 0.0f;
  }
  if (t.softcap > 0) softcap_inplace(s + clo, chi - clo, t.softcap);
  if (!sc.bias.empty())
    for (int c = clo / bs; c * bs < chi; ++c)
      if (const float* b = sc.bias[c])
        for (int j = std::max(clo, c * bs); j < std::min(chi, (c + 1) * bs); ++j) s[j] += b[j - c * bs];
  for (const slot_range& hole : sc.holes)
    for (int j = std::max<int>(hole.begin, clo); j < std::min<int>(hole.end, chi); ++j) s[j] = -INFINITY;
  const float sum = softmax_unnormalized(s + clo, chi - clo, sink);
  for (const slot_range& hole : sc.holes)
    for (int j = std::max<int>(hole.begin, clo); j < std::min<int>(hole.end, chi); ++j) s[j] = 0.0f;
  std::fill(s, s + clo, 0.0f);
  std::fill(s + chi, s + ld, 0.0f);
  return sum;
}

// Adds one row's normalised weights (columns [clo, chi)) to the statistics of its slots.
void add_stats(const attention_task& t, const attention_scratch& sc, const float* s, int clo, int chi, float inv,
               int token) {
  const int bs = t.k->shape.block_size;
  const int first_window_token = t.n_tokens - t.stats.n_window;
  float* acc = t.stats.accumulated;
  float* win = t.stats.window && token >= first_window_token
                   ? t.stats.window + static_cast<std::size_t>(token - first_window_token) * t.n_kv
                   : nullptr;
  if (!acc && !win) return;
  for (int c = clo / bs; c * bs < chi; ++c) {
    const int slot0 = (sc.blocks[c] - c) * bs;  // the slot of column j is slot0 + j
    for (int j = std::max(clo, c * bs); j < std::min(chi, (c + 1) * bs); ++j) {
      const float w = s[j] * inv;
      if (acc) acc[slot0 + j] += w;
      if (win) win[slot0 + j] += w;
    }
  }
}

// MiniCache's reader (kv_merge.h): a slot's score is the stored key's times
// the slot's K ratio, a retained slot's is its own key's (q is pre-scaled).
// Columns past n_ctx are left as they are (row_weights zeroes them).
void merge_scores(const attention_task& t, const attention_scratch& sc, int n_ctx, int rows, float* scores, int ld) {
  const paged_kv_view& k = *t.k;
  const int bs = k.shape.block_size, hd = t.head_dim;
  for (std::size_t c = 0; c < sc.blocks.size(); ++c) {
    const kv_merge_ref m = k.merge_of(sc.blocks[c], t.kv_head);
    const int col0 = static_cast<int>(c) * bs, n = std::min(bs, n_ctx - sc.blocks[c] * bs);
    const float* ratio = m.ratio_k();
    for (int r = 0; r < rows; ++r) {
      float* s = scores + static_cast<std::size_t>(r) * ld + col0;
      for (int j = 0; j < n; ++j) s[j] *= ratio[j];
    }
    for (int e = 0; e < m.shape.retain; ++e) {
      const int j = m.slot(e);
      if (j < 0 || j >= n) continue;
      const float* own = m.k(e);
      for (int r = 0; r < rows; ++r) {
        const float* q = sc.q.data() + static_cast<std::size_t>(r) * hd;
        float s = 0;
        for (int d = 0; d < hd; ++d) s += q[d] * own[d];
        scores[static_cast<std::size_t>(r) * ld + col0 + j] = s;
      }
    }
  }
}

// The reader's values: a retained slot adds its weight times its own value
// row to acc and leaves the kernel a weight of 0; every other slot's weight is
// scaled by its V ratio. Runs after the statistics took the weights as they are.
void merge_weights(const attention_task& t, const attention_scratch& sc, int n_ctx, int rows, float* w, int ld,
                   float* acc) {
  const paged_kv_view& v = *t.v;
  const int bs = v.shape.block_size, hd = t.head_dim;
  for (std::size_t c = 0; c < sc.blocks.size(); ++c) {
    const kv_merge_ref m = v.merge_of(sc.blocks[c], t.kv_head);
    const int col0 = static_cast<int>(c) * bs, n = std::min(bs, n_ctx - sc.blocks[c] * bs);
    for (int e = 0; e < m.shape.retain; ++e) {
      const int j = m.slot(e);
      if (j < 0 || j >= n) continue;
      const float* own = m.v(e);
      for (int r = 0; r < rows; ++r) {
        float& wj = w[static_cast<std::size_t>(r) * ld + col0 + j];
        float* a = acc + static_cast<std::size_t>(r) * hd;
        for (int d = 0; d < hd; ++d) a[d] += wj * own[d];
        wj = 0.0f;
      }
    }
    const float* ratio = m.ratio_v();
    for (int r = 0; r < rows; ++r) {
      float* s = w + static_cast<std::size_t>(r) * ld + col0;
      for (int j = 0; j < n; ++j) s[j] *= ratio[j];
    }
  }
}

// The group's query rows, pre-scaled: row i * n_rep + j is token g0 + i, query head kv_head * n_rep + j.
void load_queries(const attention_task& t, int g0, int gn, std::vector<float>& q) {
  const int hd = t.head_dim;
  q.resize(static_cast<std::size_t>(gn) * t.n_rep * hd);
  for (int i = 0; i < gn; ++i)
    for (int j = 0; j < t.n_rep; ++j) {
      const float* src = t.q + static_cast<std::size_t>(g0 + i) * t.q_stride +
                         static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      float* dst = q.data() + static_cast<std::size_t>(i * t.n_rep + j) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = src[d] * t.scale;
    }
}

void store_outputs(const attention_task& t, int g0, int gn, const attention_scratch& sc) {
  const int hd = t.head_dim;
  for (int i = 0; i < gn; ++i)
    for (int j = 0; j < t.n_rep; ++j) {
      const int r = i * t.n_rep + j;
      const float inv = sc.row_sum[r] > 0 ? 1.0f / sc.row_sum[r] : 0.0f;
      const float* a = sc.acc.data() + static_cast<std::size_t>(r) * hd;
      float* dst = t.out + static_cast<std::size_t>(g0 + i) * t.out_stride +
                   static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = a[d] * inv;
    }
}
}  // namespace

void visible_slots(const std::int32_t* kv_pos, int n_kv, std::int32_t q_pos, int window, int& lo, int& hi) {
  visible_slots(kv_pos, n_kv, q_pos, q_pos, window, lo, hi);
}

void visible_slots(const std::int32_t* kv_pos, int n_kv, std::int32_t q_pos, std::int32_t see_pos, int window, int& lo,
                   int& hi) {
  hi = static_cast<int>(std::upper_bound(kv_pos, kv_pos + n_kv, see_pos) - kv_pos);
  // Dead slots (negative positions) lead the row: the first seen slot is past them.
  const std::int32_t below = window > 0 ? std::max<std::int32_t>(q_pos - window, -1) : -1;
  lo = static_cast<int>(std::upper_bound(kv_pos, kv_pos + hi, below) - kv_pos);
}

float sink_of(const attention_task& t, int j) { return t.sinks ? t.sinks[t.kv_head * t.n_rep + j] : -INFINITY; }

float softmax_unnormalized_ref(float* s, int n, float sink) {
  float mx = sink;
  for (int i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sink == -INFINITY ? sum : sum + std::exp(sink - mx);
}

float softmax_unnormalized(float* s, int n, float sink) {
  switch (active_simd_level()) {
    case simd_level::avx512: return softmax_unnormalized_avx512(s, n, sink);
    case simd_level::avx2: return softmax_unnormalized_avx2(s, n, sink);
    case simd_level::scalar: break;
  }
  return softmax_unnormalized_ref(s, n, sink);
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
  check_ranges(t);
  const int tokens_per_group = std::max(1, k_max_rows_per_group / t.n_rep);
  sc.lo.resize(t.n_tokens);
  sc.hi.resize(t.n_tokens);
  for (int i = 0; i < t.n_tokens; ++i)
    visible_slots(t.kv_pos, t.n_kv, t.q_pos[i], see_of(t, i), t.window, sc.lo[i], sc.hi[i]);

  for (int g0 = 0; g0 < t.n_tokens; g0 += tokens_per_group) {
    const int gn = std::min(tokens_per_group, t.n_tokens - g0);
    const int rows = gn * t.n_rep;
    // The slots the group sees: from the first slot any row sees to the last one.
    int lo_min = t.n_kv, n_ctx = 0;
    for (int i = g0; i < g0 + gn; ++i) {
      PAGODA_DASSERT(sc.lo[i] < sc.hi[i], "a query sees no KV slot");
      lo_min = std::min(lo_min, sc.lo[i]);
      n_ctx = std::max(n_ctx, sc.hi[i]);
    }
    const int ld = plan_reads(t, lo_min, n_ctx, sc);
    sc.bias.clear();
    if (k.bias)
      for (int b : sc.blocks) sc.bias.push_back(k.bias_of(b, t.kv_head));
    load_queries(t, g0, gn, sc.q);
    sc.scores.resize(std::max<std::size_t>(1, static_cast<std::size_t>(rows) * ld));
    sc.acc.assign(static_cast<std::size_t>(rows) * hd, 0.0f);
    sc.row_sum.resize(rows);

    run_qk(k, t.kv_head, sc.blocks, n_ctx, sc.q.data(), rows, sc.scores.data(), ld, sc.tiles);
    if (k.merge) merge_scores(t, sc, n_ctx, rows, sc.scores.data(), ld);
    for (int r = 0; r < rows; ++r) {
      const int i = g0 + r / t.n_rep;
      const int clo = column_of(sc.blocks, bs, sc.lo[i]), chi = column_of(sc.blocks, bs, sc.hi[i]);
      float* s = sc.scores.data() + static_cast<std::size_t>(r) * ld;
      sc.row_sum[r] = row_weights(t, sc, s, ld, clo, chi, sink_of(t, r % t.n_rep));
      if (sc.row_sum[r] > 0) add_stats(t, sc, s, clo, chi, 1.0f / sc.row_sum[r], i);
    }
    if (v.merge) merge_weights(t, sc, n_ctx, rows, sc.scores.data(), ld, sc.acc.data());
    run_av(v, t.kv_head, sc.blocks, n_ctx, sc.scores.data(), ld, rows, sc.acc.data(), sc.tiles);
    store_outputs(t, g0, gn, sc);
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
      else x->codec_of(b)->decode(x->format_of(b), x->shape, x->params_of(b, t.kv_head), x->tile(b, t.kv_head), slot, 1, dst);
    }
  }
  // A merged pair's reader (kv_merge.h) reads restored rows: the stored row
  // times its ratio, or its own row where retained.
  auto restore = [&](const paged_kv_view& x, bool is_key, std::vector<float>& rows) {
    if (!x.merge) return;
    for (int p = 0; p < n_ctx; ++p) {
      const kv_merge_ref m = x.merge_of(p / bs, t.kv_head);
      const int slot = p % bs;
      float* row = &rows[static_cast<std::size_t>(p) * hd];
      const float ratio = is_key ? m.ratio_k()[slot] : m.ratio_v()[slot];
      for (int d = 0; d < hd; ++d) row[d] *= ratio;
      for (int e = 0; e < m.shape.retain; ++e)
        if (m.slot(e) == slot) std::copy_n(is_key ? m.k(e) : m.v(e), hd, row);
    }
  };
  restore(k, true, keys);
  restore(v, false, values);
  // What the ranges select and what the bias adds, slot by slot.
  std::vector<bool> selected(n_ctx, t.ranges.empty());
  for (const slot_range& r : t.ranges)
    for (int p = r.begin; p < r.end; ++p) selected[p] = true;
  std::vector<double> bias(n_ctx, 0.0);
  for (int p = 0; p < n_ctx; ++p)
    if (const float* b = k.bias_of(p / bs, t.kv_head)) bias[p] = b[p % bs];
  const int first_window_token = t.n_tokens - t.stats.n_window;
  std::vector<double> w(n_ctx), o(hd);
  for (int i = 0; i < t.n_tokens; ++i)
    for (int j = 0; j < t.n_rep; ++j) {
      const float* q = t.q + static_cast<std::size_t>(i) * t.q_stride + static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      // The mask, spelled out slot by slot from the positions and the ranges.
      std::vector<bool> seen(n_ctx);
      for (int p = 0; p < n_ctx; ++p)
        seen[p] = selected[p] && t.kv_pos[p] >= 0 && t.kv_pos[p] <= see_of(t, i) &&
                  (t.window <= 0 || t.kv_pos[p] > t.q_pos[i] - t.window);
      double mx = -INFINITY;
      for (int p = 0; p < n_ctx; ++p) {
        if (!seen[p]) continue;
        double s = 0;
        for (int d = 0; d < hd; ++d) s += static_cast<double>(q[d]) * keys[static_cast<std::size_t>(p) * hd + d];
        w[p] = s * t.scale;
        if (t.softcap > 0) w[p] = t.softcap * std::tanh(w[p] / t.softcap);
        w[p] += bias[p];
        mx = std::max(mx, w[p]);
      }
      const double sink = sink_of(t, j);
      const bool any_seen = mx > -INFINITY;
      if (any_seen) mx = std::max(mx, sink);
      double sum = any_seen && sink > -INFINITY ? std::exp(sink - mx) : 0;
      for (int p = 0; p < n_ctx; ++p) sum += seen[p] ? (w[p] = std::exp(w[p] - mx)) : (w[p] = 0);
      if (sum == 0) sum = 1;  // a row that sees no selected slot: output 0, no weight
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
