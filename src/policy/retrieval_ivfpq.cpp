// The IVF-PQ key index (retrieval_index.h) on faiss.
#include <faiss/IndexFlat.h>
#include <faiss/IndexIVFPQ.h>
#include <faiss/impl/IDSelector.h>
#include <faiss/invlists/InvertedLists.h>
#include <omp.h>

#include <cstdint>
#include <algorithm>
#include <exception>
#include <limits>
#include <memory>

#include "core/assert.h"
#include "policy/retrieval_index.h"

namespace pagoda {
namespace {

// faiss parallelises with OpenMP; the engine has threads of its own, so faiss
// runs on the calling thread (this sets the caller's own OpenMP ICV only).
void faiss_on_this_thread() {
  if (omp_get_max_threads() != 1) omp_set_num_threads(1);
}

class ivfpq_index final : public key_index {
 public:
  ivfpq_index(int head_dim, const ivfpq_params& p)
      : head_dim_(head_dim), params_(p), n_train_(p.resolved_n_train()) {}

  status add(const float* keys, const std::int32_t* slots, int n) override {
    try {
      if (trained()) return add_to_lists(keys, slots, n);
      pending_keys_.insert(pending_keys_.end(), keys, keys + static_cast<std::size_t>(n) * head_dim_);
      pending_slots_.insert(pending_slots_.end(), slots, slots + n);
      if (static_cast<int>(pending_slots_.size()) >= n_train_) return train_pending();
    } catch (const std::exception& e) {
      return error(errc::internal, "retrieval: ivfpq index: {}", e.what());
    }
    return {};
  }

  void search(const float* q, int k, std::vector<std::int32_t>& out) const override {
    search_rows(q, 1, head_dim_, k, out);
  }

  // One faiss call for the rows (its per-call set-up is paid once); the
  // result buffers are per thread, reused from step to step.
  void search_rows(const float* q, int n_q, int head_dim, int k, std::vector<std::int32_t>& out) const override {
    if (!trained()) {
      for (int r = 0; r < n_q; ++r)
        exact_top_k(q + static_cast<std::size_t>(r) * head_dim, pending_keys_.data(), pending_slots_.data(),
                    static_cast<int>(pending_slots_.size()), head_dim_, k, out);
      return;
    }
    PAGODA_ASSERT(head_dim == head_dim_, "ivfpq: query rows of {} values, keys of {}", head_dim, head_dim_);
    const faiss::Index::idx_t kk = std::min<faiss::Index::idx_t>(k, ivf_->ntotal);
    if (kk <= 0 || n_q <= 0) return;
    faiss_on_this_thread();
    thread_local std::vector<float> dist;
    thread_local std::vector<faiss::Index::idx_t> labels;
    dist.resize(static_cast<std::size_t>(kk) * n_q);
    labels.resize(static_cast<std::size_t>(kk) * n_q);
    if (params_.own_coarse) {
      thread_local std::vector<faiss::Index::idx_t> assign;
      thread_local std::vector<float> coarse;
      assign_lists(q, n_q, assign, coarse);
      if (const auto* lists = own_scan_lists()) return scan_rows(q, n_q, kk, assign, coarse, *lists, out);
      ivf_->search_preassigned(n_q, q, kk, assign.data(), coarse.data(), dist.data(), labels.data(), false);
    } else {
      ivf_->search(n_q, q, kk, dist.data(), labels.data());
    }
    for (faiss::Index::idx_t l : labels)
      if (l >= 0) out.push_back(static_cast<std::int32_t>(l));
  }

  void remove_from(std::int32_t slot) override {
    if (!trained()) return erase_slots_from(pending_keys_, pending_slots_, head_dim_, slot);
    faiss_on_this_thread();
    faiss::IDSelectorRange sel(slot, std::numeric_limits<faiss::Index::idx_t>::max());
    ivf_->remove_ids(sel);
  }

  void clear() override {
    if (trained()) {
      ivf_->reset();  // the lists empty; the quantizers stay trained
      return;
    }
    pending_keys_.clear();
    pending_slots_.clear();
  }

  bool needs_training() const override { return !trained(); }

  status train(const float* keys, int n) override {
    PAGODA_ASSERT(size() == 0, "ivfpq: train() on an index holding {} keys", size());
    try {
      train_on(keys, n);
    } catch (const std::exception& e) {
      return error(errc::internal, "retrieval: ivfpq index: {}", e.what());
    }
    return {};
  }

