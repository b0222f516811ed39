#include "sched/seq_policy.h"

#include <algorithm>

#include "core/assert.h"

namespace pagoda {

seq_policy::seq_policy(std::unique_ptr<kv_policy> policy, const seq_policy_shape& shape, int stats_window)
    : policy_(std::move(policy)), shape_(shape), stats_window_(stats_window) {
  if (policy_) {
    needs_ = policy_->needs();
    if (needs_.totals) stats_window_ = std::max(stats_window_, 0);
    stats_window_ = std::max(stats_window_, needs_.window_rows);
  }
  if (stats_window_ >= 0) needs_.totals = true;  // statistics asked for by the engine are kept too
}

void seq_policy::reset() {
  n_slots_ = 0;
  per_row_ = false;
  rows_.clear();
  stride_ = 0;
  totals_.clear();
  ring_.clear();
  window_fresh_ = false;
  slot_changes_.clear();
  rows_changed_ = false;
}

std::unique_ptr<seq_policy> seq_policy::fork(const policy_factory& make) const {
  std::unique_ptr<kv_policy> p;
  if (policy_) {
    auto made = make(policy_->spec());
    PAGODA_ASSERT(made.ok(), "policy {} cannot be made again: {}", policy_->spec().name, made.error().message());
    p = std::move(*made);
  }
  auto c = std::make_unique<seq_policy>(std::move(p), shape_, stats_window_);
  c->n_slots_ = n_slots_;
  c->per_row_ = per_row_;
  c->rows_ = rows_;
  c->stride_ = stride_;
  c->totals_ = totals_;
  c->ring_ = ring_;
  return c;
}

// --- steps -----------------------------------------------------------------------

void seq_policy::plan(std::span<const std::int32_t> positions) {
  if (!per_row_) return;
  const std::size_t need = static_cast<std::size_t>(n_slots_) + positions.size();
  if (need > stride_) {
    const std::size_t stride = std::max(need, stride_ * 2);
    std::vector<std::int32_t> rows(static_cast<std::size_t>(shape_.n_rows()) * stride);
    for (int r = 0; r < shape_.n_rows(); ++r)
      std::copy_n(rows_.begin() + static_cast<std::ptrdiff_t>(r * stride_), n_slots_,
                  rows.begin() + static_cast<std::ptrdiff_t>(r * stride));
    rows_ = std::move(rows);
    stride_ = stride;
  }
  for (int r = 0; r < shape_.n_rows(); ++r)
    std::copy(positions.begin(), positions.end(), rows_.begin() + static_cast<std::ptrdiff_t>(r * stride_ + n_slots_));
}

void seq_policy::commit(int n_new, attention_stats* a) {
  n_slots_ += n_new;
  window_fresh_ = false;
  if (!a || a->n_kv == 0) return;
  if (shape_.n_layers == 0 && !per_row_) {  // statistics only, shape not told: the runner's is the model's
    shape_.n_layers = a->n_layers;
    shape_.n_kv_heads = a->n_kv_heads;
  }
  PAGODA_ASSERT(a->n_kv == n_slots_ && a->n_layers == shape_.n_layers && a->n_kv_heads == shape_.n_kv_heads,
                "statistics of {} slots for a sequence of {}", a->n_kv, n_slots_);
  const int R = shape_.n_rows();
  if (needs_.totals) {
    totals_.resize(static_cast<std::size_t>(n_slots_) * R, 0.0f);
    for (int r = 0; r < R; ++r) {
      const float* w = a->accumulated_at(r / shape_.n_kv_heads, r % shape_.n_kv_heads);
      for (int slot = 0; slot < n_slots_; ++slot) totals_[static_cast<std::size_t>(slot) * R + r] += w[slot];
    }
  }
  for (int q = 0; q < a->n_window && stats_window_ > 0; ++q) {
    query_row row;
    row.n_kv = a->n_kv;
    row.w.resize(static_cast<std::size_t>(R) * row.n_kv);
    for (int r = 0; r < R; ++r) {
      const float* w = a->window_at(r / shape_.n_kv_heads, r % shape_.n_kv_heads) + static_cast<std::size_t>(q) * a->n_kv;
      std::copy_n(w, row.n_kv, row.w.begin() + static_cast<std::ptrdiff_t>(r) * row.n_kv);
    }
    ring_.push_back(std::move(row));
  }
  if (ring_.size() > static_cast<std::size_t>(std::max(stats_window_, 0)))
    ring_.erase(ring_.begin(), ring_.end() - std::max(stats_window_, 0));
}

const attention_stats* seq_policy::window() const {
  if (ring_.empty()) return nullptr;
  if (window_fresh_) return &window_;
  const int R = shape_.n_rows();
  window_.reset(shape_.n_layers, shape_.n_kv_heads, n_slots_, static_cast<int>(ring_.size()));
  std::vector<float>().swap(window_.accumulated);
  for (std::size_t q = 0; q < ring_.size(); ++q) {
    const query_row& row = ring_[q];
    const int n = std::min(row.n_kv, n_slots_);
    for (int r = 0; r < R; ++r)
      std::copy_n(row.w.begin() + static_cast<std::ptrdiff_t>(r) * row.n_kv, n,
                  window_.window_at(r / shape_.n_kv_heads, r % shape_.n_kv_heads) + q * static_cast<std::size_t>(n_slots_));
  }
  window_fresh_ = true;
  return &window_;
}

std::vector<std::int32_t> seq_policy::stored_rows() const {
  std::vector<std::int32_t> out(static_cast<std::size_t>(shape_.n_rows()) * n_slots_);
  for (int r = 0; r < shape_.n_rows(); ++r)
    std::copy_n(rows_.begin() + static_cast<std::ptrdiff_t>(r * stride_), n_slots_,
                out.begin() + static_cast<std::ptrdiff_t>(r) * n_slots_);
  return out;
}

double seq_policy::mean_live_slots() const {
  if (!per_row_) return n_slots_;
  std::int64_t live = 0;
  for (int r = 0; r < shape_.n_rows(); ++r)
    for (int i = 0; i < n_slots_; ++i) live += rows_[r * stride_ + static_cast<std::size_t>(i)] >= 0;
  return static_cast<double>(live) / shape_.n_rows();
}

// --- decisions ----------------------------------------------------------------------

eviction_input seq_policy::input(const kv_manager& kv, seq_id seq, const seq_policy_context& ctx) const {
  eviction_input in;
  in.n_layers = shape_.n_layers;
  in.n_kv_heads = shape_.n_kv_heads;
  in.block_size = shape_.block_size;
  in.n_slots = n_slots_;
  in.n_seen = ctx.n_seen;
  in.n_prompt = ctx.n_prompt;
  in.n_new = ctx.n_new;
  in.prompt_done_now = ctx.prompt_done_now;
  if (per_row_) {
    in.positions = rows_;
    in.row_stride = stride_;
  } else {
    in.positions = kv.positions(seq);
  }
  if (needs_.totals && !totals_.empty()) in.totals = totals_;
  if (policy_ && policy_->needs().window_rows >= 0) in.window = window();
  return in;
}

void seq_policy::make_per_row(std::span<const std::int32_t> kv_positions) {
  if (per_row_) return;
  stride_ = std::max<std::size_t>(kv_positions.size(), 1);
  rows_.resize(static_cast<std::size_t>(shape_.n_rows()) * stride_);
  for (int r = 0; r < shape_.n_rows(); ++r)
    std::copy(kv_positions.begin(), kv_positions.end(), rows_.begin() + static_cast<std::ptrdiff_t>(r * stride_));
  per_row_ = true;
  rows_changed_ = true;
}

std::optional<kv_compaction> seq_policy::decide(const kv_manager& kv, seq_id seq, const seq_policy_context& ctx) {
  if (!policy_ || !policy_->lossy() || n_slots_ == 0) return std::nullopt;
  PAGODA_ASSERT(n_slots_ == kv.n_stored_tokens(seq), "policy state of {} slots, KV of {}", n_slots_,
                kv.n_stored_tokens(seq));
  const eviction_input in = input(kv, seq, ctx);
  eviction_decision d = policy_->evict(in);
  if (d.empty()) return std::nullopt;
  const int R = shape_.n_rows();
  PAGODA_ASSERT(d.n_rows == R && d.count.size() == static_cast<std::size_t>(R) &&
                    d.keep.size() >= static_cast<std::size_t>(R) * d.width,
                "policy {}: a decision of {} rows for {}", policy_->spec().name, d.n_rows, R);
  int width = 0;
  for (int r = 0; r < R; ++r) {
    const auto row = d.row(r);
    PAGODA_ASSERT(row.size() <= static_cast<std::size_t>(d.width), "policy {}: row {} too long", policy_->spec().name, r);
    for (std::size_t i = 0; i < row.size(); ++i)
      PAGODA_ASSERT(row[i] >= 0 && row[i] < n_slots_ && !in.is_dead(r, row[i]) && (i == 0 || row[i] > row[i - 1]),
                    "policy {}: row {} keeps slot {} (not a live slot in order)", policy_->spec().name, r, row[i]);
    width = std::max(width, static_cast<int>(row.size()));
  }
  if (width == 0) return std::nullopt;  // a policy never empties a sequence
  const bool uniform = d.uniform();
  const bool reposition = d.reposition && uniform && !per_row_;
  const auto kv_pos = kv.positions(seq);
  const auto kv_tokens = kv.tokens(seq);
  if (!uniform) make_per_row(kv_pos);

  // Destination layout: row r's kept slots end the row; dead slots lead it.
  last_width_ = width;
  last_uniform_ = uniform;
  last_sources_.assign(static_cast<std::size_t>(uniform ? 1 : R) * width, -1);
  last_positions_.assign(per_row_ ? static_cast<std::size_t>(R) * width : 0, 0);
  for (int r = 0; r < (uniform ? 1 : R); ++r) {
    const auto row = d.row(r);
    const int dead = width - static_cast<int>(row.size());
    std::copy(row.begin(), row.end(), last_sources_.begin() + static_cast<std::ptrdiff_t>(r) * width + dead);
  }
  if (per_row_)
    for (int r = 0; r < R; ++r) {
      const std::int32_t* src = last_sources_.data() + static_cast<std::size_t>(uniform ? 0 : r) * width;
      const std::int32_t* old = rows_.data() + static_cast<std::size_t>(r) * stride_;
      std::int32_t* pos = last_positions_.data() + static_cast<std::size_t>(r) * width;
      for (int i = 0; i < width; ++i) pos[i] = src[i] >= 0 ? old[src[i]] : i - width;  // dead: -width .. -1
      // Dead slots must keep positions increasing below the first live one.
    }

  // The first slot that changes in any row (folding may rewrite any kept slot).
  int first = 0;
  if (d.fold == kv_fold::drop) {
    first = width;
    for (int r = 0; r < (uniform ? 1 : R); ++r) {
      const std::int32_t* src = last_sources_.data() + static_cast<std::size_t>(r) * width;
      int i = 0;
      while (i < first && src[i] == i && (!reposition || kv_pos[static_cast<std::size_t>(i)] == i)) ++i;
      first = std::min(first, i);
    }
  }

  kv_compaction c;
  c.first = first;
  c.n_slots = width;
  auto g = std::make_shared<kv_gather>();
  g->n_rows = uniform ? 1 : R;
  for (int r = 0; r < g->n_rows; ++r)
    g->sources.insert(g->sources.end(), last_sources_.begin() + static_cast<std::ptrdiff_t>(r) * width + first,
                      last_sources_.begin() + static_cast<std::ptrdiff_t>(r + 1) * width);
  for (int i = first; i < width; ++i) {
    if (reposition) {
      const std::int32_t src = last_sources_[static_cast<std::size_t>(i)];
      c.positions.push_back(i);
      c.tokens.push_back(kv_tokens[static_cast<std::size_t>(src)]);
      g->rotate.push_back(i - kv_pos[static_cast<std::size_t>(src)]);
    } else if (!per_row_) {
      const std::int32_t src = last_sources_[static_cast<std::size_t>(i)];
      c.positions.push_back(kv_pos[static_cast<std::size_t>(src)]);
      c.tokens.push_back(kv_tokens[static_cast<std::size_t>(src)]);
    } else {
      // The KV manager's position of a slot is the largest over the rows
      // (increasing, as every row's is); its token is that row's.
      std::int32_t p = INT32_MIN;
      for (int r = 0; r < R; ++r) p = std::max(p, last_positions_[static_cast<std::size_t>(r) * width + i]);
      c.positions.push_back(p);
      c.tokens.push_back(p >= 0 && p < static_cast<std::int32_t>(ctx.tokens.size()) ? ctx.tokens[static_cast<std::size_t>(p)] : 0);
    }
  }
  if (d.fold != kv_fold::drop) {
    g->fold = d.fold;
    std::vector<std::vector<std::int32_t>> evicted(static_cast<std::size_t>(g->n_rows));
    for (int r = 0; r < g->n_rows; ++r) {
      const auto row = d.row(r);
      for (int slot = 0; slot < n_slots_; ++slot)
        if (!in.is_dead(r, slot) && !std::binary_search(row.begin(), row.end(), slot))
          evicted[static_cast<std::size_t>(r)].push_back(slot);
      g->n_folded = std::max(g->n_folded, static_cast<int>(evicted[static_cast<std::size_t>(r)].size()));
    }
    g->folded.assign(static_cast<std::size_t>(g->n_rows) * g->n_folded, -1);
    for (int r = 0; r < g->n_rows; ++r)
      std::copy(evicted[static_cast<std::size_t>(r)].begin(), evicted[static_cast<std::size_t>(r)].end(),
                g->folded.begin() + static_cast<std::ptrdiff_t>(r) * g->n_folded);
    if (d.fold == kv_fold::cluster) {
      g->anchors_per_row = d.anchors_per_row;
      for (int r = 0; r < g->n_rows; ++r) {
        const auto row = d.row(r);
        const int dead = width - static_cast<int>(row.size());
        for (int a = 0; a < d.anchors_per_row; ++a) {
          const std::int32_t slot = d.anchors[static_cast<std::size_t>(r) * d.anchors_per_row + a];
          const auto at = std::lower_bound(row.begin(), row.end(), slot);
          PAGODA_ASSERT(at != row.end() && *at == slot, "policy {}: anchor {} of row {} is not kept",
                        policy_->spec().name, slot, r);
          g->anchors.push_back(dead + static_cast<std::int32_t>(at - row.begin()));
        }
      }
    }
  }
  c.gather = std::move(g);
  return c;
}

// --- following the slots -------------------------------------------------------------

template <typename Src>
void seq_policy::remap(int n_new_slots, Src src) {
  const int R = shape_.n_rows();
  if (!totals_.empty()) {
    std::vector<float> t(static_cast<std::size_t>(n_new_slots) * R, 0.0f);
    for (int i = 0; i < n_new_slots; ++i)
      for (int r = 0; r < R; ++r)
        if (const std::int32_t s = src(r, i); s >= 0 && s < n_slots_) t[static_cast<std::size_t>(i) * R + r] = totals_[static_cast<std::size_t>(s) * R + r];
    totals_ = std::move(t);
  }
  for (query_row& row : ring_) {
    std::vector<float> w(static_cast<std::size_t>(R) * n_new_slots, 0.0f);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < n_new_slots; ++i)
        if (const std::int32_t s = src(r, i); s >= 0 && s < row.n_kv)
          w[static_cast<std::size_t>(r) * n_new_slots + i] = row.w[static_cast<std::size_t>(r) * row.n_kv + s];
    row.n_kv = n_new_slots;
    row.w = std::move(w);
  }
  window_fresh_ = false;
}

