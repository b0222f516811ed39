#include "policy/quest.h"

#include <xmmintrin.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/assert.h"
#include "core/cpu.h"
#include "policy/quest_kernels.h"

namespace pagoda {

// --- parameters ---------------------------------------------------------------

int quest_params::blocks_read(int n_blocks) const {
  if (pages > 0) return pages;
  return std::max(1, static_cast<int>(std::ceil(budget * n_blocks - 1e-9)));
}

int quest_params::min_context_tokens(int block_size) const {
  if (min_context >= 0) return min_context;
  if (pages > 0) return 0;
  // The budget reaches 4 chosen blocks beyond the sinks and the newest block.
  const int forced = (sinks + block_size - 1) / block_size + 1;
  const double tokens = std::ceil((forced + 4) / budget) * block_size;  // budget may be tiny: clamp, then cast
  return static_cast<int>(std::min(tokens, static_cast<double>(INT32_MAX)));
}

namespace {

result<int> parse_count(std::string_view key, std::string_view text, int min) {
  int v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < min)
    return error(errc::invalid_argument, "quest: {} '{}': expected a whole number >= {}", key, text, min);
  return v;
}

// "0.125" or "12.5%".
result<double> parse_fraction(std::string_view text) {
  std::string_view num = text;
  const bool percent = !num.empty() && num.back() == '%';
  if (percent) num.remove_suffix(1);
  double v = 0;
  auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
  if (ec != std::errc() || end != num.data() + num.size() || num.empty())
    return error(errc::invalid_argument, "quest: budget '{}': expected a fraction of the blocks, such as 0.125 or 12.5%",
                 text);
  if (percent) v /= 100;
  if (!(v > 0 && v <= 1))
    return error(errc::invalid_argument,
                 "quest: budget '{}': expected a fraction in (0, 1] (for a number of blocks, use pages=N)", text);
  return v;
}

class quest_policy final : public kv_policy {
 public:
  quest_policy(kv_policy_spec spec, quest_params params) : spec_(std::move(spec)), params_(params) {}
  const kv_policy_spec& spec() const override { return spec_; }
  kv_policy_needs needs() const override {
    kv_policy_needs n;
    n.key_summaries = true;
    return n;
  }
  std::unique_ptr<kv_read_selector> make_selector(int n_layers, int n_kv_heads, int head_dim) override {
    return std::make_unique<quest_selector>(params_, n_layers, n_kv_heads, head_dim);
  }

 private:
  kv_policy_spec spec_;
  quest_params params_;
};

}  // namespace

result<quest_params> parse_quest_params(const kv_policy_spec& spec) {
  quest_params p;
  for (const auto& [key, value] : spec.params) {
    if (key == "budget") {
      PAGODA_ASSIGN_OR_RETURN(p.budget, parse_fraction(value));
    } else if (key == "bounds") {
      if (value != "int8" && value != "int4" && value != "f32")
        return error(errc::invalid_argument, "quest: bounds '{}': expected int8, int4 or f32", value);
      p.bounds = value == "int8" ? quest_bounds_kind::int8 : value == "int4" ? quest_bounds_kind::int4 : quest_bounds_kind::f32;
    } else if (key == "pages" || key == "sinks" || key == "min_context") {
      PAGODA_ASSIGN_OR_RETURN((key == "pages" ? p.pages : key == "sinks" ? p.sinks : p.min_context),
                              parse_count(key, value, key == "pages" ? 1 : 0));
    } else {
      return error(errc::invalid_argument, "quest: unknown parameter '{}'; known: budget, pages, sinks, min_context, bounds", key);
    }
  }
  return p;
}

result<std::unique_ptr<kv_policy>> make_quest_policy(const kv_policy_spec& spec) {
  PAGODA_ASSIGN_OR_RETURN(const quest_params p, parse_quest_params(spec));
  return std::unique_ptr<kv_policy>(std::make_unique<quest_policy>(spec, p));
}

// --- bounds ---------------------------------------------------------------------

