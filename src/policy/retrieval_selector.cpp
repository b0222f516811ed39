// retrieval_selector (retrieval.h): the key copies, the exact top-k and the
// union with the index's top-k. The background build is retrieval_build.cpp.
#include <algorithm>
#include <climits>
#include <functional>
#include <limits>

#include "attention/gather_attention.h"
#include "core/assert.h"
#include "core/half.h"
#include "policy/retrieval.h"
#include "policy/retrieval_build.h"

namespace pagoda {
namespace {

// 256 rows: 64 KiB at head_dim 128, the least a (layer, KV head) holds once a
// block is sealed.
constexpr int k_chunk_shift = 8;
constexpr int k_chunk_rows = 1 << k_chunk_shift;
// Slots a layer's copy grows by at most per on_layer_written: 128 keys of 8
// heads cost a few percent of a 16K-context decode step (bench/RESULTS.md,
// "Retrieval attention": first_token).
constexpr int k_copy_per_step = 128;

}  // namespace

std::unique_ptr<key_index> make_retrieval_index(const retrieval_params& p, int head_dim) {
  if (p.make_index) return p.make_index(head_dim);
  switch (p.index) {
    case retrieval_index_kind::hnsw: return make_hnsw_index(head_dim, p.hnsw);
    case retrieval_index_kind::auto_:
    case retrieval_index_kind::ivfpq: return make_ivfpq_index(head_dim, p.ivfpq);
    case retrieval_index_kind::exact: break;
  }
  return make_exact_index(head_dim);
}

retrieval_selector::retrieval_selector(const retrieval_params& p, int n_layers, int n_kv_heads, int head_dim)
    : params_(p), n_layers_(n_layers), n_kv_heads_(n_kv_heads), head_dim_(head_dim) {
  params_.ivfpq.m = divisor_at_most(head_dim, params_.ivfpq.m);
  layers_ = std::make_unique<layer_state[]>(static_cast<std::size_t>(n_layers));
  heads_ = std::make_unique<head_state[]>(static_cast<std::size_t>(n_layers) * n_kv_heads);
  for (std::size_t r = 0; r < static_cast<std::size_t>(n_layers) * n_kv_heads; ++r)
    heads_[r].ix = make_retrieval_index(params_, head_dim);
}

// The builder goes first (it is declared last), so no job outlives the copies.
retrieval_selector::~retrieval_selector() = default;

void retrieval_selector::on_layer_written(int layer, const paged_kv_view& k, std::span<const std::int32_t> kv_pos,
                                          int n_kv) {
  PAGODA_ASSERT(layer >= 0 && layer < n_layers_ && k.shape.head_dim == head_dim_, "retrieval: layer {} or head_dim {}",
                layer, k.shape.head_dim);
  block_size_ = k.shape.block_size;
  layer_state& L = layers_[layer];
  const int end = n_kv / block_size_ * block_size_;
  if (L.sealed_end > end) {  // an unannounced rollback
    stop_builds();
    forget_from(layer, end);
    requeue_from_indexes();
  }
  if (L.failed.load(std::memory_order_acquire)) return;
  // A long cached prompt is copied a few blocks a step, not all in its first
  // step (decoding and converting 16K keys of 8 heads costs several times a
  // layer's decode step): select() scores from the KV tiles and reads what
  // no index holds, so nothing waits for the copy.
  copy_blocks(layer, k, kv_pos, std::min(end, L.sealed_end + k_copy_per_step));
  if (L.sealed_end >= params_.index_from() && L.queued_end < L.sealed_end) {
    const int b0 = L.queued_end;
    L.queued_end = L.sealed_end;
    if (!builder_) builder_ = std::make_unique<retrieval_builder>(*this, params_.background);
    builder_->push(layer, b0, L.sealed_end);
  }
  if (params_.index == retrieval_index_kind::ivfpq || params_.index == retrieval_index_kind::auto_)
    release_indexed_chunks(layer);
}

// Decodes the sealed blocks in [sealed_end, end) of every head into the copies.
void retrieval_selector::copy_blocks(int layer, const paged_kv_view& k, std::span<const std::int32_t> kv_pos, int end) {
  layer_state& L = layers_[layer];
  if (end <= L.sealed_end) return;  // most decode steps seal nothing
  const int bs = block_size_;
  const auto hd = static_cast<std::size_t>(head_dim_);
  block_keys_.resize(static_cast<std::size_t>(bs) * hd);
  std::lock_guard lock(copy_mu_);
  L.live.resize(static_cast<std::size_t>(end));
  for (int s = L.sealed_end; s < end; ++s) L.live[static_cast<std::size_t>(s)] = kv_pos[static_cast<std::size_t>(s)] >= 0;
  for (int h = 0; h < n_kv_heads_; ++h) {
    head_state& hs = heads_[row(layer, h)];
    for (int b0 = L.sealed_end; b0 < end; b0 += bs) {
      decode_kv_rows(k, h, b0, bs, block_keys_.data());
      for (int i = 0; i < bs; ++i) {
        const int slot = b0 + i;
        const auto c = static_cast<std::size_t>(slot >> k_chunk_shift);
        if (c >= hs.owned.size()) {
          hs.owned.resize(c + 1);
          hs.chunks.resize(c + 1, nullptr);
        }
        if (!hs.owned[c]) {
          hs.owned[c] = std::make_unique_for_overwrite<std::uint16_t[]>(k_chunk_rows * hd);
          hs.chunks[c] = hs.owned[c].get();
        }
        std::uint16_t* dst = hs.owned[c].get() + static_cast<std::size_t>(slot & (k_chunk_rows - 1)) * hd;
        if (!L.live[static_cast<std::size_t>(slot)]) {
          std::fill_n(dst, hd, std::uint16_t{0});
          continue;
        }
        const float* x = block_keys_.data() + static_cast<std::size_t>(i) * hd;
        for (std::size_t d = 0; d < hd; ++d) {
          dst[d] = f32_to_fp16(x[d]);
          if (fp16_to_f32(dst[d]) != x[d]) L.exact_copy = false;  // NaN included: ranked by the rounding
        }
      }
    }
  }
  L.sealed_end = end;
}

// Once a (layer, KV head)'s IVF-PQ index holds a whole chunk, its copy goes.
void retrieval_selector::release_indexed_chunks(int layer) {
  for (int h = 0; h < n_kv_heads_; ++h) {
    head_state& hs = heads_[row(layer, h)];
    const int done = indexed_end(layer, h) >> k_chunk_shift;
    if (done <= hs.released_below) continue;
    std::lock_guard lock(copy_mu_);
    for (int c = hs.released_below; c < done && c < static_cast<int>(hs.owned.size()); ++c) {
      hs.owned[static_cast<std::size_t>(c)].reset();
      hs.chunks[static_cast<std::size_t>(c)] = nullptr;
      hs.copy_whole = false;
    }
    hs.released_below = done;
  }
}

key_rows retrieval_selector::key_rows_of(int layer, int kv_head) const {
  const layer_state& L = layers_[layer];
  const head_state& hs = heads_[row(layer, kv_head)];
  if (!L.exact_copy || !hs.copy_whole || L.failed.load(std::memory_order_acquire) || L.sealed_end == 0) return {};
  return {hs.chunks.data(), k_chunk_shift, L.sealed_end};
}

int retrieval_selector::indexed_end(int layer, int kv_head) const {
  const head_state& hs = heads_[row(layer, kv_head)];
  std::lock_guard lock(hs.mu);
  return hs.indexed_end;
}

int retrieval_selector::index_size(int layer, int kv_head) const {
  const head_state& hs = heads_[row(layer, kv_head)];
  std::lock_guard lock(hs.mu);
  return hs.ix->size();
}

void retrieval_selector::wait_built() {
  if (builder_) builder_->wait_idle();
}

retrieval_recall retrieval_selector::recall() const {
  return {recall_found_.load(std::memory_order_relaxed), recall_wanted_.load(std::memory_order_relaxed),
          searches_.load(std::memory_order_relaxed)};
}

std::string_view retrieval_selector::index_name() const {
  switch (params_.index) {
    case retrieval_index_kind::auto_:
    case retrieval_index_kind::ivfpq: return "ivfpq";
    case retrieval_index_kind::hnsw: return "hnsw";
    case retrieval_index_kind::exact: return {};
  }
  return {};
}

status retrieval_selector::error_status() const {
  std::lock_guard lock(error_mu_);
  return error_;
}

void retrieval_selector::fail(int layer, const status& s) {
  std::lock_guard lock(error_mu_);
  if (error_.ok()) error_ = s;
  layers_[layer].failed.store(true, std::memory_order_release);
}

void retrieval_selector::stop_builds() {
  if (builder_) builder_->cancel();
}

// After a cancel, the blocks the builder dropped are queued again from the
// least any head's index holds (a head past it skips what it has).
void retrieval_selector::requeue_from_indexes() {
  for (int l = 0; l < n_layers_; ++l) {
    int least = layers_[l].queued_end;
    for (int h = 0; h < n_kv_heads_; ++h) least = std::min(least, indexed_end(l, h));
    layers_[l].queued_end = least;
  }
}

void retrieval_selector::forget_from(int layer, int slot) {
  layer_state& L = layers_[layer];
  {
    std::lock_guard lock(copy_mu_);
    const auto keep = static_cast<std::size_t>((slot + k_chunk_rows - 1) >> k_chunk_shift);
    for (int h = 0; h < n_kv_heads_; ++h) {
      head_state& hs = heads_[row(layer, h)];
      if (hs.owned.size() > keep) {
        hs.owned.resize(keep);
        hs.chunks.resize(keep);
      }
      hs.released_below = std::min(hs.released_below, slot >> k_chunk_shift);
    }
    if (L.live.size() > static_cast<std::size_t>(slot)) L.live.resize(static_cast<std::size_t>(slot));
  }
  for (int h = 0; h < n_kv_heads_; ++h) {
    head_state& hs = heads_[row(layer, h)];
    std::lock_guard lock(hs.mu);
    hs.ix->remove_from(slot);
    hs.indexed_end = std::min(hs.indexed_end, slot);
  }
  L.sealed_end = std::min(L.sealed_end, slot);
  L.queued_end = std::min(L.queued_end, slot);
}

void retrieval_selector::on_slots_changed(int n_kv, bool kept) {
  stop_builds();  // queued blocks dropped; an in-flight one is discarded when it would publish
  for (int l = 0; l < n_layers_; ++l) {
    layer_state& L = layers_[l];
    if (kept) {
      if (block_size_ > 0 && L.sealed_end > n_kv) forget_from(l, n_kv / block_size_ * block_size_);
      continue;
    }
    {
      std::lock_guard lock(copy_mu_);
      for (int h = 0; h < n_kv_heads_; ++h) {
        head_state& hs = heads_[row(l, h)];
        hs.owned.clear();
        hs.chunks.clear();
        hs.copy_whole = true;
        hs.released_below = 0;
      }
      L.live.clear();
    }
    for (int h = 0; h < n_kv_heads_; ++h) {  // the slots hold other keys now: training goes too
      head_state& hs = heads_[row(l, h)];
      std::unique_ptr<key_index> fresh = make_retrieval_index(params_, head_dim_);
      std::lock_guard lock(hs.mu);
      hs.ix = std::move(fresh);
      hs.indexed_end = 0;
    }
    L.sealed_end = 0;
    L.queued_end = 0;
    L.exact_copy = true;
    L.failed.store(false, std::memory_order_release);
    std::lock_guard lock(error_mu_);
    error_ = {};
  }
  requeue_from_indexes();
}

std::size_t retrieval_selector::memory_bytes() const {
  const std::size_t rows = static_cast<std::size_t>(n_layers_) * n_kv_heads_;
  std::size_t bytes = sizeof(*this) + static_cast<std::size_t>(n_layers_) * sizeof(layer_state) +
                      rows * sizeof(head_state) + block_keys_.capacity() * sizeof(float);
  const std::size_t chunk_bytes = std::size_t{k_chunk_rows} * head_dim_ * sizeof(std::uint16_t);
  {
    std::lock_guard lock(copy_mu_);
    for (int l = 0; l < n_layers_; ++l) bytes += layers_[l].live.capacity();
    for (std::size_t r = 0; r < rows; ++r) {
      const head_state& hs = heads_[r];
      for (const auto& c : hs.owned) bytes += c ? chunk_bytes : 0;
      bytes += hs.owned.capacity() * sizeof(hs.owned[0]) + hs.chunks.capacity() * sizeof(hs.chunks[0]);
    }
  }
  for (std::size_t r = 0; r < rows; ++r) {
    std::lock_guard lock(heads_[r].mu);
    bytes += heads_[r].ix->memory_bytes();
  }
  if (builder_) bytes += builder_->memory_bytes();
  return bytes;
}

void retrieval_selector::exact_candidates(const kv_select_query& q, int k, int lo, int hi,
                                          std::vector<std::int32_t>& out) const {
  if (hi <= lo) return;
  std::size_t n_live = 0;
  for (int s = lo; s < hi; ++s) n_live += q.kv_pos[static_cast<std::size_t>(s)] >= 0 ? 1 : 0;
  if (n_live <= static_cast<std::size_t>(k)) {
    for (int s = lo; s < hi; ++s)
      if (q.kv_pos[static_cast<std::size_t>(s)] >= 0) out.push_back(s);
    return;
  }
  // q.k straight from the KV tiles, a run of blocks of one class at a time,
  // through the codec's qk kernel (the one full attention scores with): the
  // exact scores of what attention reads, whatever the KV type.
  // [lo, hi) lies within the sealed blocks: no staged block among them.
  const paged_kv_view& v = *q.k;
  const int bs = v.shape.block_size, base = lo / bs * bs;
  const auto n = static_cast<std::size_t>(hi - base);
  constexpr int k_run_blocks = 64;
  thread_local std::vector<float> scores;
  thread_local std::vector<const void*> tiles;
  scores.resize(static_cast<std::size_t>(q.n_rows) * n);
  for (int b0 = base / bs; b0 * bs < hi;) {
    int b1 = b0;
    while ((b1 + 1) * bs < hi && b1 - b0 + 1 < k_run_blocks && v.class_of(b1 + 1) == v.class_of(b0)) ++b1;
    tiles.clear();
    for (int b = b0; b <= b1; ++b) tiles.push_back(v.tile(b, q.kv_head));
    const int n_tokens = std::min(hi, (b1 + 1) * bs) - b0 * bs;
    v.codec_of(b0)->qk(v.format_of(b0), v.shape, v.params_of(b0, q.kv_head), tiles.data(), n_tokens, q.q, q.n_rows,
                       scores.data() + (b0 * bs - base), static_cast<int>(n));
    b0 = b1 + 1;
  }
  // Per row: t = the k-th largest of the maxima of 16-slot groups. The k
  // groups of the largest maxima hold k keys >= t, so the k-th largest key is
  // >= t: the keys >= t (a few k, where attention is peaked or clustered)
  // hold the top-k, picked among them by (score, then the smaller slot:
  // exact_top_k's order). Dead slots and those before lo score -inf.
  constexpr float k_none = -std::numeric_limits<float>::infinity();
  thread_local std::vector<float> group_max_tls;
  thread_local std::vector<std::pair<float, std::int32_t>> cand_tls;
  std::vector<float>& group_max = group_max_tls;  // the thread-local lookups once, not per key
  std::vector<std::pair<float, std::int32_t>>& cand = cand_tls;
  auto better = [](const std::pair<float, std::int32_t>& a, const std::pair<float, std::int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const std::size_t n_groups = (n + 15) / 16;
  group_max.resize(n_groups);
  const bool dead = n_live < static_cast<std::size_t>(hi - lo);
  for (int r = 0; r < q.n_rows; ++r) {
    float* sc = scores.data() + static_cast<std::size_t>(r) * n;  // sc[slot - base]
    for (int s = base; s < lo; ++s) sc[s - base] = k_none;
    for (int s = lo; dead && s < hi; ++s)
      if (q.kv_pos[static_cast<std::size_t>(s)] < 0) sc[s - base] = k_none;
    for (std::size_t g = 0; g < n_groups; ++g) {
      float m = k_none;
      for (std::size_t i = g * 16, e = std::min(n, i + 16); i < e; ++i) m = std::max(m, sc[i]);
      group_max[g] = m;
    }
    float t = k_none;
    if (n_groups > static_cast<std::size_t>(k)) {
      std::nth_element(group_max.begin(), group_max.begin() + (k - 1), group_max.end(), std::greater<float>());
      t = group_max[static_cast<std::size_t>(k - 1)];
    }
    cand.clear();
    for (std::size_t i = 0; i < n; ++i)
      if (sc[i] >= t && sc[i] != k_none) cand.emplace_back(sc[i], base + static_cast<std::int32_t>(i));
    if (cand.size() > static_cast<std::size_t>(k)) {
      std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), better);
      cand.resize(static_cast<std::size_t>(k));
    }
    for (const auto& c : cand) out.push_back(c.second);
  }
}

