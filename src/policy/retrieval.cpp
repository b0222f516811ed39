#include "policy/retrieval.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
#include <string_view>

#include "attention/gather_attention.h"
#include "core/assert.h"
#include "core/half.h"

namespace pagoda {
namespace {

constexpr const char* k_known_params =
    "index, k, sinks, recent, max_tokens, m, ef_construction, ef_search, nlist, pq_m, nbits, nprobe, train";

result<int> parse_int(std::string_view key, std::string_view v, int lo, int hi) {
  int x = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || end != v.data() + v.size() || x < lo || x > hi)
    return error(errc::invalid_argument, "retrieval: {}={}: expected an integer in [{}, {}]", key, v, lo, hi);
  return x;
}

// k: a count ("128"), a fraction ("0.01") or a percentage ("1%").
status parse_k(std::string_view v, retrieval_params& p) {
  const bool percent = !v.empty() && v.back() == '%';
  const std::string_view num = percent ? v.substr(0, v.size() - 1) : v;
  const bool integral = !percent && num.find_first_not_of("0123456789") == std::string_view::npos;
  if (integral) {
    auto r = parse_int("k", v, 1, 1 << 24);
    if (!r.ok()) return r.error();
    p.k_tokens = *r;
    p.k_fraction = 0;
    return {};
  }
  double x = 0;
  auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), x);
  if (percent) x /= 100.0;
  if (num.empty() || ec != std::errc() || end != num.data() + num.size() || !(x > 0.0 && x <= 1.0))
    return error(errc::invalid_argument, "retrieval: k={}: expected a count (128), a fraction in (0, 1] or a percentage (1%)", v);
  p.k_tokens = 0;
  p.k_fraction = x;
  return {};
}

status parse_index_kind(std::string_view v, retrieval_params& p) {
  if (v == "hnsw") p.index = retrieval_index_kind::hnsw;
  else if (v == "ivfpq") p.index = retrieval_index_kind::ivfpq;
  else if (v == "exact") p.index = retrieval_index_kind::exact;
  else return error(errc::invalid_argument, "retrieval: index={}: expected hnsw, ivfpq or exact", v);
  return {};
}

// The int field a key names, with its bounds and the index it applies to
// (nullptr: any index).
struct int_param {
  const char* key;
  int retrieval_params::*field = nullptr;
  int hnsw_params::*hnsw_field = nullptr;
  int ivfpq_params::*ivfpq_field = nullptr;
  int lo, hi;
};

constexpr int_param k_int_params[] = {
    {"sinks", &retrieval_params::sinks, nullptr, nullptr, 0, 1 << 20},
    {"recent", &retrieval_params::recent, nullptr, nullptr, 1, 1 << 20},
    {"max_tokens", &retrieval_params::max_tokens, nullptr, nullptr, 1, 1 << 16},
    {"m", nullptr, &hnsw_params::m, nullptr, 2, 256},
    {"ef_construction", nullptr, &hnsw_params::ef_construction, nullptr, 1, 4096},
    {"ef_search", nullptr, &hnsw_params::ef_search, nullptr, 1, 65536},
    {"nlist", nullptr, nullptr, &ivfpq_params::nlist, 1, 65536},
    {"pq_m", nullptr, nullptr, &ivfpq_params::m, 1, 4096},
    {"nbits", nullptr, nullptr, &ivfpq_params::nbits, 1, 12},
    {"nprobe", nullptr, nullptr, &ivfpq_params::nprobe, 1, 65536},
    {"train", nullptr, nullptr, &ivfpq_params::n_train, 0, 1 << 22},
};

// Parses one key=value into p; names the index a key needs in *needs.
status parse_param(std::string_view key, std::string_view value, retrieval_params& p, const char** needs) {
  if (key == "index") return parse_index_kind(value, p);
  if (key == "k") return parse_k(value, p);
  for (const int_param& ip : k_int_params) {
    if (key != ip.key) continue;
    auto r = parse_int(key, value, ip.lo, ip.hi);
    if (!r.ok()) return r.error();
    if (ip.field) p.*ip.field = *r;
    if (ip.hnsw_field) {
      p.hnsw.*ip.hnsw_field = *r;
      *needs = "hnsw";
    }
    if (ip.ivfpq_field) {
      p.ivfpq.*ip.ivfpq_field = *r;
      *needs = "ivfpq";
    }
    return {};
  }
  return error(errc::invalid_argument, "retrieval: unknown parameter '{}'; known: {}", key, k_known_params);
}