void quest_bounds_ref(const float* q, int n_rows, int head_dim, std::span<const key_summary> blocks, float* out) {
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    double best = -INFINITY;
    for (int r = 0; r < n_rows; ++r) {
      const float* qr = q + static_cast<std::size_t>(r) * head_dim;
      double s = 0;
      for (int d = 0; d < head_dim; ++d)
        s += std::max(static_cast<double>(qr[d]) * blocks[i].min[d], static_cast<double>(qr[d]) * blocks[i].max[d]);
      best = std::isnan(s) ? INFINITY : std::max(best, s);
    }
    out[i] = static_cast<float>(best);
  }
}

void quest_bounds(const float* q, int n_rows, int head_dim, std::span<const key_summary> blocks, float* out) {
  const simd_level level = active_simd_level();
  if (level == simd_level::scalar) return quest_bounds_ref(q, n_rows, head_dim, blocks, out);
  // q+ and q- once per call, padded to whole vectors of 16 with zeros.
  thread_local std::vector<float> split;
  const std::size_t stride = (static_cast<std::size_t>(head_dim) + 15) / 16 * 16;
  split.assign(static_cast<std::size_t>(n_rows) * 2 * stride, 0.0f);
  for (int r = 0; r < n_rows; ++r)
    for (int d = 0; d < head_dim; ++d) {
      const float x = q[static_cast<std::size_t>(r) * head_dim + d];
      split[2 * static_cast<std::size_t>(r) * stride + d] = std::max(x, 0.0f);
      split[(2 * static_cast<std::size_t>(r) + 1) * stride + d] = std::min(x, 0.0f);
    }
  if (level == simd_level::avx512) quest_detail::bounds_avx512(split.data(), stride, n_rows, head_dim, blocks, out);
  else quest_detail::bounds_avx2(split.data(), stride, n_rows, head_dim, blocks, out);
}

// --- int8 bounds ------------------------------------------------------------------

quest_block8 quest_encode_block(const key_summary& s, int head_dim, std::int8_t* codes) {
  const int pd = quest_padded_dim(head_dim);
  std::fill_n(codes, 2 * pd, std::int8_t{0});
  quest_block8 b;
  double m = 0;
  for (int d = 0; d < head_dim; ++d) {
    if (!std::isfinite(s.min[d]) || !std::isfinite(s.max[d])) {
      b.scale = INFINITY;  // no finite bound: the block is always read
      return b;
    }
    m = std::max({m, std::fabs(static_cast<double>(s.min[d])), std::fabs(static_cast<double>(s.max[d]))});
  }
  if (m == 0) return b;  // every key is 0: so is every score
  // 1/1024 of headroom keeps |x| / scale below 127 whatever the float rounding.
  b.scale = static_cast<float>(m / 127 * (1 + 1.0 / 1024));
  const double sc = b.scale;
  for (int d = 0; d < head_dim; ++d) {
    // Outward, checked in double (a float times a small integer is exact there).
    double lo = std::floor(s.min[d] / sc), hi = std::ceil(s.max[d] / sc);
    if (sc * lo > s.min[d]) lo -= 1;
    if (sc * hi < s.max[d]) hi += 1;
    codes[d] = static_cast<std::int8_t>(std::clamp(lo, -127.0, 127.0));
    codes[pd + d] = static_cast<std::int8_t>(std::clamp(hi, -127.0, 127.0));
    b.l1 += std::abs(codes[d]) + std::abs(codes[pd + d]);
  }
  return b;
}

void quest_encode_query(const float* q, int n_rows, int head_dim, quest_query8& out) {
  quest_detail::encode_query(q, n_rows, head_dim, quest_padded_dim(head_dim), out);
}

