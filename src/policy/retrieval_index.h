// Approximate nearest-neighbour indexes over the keys of one (layer, KV head)
// of one sequence, for retrieval attention (retrieval.h): a query's top-k keys
// by inner product q.k. One small interface, three implementations:
//
//   exact   brute force over f32 copies (tests, benchmarks' ground truth);
//   hnsw    hnswlib's HNSW graph over f16 copies of the keys. A graph over
//           inner products finds poorly (-q.k is no metric: keys of large
//           norm crowd out the rest), so the search is made a Euclidean one
//           (Bachrach et al. 2014, as RetrievalAttention does): each key k
//           gets one more coordinate e = sqrt(M^2 - |k|^2), M a bound on the
//           norms, a query gets 0, and |q' - k'|^2 = |q|^2 + M^2 - 2 q.k ranks
//           keys exactly by q.k. When a key exceeds M, the graph is rebuilt
//           from its own copies with a larger bound. (f16 halves the copy and
//           the bytes a search reads; hnswlib's own spaces are f32.)
//   ivfpq   faiss IndexIVFPQ, inner-product metric: trained once on the first
//           n_train keys (k-means for the coarse lists, PQ on the residuals),
//           then incremental adds; until trained it searches exactly over the
//           keys it buffers for training.
//
// Every key carries its KV slot number as its label. An index is not
// synchronised: its owner (retrieval_selector) serialises adds, removals and
// searches of one index (a search is const, and searches of different
// indexes run concurrently). faiss runs on the caller's thread
// (its OpenMP team is limited to 1 for the calling thread). Errors of the
// libraries (exceptions) never leave this module.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "pagoda/status.h"

namespace pagoda {

class key_index {
 public:
  virtual ~key_index() = default;
  // Adds n keys [n][head_dim] with labels slots[n] (each slot once, unless
  // it was forgotten by remove_from in between).
  [[nodiscard]] virtual status add(const float* keys, const std::int32_t* slots, int n) = 0;
  // Appends up to k slots whose keys have (approximately) the largest q.k, in
  // no particular order. q is [head_dim] f32.
  virtual void search(const float* q, int k, std::vector<std::int32_t>& out) const = 0;
  // search() for each of n_q query rows [n_q][head_dim], the results appended
  // one row after another (IVF-PQ searches the rows in one call).
  virtual void search_rows(const float* q, int n_q, int head_dim, int k, std::vector<std::int32_t>& out) const {
    for (int r = 0; r < n_q; ++r) search(q + static_cast<std::size_t>(r) * head_dim, k, out);
  }
  // Forgets every slot >= slot (a rollback; the slots may be added again).
  virtual void remove_from(std::int32_t slot) = 0;
  // Forgets every key (training, if any, is kept).
  virtual void clear() = 0;
  // Whether add() would first buffer keys until it can train (ivfpq, untrained).
  virtual bool needs_training() const { return false; }
  // Trains on n keys [n][head_dim] (a sample) without adding them; a no-op for
  // indexes that need no training. REQUIRES: size() == 0. The retrieval
  // selector trains a private index this way on its background thread, so
  // the expensive k-means never runs where a search waits.
  [[nodiscard]] virtual status train(const float* keys, int n) { return {}; }
  // Keys it can return.
  virtual int size() const = 0;
  // Bytes it holds, allocated capacity included.
  virtual std::size_t memory_bytes() const = 0;
};

struct hnsw_params {
  int m = 16;                 // graph degree (hnswlib's M; level 0 keeps 2M links)
  int ef_construction = 100;  // candidate list while inserting
  int ef_search = 64;         // candidate list while searching (at least k)
};

struct ivfpq_params {
  int nlist = 256;   // coarse lists (k-means centroids)
  int m = 16;        // PQ sub-quantizers; must divide head_dim
  int nbits = 8;     // bits per sub-quantizer code (2^nbits centroids each)
  int nprobe = 16;   // lists a search visits
  int n_train = 0;   // keys to train on; 0: 39 x max(nlist, 2^nbits), faiss's minimum for k-means
  // Searches pick the lists to visit themselves (SIMD inner products with the
  // coarse centroids, then faiss's search_preassigned) instead of through
  // faiss's coarse quantizer, whose inner products Debian's build computes
  // without SIMD; false: faiss's own search (the reference, for tests).
  bool own_coarse = true;
  int resolved_n_train() const;
};

// Errors name the parameter ("retrieval: pq_m 12 does not divide head_dim 128").
status check_hnsw_params(const hnsw_params& p);
status check_ivfpq_params(const ivfpq_params& p, int head_dim);

std::unique_ptr<key_index> make_exact_index(int head_dim);
std::unique_ptr<key_index> make_hnsw_index(int head_dim, const hnsw_params& p);
// REQUIRES: check_ivfpq_params(p, head_dim) is OK.
std::unique_ptr<key_index> make_ivfpq_index(int head_dim, const ivfpq_params& p);

// The exact top-k (largest q.k, ties to the smaller slot) of n keys
// [n][head_dim] labelled slots[n], appended to out in descending score order.
void exact_top_k(const float* q, const float* keys, const std::int32_t* slots, int n, int head_dim, int k,
                 std::vector<std::int32_t>& out);

// Removes the entries whose slot is >= slot from keys [n][head_dim] and
// slots [n], keeping the order of the others.
void erase_slots_from(std::vector<float>& keys, std::vector<std::int32_t>& slots, int head_dim, std::int32_t slot);

// out[i] = q . rows[i] for n_rows rows [n_rows][dim] (IVF-PQ's coarse
// centroids); dispatches on the SIMD level. The reference twin sums in float
// in index order; the SIMD one in 8 lanes (results differ by rounding).
void dots_f32(const float* q, const float* rows, int n_rows, int dim, float* out);
void dots_f32_ref(const float* q, const float* rows, int n_rows, int dim, float* out);

// IVF-PQ's list scan (8-bit codes, inner product): out[i] = base + the sum
// over m < m_sub of table[m * 256 + codes[i * m_sub + m]], added in m order
// (so every level gives the same bits).
void pq_scan(const float* table, int m_sub, const std::uint8_t* codes, int n, float base, float* out);

// sum (a[i] - b[i])^2 over f16 vectors, for the HNSW distance; dispatches on
// the SIMD level. The reference twin sums in float in index order.
float l2sq_f16(const std::uint16_t* a, const std::uint16_t* b, int n);
float l2sq_f16_ref(const std::uint16_t* a, const std::uint16_t* b, int n);

}  // namespace pagoda
