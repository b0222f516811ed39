// Per-segment policies (kv_policy.h, make_segmented_policy): each row's live
// slots are split by position into parts (each segment, and the rest, which
// follows the base policy); each part's policy decides on a sub-input holding
// only its slots, and the kept slots are merged back.
//
// A part's sub-input: its live slots in slot order, renumbered 0..m_r - 1 per
// row and padded in front with dead slots up to the widest row's m; the
// totals and the observation window sliced to them; n_seen, n_prompt and
// n_new counted within the part (so budgets are relative to the part's
// length); positions unchanged (they only order tokens).
#include <algorithm>

#include "core/assert.h"
#include "policy/eviction_internal.h"

namespace pagoda {
namespace policy_detail {
namespace {

struct part {
  std::int32_t begin = 0;  // positions [begin, end); the base part has begin = end = -1
  std::int32_t end = 0;
  std::unique_ptr<kv_policy> owned;
  eviction_policy* policy = nullptr;  // nullptr: keeps everything
  bool is_base() const { return begin < 0; }
};

// One part's view of the input, rebuilt per call.
struct part_input {
  eviction_input in;
  std::vector<std::int32_t> positions;  // [n_rows][n_slots]
  std::vector<std::int32_t> slot_of;    // [n_rows][n_slots]: the slot in the whole row, -1 where dead
  std::vector<int> live;                // [n_rows]
  std::vector<float> totals;
  attention_stats window;
  act_when mode = act_when::never;
};

class segmented_policy final : public kv_policy {
 public:
  segmented_policy(kv_policy_spec base_spec, std::vector<part> parts, int slack_param)
      : spec_(std::move(base_spec)), parts_(std::move(parts)), slack_param_(slack_param) {}

  const kv_policy_spec& spec() const override { return spec_; }
  kv_policy_needs needs() const override;
  bool lossy() const override;
  eviction_decision evict(const eviction_input& in) override;
  std::unique_ptr<kv_read_selector> make_selector(int n_layers, int n_kv_heads, int head_dim) override {
    return parts_.back().owned ? parts_.back().owned->make_selector(n_layers, n_kv_heads, head_dim) : nullptr;
  }

 private:
  bool in_part(const part& p, std::int32_t pos) const;
  void build_positions(const eviction_input& in, const part& p, part_input& out) const;
  void build_statistics(const eviction_input& in, part_input& out) const;
  void merge_part(const part_input& sub, const eviction_decision& d, decision_builder& out) const;