void quest_detail::encode_query(const float* q, int n_rows, int head_dim, int padded_dim, quest_query8& out) {
  out.n_rows = n_rows;
  out.padded_dim = padded_dim;
  const std::size_t pd = out.padded_dim;
  out.pos.assign(static_cast<std::size_t>(n_rows) * pd, 0);
  out.neg.assign(static_cast<std::size_t>(n_rows) * pd, 0);
  out.scale.resize(n_rows);
  for (int r = 0; r < n_rows; ++r) {
    const float* qr = q + static_cast<std::size_t>(r) * head_dim;
    float m = 0;
    for (int d = 0; d < head_dim; ++d) m = std::max(m, std::fabs(qr[d]));
    out.scale[r] = m / 127;
    if (!(m > 0)) continue;  // a zero row scores 0 (a NaN row: NaN scale, +inf bounds)
    const float inv = 127 / m;
    std::uint8_t* pos = out.pos.data() + r * pd;
    std::uint8_t* neg = out.neg.data() + r * pd;
    // Branch-free (the signs are random) and without a libm call per channel:
    // adding and subtracting 1.5 x 2^23 rounds a float in [0, 2^22) to the
    // nearest integer (ties to even), as nearbyint does, in plain SSE adds.
    constexpr float round_magic = 12582912.0f;
    for (int d = 0; d < head_dim; ++d) {
      const float a = std::fabs(qr[d]) * inv;  // <= 127 (1 + 2^-23): max|q| / m
      const auto u = static_cast<std::uint8_t>(std::min(127.0f, (a + round_magic) - round_magic));
      pos[d] = qr[d] >= 0 ? u : 0;
      neg[d] = qr[d] >= 0 ? 0 : u;
    }
  }
}

void quest_bounds8_ref(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out) {
  const std::size_t pd = q.padded_dim;
  quest_detail::bounds_ref(q, blocks, n, out, [&](int i, int side, int d) { return codes[(2 * i + side) * pd + d]; });
}

void quest_bounds8(const quest_query8& q, const std::int8_t* codes, const quest_block8* blocks, int n, float* out) {
  switch (active_simd_level()) {
    case simd_level::avx512: return quest_detail::bounds8_avx512(q, codes, blocks, n, out);
    case simd_level::avx2: return quest_detail::bounds8_avx2(q, codes, blocks, n, out);
    case simd_level::scalar: break;
  }
  quest_bounds8_ref(q, codes, blocks, n, out);
}

// --- selection ------------------------------------------------------------------

namespace {

// The k-th largest of a[0, m) (1 <= k <= m), destroying a; tmp holds m
// floats. Quickselect whose partitions are branch-free (each value is
// written to both ends of tmp, and only the matching end's cursor moves):
// with bounds in random order a branchy partition mispredicts about half
// of its comparisons.
float select_kth(float* a, float* tmp, std::size_t m, std::size_t k) {
  for (int round = 0; m > 16 && round < 48; ++round) {
    const float x0 = a[0], x1 = a[m / 2], x2 = a[m - 1];
    const float p = std::max(std::min(x0, x1), std::min(std::max(x0, x1), x2));  // median of three
    std::size_t g = 0, l = m;  // tmp: [0, g) above p, [l, m) below it
    for (std::size_t i = 0; i < m; ++i) {
      const float x = a[i];
      tmp[l - 1] = x;  // (when g == l - 1 both writes store x)
      tmp[g] = x;
      g += x > p;
      l -= x < p;
    }
    if (k <= g) {
      m = g;
    } else if (k <= l) {
      return p;  // [g, l) equal p
    } else {
      tmp += l;
      m -= l;
      k -= l;
    }
    std::swap(a, tmp);
  }
  std::nth_element(a, a + (k - 1), a + m, std::greater<float>());
  return a[k - 1];
}

}  // namespace

