// The exact index, top-k selection, parameter checks and the f16 inner
// product (retrieval_index.h). HNSW and IVF-PQ live in their own files.
#include "policy/retrieval_index.h"

#include <algorithm>
#include <utility>

#include "core/cpu.h"
#include "core/half.h"

namespace pagoda {

float l2sq_f16_avx2(const std::uint16_t* a, const std::uint16_t* b, int n);  // retrieval_index_avx2.cpp
void dots_f32_avx2(const float* q, const float* rows, int n_rows, int dim, float* out);  // retrieval_index_avx2.cpp

namespace {

float dot_f32(const float* a, const float* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Brute force over f32 copies.
class exact_index final : public key_index {
 public:
  explicit exact_index(int head_dim) : head_dim_(head_dim) {}

  status add(const float* keys, const std::int32_t* slots, int n) override {
    keys_.insert(keys_.end(), keys, keys + static_cast<std::size_t>(n) * head_dim_);
    slots_.insert(slots_.end(), slots, slots + n);
    return {};
  }
  void search(const float* q, int k, std::vector<std::int32_t>& out) const override {
    exact_top_k(q, keys_.data(), slots_.data(), size(), head_dim_, k, out);
  }
  void remove_from(std::int32_t slot) override { erase_slots_from(keys_, slots_, head_dim_, slot); }
  void clear() override {
    keys_.clear();
    slots_.clear();
  }
  int size() const override { return static_cast<int>(slots_.size()); }
  std::size_t memory_bytes() const override {
    return keys_.capacity() * sizeof(float) + slots_.capacity() * sizeof(std::int32_t);
  }

 private:
  int head_dim_;
  std::vector<float> keys_;          // [size][head_dim]
  std::vector<std::int32_t> slots_;  // [size]
};

}  // namespace

void erase_slots_from(std::vector<float>& keys, std::vector<std::int32_t>& slots, int head_dim, std::int32_t slot) {
  std::size_t w = 0;
  const auto hd = static_cast<std::size_t>(head_dim);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] >= slot) continue;
    slots[w] = slots[i];
    std::copy_n(keys.begin() + static_cast<std::ptrdiff_t>(i * hd), hd, keys.begin() + static_cast<std::ptrdiff_t>(w * hd));
    ++w;
  }
  slots.resize(w);
  keys.resize(w * hd);
}

void exact_top_k(const float* q, const float* keys, const std::int32_t* slots, int n, int head_dim, int k,
                 std::vector<std::int32_t>& out) {
  k = std::min(k, n);
  if (k <= 0) return;
  std::vector<std::pair<float, std::int32_t>> scored(n);
  for (int i = 0; i < n; ++i) scored[i] = {dot_f32(q, keys + static_cast<std::size_t>(i) * head_dim, head_dim), slots[i]};
  auto better = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  std::partial_sort(scored.begin(), scored.begin() + k, scored.end(), better);
  for (int i = 0; i < k; ++i) out.push_back(scored[i].second);
}

float l2sq_f16_ref(const std::uint16_t* a, const std::uint16_t* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float d = fp16_to_f32(a[i]) - fp16_to_f32(b[i]);
    s += d * d;
  }
  return s;
}

float l2sq_f16(const std::uint16_t* a, const std::uint16_t* b, int n) {
  // AVX-512 adds little here: a head's 128 f16 values are eight 256-bit loads.
  if (active_simd_level() >= simd_level::avx2) return l2sq_f16_avx2(a, b, n);
  return l2sq_f16_ref(a, b, n);
}

int ivfpq_params::resolved_n_train() const { return n_train > 0 ? n_train : 39 * std::max(nlist, 1 << nbits); }

status check_hnsw_params(const hnsw_params& p) {
  if (p.m < 2 || p.m > 256) return error(errc::invalid_argument, "retrieval: m {} must be in [2, 256]", p.m);
  if (p.ef_construction < 1 || p.ef_construction > 4096)
    return error(errc::invalid_argument, "retrieval: ef_construction {} must be in [1, 4096]", p.ef_construction);
  if (p.ef_search < 1 || p.ef_search > 65536)
    return error(errc::invalid_argument, "retrieval: ef_search {} must be in [1, 65536]", p.ef_search);
  return {};
}

status check_ivfpq_params(const ivfpq_params& p, int head_dim) {
  if (p.nlist < 1 || p.nlist > 65536) return error(errc::invalid_argument, "retrieval: nlist {} must be in [1, 65536]", p.nlist);
  if (p.nbits < 1 || p.nbits > 12) return error(errc::invalid_argument, "retrieval: nbits {} must be in [1, 12]", p.nbits);
  if (p.nprobe < 1 || p.nprobe > p.nlist)
    return error(errc::invalid_argument, "retrieval: nprobe {} must be in [1, nlist = {}]", p.nprobe, p.nlist);
  if (p.m < 1) return error(errc::invalid_argument, "retrieval: pq_m {} must be at least 1", p.m);
  if (head_dim > 0 && head_dim % p.m != 0)
    return error(errc::invalid_argument, "retrieval: pq_m {} does not divide head_dim {}", p.m, head_dim);
  const int need = std::max(p.nlist, 1 << p.nbits);
  if (p.n_train != 0 && p.n_train < need)
    return error(errc::invalid_argument, "retrieval: train {} is below max(nlist, 2^nbits) = {} (k-means needs a key per centroid)",
                 p.n_train, need);
  if (p.n_train < 0 || p.n_train > (1 << 22)) return error(errc::invalid_argument, "retrieval: train {} must be in [0, 4194304]", p.n_train);
  return {};
}

std::unique_ptr<key_index> make_exact_index(int head_dim) { return std::make_unique<exact_index>(head_dim); }

void dots_f32_ref(const float* q, const float* rows, int n_rows, int dim, float* out) {
  for (int i = 0; i < n_rows; ++i) out[i] = dot_f32(q, rows + static_cast<std::size_t>(i) * dim, dim);
}

void dots_f32(const float* q, const float* rows, int n_rows, int dim, float* out) {
  if (active_simd_level() >= simd_level::avx2) return dots_f32_avx2(q, rows, n_rows, dim, out);
  dots_f32_ref(q, rows, n_rows, dim, out);
}

void pq_scan(const float* table, int m_sub, const std::uint8_t* codes, int n, float base, float* out) {
  // Four codes at a time: four independent chains of adds (the same order as one at a time).
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    const std::uint8_t* c = codes + static_cast<std::size_t>(i) * m_sub;
    float s0 = base, s1 = base, s2 = base, s3 = base;
    for (int m = 0; m < m_sub; ++m) {
      const float* t = table + m * 256;
      s0 += t[c[m]];
      s1 += t[c[m_sub + m]];
      s2 += t[c[2 * m_sub + m]];
      s3 += t[c[3 * m_sub + m]];
    }
    out[i] = s0;
    out[i + 1] = s1;
    out[i + 2] = s2;
    out[i + 3] = s3;
  }
  for (; i < n; ++i) {
    const std::uint8_t* c = codes + static_cast<std::size_t>(i) * m_sub;
    float s = base;
    for (int m = 0; m < m_sub; ++m) s += table[m * 256 + c[m]];
    out[i] = s;
  }
}

}  // namespace pagoda