const char* index_kind_name(retrieval_index_kind k) {
  switch (k) {
    case retrieval_index_kind::hnsw: return "hnsw";
    case retrieval_index_kind::ivfpq: return "ivfpq";
    case retrieval_index_kind::exact: return "exact";
  }
  return "?";
}

// The largest divisor of n that is at most m (1 at least).
int divisor_at_most(int n, int m) {
  for (int d = std::min(n, m); d > 1; --d)
    if (n % d == 0) return d;
  return 1;
}

class retrieval_policy final : public kv_policy {
 public:
  retrieval_policy(kv_policy_spec spec, retrieval_params p) : spec_(std::move(spec)), params_(p) {}
  const kv_policy_spec& spec() const override { return spec_; }
  std::unique_ptr<kv_read_selector> make_selector(int n_layers, int n_kv_heads, int head_dim) override {
    return std::make_unique<retrieval_selector>(params_, n_layers, n_kv_heads, head_dim);
  }
  side_charge side_memory(int n_layers, int n_kv_heads, int head_dim) const override {
    return retrieval_side_memory(params_, n_layers, n_kv_heads, head_dim);
  }

 private:
  kv_policy_spec spec_;
  retrieval_params params_;
};

}  // namespace

side_charge retrieval_side_memory(const retrieval_params& p, int n_layers, int n_kv_heads, int head_dim) {
  const std::int64_t hd = head_dim;
  const std::int64_t rows = static_cast<std::int64_t>(n_layers) * n_kv_heads;
  // The key copy: whole chunks of 2^k_chunk_shift f16 rows, and their pointers.
  std::int64_t fixed = 256 * hd * 2 + 256, per_token = hd * 2 + 1;
  switch (p.index) {
    case retrieval_index_kind::hnsw: {
      const std::int64_t m = p.hnsw.m;
      // hnswlib's per-element record (level-0 links, the f16 point and its
      // extra f32, the label), link-list pointer, level, lock and visited mark.
      const std::int64_t element = (2 * m * 4 + 4) + (hd * 2 + 4) + 8 + 8 + 4 + 40 + 2;
      const std::int64_t upper_links = (m * 4 + 4) * 2 / std::max<std::int64_t>(m - 1, 1) + 1;
      const std::int64_t label = 28 + 2 * 8;  // a map node, and up to two buckets
      fixed += 1024 * element + 64 * (m * 4 + 4) + 4096;
      per_token += 2 * element + upper_links + label;
      break;
    }
    case retrieval_index_kind::ivfpq: {
      const ivfpq_params& q = p.ivfpq;
      const std::int64_t pq_m = divisor_at_most(head_dim, q.m);
      const std::int64_t n_train = q.resolved_n_train();
      fixed += 2 * n_train * (hd * 4 + 4)                // the training buffer, doubled
               + static_cast<std::int64_t>(q.nlist) * (hd * 4 + 64)  // coarse centroids, list headers
               + (std::int64_t{1} << q.nbits) * hd * 4 + 4096;      // the PQ codebooks
      per_token += 2 * (pq_m * q.nbits / 8 + 1 + 8);
      break;
    }
    case retrieval_index_kind::exact: per_token += 2 * (hd * 4 + 4); break;
  }
  return side_charge{rows * fixed + (std::int64_t{1} << 16), rows * per_token};
}

int retrieval_params::resolve_k(int n_kv) const {
  if (k_tokens > 0) return k_tokens;
  return std::max(1, static_cast<int>(std::ceil(k_fraction * n_kv)));
}

result<retrieval_params> parse_retrieval_params(const kv_policy_spec& spec) {
  retrieval_params p;
  std::vector<std::pair<std::string, const char*>> index_specific;  // key, the index it needs
  for (const auto& [key, value] : spec.params) {
    const char* needs = nullptr;
    if (status s = parse_param(key, value, p, &needs); !s.ok()) return s;
    if (needs) index_specific.emplace_back(key, needs);
  }
  for (const auto& [key, needs] : index_specific)
    if (std::string_view(needs) != index_kind_name(p.index))
      return error(errc::invalid_argument, "retrieval: {} applies to index={}, not index={}", key, needs,
                   index_kind_name(p.index));
  if (p.index == retrieval_index_kind::hnsw)
    if (status s = check_hnsw_params(p.hnsw); !s.ok()) return s;
  if (p.index == retrieval_index_kind::ivfpq)
    if (status s = check_ivfpq_params(p.ivfpq, 0); !s.ok()) return s;
  return p;
}

result<std::unique_ptr<kv_policy>> make_retrieval_policy(const kv_policy_spec& spec) {
  auto p = parse_retrieval_params(spec);
  if (!p.ok()) return p.error();
  return std::unique_ptr<kv_policy>(std::make_unique<retrieval_policy>(spec, *p));
}