float quest_kth_largest(std::span<const float> x, int k, std::vector<float>& scratch) {
  const std::size_t n = x.size();
  PAGODA_ASSERT(k >= 1 && static_cast<std::size_t>(k) <= n, "quest: the {}-th largest of {} values", k, n);
  scratch.resize(2 * n);
  float* const buf = scratch.data();
  constexpr std::size_t stride = 8;
  if (n >= 64 * stride && static_cast<std::size_t>(k) * 4 <= n) {
    // A threshold from every 8th value, ranked about 3 standard deviations
    // past where the k-th largest is expected among them, so that at least k
    // values reach it unless the sample is very unlucky (then the plain path).
    const std::size_t m = n / stride;
    for (std::size_t i = 0; i < m; ++i) buf[i] = x[i * stride];
    const double expect = static_cast<double>(k) / stride;
    const std::size_t r = std::min(m - 1, static_cast<std::size_t>(expect + 3 * std::sqrt(expect) + 4));
    const float t = select_kth(buf, buf + n, m, r + 1);
    // Every value >= t, branch-free; the k-th largest of them is the k-th
    // largest of all when there are at least k.
    std::size_t c = 0;
    for (std::size_t i = 0; i < n; ++i) {
      buf[c] = x[i];
      c += x[i] >= t;
    }
    if (c >= static_cast<std::size_t>(k)) return select_kth(buf, buf + n, c, k);
  }
  std::copy(x.begin(), x.end(), buf);
  return select_kth(buf, buf + n, n, k);
}

namespace {

// Per thread: select() runs on attention threads, for any sequence.
struct quest_scratch {
  std::vector<key_summary> summaries;  // f32 bounds: [candidates]
  quest_query8 query;                  // int8 bounds
  quest_query4 query4;                 // int4 bounds
  std::vector<float> bound;            // [candidates]
  std::vector<float> sorted;           // quest_kth_largest's scratch
};
thread_local quest_scratch t_scratch;

}  // namespace

quest_selector::quest_selector(const quest_params& params, int n_layers, int n_kv_heads, int head_dim)
    : params_(params),
      n_kv_heads_(n_kv_heads),
      padded_dim_(params.bounds == quest_bounds_kind::int4 ? quest4_padded_dim(head_dim) : quest_padded_dim(head_dim)),
      per_block_(params.bounds == quest_bounds_kind::int4 ? static_cast<std::size_t>(padded_dim_)
                                                          : 2 * static_cast<std::size_t>(padded_dim_)),
      rows_(params.bounds != quest_bounds_kind::f32 ? static_cast<std::size_t>(n_layers) * n_kv_heads : 0) {}

int quest_selector::f32_bounds(const kv_select_query& q, int c0, int c_end) {
  quest_scratch& sc = t_scratch;
  sc.summaries.clear();
  int c1 = c0;
  for (; c1 < c_end; ++c1) {
    const std::optional<key_summary> s = q.kv->key_summary_of(q.k->blocks[c1], q.layer, q.kv_head);
    if (!s) break;
    sc.summaries.push_back(*s);
  }
  sc.bound.resize(sc.summaries.size());
  quest_bounds(q.q, q.n_rows, q.head_dim, sc.summaries, sc.bound.data());
  return c1;
}

void quest_selector::encode_new_blocks(const kv_select_query& q, row& r, int c_end) {
  const bool int4 = params_.bounds == quest_bounds_kind::int4;
  if (static_cast<int>(r.ids.size()) >= c_end) return;
  if (int4 && c_end >= 2 * r.scales_blocks && c_end > r.scales_blocks + 8) {
    // Channel scales taken from few blocks (a context that grew from a short
    // prompt) describe the keys since poorly: at each doubling of the row,
    // new scales and codes (O(1) amortized per block).
    r.ids.clear();
    r.blocks.clear();
    r.codes.clear();
  }
  const int first = static_cast<int>(r.ids.size());
  std::vector<key_summary>& sums = t_scratch.summaries;
  sums.clear();
  for (int b = first; b < c_end; ++b) {
    const std::optional<key_summary> s = q.kv->key_summary_of(q.k->blocks[b], q.layer, q.kv_head);
    if (!s) break;
    sums.push_back(*s);
  }
  if (int4 && first == 0 && !sums.empty()) {
    // The row's channel scales, from (up to 64 of) the blocks sealed now.
    std::vector<key_summary> sample;
    const std::size_t step = (sums.size() + 63) / 64;
    for (std::size_t i = 0; i < sums.size(); i += step) sample.push_back(sums[i]);
    r.channel_scale.resize(q.head_dim);
    quest_channel_scales(sample, q.head_dim, r.channel_scale.data());
    r.scales_blocks = static_cast<int>(sums.size());
  }
  for (std::size_t i = 0; i < sums.size(); ++i) {
    r.ids.push_back(q.k->blocks[first + i]);
    r.codes.resize(r.codes.size() + per_block_);
    std::int8_t* codes = r.codes.data() + r.codes.size() - per_block_;
    r.blocks.push_back(int4 ? quest_encode_block4(sums[i], q.head_dim, r.channel_scale.data(),
                                                  reinterpret_cast<std::uint8_t*>(codes))
                            : quest_encode_block(sums[i], q.head_dim, codes));
  }
}