// Every query row's exact top-k over the index's live slots in [lo, hi),
// decoded from the view (the copy may be released there), against the index's
// own top-k of that row. REQUIRES: hs.mu held.
void retrieval_selector::sample_recall(const kv_select_query& q, const head_state& hs, int k, int lo, int hi) const {
  const int bs = q.k->shape.block_size;
  const auto hd = static_cast<std::size_t>(q.head_dim);
  std::vector<float> keys, block(static_cast<std::size_t>(bs) * hd);
  std::vector<std::int32_t> slots, ann, want;
  for (int b0 = lo / bs * bs; b0 < hi; b0 += bs) {
    decode_kv_rows(*q.k, q.kv_head, b0, bs, block.data());
    for (int i = 0; i < bs; ++i) {
      const int s = b0 + i;
      if (s < lo || s >= hi || q.kv_pos[static_cast<std::size_t>(s)] < 0) continue;
      keys.insert(keys.end(), block.begin() + static_cast<std::ptrdiff_t>(i * hd),
                  block.begin() + static_cast<std::ptrdiff_t>((i + 1) * hd));
      slots.push_back(s);
    }
  }
  std::uint64_t found = 0, wanted = 0;
  for (int r = 0; r < q.n_rows; ++r) {
    const float* qr = q.q + static_cast<std::size_t>(r) * hd;
    ann.clear();
    want.clear();
    hs.ix->search(qr, k, ann);
    exact_top_k(qr, keys.data(), slots.data(), static_cast<int>(slots.size()), q.head_dim, k, want);
    std::sort(ann.begin(), ann.end());
    for (std::int32_t s : want) found += std::binary_search(ann.begin(), ann.end(), s) ? 1 : 0;
    wanted += want.size();
  }
  recall_found_.fetch_add(found, std::memory_order_relaxed);
  recall_wanted_.fetch_add(wanted, std::memory_order_relaxed);
}