retrieval_selector::retrieval_selector(const retrieval_params& p, int n_layers, int n_kv_heads, int head_dim)
    : params_(p), n_layers_(n_layers), n_kv_heads_(n_kv_heads), head_dim_(head_dim) {
  params_.ivfpq.m = divisor_at_most(head_dim, params_.ivfpq.m);
  indexes_.resize(static_cast<std::size_t>(n_layers) * n_kv_heads);
  for (auto& ix : indexes_) {
    switch (params_.index) {
      case retrieval_index_kind::hnsw: ix = make_hnsw_index(head_dim, params_.hnsw); break;
      case retrieval_index_kind::ivfpq: ix = make_ivfpq_index(head_dim, params_.ivfpq); break;
      case retrieval_index_kind::exact: ix = make_exact_index(head_dim); break;
    }
  }
  indexed_end_.assign(n_layers, 0);
  failed_.assign(n_layers, 0);
  rows_.resize(indexes_.size());
  rows_exact_.assign(n_layers, 1);
}

void retrieval_selector::on_layer_written(int layer, const paged_kv_view& k, std::span<const std::int32_t> kv_pos,
                                          int n_kv) {
  PAGODA_ASSERT(layer >= 0 && layer < n_layers_ && k.shape.head_dim == head_dim_, "retrieval: layer {} or head_dim {}",
                layer, k.shape.head_dim);
  block_size_ = k.shape.block_size;
  if (indexed_end_[layer] > n_kv) forget_from(layer, n_kv / block_size_ * block_size_);  // an unannounced rollback
  if (!failed_[layer]) add_blocks(layer, k, kv_pos, n_kv / block_size_ * block_size_);
}

// Decodes the sealed blocks in [indexed_end, end) of every head, copies them
// (key_rows_of) and adds their live slots to the index.
void retrieval_selector::add_blocks(int layer, const paged_kv_view& k, std::span<const std::int32_t> kv_pos, int end) {
  if (end <= indexed_end_[layer]) return;  // most decode steps seal nothing
  const int bs = block_size_;
  const auto hd = static_cast<std::size_t>(head_dim_);
  std::vector<float>& keys = block_keys_;
  std::vector<std::int32_t>& slots = block_slots_;
  keys.resize(static_cast<std::size_t>(bs) * hd);
  for (int h = 0; h < n_kv_heads_; ++h) {
    for (int b0 = indexed_end_[layer]; b0 < end; b0 += bs) {
      decode_kv_rows(k, h, b0, bs, keys.data());
      if (rows_exact_[layer]) copy_rows(layer, h, b0, keys.data(), kv_pos);
      slots.clear();
      for (int i = 0; i < bs; ++i) {
        if (kv_pos[b0 + i] < 0) continue;  // dead: nothing to find
        std::copy_n(&keys[static_cast<std::size_t>(i) * hd], hd, &keys[slots.size() * hd]);
        slots.push_back(b0 + i);
      }
      status s = indexes_[row(layer, h)]->add(keys.data(), slots.data(), static_cast<int>(slots.size()));
      if (!s.ok()) {
        if (error_.ok()) error_ = s;
        failed_[layer] = 1;
        return;
      }
    }
  }
  indexed_end_[layer] = std::max(indexed_end_[layer], end);
}

// Appends block [b0, b0 + block_size)'s decoded keys to (layer, h)'s copy, or
// drops the layer's copies for good when one value is not an f16 (the copy
// must score exactly what the view holds).
void retrieval_selector::copy_rows(int layer, int h, int b0, const float* keys, std::span<const std::int32_t> kv_pos) {
  const auto hd = static_cast<std::size_t>(head_dim_);
  constexpr int chunk_rows = 1 << k_chunk_shift;
  row_copy& rc = rows_[row(layer, h)];
  for (int i = 0; i < block_size_; ++i) {
    const int slot = b0 + i;
    const auto c = static_cast<std::size_t>(slot >> k_chunk_shift);
    PAGODA_DASSERT(c <= rc.owned.size());
    if (c == rc.owned.size()) {
      rc.owned.push_back(std::make_unique_for_overwrite<std::uint16_t[]>(chunk_rows * hd));
      rc.chunks.push_back(rc.owned.back().get());
    }
    std::uint16_t* dst = rc.owned[c].get() + static_cast<std::size_t>(slot & (chunk_rows - 1)) * hd;
    const float* x = keys + static_cast<std::size_t>(i) * hd;
    if (kv_pos[b0 + i] < 0) {
      std::fill_n(dst, hd, std::uint16_t{0});
      continue;
    }
    for (std::size_t d = 0; d < hd; ++d) {
      dst[d] = f32_to_fp16(x[d]);
      if (fp16_to_f32(dst[d]) != x[d]) {  // NaN included
        rows_exact_[layer] = 0;
        for (int g = 0; g < n_kv_heads_; ++g) trim_rows(layer, g, 0);
        return;
      }
    }
  }
}