int quest_selector::coded_bounds(const kv_select_query& q, int c0, int c_end) {
  const bool int4 = params_.bounds == quest_bounds_kind::int4;
  PAGODA_ASSERT(q.layer >= 0 && q.kv_head >= 0 && q.kv_head < n_kv_heads_ &&
                    static_cast<std::size_t>(q.layer) * n_kv_heads_ + q.kv_head < rows_.size() &&
                    (int4 ? quest4_padded_dim(q.head_dim) : quest_padded_dim(q.head_dim)) == padded_dim_,
                "quest: a query for layer {} head {} of head_dim {} outside the selector's shape", q.layer,
                q.kv_head, q.head_dim);
  row& r = rows_[static_cast<std::size_t>(q.layer) * n_kv_heads_ + q.kv_head];
  r.block_size = q.k->shape.block_size;
  // Cached entries stay valid while the table holds the same block there
  // (a truncation or compaction is announced by on_slots_changed).
  static_assert(std::has_unique_object_representations_v<block_id>, "ids are compared as bytes");
  // (One comparison of the whole id arrays in the usual case where nothing
  // changed: the mismatch search only when it fails.)
  const std::size_t limit = std::min(r.ids.size(), q.k->blocks.size());
  std::size_t n = limit;
  if (limit > 0 && std::memcmp(r.ids.data(), q.k->blocks.data(), limit * sizeof(block_id)) != 0)
    n = static_cast<std::size_t>(std::mismatch(r.ids.begin(), r.ids.begin() + limit, q.k->blocks.begin()).first -
                                 r.ids.begin());
  if (n < r.ids.size()) {
    r.ids.resize(n);
    r.blocks.resize(n);
    r.codes.resize(n * per_block_);
  }
  encode_new_blocks(q, r, c_end);
  const int c1 = std::max(c0, std::min(c_end, static_cast<int>(r.ids.size())));
  quest_scratch& sc = t_scratch;
  sc.bound.resize(c1 - c0);
  if (c1 > c0) {
    const std::int8_t* codes = r.codes.data() + c0 * per_block_;
    if (int4) {
      quest_encode_query4(q.q, q.n_rows, q.head_dim, r.channel_scale.data(), sc.query4);
      quest_bounds4(sc.query4, reinterpret_cast<const std::uint8_t*>(codes), r.blocks.data() + c0, c1 - c0,
                    sc.bound.data());
    } else {
      quest_encode_query(q.q, q.n_rows, q.head_dim, sc.query);
      quest_bounds8(sc.query, codes, r.blocks.data() + c0, c1 - c0, sc.bound.data());
    }
  }
  return c1;
}

