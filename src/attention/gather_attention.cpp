#include "attention/gather_attention.h"

#include <algorithm>
#include <cmath>

#include "core/assert.h"
#include "core/cpu.h"
#include "core/half.h"

namespace pagoda {

void score_key_rows_avx2(const float* q, int n_q, int head_dim, const key_rows& rows, const std::int32_t* slots,
                         std::size_t n, float* scores, std::size_t ld);  // gather_attention_avx2.cpp
void add_weighted_row_avx2(const float* row, int head_dim, const float* w, std::size_t w_stride, int n_q,
                           float* acc);  // gather_attention_avx2.cpp

namespace {

// A block with at least block_size / k_dense_divisor listed slots has its
// value tile read whole (av) rather than row by row.
constexpr int k_dense_divisor = 4;
// Blocks in one qk/av run: a run's scores ([rows][run tokens]) stay in L2.
constexpr int k_max_run_blocks = 64;
// Scattered value rows decoded before any is added (gather_scratch::row).
constexpr std::size_t k_row_batch = 8;

// Listed entries [j0, j1) in table blocks [b0, b1]; the codec reads tokens
// [b0 * bs, b0 * bs + n_tokens) of the run (up to its last listed slot).
struct run {
  std::size_t j0 = 0, j1 = 0;
  int b0 = 0, b1 = 0;
  int n_tokens = 0;
  bool staged = false;
};

// The end of block slots[j] / bs's listed entries.
std::size_t block_end(std::span<const std::int32_t> slots, std::size_t j, int bs) {
  const int b = slots[j] / bs;
  while (j < slots.size() && slots[j] / bs == b) ++j;
  return j;
}

bool dense(std::size_t j0, std::size_t j1, int bs) { return static_cast<int>(j1 - j0) * k_dense_divisor >= bs; }

// The run starting at entry j: block slots[j] / bs, then the following table
// blocks while each holds listed slots, is not staged, is of the run's block
// class and satisfies `joins` (a staged block is a run of its own, and a run
// never spans two classes: one codec reads it).
template <class Joins>
run next_run(const paged_kv_view& v, std::span<const std::int32_t> slots, std::size_t j, Joins joins) {
  const int bs = v.shape.block_size;
  run r;
  r.j0 = j;
  r.b0 = r.b1 = slots[j] / bs;
  r.staged = v.is_staged(r.b0);
  r.j1 = block_end(slots, j, bs);
  while (!r.staged && r.j1 < slots.size() && r.b1 - r.b0 + 1 < k_max_run_blocks) {
    const int b = slots[r.j1] / bs;
    if (b != r.b1 + 1 || v.is_staged(b) || v.class_of(b) != v.class_of(r.b0)) break;
    const std::size_t e = block_end(slots, r.j1, bs);
    if (!joins(r.j1, e)) break;
    r.b1 = b;
    r.j1 = e;
  }
  r.n_tokens = slots[r.j1 - 1] + 1 - r.b0 * bs;
  return r;
}

// The codec, format, parameters and tiles of a run of head h.
struct run_tiles {
  const kv_codec* codec;
  const kv_format* format;
  const kv_static_params* params;
};

run_tiles tiles_of(const paged_kv_view& v, int h, const run& r, std::vector<const void*>& tiles) {
  tiles.clear();
  if (r.staged) {
    tiles.push_back(v.staged_tile(h));
    return {v.staged_codec, &v.staged_format, nullptr};
  }
  for (int b = r.b0; b <= r.b1; ++b) tiles.push_back(v.tile(b, h));
  return {v.codec_of(r.b0), &v.format_of(r.b0), v.params_of(r.b0, h)};
}

// scores[r * n + e] = q_r . k(slots[e]) for every listed entry: the ones the
// copy holds (they lead: slots are sorted) from their rows, the rest a tile run
// at a time.
void score_keys(const attention_task& t, std::span<const std::int32_t> slots, int rows, const key_rows& kr,
                gather_scratch& sc) {
  const paged_kv_view& k = *t.k;
  const int bs = k.shape.block_size;
  const std::size_t n = slots.size();
  const std::size_t n_copied =
      kr.chunks ? static_cast<std::size_t>(std::lower_bound(slots.begin(), slots.end(), kr.n_slots) - slots.begin()) : 0;
  if (n_copied > 0) score_key_rows(sc.q.data(), rows, t.head_dim, kr, slots.data(), n_copied, sc.scores.data(), n);
  for (std::size_t j = n_copied; j < n;) {
    const run r = next_run(k, slots, j, [](std::size_t, std::size_t) { return true; });
    const run_tiles rt = tiles_of(k, t.kv_head, r, sc.tiles);
    const int ld = r.n_tokens;
    sc.tile_io.resize(static_cast<std::size_t>(rows) * ld);
    rt.codec->qk(*rt.format, k.shape, rt.params, sc.tiles.data(), r.n_tokens, sc.q.data(), rows, sc.tile_io.data(), ld);
    const int base = r.b0 * bs;
    for (int row = 0; row < rows; ++row)
      for (std::size_t e = r.j0; e < r.j1; ++e)
        sc.scores[row * n + e] = sc.tile_io[static_cast<std::size_t>(row) * ld + (slots[e] - base)];
    j = r.j1;
  }
}

// Masks, soft-capping, bias and the unnormalised softmax of every row, in
// sc.scores; sc.inv[r] = 1 / (sum of row r's weights), 0 when the row sees no
// listed slot.
void softmax_rows(const attention_task& t, std::span<const std::int32_t> slots, gather_scratch& sc) {
  const paged_kv_view& k = *t.k;
  const int bs = k.shape.block_size;
  const std::size_t n = slots.size();
  for (int i = 0; i < t.n_tokens; ++i) {
    int lo, hi;
    visible_slots(t.kv_pos, t.n_kv, t.q_pos[i], see_of(t, i), t.window, lo, hi);
    sc.lo[i] = static_cast<int>(std::lower_bound(slots.begin(), slots.end(), lo) - slots.begin());
    sc.hi[i] = static_cast<int>(std::lower_bound(slots.begin(), slots.end(), hi) - slots.begin());
  }
  for (int i = 0; i < t.n_tokens; ++i)
    for (int j = 0; j < t.n_rep; ++j) {
      const int r = i * t.n_rep + j;
      const int lo = sc.lo[i], hi = std::max(sc.lo[i], sc.hi[i]);
      float* s = sc.scores.data() + static_cast<std::size_t>(r) * n;
      if (t.softcap > 0) softcap_inplace(s + lo, hi - lo, t.softcap);
      if (k.bias)
        for (int e = lo; e < hi; ++e)
          if (const float* bias = k.bias_of(slots[e] / bs, t.kv_head)) s[e] += bias[slots[e] % bs];
      const float sum = hi > lo ? softmax_unnormalized(s + lo, hi - lo, sink_of(t, j)) : 0.0f;
      std::fill(s, s + lo, 0.0f);
      std::fill(s + hi, s + n, 0.0f);
      sc.inv[r] = sum > 0 ? 1.0f / sum : 0.0f;
    }
}

// acc[r] += sum over listed e of w[r][e] * v(slots[e]).
void add_values(const attention_task& t, std::span<const std::int32_t> slots, int rows, gather_scratch& sc) {
  const paged_kv_view& v = *t.v;
  const int bs = v.shape.block_size, hd = t.head_dim;
  const std::size_t n = slots.size();
  sc.row.resize(static_cast<std::size_t>(k_row_batch) * hd);
  for (std::size_t j = 0; j < n;) {
    if (!dense(j, block_end(slots, j, bs), bs)) {  // few rows of this block: decode just those
      // Entries of this and the following sparse blocks, k_row_batch rows at
      // a time: their decodes (scattered reads) are independent of each
      // other, so their cache misses overlap before the rows are added.
      std::size_t e = block_end(slots, j, bs);
      while (e < n && e - j < k_row_batch && !dense(e, block_end(slots, e, bs), bs)) e = block_end(slots, e, bs);
      e = std::min(e, j + k_row_batch);
      for (std::size_t i = j; i < e; ++i) decode_kv_rows(v, t.kv_head, slots[i], 1, &sc.row[(i - j) * hd]);
      for (std::size_t i = j; i < e; ++i)
        add_weighted_row(&sc.row[(i - j) * hd], hd, sc.scores.data() + i, n, rows, sc.acc.data());
      j = e;
      continue;
    }
    const run ru = next_run(v, slots, j, [bs](std::size_t j0, std::size_t j1) { return dense(j0, j1, bs); });
    const run_tiles rt = tiles_of(v, t.kv_head, ru, sc.tiles);
    const int ld = ru.n_tokens, base = ru.b0 * bs;
    sc.tile_io.assign(static_cast<std::size_t>(rows) * ld, 0.0f);
    for (int r = 0; r < rows; ++r)
      for (std::size_t e = ru.j0; e < ru.j1; ++e)
        sc.tile_io[static_cast<std::size_t>(r) * ld + (slots[e] - base)] = sc.scores[r * n + e];
    rt.codec->av(*rt.format, v.shape, rt.params, sc.tiles.data(), ru.n_tokens, sc.tile_io.data(), ld, rows,
                 sc.acc.data());
    j = ru.j1;
  }
}

}  // namespace

void decode_kv_rows(const paged_kv_view& v, int head, int slot, int n, float* out) {
  const int bs = v.shape.block_size;
  const int b = slot / bs, t0 = slot % bs;
  PAGODA_DASSERT(n >= 1 && t0 + n <= bs && slot + n <= v.n_tokens);
  if (v.is_staged(b)) v.staged_codec->decode(v.staged_format, v.shape, nullptr, v.staged_tile(head), t0, n, out);
  else v.codec_of(b)->decode(v.format_of(b), v.shape, v.params_of(b, head), v.tile(b, head), t0, n, out);
}

void add_weighted_row_ref(const float* row, int head_dim, const float* w, std::size_t w_stride, int n_q, float* acc) {
  for (int r = 0; r < n_q; ++r) {
    const float wr = w[r * w_stride];
    if (wr == 0.0f) continue;
    float* a = acc + static_cast<std::size_t>(r) * head_dim;
    for (int d = 0; d < head_dim; ++d) a[d] += wr * row[d];
  }
}

void add_weighted_row(const float* row, int head_dim, const float* w, std::size_t w_stride, int n_q, float* acc) {
  if (active_simd_level() >= simd_level::avx2 && head_dim % 8 == 0)
    return add_weighted_row_avx2(row, head_dim, w, w_stride, n_q, acc);
  add_weighted_row_ref(row, head_dim, w, w_stride, n_q, acc);
}

void score_key_rows_ref(const float* q, int n_q, int head_dim, const key_rows& rows, const std::int32_t* slots,
                        std::size_t n, float* scores, std::size_t ld) {
  for (std::size_t e = 0; e < n; ++e) {
    const std::uint16_t* key = rows.row(slots[e], head_dim);
    for (int r = 0; r < n_q; ++r) {
      const float* qr = q + static_cast<std::size_t>(r) * head_dim;
      float s = 0.0f;
      for (int d = 0; d < head_dim; ++d) s += qr[d] * fp16_to_f32(key[d]);
      scores[r * ld + e] = s;
    }
  }
}

void score_key_rows(const float* q, int n_q, int head_dim, const key_rows& rows, const std::int32_t* slots,
                    std::size_t n, float* scores, std::size_t ld) {
  if (active_simd_level() >= simd_level::avx2 && head_dim % 8 == 0)
    return score_key_rows_avx2(q, n_q, head_dim, rows, slots, n, scores, ld);
  score_key_rows_ref(q, n_q, head_dim, rows, slots, n, scores, ld);
}

void append_slots_of_ranges(std::span<const slot_range> ranges, std::vector<std::int32_t>& out) {
  for (const slot_range& r : ranges)
    for (std::int32_t s = r.begin; s < r.end; ++s) out.push_back(s);
}

void gather_attention(const attention_task& t, std::span<const std::int32_t> slots, gather_scratch& sc,
                      const key_rows& kr) {
  const int hd = t.head_dim;
  const int rows = t.n_tokens * t.n_rep;
  PAGODA_DASSERT(t.k->shape.head_dim == hd && t.v->shape.head_dim == hd);
  PAGODA_DASSERT(t.k->n_tokens >= t.n_kv && t.v->n_tokens >= t.n_kv);
  PAGODA_DASSERT(slots.empty() || (slots.front() >= 0 && slots.back() < t.n_kv));
  sc.q.resize(static_cast<std::size_t>(rows) * hd);
  for (int i = 0; i < t.n_tokens; ++i)
    for (int j = 0; j < t.n_rep; ++j) {
      const float* src = t.q + static_cast<std::size_t>(i) * t.q_stride + static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      float* dst = sc.q.data() + static_cast<std::size_t>(i * t.n_rep + j) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = src[d] * t.scale;
    }
  sc.scores.resize(static_cast<std::size_t>(rows) * slots.size());
  sc.lo.resize(t.n_tokens);
  sc.hi.resize(t.n_tokens);
  sc.acc.assign(static_cast<std::size_t>(rows) * hd, 0.0f);
  sc.inv.assign(rows, 0.0f);
  if (!slots.empty()) {
    score_keys(t, slots, rows, kr, sc);
    softmax_rows(t, slots, sc);
    add_values(t, slots, rows, sc);
  }
  for (int i = 0; i < t.n_tokens; ++i)
    for (int j = 0; j < t.n_rep; ++j) {
      const int r = i * t.n_rep + j;
      const float s = sc.inv[r];
      const float* a = sc.acc.data() + static_cast<std::size_t>(r) * hd;
      float* dst = t.out + static_cast<std::size_t>(i) * t.out_stride + static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = a[d] * s;
    }
}

void gather_attention_ref(const attention_task& t, std::span<const std::int32_t> slots) {
  const paged_kv_view& k = *t.k;
  const int hd = t.head_dim, bs = k.shape.block_size;
  const std::size_t n = slots.size();
  std::vector<float> keys(n * hd), values(n * hd);
  for (std::size_t e = 0; e < n; ++e) {
    decode_kv_rows(k, t.kv_head, slots[e], 1, &keys[e * hd]);
    decode_kv_rows(*t.v, t.kv_head, slots[e], 1, &values[e * hd]);
  }
  std::vector<double> w(n), o(hd);
  for (int i = 0; i < t.n_tokens; ++i)
    for (int j = 0; j < t.n_rep; ++j) {
      const float* q = t.q + static_cast<std::size_t>(i) * t.q_stride + static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      std::vector<bool> seen(n);
      double mx = -INFINITY;
      for (std::size_t e = 0; e < n; ++e) {
        const std::int32_t p = t.kv_pos[slots[e]];
        seen[e] = p >= 0 && p <= see_of(t, i) && (t.window <= 0 || p > t.q_pos[i] - t.window);
        if (!seen[e]) continue;
        double s = 0;
        for (int d = 0; d < hd; ++d) s += static_cast<double>(q[d]) * keys[e * hd + d];
        w[e] = s * t.scale;
        if (t.softcap > 0) w[e] = t.softcap * std::tanh(w[e] / t.softcap);
        if (const float* bias = k.bias_of(slots[e] / bs, t.kv_head)) w[e] += bias[slots[e] % bs];
        mx = std::max(mx, w[e]);
      }
      const double sink = sink_of(t, j);
      const bool any_seen = mx > -INFINITY;
      if (any_seen) mx = std::max(mx, sink);
      double sum = any_seen && sink > -INFINITY ? std::exp(sink - mx) : 0;
      for (std::size_t e = 0; e < n; ++e) sum += seen[e] ? (w[e] = std::exp(w[e] - mx)) : (w[e] = 0);
      std::fill(o.begin(), o.end(), 0.0);
      if (sum > 0)
        for (std::size_t e = 0; e < n; ++e)
          for (int d = 0; d < hd; ++d) o[d] += w[e] / sum * values[e * hd + d];
      float* dst = t.out + static_cast<std::size_t>(i) * t.out_stride + static_cast<std::size_t>(t.kv_head * t.n_rep + j) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = static_cast<float>(o[d]);
    }
}

}  // namespace pagoda
