// What the eviction policies share (eviction_internal.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/assert.h"
#include "policy/eviction_internal.h"

namespace pagoda::policy_detail {

void check_input(const eviction_input& in) {
  PAGODA_ASSERT(in.n_layers > 0 && in.n_kv_heads > 0 && in.n_slots >= 0 && in.block_size >= 0,
                "eviction input of {} layers x {} KV heads, {} slots, blocks of {}", in.n_layers, in.n_kv_heads,
                in.n_slots, in.block_size);
  const auto n_slots = static_cast<std::size_t>(in.n_slots);
  const auto n_rows = static_cast<std::size_t>(in.n_rows());
  PAGODA_ASSERT(in.row_stride == 0 || in.row_stride >= n_slots, "row stride {} below {} slots", in.row_stride,
                n_slots);
  const std::size_t needed = in.row_stride == 0 ? n_slots : (n_rows - 1) * in.row_stride + n_slots;
  PAGODA_ASSERT(in.positions.size() >= needed, "eviction input holds {} positions, its shape needs {}",
                in.positions.size(), needed);
  PAGODA_ASSERT(in.totals.empty() || in.totals.size() == n_slots * n_rows,
                "accumulated attention holds {} values for {} slots x {} rows", in.totals.size(), n_slots, n_rows);
}

int live_count(const eviction_input& in, int r) {
  const std::int32_t* p = in.row_positions(r);
  const std::int32_t* first_live = std::partition_point(p, p + in.n_slots, [](std::int32_t x) { return x < 0; });
  return static_cast<int>(p + in.n_slots - first_live);
}

void live_slots(const eviction_input& in, int r, row_slots& out) {
  out.clear();
  const std::int32_t* p = in.row_positions(r);
  for (std::int32_t s = 0; s < in.n_slots; ++s) {
    if (p[s] < 0) continue;
    out.slot.push_back(s);
    out.pos.push_back(p[s]);
  }
  if (std::is_sorted(out.pos.begin(), out.pos.end())) return;  // the usual case: slots in position order
  std::vector<int> order(out.slot.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return out.pos[a] < out.pos[b]; });
  row_slots sorted;
  for (const int i : order) {
    sorted.slot.push_back(out.slot[static_cast<std::size_t>(i)]);
    sorted.pos.push_back(out.pos[static_cast<std::size_t>(i)]);
  }
  out = std::move(sorted);
}

namespace {

// Best first: higher score, then the newer position (positions are unique
// within a row, so this is a strict order). NaN ranks as -infinity.
struct better_score {
  std::span<const float> scores;
  std::span<const std::int32_t> pos;
  float key(int i) const {
    const float s = scores[static_cast<std::size_t>(i)];
    return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s;
  }
  bool operator()(int a, int b) const {
    const float ka = key(a);
    const float kb = key(b);
    if (ka != kb) return ka > kb;
    return pos[static_cast<std::size_t>(a)] > pos[static_cast<std::size_t>(b)];
  }
};

}  // namespace

void top_scores(std::span<const float> scores, std::span<const std::int32_t> pos, int n, std::vector<int>& out) {
  PAGODA_ASSERT(scores.size() == pos.size(), "{} scores for {} positions", scores.size(), pos.size());
  out.resize(scores.size());
  std::iota(out.begin(), out.end(), 0);
  if (n >= static_cast<int>(out.size())) return;
  if (n <= 0) {
    out.clear();
    return;
  }
  std::nth_element(out.begin(), out.begin() + (n - 1), out.end(), better_score{scores, pos});
  out.resize(static_cast<std::size_t>(n));
}

void sort_best_first(std::span<const float> scores, std::span<const std::int32_t> pos, std::vector<int>& order) {
  std::sort(order.begin(), order.end(), better_score{scores, pos});
}

bool frees_enough(act_when mode, int n_slots, int width, int slack_slots) {
  switch (mode) {
    case act_when::never: return false;
    case act_when::now: return n_slots - width >= 1;
    case act_when::slack: return n_slots - width >= std::max(1, slack_slots);
  }
  return false;
}

std::vector<std::int32_t>& decision_builder::anchors(int r) {
  if (anchors_.empty()) anchors_.resize(rows_.size());
  return anchors_[static_cast<std::size_t>(r)];
}

