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
  segmented_policy(kv_policy_spec base_spec, std::vector<part> parts, int slack)
      : spec_(std::move(base_spec)), parts_(std::move(parts)), slack_(slack), work_(parts_.size()) {}

  const kv_policy_spec& spec() const override { return spec_; }
  kv_policy_needs needs() const override;
  bool lossy() const override;
  eviction_decision evict(const eviction_input& in) override;
  prompt_chunking prompt_chunks(int n_prompt, int block_size) const override;
  std::unique_ptr<kv_read_selector> make_selector(int n_layers, int n_kv_heads, int head_dim) override {
    return parts_.back().owned ? parts_.back().owned->make_selector(n_layers, n_kv_heads, head_dim) : nullptr;
  }

 private:
  std::size_t part_of(std::int32_t pos) const;
  void count_parts(const eviction_input& in);
  void describe_part(const eviction_input& in, std::size_t i);
  void build_positions(const eviction_input& in);
  void build_statistics(const eviction_input& in, part_input& out) const;
  void merge_part(const part_input& sub, const eviction_decision& d, decision_builder& out) const;

  kv_policy_spec spec_;
  std::vector<part> parts_;  // the segments in order, then the base
  int slack_ = 0;
  std::vector<part_input> work_;  // per part
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

// The part a position belongs to: a segment's index, or the base (last).
std::size_t segmented_policy::part_of(std::int32_t pos) const {
  const std::size_t n_segments = parts_.size() - 1;
  const auto after = std::upper_bound(parts_.begin(), parts_.begin() + static_cast<std::ptrdiff_t>(n_segments), pos,
                                      [](std::int32_t p, const part& s) { return p < s.begin; });
  if (after == parts_.begin()) return n_segments;
  const auto i = static_cast<std::size_t>(after - parts_.begin()) - 1;
  return pos < parts_[i].end ? i : n_segments;
}

// Per row, how many live slots each part holds: binary searches at the
// segments' bounds, as live positions ascend along a row (the engine keeps
// kept slots in order and appends new tokens). This only gates the work:
// were positions out of order, an eviction could come late, but a decision
// is always built from every slot (build_positions).
void segmented_policy::count_parts(const eviction_input& in) {
  const std::size_t base = parts_.size() - 1;
  for (int r = 0; r < in.n_rows(); ++r) {
    const std::int32_t* first = in.row_positions(r);
    const std::int32_t* last = first + in.n_slots;
    first = std::partition_point(first, last, [](std::int32_t x) { return x < 0; });
    int in_segments = 0;
    for (std::size_t i = 0; i < base; ++i) {
      const auto n = static_cast<int>(std::lower_bound(first, last, parts_[i].end) -
                                      std::lower_bound(first, last, parts_[i].begin));
      work_[i].live[static_cast<std::size_t>(r)] = n;
      in_segments += n;
    }
    work_[base].live[static_cast<std::size_t>(r)] = static_cast<int>(last - first) - in_segments;
  }
}

// A part's sub-input without its slots: counts within the part, its width
// (the widest row's live slots) and when its policy would act.
void segmented_policy::describe_part(const eviction_input& in, std::size_t i) {
  const part& p = parts_[i];
  part_input& out = work_[i];
  const auto within = [&](std::int32_t lo, std::int32_t hi) {  // positions [lo, hi) in this part
    if (!p.is_base()) return std::max(0, std::min(hi, p.end) - std::max(lo, p.begin));
    int n = std::max(0, hi - lo);
    for (std::size_t k = 0; k + 1 < parts_.size(); ++k) {
      n -= std::max(0, std::min(hi, parts_[k].end) - std::max(lo, parts_[k].begin));
    }
    return n;
  };
  eviction_input& sub = out.in;
  sub = in;
  sub.n_slots = *std::max_element(out.live.begin(), out.live.end());
  sub.n_seen = within(0, in.n_seen);
  sub.n_prompt = within(0, in.n_prompt);
  sub.n_new = within(in.n_seen - in.n_new, in.n_seen);
  sub.positions = {};
  sub.row_stride = 0;
  sub.totals = {};
  sub.window = nullptr;
  sub.segments = {};
  out.mode = p.policy == nullptr || sub.n_seen <= 0 ? act_when::never : p.policy->when(sub);
}

