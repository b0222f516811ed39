// The retrieval selector's builder (retrieval_build.h): sealed blocks into the
// indexes, beside the forward pass.
#include "policy/retrieval_build.h"

#include <algorithm>

#include "core/half.h"

namespace pagoda {

retrieval_builder::retrieval_builder(retrieval_selector& sel, bool background) : sel_(sel), background_(background) {
  if (background_) thread_ = std::thread([this] { loop(); });
}

retrieval_builder::~retrieval_builder() {
  if (!background_) return;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    queue_.clear();
    gen_.fetch_add(1, std::memory_order_acq_rel);
  }
  wake_.notify_all();
  thread_.join();
}

void retrieval_builder::push(int layer, int b0, int b1) {
  const job j{layer, b0, b1, gen_.load(std::memory_order_acquire)};
  if (!background_) return run(j);
  {
    std::lock_guard lock(mu_);
    queue_.push_back(j);
  }
  wake_.notify_one();
}

void retrieval_builder::cancel() {
  std::lock_guard lock(mu_);
  queue_.clear();
  gen_.fetch_add(1, std::memory_order_acq_rel);
}

void retrieval_builder::wait_idle() {
  if (!background_) return;
  std::unique_lock lock(mu_);
  idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
}

std::size_t retrieval_builder::memory_bytes() const { return scratch_bytes_.load(std::memory_order_relaxed); }

void retrieval_builder::loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const job j = queue_.front();
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    run(j);
    lock.lock();
    busy_ = false;
    if (queue_.empty()) idle_.notify_all();
  }
}

void retrieval_builder::run(const job& j) {
  run_heads(j);
  // A prompt's job holds a whole head's keys: give them back.
  std::vector<float>().swap(keys_);
  std::vector<float>().swap(sample_);
  std::vector<std::int32_t>().swap(slots_);
  scratch_bytes_.store(0, std::memory_order_relaxed);
}

void retrieval_builder::run_heads(const job& j) {
  const retrieval_params& p = sel_.params_;
  const auto hd = static_cast<std::size_t>(sel_.head_dim_);
  constexpr int shift = 8;  // the copy's chunk rows (retrieval_selector.cpp)
  for (int h = 0; h < sel_.n_kv_heads_ && current(j); ++h) {
    retrieval_selector::head_state& hs = sel_.heads_[sel_.row(j.layer, h)];
    int start;
    bool fresh;
    {
      std::lock_guard lock(hs.mu);
      start = hs.indexed_end;
      fresh = hs.ix->size() == 0;
    }
    if (start >= j.b1) continue;  // a head already past this job (queued again after a cancel)
    keys_.clear();
    slots_.clear();
    {
      std::lock_guard lock(sel_.copy_mu_);
      if (!current(j)) return;
      const auto& live = sel_.layers_[j.layer].live;
      for (int s = start; s < j.b1 && static_cast<std::size_t>(s) < live.size(); ++s) {
        if (!live[static_cast<std::size_t>(s)]) continue;
        const std::uint16_t* r = hs.chunks[static_cast<std::size_t>(s >> shift)] +
                                 static_cast<std::size_t>(s & ((1 << shift) - 1)) * hd;
        for (std::size_t d = 0; d < hd; ++d) keys_.push_back(fp16_to_f32(r[d]));
        slots_.push_back(s);
      }
    }
    const int n = static_cast<int>(slots_.size());
    scratch_bytes_.store((keys_.capacity() + sample_.capacity()) * sizeof(float) + slots_.capacity() * sizeof(std::int32_t),
                         std::memory_order_relaxed);
    status st;
    if (fresh) {
      // Nothing published yet: build privately, so no search waits for the
      // training or for adding a whole prompt's keys.
      std::unique_ptr<key_index> ix = make_retrieval_index(p, sel_.head_dim_);
      if (ix->needs_training()) {
        const int need = std::max(p.ivfpq.nlist, 1 << p.ivfpq.nbits);
        if (n < need) continue;  // too few live keys to train: served exactly until more seal
        // The sample: n_train keys spread evenly over the keys there are.
        const int m = std::min(n, p.ivfpq.resolved_n_train());
        sample_.resize(static_cast<std::size_t>(m) * hd);
        for (int i = 0; i < m; ++i) {
          const auto src = static_cast<std::size_t>(static_cast<std::int64_t>(i) * n / m);
          std::copy_n(keys_.begin() + static_cast<std::ptrdiff_t>(src * hd), hd,
                      sample_.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i) * hd));
        }
        st = ix->train(sample_.data(), m);
      }
      if (st.ok() && n > 0) st = ix->add(keys_.data(), slots_.data(), n);
      std::lock_guard lock(hs.mu);
      if (!current(j)) return;
      if (st.ok()) {
        hs.ix = std::move(ix);
        hs.indexed_end = j.b1;
      }
    } else {
      std::lock_guard lock(hs.mu);
      if (!current(j)) return;
      if (n > 0) st = hs.ix->add(keys_.data(), slots_.data(), n);
      if (st.ok()) hs.indexed_end = j.b1;
    }
    if (!st.ok()) sel_.fail(j.layer, st);
  }
}

}  // namespace pagoda
