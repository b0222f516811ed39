// What the eviction policies share (eviction_internal.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
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

// A candidate's rank as one integer: its score's order-preserving bits above
// its index. Candidates are oldest first, so among equal scores the higher
// index, the newer token, ranks higher; comparing integers is what makes
// selecting among a long row's candidates cheap.
std::uint64_t rank_bits(float score, int index) {
  float f = rank_key(score);
  if (f == 0) f = 0;  // -0 ties +0
  std::uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  u = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
  return (std::uint64_t{u} << 32) | static_cast<std::uint32_t>(index);
}

// Scratch for the keys (one per thread: policies of different sequences may
// run side by side).
std::vector<std::uint64_t>& rank_scratch() {
  thread_local std::vector<std::uint64_t> keys;
  return keys;
}

}  // namespace

void partition_best(std::span<const float> scores, int n, std::vector<int>& order) {
  std::vector<std::uint64_t>& keys = rank_scratch();
  keys.resize(scores.size());
  for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = rank_bits(scores[i], static_cast<int>(i));
  if (n > 0 && n < static_cast<int>(keys.size())) {
    std::nth_element(keys.begin(), keys.begin() + (n - 1), keys.end(), std::greater<>());
  }
  order.resize(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) order[i] = static_cast<int>(keys[i] & 0xffffffffu);
}

void top_scores(std::span<const float> scores, int n, std::vector<int>& out) {
  partition_best(scores, n, out);
  out.resize(std::min(out.size(), static_cast<std::size_t>(std::max(n, 0))));
}

void sort_best_first(std::span<const float> scores, std::vector<int>& order) {
  std::vector<std::uint64_t>& keys = rank_scratch();
  keys.resize(order.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys[i] = rank_bits(scores[static_cast<std::size_t>(order[i])], order[i]);
  }
  std::sort(keys.begin(), keys.end(), std::greater<>());
  for (std::size_t i = 0; i < keys.size(); ++i) order[i] = static_cast<int>(keys[i] & 0xffffffffu);
}

bool worth_evicting(act_when mode, long long evicted, int n_rows, int slack_slots) {
  switch (mode) {
    case act_when::never: return false;
    case act_when::now: return evicted >= 1;
    case act_when::slack:
      return slack_slots <= 0 ? evicted >= 1 : evicted >= static_cast<long long>(slack_slots) * n_rows;
  }
  return false;
}

long long n_evicted(std::span<const int> live, std::span<const int> keep) {
  long long n = 0;
  for (std::size_t r = 0; r < live.size(); ++r) n += live[r] - std::min(live[r], keep[r]);
  return n;
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
    if (!std::is_sorted(row.begin(), row.end())) std::sort(row.begin(), row.end());
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
  const int n_pick = t - n_protected;
  PAGODA_ASSERT(n_anchors <= std::min(n_pick, m), "row {}: {} anchors from {} chosen slots", r, n_anchors,
                std::min(n_pick, m));
  const auto newest = work.live.slot.begin() + m;
  if (n_pick >= m && n_anchors == 0) {  // every candidate stays: no need to score
    keep.insert(keep.end(), work.live.slot.begin(), work.live.slot.end());
    return;
  }
  work.cands.slot.assign(work.live.slot.begin(), newest);
  work.cands.pos.assign(work.live.pos.begin(), work.live.pos.begin() + m);
  work.scores.assign(static_cast<std::size_t>(m), 0.0f);
  scorer.score(in, r, work.cands, work.scores);
  top_scores(work.scores, n_pick, work.picked);
  // Oldest first, then the protected newest: in slot order when slots are in
  // position order (the usual case), which spares finish() a sort.
  work.chosen.assign(static_cast<std::size_t>(m), 0);
  for (const int i : work.picked) work.chosen[static_cast<std::size_t>(i)] = 1;
  for (int i = 0; i < m; ++i) {
    if (work.chosen[static_cast<std::size_t>(i)] != 0) keep.push_back(work.cands.slot[static_cast<std::size_t>(i)]);
  }
  keep.insert(keep.end(), newest, work.live.slot.end());
  if (n_anchors == 0) return;
  sort_best_first(work.scores, work.picked);
  for (std::size_t i = work.picked.size() - static_cast<std::size_t>(n_anchors); i < work.picked.size(); ++i) {
    anchors->push_back(work.cands.slot[static_cast<std::size_t>(work.picked[i])]);
  }
}

eviction_decision eviction_policy::evict(const eviction_input& in) {
  check_input(in);
  const act_when mode = when(in);
  if (mode == act_when::never || in.n_slots == 0) return {};
  const auto n_rows = static_cast<std::size_t>(in.n_rows());
  std::vector<int> live(n_rows);
  for (std::size_t r = 0; r < n_rows; ++r) live[r] = live_count(in, static_cast<int>(r));
  std::vector<int> keep(n_rows);
  min_keep(in, live, keep);
  if (!worth_evicting(mode, n_evicted(live, keep), in.n_rows(), slack())) return {};
  eviction_decision d = decide(in);
  if (d.empty() || !worth_evicting(mode, n_evicted(live, d.count), in.n_rows(), slack())) return {};
  return d;
}

status read_eviction_common(param_reader& params, eviction_common& out) {
  PAGODA_ASSIGN_OR_RETURN(out.slack, params.integer("slack", 0, 0, 1 << 24));
  PAGODA_ASSIGN_OR_RETURN(out.chunk, params.integer("chunk", -1, 0, 1 << 24));
  return ok_status();
}

prompt_chunking eviction_policy::prompt_chunks(int n_prompt, int block_size) const {
  if (common_.chunk == 0 || n_prompt <= 0) return {};
  const int kept = kept_at(n_prompt);
  const int bs = std::max(block_size, 1);
  prompt_chunking c;
  c.min_last = observation_rows();
  // The default: the budget, at most k_default_prompt_chunk, in whole blocks;
  // either way at least the observation window, so that it fits the last chunk.
  const int wanted = common_.chunk > 0 ? common_.chunk : std::min(kept, k_default_prompt_chunk);
  c.chunk = std::max(wanted, c.min_last);
  if (common_.chunk < 0) {
    // An observation window choosing after a chunk whose budget is no more
    // than the window keeps only the window's own tokens (the first ones,
    // which attention leans on, go): the default chunk keeps at least twice
    // the window by its end (stories260K, SnapKV at 25%: chunks of 64 had 3.6x
    // the KL of the prompt computed whole, chunks of 128 1.08x).
    c.chunk = std::max(bs, (c.chunk + bs - 1) / bs * bs);
    while (c.min_last > 0 && c.chunk < k_default_prompt_chunk && kept_at(c.chunk) < 2 * c.min_last) c.chunk += bs;
  }
  // A prompt that fits the budget and one chunk peaks no higher computed whole.
  if (n_prompt <= kept + c.chunk) return {};
  return c;
}

}  // namespace pagoda::policy_detail
