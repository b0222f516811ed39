#include "policy/quest.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/assert.h"
#include "core/cpu.h"

namespace pagoda {

// split: [n_rows][2][stride], q+ = max(q, 0) then q- = min(q, 0), zero past head_dim.
void quest_bounds_avx2(const float* split, std::size_t stride, int n_rows, int head_dim,
                       std::span<const key_summary> blocks, float* out);  // quest_avx2.cpp
void quest_bounds_avx512(const float* split, std::size_t stride, int n_rows, int head_dim,
                         std::span<const key_summary> blocks, float* out);  // quest_avx512.cpp

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
  return static_cast<int>(std::ceil((forced + 4) / budget)) * block_size;
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
    return std::make_unique<quest_selector>(params_);
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
    } else if (key == "pages" || key == "sinks" || key == "min_context") {
      PAGODA_ASSIGN_OR_RETURN((key == "pages" ? p.pages : key == "sinks" ? p.sinks : p.min_context),
                              parse_count(key, value, key == "pages" ? 1 : 0));
    } else {
      return error(errc::invalid_argument, "quest: unknown parameter '{}'; known: budget, pages, sinks, min_context", key);
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
  if (level == simd_level::avx512) quest_bounds_avx512(split.data(), stride, n_rows, head_dim, blocks, out);
  else quest_bounds_avx2(split.data(), stride, n_rows, head_dim, blocks, out);
}

// --- selection ------------------------------------------------------------------

namespace {

// Per thread: select() runs on attention threads, for any sequence.
struct quest_scratch {
  std::vector<key_summary> summaries;  // [candidates]
  std::vector<int> candidates;         // block indices with a summary, not forced
  std::vector<float> bound;            // [candidates]
  std::vector<int> order;              // [candidates] indices into candidates
  std::vector<std::uint8_t> read;      // [blocks]
};
thread_local quest_scratch t_scratch;

}  // namespace

bool quest_selector::select(const kv_select_query& q, std::vector<slot_range>& out) {
  out.clear();
  PAGODA_ASSERT(q.k != nullptr && q.n_rep > 0);
  if (!q.kv || q.n_kv <= 0 || q.n_rows / q.n_rep > k_quest_max_query_tokens) return false;
  const int bs = q.k->shape.block_size;
  const int n_blocks = (q.n_kv + bs - 1) / bs;
  const int n_read = params_.blocks_read(n_blocks);
  if (q.n_kv < params_.min_context_tokens(bs) || n_read >= n_blocks) return false;

  quest_scratch& sc = t_scratch;
  sc.read.assign(n_blocks, 0);
  sc.summaries.clear();
  sc.candidates.clear();
  // Dead slots (negative positions) lead the row: the sinks are the first live ones.
  const int first_live = static_cast<int>(
      std::partition_point(q.kv_pos.begin(), q.kv_pos.begin() + std::min<std::size_t>(q.kv_pos.size(), q.n_kv),
                           [](std::int32_t p) { return p < 0; }) -
      q.kv_pos.begin());
  const int sink_end = params_.sinks > 0 ? std::min(n_blocks, (first_live + params_.sinks + bs - 1) / bs) : 0;
  int n_forced = 0;
  for (int b = first_live / bs; b < n_blocks; ++b) {
    std::optional<key_summary> s;
    if (b >= sink_end && b != n_blocks - 1) s = q.kv->key_summary_of(q.k->blocks[b], q.layer, q.kv_head);
    if (s) {
      sc.candidates.push_back(b);
      sc.summaries.push_back(*s);
    } else {
      sc.read[b] = 1;
      ++n_forced;
    }
  }
  const int n_cand = static_cast<int>(sc.candidates.size());
  const int k = std::clamp(n_read - n_forced, 0, n_cand);
  if (k == n_cand && first_live < bs) return false;  // every block: a plain full read
  if (k > 0) {
    sc.bound.resize(n_cand);
    quest_bounds(q.q, q.n_rows, q.head_dim, sc.summaries, sc.bound.data());
    sc.order.resize(n_cand);
    for (int i = 0; i < n_cand; ++i) sc.order[i] = i;
    // The k largest bounds; ties go to the older block, so the choice is deterministic.
    auto larger = [&](int a, int b) { return sc.bound[a] > sc.bound[b] || (sc.bound[a] == sc.bound[b] && a < b); };
    std::nth_element(sc.order.begin(), sc.order.begin() + (k - 1), sc.order.end(), larger);
    for (int i = 0; i < k; ++i) sc.read[sc.candidates[sc.order[i]]] = 1;
  }
  for (int b = 0; b < n_blocks; ++b) {
    if (!sc.read[b]) continue;
    const int begin = b * bs, end = std::min(q.n_kv, begin + bs);
    if (!out.empty() && out.back().end == begin) out.back().end = end;
    else out.push_back({begin, end});
  }
  return true;
}

}  // namespace pagoda
