#include "kv/kv_fold.h"

#include <cmath>
#include <limits>
#include <vector>

#include "core/assert.h"

namespace pagoda {
namespace {

double dot(const float* a, const float* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

double squared_distance(const float* a, const double* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) {
    const double d = a[i] - b[i];
    s += d * d;
  }
  return s;
}

// Mass-weighted sums of K and V and the total mass of one group.
struct group_sum {
  std::vector<double> k, v;
  double mass = 0;
  void reset(int dim) {
    k.assign(static_cast<std::size_t>(dim), 0.0);
    v.assign(static_cast<std::size_t>(dim), 0.0);
    mass = 0;
  }
  void add(const float* key, const float* value, double m, int dim) {
    for (int d = 0; d < dim; ++d) {
      k[static_cast<std::size_t>(d)] += m * key[d];
      v[static_cast<std::size_t>(d)] += m * value[d];
    }
    mass += m;
  }
  void store(float* key, float* value, float* m, int dim) const {
    for (int d = 0; d < dim; ++d) {
      key[d] = static_cast<float>(k[static_cast<std::size_t>(d)] / mass);
      value[d] = static_cast<float>(v[static_cast<std::size_t>(d)] / mass);
    }
    *m = static_cast<float>(mass);
  }
};

}  // namespace

void fold_nearest(const kv_fold_rows& r) {
  PAGODA_ASSERT(r.n_kept >= 1, "folding into no kept entry");
  const int dim = r.dim;
  std::vector<double> norm(static_cast<std::size_t>(r.n_kept));
  for (int i = 0; i < r.n_kept; ++i) norm[static_cast<std::size_t>(i)] = std::sqrt(dot(r.kept_k + i * dim, r.kept_k + i * dim, dim));
  std::vector<group_sum> groups(static_cast<std::size_t>(r.n_kept));
  for (int i = 0; i < r.n_kept; ++i) {
    groups[static_cast<std::size_t>(i)].reset(dim);
    groups[static_cast<std::size_t>(i)].add(r.kept_k + i * dim, r.kept_v + i * dim, r.kept_mass[i], dim);
  }
  for (int e = 0; e < r.n_evicted; ++e) {
    const float* k = r.evicted_k + static_cast<std::size_t>(e) * dim;
    int best = 0;
    double best_cos = -std::numeric_limits<double>::infinity();
    for (int i = 0; i < r.n_kept; ++i) {
      const double n = norm[static_cast<std::size_t>(i)];
      const double c = n > 0 ? dot(k, r.kept_k + static_cast<std::size_t>(i) * dim, dim) / n : 0.0;
      if (c > best_cos) {
        best_cos = c;
        best = i;
      }
    }
    groups[static_cast<std::size_t>(best)].add(k, r.evicted_v + static_cast<std::size_t>(e) * dim, r.evicted_mass[e], dim);
  }
  for (int i = 0; i < r.n_kept; ++i)
    groups[static_cast<std::size_t>(i)].store(r.kept_k + i * dim, r.kept_v + i * dim, r.kept_mass + i, dim);
}

void fold_cluster(const kv_fold_rows& r, std::span<const std::int32_t> anchors, int iterations) {
  const int dim = r.dim;
  const int n_a = static_cast<int>(anchors.size());
  if (n_a == 0) return;
  // Members: each anchor's own entry, then the evicted ones.
  const int n_m = n_a + r.n_evicted;
  auto member_k = [&](int m) {
    return m < n_a ? r.kept_k + static_cast<std::size_t>(anchors[static_cast<std::size_t>(m)]) * dim
                   : r.evicted_k + static_cast<std::size_t>(m - n_a) * dim;
  };
  auto member_v = [&](int m) {
    return m < n_a ? r.kept_v + static_cast<std::size_t>(anchors[static_cast<std::size_t>(m)]) * dim
                   : r.evicted_v + static_cast<std::size_t>(m - n_a) * dim;
  };
  auto member_mass = [&](int m) {
    return m < n_a ? r.kept_mass[anchors[static_cast<std::size_t>(m)]] : r.evicted_mass[m - n_a];
  };
  std::vector<double> centroid(static_cast<std::size_t>(n_a) * dim);
  for (int a = 0; a < n_a; ++a)
    for (int d = 0; d < dim; ++d) centroid[static_cast<std::size_t>(a) * dim + d] = member_k(a)[d];
  std::vector<int> assign(static_cast<std::size_t>(n_m), 0);
  std::vector<group_sum> groups(static_cast<std::size_t>(n_a));
  for (int it = 0; it < std::max(iterations, 1); ++it) {
    for (int m = 0; m < n_m; ++m) {
      int best = 0;
      double best_d = std::numeric_limits<double>::infinity();
      for (int a = 0; a < n_a; ++a) {
        const double dd = squared_distance(member_k(m), centroid.data() + static_cast<std::size_t>(a) * dim, dim);
        if (dd < best_d) {
          best_d = dd;
          best = a;
        }
      }
      assign[static_cast<std::size_t>(m)] = best;
    }
    for (auto& g : groups) g.reset(dim);
    for (int m = 0; m < n_m; ++m) groups[static_cast<std::size_t>(assign[static_cast<std::size_t>(m)])].add(member_k(m), member_v(m), member_mass(m), dim);
    for (int a = 0; a < n_a; ++a) {
      const group_sum& g = groups[static_cast<std::size_t>(a)];
      if (g.mass <= 0) continue;  // empty: the centroid stays
      for (int d = 0; d < dim; ++d) centroid[static_cast<std::size_t>(a) * dim + d] = g.k[static_cast<std::size_t>(d)] / g.mass;
    }
  }
  for (int a = 0; a < n_a; ++a) {
    const group_sum& g = groups[static_cast<std::size_t>(a)];
    if (g.mass <= 0) continue;
    const auto i = static_cast<std::size_t>(anchors[static_cast<std::size_t>(a)]);
    g.store(r.kept_k + i * dim, r.kept_v + i * dim, r.kept_mass + i, dim);
  }
}

}  // namespace pagoda