// Every part's slots, renumbered per row (dead slots in front), from every
// slot of the input; the live counts are recounted exactly.
void segmented_policy::build_positions(const eviction_input& in) {
  const int n_rows = in.n_rows();
  for (part_input& w : work_) std::fill(w.live.begin(), w.live.end(), 0);
  for (int r = 0; r < n_rows; ++r) {
    const std::int32_t* pos = in.row_positions(r);
    for (int s = 0; s < in.n_slots; ++s) {
      if (pos[s] >= 0) ++work_[part_of(pos[s])].live[static_cast<std::size_t>(r)];
    }
  }
  std::vector<std::size_t> at(work_.size());
  for (part_input& w : work_) {
    const int width = *std::max_element(w.live.begin(), w.live.end());
    w.in.n_slots = width;
    w.positions.assign(static_cast<std::size_t>(n_rows) * width, -1);
    w.slot_of.assign(static_cast<std::size_t>(n_rows) * width, -1);
    w.in.positions = w.positions;
    w.in.row_stride = static_cast<std::size_t>(width);
  }
  for (int r = 0; r < n_rows; ++r) {
    for (std::size_t i = 0; i < work_.size(); ++i) {
      const part_input& w = work_[i];
      at[i] = static_cast<std::size_t>(r) * w.in.n_slots + static_cast<std::size_t>(w.in.n_slots - w.live[r]);
    }
    const std::int32_t* pos = in.row_positions(r);
    for (int s = 0; s < in.n_slots; ++s) {
      if (pos[s] < 0) continue;
      const std::size_t i = part_of(pos[s]);
      work_[i].positions[at[i]] = pos[s];
      work_[i].slot_of[at[i]++] = s;
    }
  }
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
  const auto n_rows = static_cast<std::size_t>(in.n_rows());
  for (part_input& w : work_) w.live.assign(n_rows, 0);
  count_parts(in);
  act_when mode = act_when::never;
  std::vector<int> lower(n_rows, 0);  // per row: what it keeps, as known before scoring
  std::vector<int> floor(n_rows);
  for (std::size_t i = 0; i < parts_.size(); ++i) {
    describe_part(in, i);
    const part_input& sub = work_[i];
    if (sub.mode != act_when::never) {
      parts_[i].policy->min_keep(sub.in, sub.live, floor);
      mode = std::max(mode, sub.mode);
    }
    for (std::size_t r = 0; r < n_rows; ++r) {
      lower[r] += sub.mode == act_when::never ? sub.live[r] : std::min(sub.live[r], floor[r]);
    }
  }
  std::vector<int> live(n_rows);
  for (std::size_t r = 0; r < n_rows; ++r) live[r] = live_count(in, static_cast<int>(r));
  const int slack = slack_;
  if (!worth_evicting(mode, n_evicted(live, lower), in.n_rows(), slack)) return {};

  build_positions(in);
  decision_builder out(static_cast<int>(n_rows));
  kv_fold fold = kv_fold::drop;
  for (std::size_t i = 0; i < parts_.size(); ++i) {
    part_input& sub = work_[i];
    eviction_decision d;
    if (sub.mode != act_when::never && sub.in.n_slots > 0) {
      build_statistics(in, sub);
      d = parts_[i].policy->decide(sub.in);
    }
    // Evicting parts share one fold (checked at construction), but a cluster
    // part that found no anchors this time reports drop: the strongest wins.
    if (!d.empty()) fold = std::max(fold, d.fold);
    merge_part(sub, d, out);
  }
  eviction_decision d = out.finish(live, fold);
  if (d.empty() || !worth_evicting(mode, n_evicted(live, d.count), in.n_rows(), slack)) return {};
  return d;
}

// Each evicting part sizes chunks from its own length within the prompt (its
// budget is relative to it); the prompt takes the smallest chunk any part
// asks for, and the largest last chunk.
prompt_chunking segmented_policy::prompt_chunks(int n_prompt, int block_size) const {
  prompt_chunking all;
  int in_segments = 0;
  for (const part& p : parts_) {
    const int length = p.is_base() ? n_prompt - in_segments : std::max(0, std::min(p.end, n_prompt) - p.begin);
    if (!p.is_base()) in_segments += length;
    if (p.policy == nullptr) continue;
    const prompt_chunking c = p.policy->prompt_chunks(length, block_size);
    if (c.chunk <= 0) continue;
    all.chunk = all.chunk > 0 ? std::min(all.chunk, c.chunk) : c.chunk;
    all.min_last = std::max(all.min_last, c.min_last);
  }
  if (all.chunk > 0) all.chunk = std::max(all.chunk, all.min_last);
  return all;
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
  const int slack = base_policy != nullptr ? base_policy->slack() : 0;
  return std::unique_ptr<kv_policy>(std::make_unique<segmented_policy>(base, std::move(parts), slack));
}

}  // namespace pagoda