  int size() const override { return static_cast<int>(trained() ? ivf_->ntotal : static_cast<faiss::Index::idx_t>(pending_slots_.size())); }

  // Before training: the buffered keys. After: the coarse centroids, the PQ
  // codebooks and any precomputed tables, and the inverted lists' codes and
  // ids as allocated.
  std::size_t memory_bytes() const override {
    std::size_t bytes = pending_keys_.capacity() * sizeof(float) +
                        pending_slots_.capacity() * sizeof(std::int32_t);
    if (!trained()) return bytes;
    bytes += static_cast<std::size_t>(quantizer_->ntotal) * head_dim_ * sizeof(float);
    bytes += ivf_->pq.centroids.capacity() * sizeof(float) + ivf_->precomputed_table.size() * sizeof(float);
    if (const auto* lists = dynamic_cast<const faiss::ArrayInvertedLists*>(ivf_->invlists)) {
      for (std::size_t i = 0; i < lists->nlist; ++i)
        bytes += lists->codes[i].capacity() + lists->ids[i].capacity() * sizeof(faiss::Index::idx_t) +
                 2 * sizeof(std::vector<std::uint8_t>);
    }
    return bytes;
  }

 private:
  bool trained() const { return ivf_ != nullptr; }

  // The lists, when this index's search can scan them itself: 8-bit codes in
  // faiss's in-memory lists (faiss's IndexIVFPQ is by residual: a key's inner
  // product is q . centroid + the PQ table's terms).
  const faiss::ArrayInvertedLists* own_scan_lists() const {
    if (ivf_->pq.nbits != 8 || !ivf_->by_residual || ivf_->metric_type != faiss::METRIC_INNER_PRODUCT) return nullptr;
    return dynamic_cast<const faiss::ArrayInvertedLists*>(ivf_->invlists);
  }

  // What faiss's IVF-PQ scan computes, with the per-query table in SIMD
  // (dots_f32) and the codes summed by pq_scan: per row, the kk keys of the
  // largest approximate q . key over the assigned lists, largest first (ties
  // to the smaller slot), appended to out.
  void scan_rows(const float* q, int n_q, faiss::Index::idx_t kk, const std::vector<faiss::Index::idx_t>& assign,
                 const std::vector<float>& coarse, const faiss::ArrayInvertedLists& lists,
                 std::vector<std::int32_t>& out) const {
    const faiss::ProductQuantizer& pq = ivf_->pq;
    const int m_sub = static_cast<int>(pq.M), ksub = static_cast<int>(pq.ksub), dsub = static_cast<int>(pq.dsub);
    thread_local std::vector<float> table, scores;
    thread_local std::vector<std::pair<float, faiss::Index::idx_t>> cand;
    table.resize(static_cast<std::size_t>(m_sub) * ksub);
    const auto nprobe = static_cast<std::size_t>(ivf_->nprobe);
    for (int r = 0; r < n_q; ++r) {
      const float* qr = q + static_cast<std::size_t>(r) * head_dim_;
      for (int m = 0; m < m_sub; ++m)
        dots_f32(qr + static_cast<std::size_t>(m) * dsub, pq.centroids.data() + static_cast<std::size_t>(m) * ksub * dsub,
                 ksub, dsub, table.data() + static_cast<std::size_t>(m) * ksub);
      cand.clear();
      for (std::size_t j = 0; j < nprobe; ++j) {
        const faiss::Index::idx_t l = assign[static_cast<std::size_t>(r) * nprobe + j];
        if (l < 0) continue;
        const auto& ids = lists.ids[static_cast<std::size_t>(l)];
        const int n = static_cast<int>(ids.size());
        scores.resize(static_cast<std::size_t>(n));
        pq_scan(table.data(), m_sub, lists.codes[static_cast<std::size_t>(l)].data(), n,
                coarse[static_cast<std::size_t>(r) * nprobe + j], scores.data());
        for (int i = 0; i < n; ++i) cand.emplace_back(scores[static_cast<std::size_t>(i)], ids[static_cast<std::size_t>(i)]);
      }
      const auto take = static_cast<std::ptrdiff_t>(std::min<std::size_t>(static_cast<std::size_t>(kk), cand.size()));
      auto better = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
      std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), better);
      for (std::ptrdiff_t i = 0; i < take; ++i) out.push_back(static_cast<std::int32_t>(cand[static_cast<std::size_t>(i)].second));
    }
  }