void seq_policy::compacted(const kv_compaction& c) {
  const int width = c.n_slots;
  const int first = c.first;
  auto src = [&](int r, int i) -> std::int32_t {
    if (i < first) return i;
    return last_sources_[static_cast<std::size_t>(last_uniform_ ? 0 : r) * last_width_ + i];
  };
  remap(width, src);
  if (per_row_) {
    stride_ = std::max<std::size_t>(stride_, static_cast<std::size_t>(width));
    std::vector<std::int32_t> rows(static_cast<std::size_t>(shape_.n_rows()) * stride_);
    for (int r = 0; r < shape_.n_rows(); ++r)
      std::copy_n(last_positions_.begin() + static_cast<std::ptrdiff_t>(r) * width, width,
                  rows.begin() + static_cast<std::ptrdiff_t>(r * stride_));
    rows_ = std::move(rows);
  }
  n_slots_ = width;
  rows_changed_ = rows_changed_ || per_row_;
  slot_changes_.push_back({n_slots_, false});
}

void seq_policy::commit_verified(int n_new, int n_step, const attention_stats* a) {
  if (!a || a->n_kv == 0) {
    commit(n_new, nullptr);
  } else {
    PAGODA_ASSERT(a->n_window == n_step && a->n_kv == n_slots_ + n_step,
                  "verification statistics: {} window rows of {} slots for {} rows over {} slots", a->n_window, a->n_kv,
                  n_step, n_slots_);
    attention_stats one;
    for (int j = 0; j < n_new; ++j) {
      const int n_kv = n_slots_ + 1;
      one.reset(a->n_layers, a->n_kv_heads, n_kv, stats_window_ > 0 ? 1 : 0);
      for (int l = 0; l < a->n_layers; ++l)
        for (int h = 0; h < a->n_kv_heads; ++h) {
          const float* w = a->window.data() +
                           ((static_cast<std::size_t>(l) * a->n_kv_heads + h) * a->n_window + j) * a->n_kv;
          std::copy_n(w, n_kv, one.accumulated_at(l, h));
          if (one.n_window > 0) std::copy_n(w, n_kv, one.window_at(l, h));
        }
      commit(1, &one);
    }
  }
  if (n_new < n_step) slot_changes_.push_back({n_slots_, true});
}

