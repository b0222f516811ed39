// Folding evicted tokens into kept ones (the merge policies, kv_gather.h):
// plain arithmetic on decoded K/V rows of one (layer, KV head), so it tests
// alone. Masses count tokens: an entry standing for m tokens has mass m, and
// attention adds log m to its score (the per-slot bias), so the softmax gives
// it the weight m copies of it would have had.
#pragma once

#include <cstdint>
#include <span>

namespace pagoda {

// Rows of one (layer, KV head): kept entries [n_kept][dim] and evicted ones
// [n_evicted][dim], with their masses.
struct kv_fold_rows {
  int dim = 0;
  float* kept_k = nullptr;         // [n_kept][dim], updated in place
  float* kept_v = nullptr;         // [n_kept][dim], updated in place
  float* kept_mass = nullptr;      // [n_kept], updated in place
  int n_kept = 0;
  const float* evicted_k = nullptr;   // [n_evicted][dim]
  const float* evicted_v = nullptr;   // [n_evicted][dim]
  const float* evicted_mass = nullptr;  // [n_evicted]
  int n_evicted = 0;
};

// Each evicted entry joins the kept entry whose key is most similar (cosine;
// ties: the lowest index); every kept entry becomes the mass-weighted mean of
// itself and what joined it. REQUIRES n_kept >= 1.
void fold_nearest(const kv_fold_rows& rows);

// k-means on keys: the entries at `anchors` (indices into the kept ones)
// start as centroids; the members are the anchors' own entries and the evicted
// ones; `iterations` rounds of assigning each member to the nearest centroid
// (squared distance; ties: the lowest anchor) and moving each centroid to its
// members' mass-weighted mean. Each anchor then holds its cluster's mean K and
// V and its total mass; an anchor whose cluster ends empty keeps its own entry.
void fold_cluster(const kv_fold_rows& rows, std::span<const std::int32_t> anchors, int iterations = 3);

}  // namespace pagoda