eviction_decision decision_builder::finish(std::span<const int> live, kv_fold fold) {
  PAGODA_ASSERT(live.size() == rows_.size(), "{} live counts for {} rows", live.size(), rows_.size());
  bool any_evicted = false;
  int width = 0;
  for (std::size_t r = 0; r < rows_.size(); ++r) {
    PAGODA_ASSERT(static_cast<int>(rows_[r].size()) <= live[r], "row {} keeps {} of {} live slots", r,
                  rows_[r].size(), live[r]);
    any_evicted |= static_cast<int>(rows_[r].size()) < live[r];
    width = std::max(width, static_cast<int>(rows_[r].size()));
  }
  if (!any_evicted) return {};
  eviction_decision d;
  d.n_rows = static_cast<int>(rows_.size());
  d.width = width;
  d.keep.assign(rows_.size() * static_cast<std::size_t>(width), -1);
  d.count.resize(rows_.size());
  for (std::size_t r = 0; r < rows_.size(); ++r) {
    std::vector<std::int32_t>& row = rows_[r];
    std::sort(row.begin(), row.end());
    PAGODA_ASSERT(std::adjacent_find(row.begin(), row.end()) == row.end(), "row {} keeps a slot twice", r);
    std::copy(row.begin(), row.end(), d.keep.begin() + static_cast<std::ptrdiff_t>(r * width));
    d.count[r] = static_cast<std::int32_t>(row.size());
  }
  d.fold = fold;
  if (fold != kv_fold::cluster) return d;
  d.anchors_per_row = anchors_.empty() ? 0 : static_cast<int>(anchors_[0].size());
  if (d.anchors_per_row == 0) {
    d.fold = kv_fold::drop;  // nothing to cluster into: the evicted tokens are dropped
    return d;
  }
  for (std::size_t r = 0; r < anchors_.size(); ++r) {
    std::vector<std::int32_t>& a = anchors_[r];
    PAGODA_ASSERT(static_cast<int>(a.size()) == d.anchors_per_row, "row {} has {} anchors, row 0 has {}", r,
                  a.size(), d.anchors_per_row);
    std::sort(a.begin(), a.end());
    for (const std::int32_t s : a) {
      PAGODA_ASSERT(std::binary_search(rows_[r].begin(), rows_[r].end(), s), "row {}: anchor {} is not kept", r, s);
    }
    d.anchors.insert(d.anchors.end(), a.begin(), a.end());
  }
  return d;
}

void choose_row(const row_scorer& scorer, const eviction_input& in, int r, int target, int n_anchors,
                row_choice& work, std::vector<std::int32_t>& keep, std::vector<std::int32_t>* anchors) {
  live_slots(in, r, work.live);
  const int n = work.live.size();
  const int t = std::min(target, n);
  if (t <= 0) return;
  const int n_protected = std::clamp(scorer.protected_newest(in, t), 0, t);
  const int m = n - n_protected;
  keep.insert(keep.end(), work.live.slot.begin() + m, work.live.slot.end());
  const int n_pick = t - n_protected;
  PAGODA_ASSERT(n_anchors <= std::min(n_pick, m), "row {}: {} anchors from {} chosen slots", r, n_anchors,
                std::min(n_pick, m));
  if (n_pick >= m && n_anchors == 0) {  // every candidate stays: no need to score
    keep.insert(keep.end(), work.live.slot.begin(), work.live.slot.begin() + m);
    return;
  }
  work.cands.slot.assign(work.live.slot.begin(), work.live.slot.begin() + m);
  work.cands.pos.assign(work.live.pos.begin(), work.live.pos.begin() + m);
  work.scores.assign(static_cast<std::size_t>(m), 0.0f);
  scorer.score(in, r, work.cands, work.scores);
  top_scores(work.scores, work.cands.pos, n_pick, work.picked);
  for (const int i : work.picked) keep.push_back(work.cands.slot[static_cast<std::size_t>(i)]);
  if (n_anchors == 0) return;
  sort_best_first(work.scores, work.cands.pos, work.picked);
  for (std::size_t i = work.picked.size() - static_cast<std::size_t>(n_anchors); i < work.picked.size(); ++i) {
    anchors->push_back(work.cands.slot[static_cast<std::size_t>(work.picked[i])]);
  }
}

eviction_decision eviction_policy::evict(const eviction_input& in) {
  check_input(in);
  const act_when mode = when(in);
  if (mode == act_when::never || in.n_slots == 0) return {};
  std::vector<int> floor(static_cast<std::size_t>(in.n_rows()));
  min_keep(in, floor);
  int lower_width = 0;
  for (int r = 0; r < in.n_rows(); ++r) {
    lower_width = std::max(lower_width, std::min(live_count(in, r), floor[static_cast<std::size_t>(r)]));
  }
  if (!frees_enough(mode, in.n_slots, lower_width, slack(in))) return {};
  eviction_decision d = decide(in);
  if (d.empty() || !frees_enough(mode, in.n_slots, d.width, slack(in))) return {};
  return d;
}

}  // namespace pagoda::policy_detail