bool retrieval_selector::select(const kv_select_query& q, std::vector<slot_range>& out) {
  out.clear();
  const int n_kv = q.n_kv;
  const layer_state& L = layers_[q.layer];
  if (L.failed.load(std::memory_order_acquire) || q.n_rows > params_.max_tokens * q.n_rep || n_kv <= 0) return false;
  // Dead slots (negative positions) lead; sinks are the first live ones.
  const int first = static_cast<int>(std::upper_bound(q.kv_pos.begin(), q.kv_pos.begin() + n_kv, -1) - q.kv_pos.begin());
  if (first >= n_kv) return false;
  // The sealed blocks of the view (the copies may lag: select never reads them).
  const int bs = q.k->shape.block_size;
  const int sealed = n_kv / bs * bs;
  // Slots past the sealed blocks are read, so the window reaches back to them.
  const int window_begin = std::max(first, std::min(n_kv - params_.recent, sealed));
  const int sink_end = std::min(first + params_.sinks, window_begin);
  const int k = params_.resolve_k(n_kv);
  if (k >= window_begin - sink_end) {  // every candidate: no search needed
    out.push_back({first, n_kv});
    return true;
  }
  thread_local std::vector<std::int32_t> cand;
  cand.clear();
  int ie = sink_end;  // [sink_end, ie) from the index, [ie, window_begin) exactly
  {
    const head_state& hs = heads_[row(q.layer, q.kv_head)];
    std::lock_guard lock(hs.mu);
    ie = std::clamp(hs.indexed_end, sink_end, window_begin);
    // The exact top-k over many slots costs more than reading them all.
    if (params_.index != retrieval_index_kind::exact && window_begin - ie > params_.exact_max) return false;
    if (ie > sink_end && hs.ix->size() > 0) {
      const std::uint64_t n = searches_.fetch_add(1, std::memory_order_relaxed);
      hs.ix->search_rows(q.q, q.n_rows, q.head_dim, k, cand);
      std::erase_if(cand, [&](std::int32_t s) { return s < sink_end || s >= ie; });
      if (params_.recall_every > 0 && n % static_cast<std::uint64_t>(params_.recall_every) == 0)
        sample_recall(q, hs, k, first, std::min(hs.indexed_end, n_kv));
    }
  }
  exact_candidates(q, k, ie, window_begin, cand);
  std::sort(cand.begin(), cand.end());
  cand.erase(std::unique(cand.begin(), cand.end()), cand.end());
  if (sink_end > first) out.push_back({first, sink_end});
  for (std::int32_t s : cand) {
    if (!out.empty() && out.back().end == s) ++out.back().end;
    else out.push_back({s, s + 1});
  }
  if (!out.empty() && out.back().end == window_begin) out.back().end = n_kv;
  else out.push_back({window_begin, n_kv});
  return true;
}

}  // namespace pagoda
