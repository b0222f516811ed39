// The HNSW key index (retrieval_index.h) on hnswlib. hnswlib.h defines
// non-inline functions, so this is the only file that includes it.
//
// hnswlib 0.6.2's SSE prefetches read the link one past the end of an
// upper-level link list (to compute a prefetch address; the 4-byte read lands
// in malloc's rounding slack of that allocation, so it is harmless in practice)
// and AddressSanitizer rightly reports it. Sanitized builds compile hnswlib
// without its SSE paths, which removes the prefetches and nothing else that
// this index uses (its distance is our own).
#if defined(__SANITIZE_ADDRESS__)
#define NO_MANUAL_VECTORIZATION
#endif
#include <hnswlib/hnswlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>

#include "core/cpu.h"
#include "core/half.h"
#include "policy/retrieval_index.h"

namespace pagoda {

float l2sq_f16_avx2(const std::uint16_t* a, const std::uint16_t* b, int n);  // retrieval_index_avx2.cpp

namespace {

constexpr std::size_t k_initial_capacity = 1024;
// The norm bound M is this much above the largest key norm seen, so that a
// few later, slightly longer keys do not each force a rebuild.
constexpr float k_norm_headroom = 1.25f;

// A stored point: head_dim f16 values, then the extra coordinate e as an f32
// (e^2 = M^2 - |k|^2 would lose the ranking to f16 rounding of e at large M).
// A query has e = 0. The distance is the squared Euclidean one over both.
class mips_l2_space final : public hnswlib::SpaceInterface<float> {
 public:
  explicit mips_l2_space(int dim)
      : param_{static_cast<std::size_t>(dim)},
        dist_(active_simd_level() >= simd_level::avx2 ? &distance<l2sq_f16_avx2> : &distance<l2sq_f16_ref>) {}
  std::size_t get_data_size() override { return param_ * sizeof(fp16_t) + sizeof(float); }
  hnswlib::DISTFUNC<float> get_dist_func() override { return dist_; }
  void* get_dist_func_param() override { return &param_; }

 private:
  template <float (*l2)(const std::uint16_t*, const std::uint16_t*, int)>
  static float distance(const void* a, const void* b, const void* param) {
    const std::size_t dim = *static_cast<const std::size_t*>(param);
    float ea, eb;
    std::memcpy(&ea, static_cast<const char*>(a) + dim * sizeof(fp16_t), sizeof(float));
    std::memcpy(&eb, static_cast<const char*>(b) + dim * sizeof(fp16_t), sizeof(float));
    return l2(static_cast<const fp16_t*>(a), static_cast<const fp16_t*>(b), static_cast<int>(dim)) + (ea - eb) * (ea - eb);
  }
  std::size_t param_;
  hnswlib::DISTFUNC<float> dist_;
};

class hnsw_index final : public key_index {
 public:
  hnsw_index(int head_dim, const hnsw_params& p)
      : head_dim_(head_dim), params_(p), space_(head_dim), point_(space_.get_data_size()) {}

  status add(const float* keys, const std::int32_t* slots, int n) override {
    try {
      float max_norm = 0.0f;
      for (int i = 0; i < n; ++i) max_norm = std::max(max_norm, norm_f16(keys + static_cast<std::size_t>(i) * head_dim_));
      if (max_norm > bound_) rebuild(max_norm * k_norm_headroom);
      for (int i = 0; i < n; ++i) {
        reserve(static_cast<std::size_t>(size_all()) + 1);
        encode(keys + static_cast<std::size_t>(i) * head_dim_, point_.data());
        graph_->addPoint(point_.data(), static_cast<hnswlib::labeltype>(slots[i]));
      }
    } catch (const std::exception& e) {
      return error(errc::internal, "retrieval: hnsw index: {}", e.what());
    }
    return {};
  }

  void search(const float* q, int k, std::vector<std::int32_t>& out) const override {
    if (!graph_ || size() == 0 || k <= 0) return;
    thread_local std::vector<char> h;  // the query as a point; per thread, reused
    h.assign(space_.get_data_size(), 0);
    fp16_t* x = reinterpret_cast<fp16_t*>(h.data());
    for (int d = 0; d < head_dim_; ++d) x[d] = f32_to_fp16(q[d]);  // e = 0 (zero bytes)
    auto found = graph_->searchKnn(h.data(), static_cast<std::size_t>(std::min(k, size())));
    for (; !found.empty(); found.pop()) out.push_back(static_cast<std::int32_t>(found.top().second));
  }

  void remove_from(std::int32_t slot) override {
    if (!graph_) return;
    std::vector<hnswlib::labeltype> gone;
    for (const auto& [label, id] : graph_->label_lookup_)
      if (static_cast<std::int64_t>(label) >= slot && !graph_->isMarkedDeleted(id)) gone.push_back(label);
    for (hnswlib::labeltype label : gone) graph_->markDelete(label);
  }

