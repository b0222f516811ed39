// The int4 Quest bound (quest.h: quest_bounds4): per-channel power-of-two
// scales, nibble codes of each block's min and max, the folded query, and the
// reference twin and dispatch of the kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "core/cpu.h"
#include "policy/quest.h"
#include "policy/quest_kernels.h"

namespace pagoda {

void quest_channel_scales(std::span<const key_summary> sample, int head_dim, float* scales) {
  std::vector<float> mags;
  float largest = 0;
  for (int d = 0; d < head_dim; ++d) {
    mags.clear();
    for (const key_summary& s : sample) {
      const float m = std::max(std::fabs(s.min[d]), std::fabs(s.max[d]));
      if (std::isfinite(m)) mags.push_back(m);
    }
    float med = 0;
    if (!mags.empty()) {
      std::nth_element(mags.begin(), mags.begin() + mags.size() / 2, mags.end());
      med = mags[mags.size() / 2];
    }
    scales[d] = med;
    largest = std::max(largest, med);
  }
  // The least power of two >= m (frexp: m = f 2^e, f in [0.5, 1)), within
  // 2^+-100 (q_d s_d of a usual query neither overflows nor underflows).
  const float floor = largest > 0 ? largest / 64 : 1.0f;
  for (int d = 0; d < head_dim; ++d) {
    int e = 0;
    if (std::frexp(std::max(scales[d], floor), &e) == 0.5f) --e;
    scales[d] = std::ldexp(1.0f, std::clamp(e, -100, 100));
  }
}

quest_block8 quest_encode_block4(const key_summary& s, int head_dim, const float* scales, std::uint8_t* codes) {
  const int half = quest4_padded_dim(head_dim) / 2;
  std::fill_n(codes, 2 * half, std::uint8_t{0x88});  // code 0 in both nibbles
  quest_block8 b;
  double m = 0;
  for (int d = 0; d < head_dim; ++d) {
    if (!std::isfinite(s.min[d]) || !std::isfinite(s.max[d])) {
      b.scale = INFINITY;  // no finite bound: the block is always read
      return b;
    }
    m = std::max({m, std::fabs(s.min[d] / static_cast<double>(scales[d])), std::fabs(s.max[d] / static_cast<double>(scales[d]))});
  }
  if (m == 0) return b;  // every key is 0: so is every score
  b.scale = static_cast<float>(m / 7 * (1 + 1.0 / 1024));  // headroom as quest_encode_block's
  const double sc = b.scale;
  auto put = [&](std::uint8_t* side, int d, int code) {
    const int g = d / k_quest4_align, j = d % k_quest4_align;
    std::uint8_t& byte = side[g * (k_quest4_align / 2) + j % (k_quest4_align / 2)];
    const int shift = j < k_quest4_align / 2 ? 0 : 4;
    byte = static_cast<std::uint8_t>((byte & ~(0xF << shift)) | ((code + 8) << shift));
  };
  for (int d = 0; d < head_dim; ++d) {
    // Outward, in double (y = x / s_d is exact: s_d is a power of two).
    const double ylo = s.min[d] / static_cast<double>(scales[d]), yhi = s.max[d] / static_cast<double>(scales[d]);
    double lo = std::floor(ylo / sc), hi = std::ceil(yhi / sc);
    if (sc * lo > ylo) lo -= 1;
    if (sc * hi < yhi) hi += 1;
    const int cl = static_cast<int>(std::clamp(lo, -7.0, 7.0)), ch = static_cast<int>(std::clamp(hi, -7.0, 7.0));
    put(codes, d, -cl);  // negated: one accumulator sums pos x hi + neg x (-lo)
    put(codes + half, d, ch);
    b.l1 += std::abs(cl) + std::abs(ch);
  }
  return b;
}

void quest_encode_query4(const float* q, int n_rows, int head_dim, const float* scales, quest_query4& out) {
  thread_local std::vector<float> folded;
  folded.resize(static_cast<std::size_t>(n_rows) * head_dim);
  for (int r = 0; r < n_rows; ++r)
    for (int d = 0; d < head_dim; ++d)
      folded[static_cast<std::size_t>(r) * head_dim + d] = q[static_cast<std::size_t>(r) * head_dim + d] * scales[d];
  quest_detail::encode_query(folded.data(), n_rows, head_dim, quest4_padded_dim(head_dim), out.q);
  out.bias.assign((n_rows + 3) / 4 * 4, 0);
  out.half_scale.assign(out.bias.size(), 0.0f);
  const std::size_t pd = out.q.padded_dim;
  for (int r = 0; r < n_rows; ++r) {
    for (std::size_t d = 0; d < pd; ++d) out.bias[r] += 8 * (out.q.pos[r * pd + d] + out.q.neg[r * pd + d]);
    out.half_scale[r] = 0.5f * out.q.scale[r];
  }
}

namespace {
// Channel d's code of block side 0 (min: nibble = 8 - code) or 1 (max: nibble = code + 8).
int code4(const std::uint8_t* codes, int side, int d) {
  const int g = d / k_quest4_align, j = d % k_quest4_align;
  const std::uint8_t byte = codes[g * (k_quest4_align / 2) + j % (k_quest4_align / 2)];
  const int nib = j < k_quest4_align / 2 ? byte & 0xF : byte >> 4;
  return side == 0 ? 8 - nib : nib - 8;
}
}  // namespace

void quest_bounds4_ref(const quest_query4& q, const std::uint8_t* codes, const quest_block8* blocks, int n, float* out) {
  const int pd = q.q.padded_dim;
  quest_detail::bounds_ref(q.q, blocks, n, out, [&](int i, int side, int d) {
    return code4(codes + static_cast<std::size_t>(i) * pd + side * pd / 2, side, d);
  });
}

void quest_bounds4(const quest_query4& q, const std::uint8_t* codes, const quest_block8* blocks, int n, float* out) {
  switch (active_simd_level()) {
    case simd_level::avx512: return quest_detail::bounds4_avx512(q, codes, blocks, n, out);
    case simd_level::avx2: return quest_detail::bounds4_avx2(q, codes, blocks, n, out);
    case simd_level::scalar: break;
  }
  quest_bounds4_ref(q, codes, blocks, n, out);
}

}  // namespace pagoda
