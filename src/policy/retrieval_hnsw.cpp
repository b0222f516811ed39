// The HNSW key index (retrieval_index.h) on hnswlib. hnswlib.h defines
// non-inline functions, so this is the only file that includes it.
#include <hnswlib/hnswlib.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <mutex>

#include "core/cpu.h"
#include "core/half.h"
#include "policy/retrieval_index.h"

namespace pagoda {

float dot_f16_avx2(const std::uint16_t* a, const std::uint16_t* b, int n);  // retrieval_index_avx2.cpp

namespace {

constexpr std::size_t k_initial_capacity = 1024;

// Inner product over f16 vectors as hnswlib's "distance": -q.k (smaller is
// nearer). Queries are rounded to f16 too: hnswlib passes a query and a stored
// point to the same function.
class ip_f16_space final : public hnswlib::SpaceInterface<float> {
 public:
  explicit ip_f16_space(int dim)
      : dim_(static_cast<std::size_t>(dim)),
        dist_(active_simd_level() >= simd_level::avx2 ? &distance<dot_f16_avx2> : &distance<dot_f16_ref>) {}
  std::size_t get_data_size() override { return dim_ * sizeof(fp16_t); }
  hnswlib::DISTFUNC<float> get_dist_func() override { return dist_; }
  void* get_dist_func_param() override { return &dim_; }

 private:
  template <float (*dot)(const std::uint16_t*, const std::uint16_t*, int)>
  static float distance(const void* a, const void* b, const void* param) {
    return -dot(static_cast<const fp16_t*>(a), static_cast<const fp16_t*>(b),
                static_cast<int>(*static_cast<const std::size_t*>(param)));
  }
  std::size_t dim_;
  hnswlib::DISTFUNC<float> dist_;
};

class hnsw_index final : public key_index {
 public:
  hnsw_index(int head_dim, const hnsw_params& p) : head_dim_(head_dim), params_(p), space_(head_dim) {}

  status add(const float* keys, const std::int32_t* slots, int n) override {
    std::vector<fp16_t> h(head_dim_);
    try {
      for (int i = 0; i < n; ++i) {
        reserve(static_cast<std::size_t>(size_all()) + 1);
        to_f16(keys + static_cast<std::size_t>(i) * head_dim_, h.data());
        graph_->addPoint(h.data(), static_cast<hnswlib::labeltype>(slots[i]));
      }
    } catch (const std::exception& e) {
      return error(errc::internal, "retrieval: hnsw index: {}", e.what());
    }
    return {};
  }

  void search(const float* q, int k, std::vector<std::int32_t>& out) const override {
    if (!graph_ || size() == 0 || k <= 0) return;
    std::vector<fp16_t> h(head_dim_);
    to_f16(q, h.data());
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

  void clear() override { graph_.reset(); }

  int size() const override { return graph_ ? size_all() - static_cast<int>(graph_->num_deleted_) : 0; }

  // hnswlib's allocations: per element of capacity, the level-0 record (f16
  // key, 2M links, label), a link-list pointer, a level, a lock and an entry
  // of one visited list; the upper-level link lists of the elements above
  // level 0; the label map.
  std::size_t memory_bytes() const override {
    if (!graph_) return 0;
    const auto& g = *graph_;
    std::size_t bytes = g.max_elements_ * (g.size_data_per_element_ + sizeof(void*) + sizeof(int) +
                                           sizeof(std::mutex) + sizeof(hnswlib::vl_type));
    for (std::size_t i = 0; i < g.cur_element_count; ++i)
      bytes += static_cast<std::size_t>(g.element_levels_[i]) * g.size_links_per_element_;
    bytes += g.label_lookup_.size() * (sizeof(hnswlib::labeltype) + sizeof(hnswlib::tableint) + 2 * sizeof(void*)) +
             g.label_lookup_.bucket_count() * sizeof(void*);
    return bytes;
  }

 private:
  int size_all() const { return graph_ ? static_cast<int>(graph_->cur_element_count) : 0; }

  void to_f16(const float* x, fp16_t* h) const {
    for (int d = 0; d < head_dim_; ++d) h[d] = f32_to_fp16(x[d]);
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
  ip_f16_space space_;
  std::unique_ptr<hnswlib::HierarchicalNSW<float>> graph_;
};

}  // namespace

std::unique_ptr<key_index> make_hnsw_index(int head_dim, const hnsw_params& p) {
  return std::make_unique<hnsw_index>(head_dim, p);
}

}  // namespace pagoda