void retrieval_selector::trim_rows(int layer, int h, int slot) {
  row_copy& rc = rows_[row(layer, h)];
  const std::size_t keep = (static_cast<std::size_t>(slot) + (1u << k_chunk_shift) - 1) >> k_chunk_shift;
  if (rc.owned.size() <= keep) return;
  rc.owned.resize(keep);
  rc.chunks.resize(keep);
}

key_rows retrieval_selector::key_rows_of(int layer, int kv_head) const {
  // The copy may run past indexed_end when a block's add failed (failed_ then).
  if (!rows_exact_[layer] || failed_[layer] || indexed_end_[layer] == 0) return {};
  return {rows_[row(layer, kv_head)].chunks.data(), k_chunk_shift, indexed_end_[layer]};
}

void retrieval_selector::forget_from(int layer, int slot) {
  for (int h = 0; h < n_kv_heads_; ++h) {
    indexes_[row(layer, h)]->remove_from(slot);
    trim_rows(layer, h, slot);
  }
  indexed_end_[layer] = std::min(indexed_end_[layer], slot);
}

void retrieval_selector::on_slots_changed(int n_kv, bool kept) {
  for (int l = 0; l < n_layers_; ++l) {
    if (!kept) {
      for (int h = 0; h < n_kv_heads_; ++h) {
        indexes_[row(l, h)]->clear();
        trim_rows(l, h, 0);
      }
      indexed_end_[l] = 0;
      failed_[l] = 0;
      rows_exact_[l] = 1;
    } else if (indexed_end_[l] > n_kv) {
      forget_from(l, n_kv / block_size_ * block_size_);
    }
  }
}

std::size_t retrieval_selector::memory_bytes() const {
  std::size_t bytes = sizeof(*this) + indexes_.capacity() * sizeof(indexes_[0]) + indexed_end_.capacity() * sizeof(int) +
                      failed_.capacity() + rows_exact_.capacity() + rows_.capacity() * sizeof(rows_[0]) +
                      block_keys_.capacity() * sizeof(float) + block_slots_.capacity() * sizeof(std::int32_t);
  for (const auto& ix : indexes_) bytes += ix->memory_bytes();
  for (const row_copy& rc : rows_)
    bytes += rc.owned.size() * (std::size_t{1} << k_chunk_shift) * head_dim_ * sizeof(std::uint16_t) +
             rc.owned.capacity() * sizeof(rc.owned[0]) + rc.chunks.capacity() * sizeof(rc.chunks[0]);
  return bytes;
}

void retrieval_selector::candidates(const kv_select_query& q, int k, int lo, int hi,
                                    std::vector<std::int32_t>& out) const {
  const key_index& ix = *indexes_[row(q.layer, q.kv_head)];
  ix.search_rows(q.q, q.n_rows, q.head_dim, k, out);
  std::erase_if(out, [lo, hi](std::int32_t s) { return s < lo || s >= hi; });
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
}

bool retrieval_selector::select(const kv_select_query& q, std::vector<slot_range>& out) {
  out.clear();
  const int n_kv = q.n_kv;
  if (failed_[q.layer] || q.n_rows > params_.max_tokens * q.n_rep || n_kv <= 0) return false;
  // Dead slots (negative positions) lead; sinks are the first live ones.
  const int first = static_cast<int>(std::upper_bound(q.kv_pos.begin(), q.kv_pos.begin() + n_kv, -1) - q.kv_pos.begin());
  if (first >= n_kv) return false;
  const int indexed = std::min(indexed_end_[q.layer], n_kv);
  // Everything not indexed is read, so the window reaches back to the index's end.
  const int window_begin = std::max(first, std::min(n_kv - params_.recent, indexed));
  const int sink_end = std::min(first + params_.sinks, window_begin);
  const int k = params_.resolve_k(n_kv);
  const key_index& ix = *indexes_[row(q.layer, q.kv_head)];
  if (k >= ix.size()) {  // every indexed key: no search needed
    out.push_back({first, n_kv});
    return true;
  }
  thread_local std::vector<std::int32_t> cand;
  cand.clear();
  candidates(q, k, sink_end, window_begin, cand);
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