  kv_policy_spec spec_;
  std::vector<part> parts_;  // the segments in order, then the base
  int slack_param_ = -1;
  std::vector<part_input> work_;
};

kv_policy_needs segmented_policy::needs() const {
  kv_policy_needs all;
  for (const part& p : parts_) {
    if (!p.owned) continue;
    const kv_policy_needs n = p.owned->needs();
    all.totals |= n.totals;
    all.window_rows = std::max(all.window_rows, n.window_rows);
    all.key_summaries |= n.key_summaries;
  }
  return all;
}

bool segmented_policy::lossy() const {
  return std::any_of(parts_.begin(), parts_.end(), [](const part& p) { return p.owned && p.owned->lossy(); });
}

bool segmented_policy::in_part(const part& p, std::int32_t pos) const {
  if (!p.is_base()) return pos >= p.begin && pos < p.end;
  for (std::size_t i = 0; i + 1 < parts_.size(); ++i) {
    if (pos >= parts_[i].begin && pos < parts_[i].end) return false;
  }
  return true;
}

// The part's slots and counts (what the slack check needs); statistics later,
// only when the policy acts.
void segmented_policy::build_positions(const eviction_input& in, const part& p, part_input& out) const {
  const int n_rows = in.n_rows();
  out.live.assign(static_cast<std::size_t>(n_rows), 0);
  int width = 0;
  for (int r = 0; r < n_rows; ++r) {
    const std::int32_t* pos = in.row_positions(r);
    int n = 0;
    for (int s = 0; s < in.n_slots; ++s) n += pos[s] >= 0 && in_part(p, pos[s]);
    out.live[static_cast<std::size_t>(r)] = n;
    width = std::max(width, n);
  }
  out.positions.assign(static_cast<std::size_t>(n_rows) * width, -1);
  out.slot_of.assign(static_cast<std::size_t>(n_rows) * width, -1);
  for (int r = 0; r < n_rows; ++r) {
    const std::int32_t* pos = in.row_positions(r);
    std::size_t at = static_cast<std::size_t>(r) * width + static_cast<std::size_t>(width - out.live[r]);
    for (int s = 0; s < in.n_slots; ++s) {
      if (pos[s] < 0 || !in_part(p, pos[s])) continue;
      out.positions[at] = pos[s];
      out.slot_of[at++] = s;
    }
  }
  // Counts within the part: tokens seen, prompt tokens, the last step's.
  const auto within = [&](std::int32_t lo, std::int32_t hi) {  // positions [lo, hi) in this part
    if (!p.is_base()) return std::max(0, std::min(hi, p.end) - std::max(lo, p.begin));
    int n = std::max(0, hi - lo);
    for (std::size_t i = 0; i + 1 < parts_.size(); ++i) {
      n -= std::max(0, std::min(hi, parts_[i].end) - std::max(lo, parts_[i].begin));
    }
    return n;
  };
  eviction_input& sub = out.in;
  sub = in;
  sub.n_slots = width;
  sub.n_seen = within(0, in.n_seen);
  sub.n_prompt = within(0, in.n_prompt);
  sub.n_new = within(in.n_seen - in.n_new, in.n_seen);
  sub.positions = out.positions;
  sub.row_stride = static_cast<std::size_t>(width);
  sub.totals = {};
  sub.window = nullptr;
  sub.segments = {};
  out.mode = p.policy == nullptr || sub.n_seen <= 0 || width == 0 ? act_when::never : p.policy->when(sub);
}

void segmented_policy::build_statistics(const eviction_input& in, part_input& out) const {
  const int n_rows = in.n_rows();
  const std::size_t width = static_cast<std::size_t>(out.in.n_slots);
  if (!in.totals.empty()) {
    out.totals.assign(static_cast<std::size_t>(n_rows) * width, 0.0f);
    for (int r = 0; r < n_rows; ++r) {
      for (std::size_t s = 0; s < width; ++s) {
        const std::int32_t from = out.slot_of[static_cast<std::size_t>(r) * width + s];
        if (from < 0) continue;
        out.totals[s * static_cast<std::size_t>(n_rows) + static_cast<std::size_t>(r)] =
            in.totals[static_cast<std::size_t>(from) * static_cast<std::size_t>(n_rows) + static_cast<std::size_t>(r)];
      }
    }
    out.in.totals = out.totals;
  }
  if (in.window != nullptr && in.window->n_window > 0 && in.window->n_kv == in.n_slots) {
    const attention_stats& w = *in.window;
    out.window.reset(in.n_layers, in.n_kv_heads, static_cast<int>(width), w.n_window);
    for (int r = 0; r < n_rows; ++r) {
      for (int q = 0; q < w.n_window; ++q) {
        const float* src = w.window.data() + (static_cast<std::size_t>(r) * w.n_window + q) * w.n_kv;
        float* dst = out.window.window.data() + (static_cast<std::size_t>(r) * w.n_window + q) * width;
        for (std::size_t s = 0; s < width; ++s) {
          const std::int32_t from = out.slot_of[static_cast<std::size_t>(r) * width + s];
          if (from >= 0) dst[s] = src[from];
        }
      }
    }
    out.in.window = &out.window;
  }
}

void segmented_policy::merge_part(const part_input& sub, const eviction_decision& d, decision_builder& out) const {
  const std::size_t width = static_cast<std::size_t>(sub.in.n_slots);
  for (int r = 0; r < sub.in.n_rows(); ++r) {
    const std::int32_t* slot_of = sub.slot_of.data() + static_cast<std::size_t>(r) * width;
    std::vector<std::int32_t>& keep = out.row(r);
    if (d.empty()) {  // keeps all its live slots
      for (std::size_t s = 0; s < width; ++s) {
        if (slot_of[s] >= 0) keep.push_back(slot_of[s]);
      }
      continue;
    }
    for (const std::int32_t s : d.row(r)) keep.push_back(slot_of[s]);
    for (int a = 0; a < d.anchors_per_row; ++a) {
      out.anchors(r).push_back(slot_of[d.anchors[static_cast<std::size_t>(r) * d.anchors_per_row + a]]);
    }
  }
}

eviction_decision segmented_policy::evict(const eviction_input& in) {
  check_input(in);
  const int n_rows = in.n_rows();
  work_.resize(parts_.size());
  act_when mode = act_when::never;
  std::vector<int> lower(static_cast<std::size_t>(n_rows), 0);  // per row: the fewest slots it keeps
  std::vector<int> floor(static_cast<std::size_t>(n_rows));
  for (std::size_t i = 0; i < parts_.size(); ++i) {
    part_input& sub = work_[i];
    build_positions(in, parts_[i], sub);
    if (sub.mode != act_when::never) {
      parts_[i].policy->min_keep(sub.in, floor);
      mode = std::max(mode, sub.mode);
    }
    for (int r = 0; r < n_rows; ++r) {
      const auto ri = static_cast<std::size_t>(r);
      lower[ri] += sub.mode == act_when::never ? sub.live[ri] : std::min(sub.live[ri], floor[ri]);
    }
  }
  const int slack = slack_param_ >= 0 ? slack_param_ : in.block_size;
  if (!frees_enough(mode, in.n_slots, *std::max_element(lower.begin(), lower.end()), slack)) return {};

  decision_builder out(n_rows);
  kv_fold fold = kv_fold::drop;
  for (std::size_t i = 0; i < parts_.size(); ++i) {
    part_input& sub = work_[i];
    eviction_decision d;
    if (sub.mode != act_when::never) {
      build_statistics(in, sub);
      d = parts_[i].policy->decide(sub.in);
    }
    // Evicting parts share one fold (checked at construction), but a cluster
    // part that found no anchors this time reports drop: the strongest wins.
    if (!d.empty()) fold = std::max(fold, d.fold);
    merge_part(sub, d, out);
  }
  std::vector<int> live(static_cast<std::size_t>(n_rows));
  for (int r = 0; r < n_rows; ++r) live[static_cast<std::size_t>(r)] = live_count(in, r);
  eviction_decision d = out.finish(live, fold);
  if (d.empty() || !frees_enough(mode, in.n_slots, d.width, slack)) return {};
  return d;
}

// A part's policy: nullptr for "none"; an error for what cannot be composed.
result<std::unique_ptr<kv_policy>> part_policy(const kv_policy_spec& spec, std::string_view where) {
  if (spec.is_none() && spec.params.empty()) return std::unique_ptr<kv_policy>();
  result<std::unique_ptr<kv_policy>> made = make_kv_policy(spec);
  if (!made.ok()) return made.error().with_context(where);
  const auto* ev = dynamic_cast<const eviction_policy*>(made->get());
  if (ev != nullptr && ev->repositions()) {
    return error(errc::invalid_argument, "{}: {}: positions=cache cannot be combined with segments", where,
                 spec.to_string());
  }
  return made;
}

}  // namespace
}  // namespace policy_detail

result<std::unique_ptr<kv_policy>> make_segmented_policy(const kv_policy_spec& base,
                                                         std::span<const kv_segment> segments) {
  using namespace policy_detail;
  if (segments.empty()) return make_kv_policy(base);
  std::vector<part> parts;
  std::string fold_owner;  // the first evicting part, for the fold message
  kv_fold fold = kv_fold::drop;
  for (std::size_t i = 0; i <= segments.size(); ++i) {
    part p;
    std::string where = "the base policy";
    const kv_policy_spec* spec = &base;
    if (i < segments.size()) {
      const kv_segment& s = segments[i];
      where = fmt::format("segment [{}, {})", s.begin, s.end);
      if (s.begin < 0 || s.end <= s.begin) return error(errc::invalid_argument, "{}: empty or negative", where);
      if (i > 0 && s.begin < segments[i - 1].end) {
        return error(errc::invalid_argument, "{}: segments must be sorted and disjoint (the one before ends at {})",
                     where, segments[i - 1].end);
      }
      p.begin = s.begin;
      p.end = s.end;
      spec = &s.policy;
    } else {
      p.begin = p.end = -1;
    }
    PAGODA_ASSIGN_OR_RETURN(p.owned, part_policy(*spec, where));
    p.policy = dynamic_cast<eviction_policy*>(p.owned.get());
    if (p.owned && p.policy == nullptr && !p.is_base()) {
      return error(errc::invalid_argument, "{}: policy '{}' does not evict; only eviction policies apply per segment",
                   where, spec->name);
    }
    if (p.policy != nullptr) {
      if (fold_owner.empty()) {
        fold_owner = fmt::format("{} ({})", where, spec->to_string());
        fold = p.policy->fold();
      } else if (p.policy->fold() != fold) {
        return error(errc::invalid_argument,
                     "{} ({}) folds evicted tokens differently from {}: one decision has one kv_fold (use merge, "
                     "cluster or a dropping policy throughout)",
                     where, spec->to_string(), fold_owner);
      }
    }
    parts.push_back(std::move(p));
  }
  const auto* base_policy = parts.back().policy;
  const int slack = base_policy != nullptr ? base_policy->slack_param() : -1;
  return std::unique_ptr<kv_policy>(std::make_unique<segmented_policy>(base, std::move(parts), slack));
}

}  // namespace pagoda