  void clear() override {
    graph_.reset();
    ++graph_gen_;
    bound_ = 0.0f;
  }

  int size() const override { return graph_ ? size_all() - static_cast<int>(graph_->num_deleted_) : 0; }

  // hnswlib's allocations: per element of capacity, the level-0 record (key,
  // 2M links, label), a link-list pointer, a level, a lock and an entry of one
  // visited list; the upper-level link lists of the elements above level 0;
  // the label map.
  std::size_t memory_bytes() const override {
    if (!graph_) return 0;
    const auto& g = *graph_;
    std::size_t bytes = g.max_elements_ * (g.size_data_per_element_ + sizeof(void*) + sizeof(int) +
                                           sizeof(std::mutex) + sizeof(hnswlib::vl_type));
    // Upper-level links: elements only append (deletion marks), so the sum of
    // their levels is kept from the last call (the engine asks every step).
    if (levels_gen_ != graph_gen_) levels_gen_ = graph_gen_, levels_counted_ = 0, levels_sum_ = 0;
    for (; levels_counted_ < g.cur_element_count; ++levels_counted_)
      levels_sum_ += static_cast<std::size_t>(g.element_levels_[levels_counted_]);
    bytes += levels_sum_ * g.size_links_per_element_;
    bytes += g.label_lookup_.size() * (sizeof(hnswlib::labeltype) + sizeof(hnswlib::tableint) + 2 * sizeof(void*)) +
             g.label_lookup_.bucket_count() * sizeof(void*);
    return bytes;
  }

 private:
  int size_all() const { return graph_ ? static_cast<int>(graph_->cur_element_count) : 0; }

  // The norm of x as stored (rounded to f16).
  float norm_f16(const float* x) const {
    float s = 0.0f;
    for (int d = 0; d < head_dim_; ++d) {
      const float v = fp16_to_f32(f32_to_fp16(x[d]));
      s += v * v;
    }
    return std::sqrt(s);
  }

  // x as a stored point: f16 values and e = sqrt(M^2 - |x|^2).
  void encode(const float* x, char* point) const {
    fp16_t* h = reinterpret_cast<fp16_t*>(point);
    float s = 0.0f;
    for (int d = 0; d < head_dim_; ++d) {
      h[d] = f32_to_fp16(x[d]);
      const float v = fp16_to_f32(h[d]);
      s += v * v;
    }
    const float e = std::sqrt(std::max(0.0f, bound_ * bound_ - s));
    std::memcpy(point + static_cast<std::size_t>(head_dim_) * sizeof(fp16_t), &e, sizeof(float));
  }

  // A new norm bound: every live point is re-encoded into a new graph.
  void rebuild(float bound) {
    std::unique_ptr<hnswlib::HierarchicalNSW<float>> old = std::move(graph_);
    bound_ = bound;
    ++graph_gen_;
    if (!old) return;
    std::vector<float> x(head_dim_);
    for (std::size_t id = 0; id < old->cur_element_count; ++id) {
      if (old->isMarkedDeleted(static_cast<hnswlib::tableint>(id))) continue;
      const auto* h = reinterpret_cast<const fp16_t*>(old->getDataByInternalId(static_cast<hnswlib::tableint>(id)));
      for (int d = 0; d < head_dim_; ++d) x[d] = fp16_to_f32(h[d]);
      reserve(static_cast<std::size_t>(size_all()) + 1);
      encode(x.data(), point_.data());
      graph_->addPoint(point_.data(), old->getExternalLabel(static_cast<hnswlib::tableint>(id)));
    }
  }

  // Capacity for n elements: hnswlib preallocates; grow by doubling.
  void reserve(std::size_t n) {
    if (!graph_) {
      graph_ = std::make_unique<hnswlib::HierarchicalNSW<float>>(&space_, std::max(n, k_initial_capacity),
                                                                  params_.m, params_.ef_construction);
      graph_->setEf(params_.ef_search);
    } else if (n > graph_->max_elements_) {
      graph_->resizeIndex(std::max(n, 2 * graph_->max_elements_));
    }
  }

  int head_dim_;
  hnsw_params params_;
  mutable mips_l2_space space_;  // hnswlib's interface is not const
  std::vector<char> point_;      // one encoded point (add's scratch)
  float bound_ = 0.0f;           // M: every stored key's norm is at most this
  std::uint64_t graph_gen_ = 0;  // bumped by each rebuild (a new graph)
  // memory_bytes()'s running sum of element levels, for graph generation levels_gen_.
  mutable std::uint64_t levels_gen_ = 0;
  mutable std::size_t levels_counted_ = 0, levels_sum_ = 0;
  std::unique_ptr<hnswlib::HierarchicalNSW<float>> graph_;
};

}  // namespace

std::unique_ptr<key_index> make_hnsw_index(int head_dim, const hnsw_params& p) {
  return std::make_unique<hnsw_index>(head_dim, p);
}

}  // namespace pagoda