bool quest_selector::select(const kv_select_query& q, std::vector<slot_range>& out) {
  out.clear();
  PAGODA_ASSERT(q.k != nullptr && q.n_rep > 0);
  if (!q.kv || q.n_kv <= 0 || q.n_rows / q.n_rep > k_quest_max_query_tokens) return false;
  const int bs = q.k->shape.block_size;
  const int n_blocks = (q.n_kv + bs - 1) / bs;
  const int n_read = params_.blocks_read(n_blocks);
  if (q.n_kv < params_.min_context_tokens(bs) || n_read >= n_blocks) return false;

  // Dead slots (negative positions) lead the row: the sinks are the first live ones.
  const auto kv_pos = q.kv_pos.first(std::min<std::size_t>(q.kv_pos.size(), q.n_kv));
  const int first_live =
      static_cast<int>(std::partition_point(kv_pos.begin(), kv_pos.end(), [](std::int32_t p) { return p < 0; }) -
                       kv_pos.begin());
  const int live_block = first_live / bs;
  const int sink_end = params_.sinks > 0 ? std::min(n_blocks, (first_live + params_.sinks + bs - 1) / bs) : live_block;
  // Candidates: the blocks from the sinks to the newest (excluded) that have a
  // bound, [c0, c1); every other live block is read.
  const int c0 = std::max(sink_end, live_block), c_end = std::max(c0, n_blocks - 1);
  const int c1 = params_.bounds != quest_bounds_kind::f32 ? coded_bounds(q, c0, c_end) : f32_bounds(q, c0, c_end);
  const int n_cand = c1 - c0;
  const int n_forced = n_blocks - live_block - n_cand;
  const int k = std::clamp(n_read - n_forced, 0, n_cand);
  if (k == n_cand && live_block == 0) return false;  // every block: a plain full read

  // Ranges in block order: the forced blocks before the candidates, the
  // chosen candidates, the forced blocks after them. O(n_cand) simple passes
  // and a partial selection of about k values (no sort, no per-block array).
  auto add = [&](int b0, int b1) {  // blocks [b0, b1)
    if (b0 >= b1) return;
    const int begin = b0 * bs, end = std::min(q.n_kv, b1 * bs);
    if (!out.empty() && out.back().end == begin) out.back().end = end;
    else out.push_back({begin, end});
  };
  add(live_block, c0);
  if (k > 0) {
    quest_scratch& sc = t_scratch;
    const float* bound = sc.bound.data();
    // The k largest bounds: every bound above the k-th largest, then the
    // oldest blocks whose bound equals it (a deterministic choice among ties).
    const float kth = quest_kth_largest(std::span<const float>(bound, n_cand), k, sc.sorted);
    // Four bounds per comparison (SSE, which every x86-64 has): a mask of
    // those above kth, and of those equal to it, the first `ties` of which
    // (in block order) are taken; the chosen ones' ranges from the masks'
    // set bits (1/8 of them, in random places).
    const __m128 kv = _mm_set1_ps(kth);
    const int n4 = n_cand / 4 * 4;
    auto above = [&](int i) { return _mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(bound + i), kv)); };
    int ties = k;
    for (int i = 0; i < n4; i += 4) ties -= std::popcount(static_cast<unsigned>(above(i)));
    for (int i = n4; i < n_cand; ++i) ties -= bound[i] > kth;
    auto take = [&](int i0, unsigned gt, unsigned eq) {
      for (; eq != 0 && ties > 0; eq &= eq - 1, --ties) gt |= eq & -eq;
      for (; gt != 0; gt &= gt - 1) {
        const int b = c0 + i0 + std::countr_zero(gt);
        add(b, b + 1);
      }
    };
    for (int i = 0; i < n4; i += 4)
      take(i, static_cast<unsigned>(above(i)),
           static_cast<unsigned>(_mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(bound + i), kv))));
    for (int i = n4; i < n_cand; ++i) take(i, bound[i] > kth, bound[i] == kth);
  }
  add(c1, n_blocks);
  return true;
}

void quest_selector::on_slots_changed(int n_kv, bool kept) {
  for (row& r : rows_) {
    // A rollback keeps the blocks wholly below n_kv; anything else starts over.
    const std::size_t keep = kept && r.block_size > 0 ? std::min<std::size_t>(r.ids.size(), n_kv / r.block_size) : 0;
    r.ids.resize(keep);
    r.blocks.resize(keep);
    r.codes.resize(keep * per_block_);
  }
}

std::size_t quest_selector::memory_bytes() const {
  std::size_t bytes = rows_.capacity() * sizeof(row);
  for (const row& r : rows_)
    bytes += r.ids.capacity() * sizeof(block_id) + r.codes.capacity() + r.blocks.capacity() * sizeof(quest_block8) +
             r.channel_scale.capacity() * sizeof(float);
  return bytes;
}

}  // namespace pagoda