  // What faiss's coarse quantizer (IndexFlatIP) gives a search: per row the
  // nprobe lists of the largest q . centroid, in descending order (ties to
  // the smaller list), and those inner products: assign and coarse
  // [n_q][index nprobe] (-1 and -inf past the lists there are).
  void assign_lists(const float* q, int n_q, std::vector<faiss::Index::idx_t>& assign, std::vector<float>& coarse) const {
    thread_local std::vector<float> scores;
    thread_local std::vector<int> order;
    const int nlist = static_cast<int>(quantizer_->ntotal);
    const int nprobe = std::min(static_cast<int>(ivf_->nprobe), nlist);
    assign.resize(static_cast<std::size_t>(n_q) * ivf_->nprobe);
    coarse.resize(assign.size());
    scores.resize(static_cast<std::size_t>(nlist));
    order.resize(static_cast<std::size_t>(nlist));
    const float* centroids = quantizer_->get_xb();
    for (int r = 0; r < n_q; ++r) {
      dots_f32(q + static_cast<std::size_t>(r) * head_dim_, centroids, nlist, head_dim_, scores.data());
      for (int i = 0; i < nlist; ++i) order[static_cast<std::size_t>(i)] = i;
      std::partial_sort(order.begin(), order.begin() + nprobe, order.end(), [&](int a, int b) {
        return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
      });
      faiss::Index::idx_t* out = assign.data() + static_cast<std::size_t>(r) * ivf_->nprobe;
      float* dis = coarse.data() + static_cast<std::size_t>(r) * ivf_->nprobe;
      for (int j = 0; j < static_cast<int>(ivf_->nprobe); ++j) {
        out[j] = j < nprobe ? order[static_cast<std::size_t>(j)] : -1;
        dis[j] = j < nprobe ? scores[order[static_cast<std::size_t>(j)]] : -std::numeric_limits<float>::infinity();
      }
    }
  }

  // k-means for the coarse lists and PQ codebooks on the buffered keys, which
  // then become the first entries of the lists.
  status train_pending() {
    const auto n = static_cast<faiss::Index::idx_t>(pending_slots_.size());
    train_on(pending_keys_.data(), static_cast<int>(n));
    status s = add_to_lists(pending_keys_.data(), pending_slots_.data(), static_cast<int>(n));
    std::vector<float>().swap(pending_keys_);  // releases the capacity
    std::vector<std::int32_t>().swap(pending_slots_);
    return s;
  }

  // The coarse lists and codebooks from n keys; the lists stay empty.
  void train_on(const float* keys, int n) {
    faiss_on_this_thread();
    quantizer_ = std::make_unique<faiss::IndexFlatIP>(head_dim_);
    auto ivf = std::make_unique<faiss::IndexIVFPQ>(quantizer_.get(), head_dim_, params_.nlist, params_.m, params_.nbits,
                                                   faiss::METRIC_INNER_PRODUCT);
    // 10 k-means iterations rather than faiss's 25: the coarse lists and
    // codebooks barely move after that (training runs on the retrieval
    // selector's builder thread, once per layer and KV head).
    ivf->cp.seed = 1234;
    ivf->pq.cp.seed = 1234;
    ivf->cp.niter = 10;
    ivf->pq.cp.niter = 10;
    ivf->nprobe = params_.nprobe;
    ivf->train(n, keys);
    ivf_ = std::move(ivf);
  }

  status add_to_lists(const float* keys, const std::int32_t* slots, int n) {
    faiss_on_this_thread();
    std::vector<faiss::Index::idx_t> ids(slots, slots + n);
    ivf_->add_with_ids(n, keys, ids.data());
    return {};
  }

  int head_dim_;
  ivfpq_params params_;
  int n_train_;
  std::vector<float> pending_keys_;  // [pending][head_dim]: the training set, searched exactly until trained
  std::vector<std::int32_t> pending_slots_;
  std::unique_ptr<faiss::IndexFlatIP> quantizer_;  // outlives ivf_ (declared first)
  std::unique_ptr<faiss::IndexIVFPQ> ivf_;
};

}  // namespace

std::unique_ptr<key_index> make_ivfpq_index(int head_dim, const ivfpq_params& p) {
  return std::make_unique<ivfpq_index>(head_dim, p);
}

}  // namespace pagoda
