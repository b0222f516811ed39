#include "kv/kv_merge.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace pagoda {

int kv_merge_head::find(int s) const {
  for (int e = 0; e < shape.retain; ++e)
    if (slot(e) == s) return e;
  return -1;
}

void kv_merge_head::drop_from(int n_tokens) const {
  for (int e = 0; e < shape.retain; ++e)
    if (slot(e) >= n_tokens) entry(e)[0] = 0.0f;
}

namespace {
double norm_of(const float* x, int dim) {
  double s = 0;
  for (int i = 0; i < dim; ++i) s += static_cast<double>(x[i]) * x[i];
  return std::sqrt(s);
}
double dot_of(const float* a, const float* b, int dim) {
  double s = 0;
  for (int i = 0; i < dim; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}
}  // namespace

float kv_row_divergence(const float* a, const float* b, int dim) {
  const double na = norm_of(a, dim), nb = norm_of(b, dim);
  if (na == 0 || nb == 0) return 1.0f;
  const double c = std::clamp(dot_of(a, b, dim) / (na * nb), -1.0, 1.0);
  return static_cast<float>(std::acos(c) / std::numbers::pi);
}

float kv_merge_rows(const float* a, const float* b, int dim, float t, float* out) {
  const double na = norm_of(a, dim), nb = norm_of(b, dim);
  if (na == 0) {
    std::fill(out, out + dim, 0.0f);
    return 0.0f;
  }
  if (nb == 0) {
    std::copy(a, a + dim, out);
    return 0.0f;
  }
  const double c = std::clamp(dot_of(a, b, dim) / (na * nb), -1.0, 1.0);
  const double omega = std::acos(c);
  double wa, wb;  // weights of a/|a| and b/|b|
  if (std::sin(omega) < 1e-6) {
    // Nearly parallel (or opposite: no unique great circle): interpolate
    // linearly and normalise, or keep a's direction when that cancels.
    wa = 1.0 - t;
    wb = t;
  } else {
    wa = std::sin((1.0 - t) * omega) / std::sin(omega);
    wb = std::sin(t * omega) / std::sin(omega);
  }
  double n2 = 0;
  for (int i = 0; i < dim; ++i) {
    const double e = wa * a[i] / na + wb * b[i] / nb;
    n2 += e * e;
  }
  const double ne = std::sqrt(n2);
  if (ne < 1e-12) {
    std::copy(a, a + dim, out);
  } else {
    // Slerp of unit vectors is a unit vector; normalising removes the rounding
    // (and the length the linear fallback loses).
    for (int i = 0; i < dim; ++i) out[i] = static_cast<float>(na * (wa * a[i] / na + wb * b[i] / nb) / ne);
  }
  return static_cast<float>(nb / na);
}

int kv_merge_choose(const kv_merge_head& h, float divergence) {
  int empty = -1, least = -1;
  for (int e = 0; e < h.shape.retain; ++e) {
    if (h.slot(e) < 0) {
      if (empty < 0) empty = e;
    } else if (least < 0 || h.divergence(e) < h.divergence(least)) {
      least = e;
    }
  }
  if (empty >= 0) return empty;
  // Full: displace the least divergent (the earliest of equals) only for a strictly larger one.
  return least >= 0 && divergence > h.divergence(least) ? least : -1;
}

void kv_merge_token(const kv_merge_head& h, int slot, const kv_merge_rows_in& in, float t, float* scratch_k,
                    float* scratch_v, kv_merge_write writes[2], const kv_merge_decode& decode) {
  const int hd = h.shape.head_dim;
  const float d = 0.5f * (kv_row_divergence(in.a_k, in.b_k, hd) + kv_row_divergence(in.a_v, in.b_v, hd));
  writes[0] = {slot, scratch_k, scratch_v};
  writes[1] = {};
  if (const int again = h.find(slot); again >= 0) h.entry(again)[0] = 0.0f;  // a slot written anew
  const int e = kv_merge_choose(h, d);
  if (e < 0) {
    h.ratio_k()[slot] = kv_merge_rows(in.a_k, in.b_k, hd, t, scratch_k);
    h.ratio_v()[slot] = kv_merge_rows(in.a_v, in.b_v, hd, t, scratch_v);
    return;
  }
  if (const int old = h.slot(e); old >= 0) {
    // The displaced token: merged from the producer's row as stored and its retained own rows.
    float* a_k = scratch_k + 2 * static_cast<std::size_t>(hd);
    float* a_v = scratch_v + 2 * static_cast<std::size_t>(hd);
    decode(old, a_k, a_v);
    h.ratio_k()[old] = kv_merge_rows(a_k, h.k(e), hd, t, scratch_k + hd);
    h.ratio_v()[old] = kv_merge_rows(a_v, h.v(e), hd, t, scratch_v + hd);
    writes[1] = {old, scratch_k + hd, scratch_v + hd};
  }
  float* en = h.entry(e);
  en[0] = static_cast<float>(slot + 1);
  en[1] = d;
  std::copy(in.b_k, in.b_k + hd, h.k(e));
  std::copy(in.b_v, in.b_v + hd, h.v(e));
  std::copy(in.a_k, in.a_k + hd, scratch_k);
  std::copy(in.a_v, in.a_v + hd, scratch_v);
  h.ratio_k()[slot] = 0.0f;  // the reader reads its own rows there
  h.ratio_v()[slot] = 0.0f;
}

}  // namespace pagoda