void seq_policy::truncated(int n_slots) {
  if (n_slots >= n_slots_) return;
  totals_.resize(std::min(totals_.size(), static_cast<std::size_t>(n_slots) * shape_.n_rows()));
  for (query_row& row : ring_)
    if (row.n_kv > n_slots) {
      const int R = shape_.n_rows();
      std::vector<float> w(static_cast<std::size_t>(R) * n_slots);
      for (int r = 0; r < R; ++r)
        std::copy_n(row.w.begin() + static_cast<std::ptrdiff_t>(r) * row.n_kv, n_slots,
                    w.begin() + static_cast<std::ptrdiff_t>(r) * n_slots);
      row.n_kv = n_slots;
      row.w = std::move(w);
    }
  n_slots_ = n_slots;
  window_fresh_ = false;
  slot_changes_.push_back({n_slots_, true});
}

void seq_policy::dropped(std::span<const std::int32_t> block_indices) {
  std::vector<std::int32_t> order(block_indices.begin(), block_indices.end());
  std::sort(order.begin(), order.end());
  std::vector<std::int32_t> keep;  // old slot of each remaining slot
  for (int slot = 0; slot < n_slots_; ++slot)
    if (!std::binary_search(order.begin(), order.end(), slot / shape_.block_size)) keep.push_back(slot);
  const int n = static_cast<int>(keep.size());
  remap(n, [&](int, int i) { return keep[static_cast<std::size_t>(i)]; });
  if (per_row_)
    for (int r = 0; r < shape_.n_rows(); ++r) {
      std::int32_t* row = rows_.data() + static_cast<std::size_t>(r) * stride_;
      for (int i = 0; i < n; ++i) row[i] = row[keep[static_cast<std::size_t>(i)]];
    }
  n_slots_ = n;
  rows_changed_ = rows_changed_ || per_row_;
  slot_changes_.push_back({n_slots_, false});
}

side_charge seq_policy::side_memory_of(const kv_policy* policy, const seq_policy_shape& shape, int stats_window) {
  side_charge c;
  kv_policy_needs needs;
  if (policy) {
    c = policy->side_memory(shape.n_layers, shape.n_kv_heads, shape.head_dim);
    needs = policy->needs();
  }
  // As the constructor resolves them.
  if (needs.totals) stats_window = std::max(stats_window, 0);
  stats_window = std::max(stats_window, needs.window_rows);
  const std::int64_t row_bytes = static_cast<std::int64_t>(shape.n_rows()) * 4 * 2;  // a 4-byte value per row, doubled
  if (stats_window >= 0) c.bytes_per_token += row_bytes;                    // totals
  if (stats_window > 0) c.bytes_per_token += row_bytes * stats_window;      // the window's query rows
  if (policy && policy->lossy()) c.bytes_per_token += 3 * row_bytes;        // rows_, last_sources_, last_positions_
  return c;
}

}  // namespace pagoda
