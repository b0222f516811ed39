// AVX-512 (BW, VL, VNNI) kernels for the super-block formats: q2_K, q3_K,
// q4_K, q5_K, q6_K, iq4_xs and iq3_s, against q8_K activations. Weights are
// read in the file's layout (nothing is packed or repacked).
//
// A super-block of 256 weights is decoded in registers in four k-steps of 64
// bytes. Each format's bytes unpack most cheaply into some fixed order of its
// elements (q4_K's low nibbles of 64 bytes are elements 0..31 and 64..95, for
// instance), so the activations are stored in that order instead: at prepare
// time each q8_K super-block's 256 values are permuted (perm_of), once per row,
// and the weight bytes need no shuffling. Per pair and super-block:
//
//   s = 0; for k < 4: s = dpwssd(s, maddubs(u_k, x_k), sc_k)       (exact int32)
//   [offset formats] s = dpwssd(s, bsums, -C * sc_g)                (q3_K, q6_K, iq3_s)
//   f = float(s) * d
//   [min formats]    f = fnmadd(float(madd(bsums, mn_g)), dmin, f)  (q2_K, q4_K, q5_K)
//   acc = fma(f, dx, acc)
//
// then hsum16 over the super-blocks' lanes. u_k are unsigned weight bytes: the
// stored value itself (q2_K 0..3, q4_K 0..15, q5_K 0..31) or value + C with the
// offset C cancelled by the bsums term (q3_K C = 4, q6_K 32, iq3_s 16, whose
// signs are applied to the grid values first). maddubs sums two u8 x s8
// products into int16 without saturating as long as u <= 129 (2 x 129 x 127 <
// 2^15); all these formats stay below 64. sc_k holds each int16 lane's group
// scale (16 or 32 elements share one), so the scale multiply is part of the
// dpwssd. iq4_xs's table values (-127..113) do not fit that bound as u + 128,
// so it multiplies |w| by x with w's signs (one masked subtract per pair).
//
// Bounds: per lane and super-block |s| <= 8 x 2 x 64 x 127 x 128 < 2^24 before
// the bsums term, so the int32 sums are exact. Every pair's sequence is fixed
// by n_in alone (batch invariance, model/matmul.h).
#include <immintrin.h>

#include <cstring>

#include "model/matmul_internal.h"
#include "model/matmul_simd_avx512.h"

namespace pagoda::matmul_detail {
namespace {

constexpr int k_kr = 3;  // rows per tile
constexpr int k_kc = 2;  // columns per tile

// ---------------------------------------------------------------------------
// Activation permutations: byte 64k + i of a prepared super-block holds value
// perm(64k + i) of the natural order.
// ---------------------------------------------------------------------------
enum class perm_kind { natural, k4, k23, xs };

perm_kind perm_of(tensor_type t) {
  switch (t) {
    case tensor_type::q4_k:
    case tensor_type::q5_k: return perm_kind::k4;
    case tensor_type::q2_k:
    case tensor_type::q3_k: return perm_kind::k23;
    case tensor_type::iq4_xs: return perm_kind::xs;
    default: return perm_kind::natural;  // q6_K, iq3_s
  }
}

constexpr int permuted_element(perm_kind kind, int p) {
  const int k = p / 64, i = p % 64, h = k / 2, hi = k % 2;
  switch (kind) {
    case perm_kind::k4: return 128 * h + 64 * (i / 32) + 32 * hi + i % 32;     // nibble hi of qs[64h + i]
    case perm_kind::k23: return 128 * (i / 32) + 32 * k + i % 32;              // 2-bit field k of qs[i]
    case perm_kind::xs: return 32 * (4 * h + i / 16) + 16 * hi + i % 16;       // nibble hi of qs[64h + i]
    default: return p;
  }
}

struct perm_table {
  std::uint8_t src[k_qk_k];
};
constexpr perm_table make_perm(perm_kind kind) {
  perm_table t{};
  for (int p = 0; p < k_qk_k; ++p) t.src[p] = static_cast<std::uint8_t>(permuted_element(kind, p));
  return t;
}
constexpr perm_table k_perm_k4 = make_perm(perm_kind::k4);
constexpr perm_table k_perm_k23 = make_perm(perm_kind::k23);
constexpr perm_table k_perm_xs = make_perm(perm_kind::xs);

// ---------------------------------------------------------------------------
// Shared pieces
// ---------------------------------------------------------------------------


inline std::uint32_t load_u32(const std::byte* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline __m512i load512(const std::byte* p) { return _mm512_loadu_si512(p); }
// 32 bytes at p in both halves of a zmm.
inline __m512i dup256(const std::byte* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Low (hi = 0) or high nibbles of the 64 bytes at p.
inline __m512i nibbles(const std::byte* p, int hi) {
  __m512i v = load512(p);
  if (hi) v = _mm512_srli_epi16(v, 4);
  return _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
}
// Per-byte mask: bit `lo_bit` for bytes 0..31, bit `hi_bit` for bytes 32..63.
inline __m512i half_bits(int lo_bit, int hi_bit) {
  return _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << lo_bit)),
                            _mm256_set1_epi8(static_cast<char>(1 << hi_bit)), 1);
}
// Eight bytes -> eight int16 lanes (zero-extended) in the low lanes of a zmm.
inline __m512i bytes8_to_i16(std::uint64_t v) { return _mm512_zextsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(v)))); }
// Sixteen bytes -> sixteen int16 lanes in the low half of a zmm.
inline __m512i bytes16_to_i16(__m128i v) { return _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(v)); }

// Lane maps for vpermw: scale_index<K>(t) = the group of int16 lane t at step K.
struct lane_map {
  alignas(64) std::int16_t idx[4][32];
};
template <typename F>
constexpr lane_map make_map(F f) {
  lane_map m{};
  for (int k = 0; k < 4; ++k)
    for (int t = 0; t < 32; ++t) m.idx[k][t] = static_cast<std::int16_t>(f(k, t));
  return m;
}
inline __m512i map_vec(const lane_map& m, int k) { return _mm512_load_si512(m.idx[k]); }

// Sub-block (of 32) of lane t at step k for the k4 order; 16-groups for the
// k23 and natural orders; sub-blocks for the xs and natural (iq3_s) orders.
constexpr lane_map k_map_k4 = make_map([](int k, int t) { return 4 * (k / 2) + 2 * (t / 16) + k % 2; });
constexpr lane_map k_map_k23 = make_map([](int k, int t) { return 8 * (t / 16) + 2 * k + (t / 8) % 2; });
constexpr lane_map k_map_natural16 = make_map([](int k, int t) { return 4 * k + t / 8; });
constexpr lane_map k_map_xs = make_map([](int k, int t) { return 4 * (k / 2) + t / 8; });
constexpr lane_map k_map_natural32 = make_map([](int k, int t) { return 2 * k + t / 16; });
// Group g (of 16) -> its sub-block g / 2, for expanding 8 per-32 values to 16 lanes.
constexpr lane_map k_map_pairs = make_map([](int, int t) { return t < 16 ? t / 2 : 0; });

// The 16 per-group values in lanes 0..15 from 8 per-sub-block values (upper lanes zero).
inline __m512i expand_pairs(__m512i v8) { return _mm512_maskz_permutexvar_epi16(0xffff, map_vec(k_map_pairs, 0), v8); }
inline __m512i neg_shifted(__m512i v, int shift) { return _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(v, shift)); }

// ---------------------------------------------------------------------------
// Formats. Each provides:
//   bytes            block size
//   k_corr           s += dpwssd(bsums, col.g16): an offset folded into the d term
//   k_min            f -= float(madd(bsums, col.g16)) * dmin
//   k_signed         weights() returns signed bytes (sign trick)
//   col load(p)      per-column state for one super-block
//   weights(col, k)  the 64 weight bytes of step k, in the activation order
//   scales(col, k)   the int16 group scale of each lane of step k
// ---------------------------------------------------------------------------

struct col_state {
  const std::byte* p;
  __m512i sc;   // scales (vpermw source)
  __m512i g16;  // per-16-group correction or min, lanes 0..15
  __m512i aux;  // format-specific (high-bit bytes)
  float d, dmin;
};

struct fmt_q2_k {
  static constexpr std::size_t bytes = sizeof(block_q2_k);
  static constexpr bool k_corr = false, k_min = true, k_signed = false;
  static col_state load(const std::byte* p) {
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i m4 = _mm_set1_epi8(0x0f);
    return {p, bytes16_to_i16(_mm_and_si128(s, m4)), bytes16_to_i16(_mm_and_si128(_mm_srli_epi16(s, 4), m4)),
            _mm512_setzero_si512(), load_half(p + 80), load_half(p + 82)};
  }
  static __m512i weights(const col_state& c, int k) {
    return _mm512_and_si512(_mm512_srli_epi16(load512(c.p + 16), 2 * k), _mm512_set1_epi8(3));
  }
  static __m512i scales(const col_state& c, int k) { return _mm512_permutexvar_epi16(map_vec(k_map_k23, k), c.sc); }
};

struct fmt_q3_k {
  static constexpr std::size_t bytes = sizeof(block_q3_k);
  static constexpr bool k_corr = true, k_min = false, k_signed = false;
  static col_state load(const std::byte* p) {
    const std::uint32_t a0 = load_u32(p + 96), a1 = load_u32(p + 100), a2 = load_u32(p + 104);
    const std::uint32_t m4 = 0x0f0f0f0f, m2 = 0x03030303;
    const __m128i s6 = _mm_setr_epi32(static_cast<int>((a0 & m4) | (a2 & m2) << 4),
                                      static_cast<int>((a1 & m4) | ((a2 >> 2) & m2) << 4),
                                      static_cast<int>(((a0 >> 4) & m4) | ((a2 >> 4) & m2) << 4),
                                      static_cast<int>(((a1 >> 4) & m4) | ((a2 >> 6) & m2) << 4));
    const __m512i sc = _mm512_maskz_sub_epi16(0xffff, bytes16_to_i16(s6), _mm512_set1_epi16(32));
    return {p, sc, neg_shifted(sc, 2), dup256(p), load_half(p + 108), 0.0f};
  }
  static __m512i weights(const col_state& c, int k) {
    const __m512i v = _mm512_and_si512(_mm512_srli_epi16(load512(c.p + 32), 2 * k), _mm512_set1_epi8(3));
    const __mmask64 high = _mm512_test_epi8_mask(c.aux, half_bits(k, 4 + k));
    return _mm512_mask_add_epi8(v, high, v, _mm512_set1_epi8(4));
  }
  static __m512i scales(const col_state& c, int k) { return _mm512_permutexvar_epi16(map_vec(k_map_k23, k), c.sc); }
};

// q4_K / q5_K scales and mins (ggml's get_scale_min_k4, eight at a time).
inline void k4_scales(const std::byte* p, col_state& c) {
  const std::uint32_t w0 = load_u32(p + 4), w1 = load_u32(p + 8), w2 = load_u32(p + 12);
  const std::uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  const std::uint64_t sc = (w0 & m6) | static_cast<std::uint64_t>((w2 & m4) | ((w0 >> 6) & m2) << 4) << 32;
  const std::uint64_t mn = (w1 & m6) | static_cast<std::uint64_t>(((w2 >> 4) & m4) | ((w1 >> 6) & m2) << 4) << 32;
  c.sc = bytes8_to_i16(sc);
  c.g16 = expand_pairs(bytes8_to_i16(mn));
  c.d = load_half(p);
  c.dmin = load_half(p + 2);
}

struct fmt_q4_k {
  static constexpr std::size_t bytes = sizeof(block_q4_k);
  static constexpr bool k_corr = false, k_min = true, k_signed = false;
  static col_state load(const std::byte* p) {
    col_state c{p, {}, {}, _mm512_setzero_si512(), 0, 0};
    k4_scales(p, c);
    return c;
  }
  static __m512i weights(const col_state& c, int k) { return nibbles(c.p + 16 + 64 * (k / 2), k % 2); }
  static __m512i scales(const col_state& c, int k) { return _mm512_permutexvar_epi16(map_vec(k_map_k4, k), c.sc); }
};

struct fmt_q5_k {
  static constexpr std::size_t bytes = sizeof(block_q5_k);
  static constexpr bool k_corr = false, k_min = true, k_signed = false;
  static col_state load(const std::byte* p) {
    col_state c{p, {}, {}, dup256(p + 16), 0, 0};
    k4_scales(p, c);
    return c;
  }
  static __m512i weights(const col_state& c, int k) {
    const int h = k / 2, hi = k % 2;
    const __m512i v = nibbles(c.p + 48 + 64 * h, hi);
    const __mmask64 high = _mm512_test_epi8_mask(c.aux, half_bits(4 * h + hi, 4 * h + 2 + hi));
    return _mm512_mask_add_epi8(v, high, v, _mm512_set1_epi8(16));
  }
  static __m512i scales(const col_state& c, int k) { return _mm512_permutexvar_epi16(map_vec(k_map_k4, k), c.sc); }
};

struct fmt_q6_k {
  static constexpr std::size_t bytes = sizeof(block_q6_k);
  static constexpr bool k_corr = true, k_min = false, k_signed = false;
  static col_state load(const std::byte* p) {
    const __m512i sc = _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192))));
    return {p, sc, neg_shifted(sc, 5), _mm512_setzero_si512(), load_half(p + 208), 0.0f};
  }
  // Natural order: step k is half n = k / 2; its low (k even) or high nibbles
  // of ql[64n ..] with the 2-bit fields of qh[32n ..] moved to bits 4-5.
  static __m512i weights(const col_state& c, int k) {
    const int n = k / 2;
    const __m512i lo4 = nibbles(c.p + 64 * n, k % 2);
    const __m512i qh = dup256(c.p + 128 + 32 * n);
    const __m512i count = _mm512_inserti64x4(_mm512_set1_epi16(k % 2 ? 0 : 4), _mm256_set1_epi16(2), 1);
    const __m512i shifted = k % 2 ? _mm512_srlv_epi16(qh, count) : _mm512_sllv_epi16(qh, count);
    return _mm512_or_si512(lo4, _mm512_and_si512(shifted, _mm512_set1_epi8(0x30)));
  }
  static __m512i scales(const col_state& c, int k) {
    return _mm512_permutexvar_epi16(map_vec(k_map_natural16, k), c.sc);
  }
};

struct fmt_iq4_xs {
  static constexpr std::size_t bytes = sizeof(block_iq4_xs);
  static constexpr bool k_corr = false, k_min = false, k_signed = true;
  static col_state load(const std::byte* p) {
    std::uint16_t sh;
    std::memcpy(&sh, p + 2, 2);
    const std::uint64_t ls = _pdep_u64(load_u32(p + 4), 0x0f0f0f0f0f0f0f0full) | _pdep_u64(sh, 0x3030303030303030ull);
    const __m512i sc = _mm512_maskz_sub_epi16(0xff, bytes8_to_i16(ls), _mm512_set1_epi16(32));
    return {p, sc, _mm512_setzero_si512(), _mm512_setzero_si512(), load_half(p), 0.0f};
  }
  static __m512i weights(const col_state& c, int k) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k_iq4nl_values)));
    return _mm512_shuffle_epi8(table, nibbles(c.p + 8 + 64 * (k / 2), k % 2));
  }
  static __m512i scales(const col_state& c, int k) { return _mm512_permutexvar_epi16(map_vec(k_map_xs, k), c.sc); }
};

struct fmt_iq3_s {
  static constexpr std::size_t bytes = sizeof(block_iq3_s);
  static constexpr bool k_corr = true, k_min = false, k_signed = false;
  static col_state load(const std::byte* p) {
    const std::uint64_t nib = _pdep_u64(load_u32(p + 106), 0x0f0f0f0f0f0f0f0full);
    const __m512i sc8 = bytes8_to_i16(nib);
    const __m512i sc = _mm512_maskz_add_epi16(0xff, _mm512_add_epi16(sc8, sc8), _mm512_set1_epi16(1));
    return {p, sc, neg_shifted(expand_pairs(sc), 4), _mm512_setzero_si512(), load_half(p), 0.0f};
  }
  // Natural order: step k holds grid groups 16k .. 16k + 15, signs applied,
  // plus the offset 16.
  static __m512i weights(const col_state& c, int k) {
    __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c.p + 2 + 16 * k)));
    std::uint16_t qh;
    std::memcpy(&qh, c.p + 66 + 2 * k, 2);
    idx = _mm512_or_si512(idx, _mm512_maskz_mov_epi32(qh, _mm512_set1_epi32(256)));
    const __m512i grid = _mm512_i32gather_epi32(idx, k_iq3s_grid, 4);
    std::uint64_t signs;
    std::memcpy(&signs, c.p + 74 + 8 * k, 8);
    const __m512i off = _mm512_set1_epi8(16);
    return _mm512_mask_sub_epi8(_mm512_add_epi8(grid, off), signs, off, grid);
  }
  static __m512i scales(const col_state& c, int k) {
    return _mm512_permutexvar_epi16(map_vec(k_map_natural32, k), c.sc);
  }
};

// ---------------------------------------------------------------------------
// The tile kernel: y[r][c] for r < R, c < C.
// ---------------------------------------------------------------------------


template <typename F>
struct kq_tile {
  template <int R, int C>
  struct shape {
    static void run(const kq_act_rows& a, const std::byte* w, std::size_t w_stride, std::int64_t nsb, float* y,
                    std::int64_t ldy);
  };
};

template <typename F>
template <int R, int C>
void kq_tile<F>::shape<R, C>::run(const kq_act_rows& a, const std::byte* w, std::size_t w_stride, std::int64_t nsb,
                                  float* y, std::int64_t ldy) {
  __m512 acc[R][C];
  zero_tile(acc, _mm512_setzero_ps());
  for (std::int64_t b = 0; b < nsb; ++b) {
    col_state cs[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) cs[c] = F::load(w + c * w_stride + static_cast<std::size_t>(b) * F::bytes);
    __m512i s[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) s[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      __m512i wk[C], sk[C];
      __mmask64 neg[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        wk[c] = F::weights(cs[c], k);
        sk[c] = F::scales(cs[c], k);
        if constexpr (F::k_signed) {
          neg[c] = _mm512_movepi8_mask(wk[c]);
          wk[c] = _mm512_abs_epi8(wk[c]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i xk = _mm512_load_si512(a.qs(r, b, 64 * k));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          __m512i xs = xk;
          if constexpr (F::k_signed) xs = _mm512_mask_sub_epi8(xk, neg[c], _mm512_setzero_si512(), xk);
          s[r][c] = _mm512_dpwssd_epi32(s[r][c], _mm512_maddubs_epi16(wk[c], xs), sk[c]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i bsums = _mm512_zextsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(a.bsums(r, b))));
      const __m512 dx = _mm512_set1_ps(a.dx(r, b));
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        if constexpr (F::k_corr) s[r][c] = _mm512_dpwssd_epi32(s[r][c], bsums, cs[c].g16);
        __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s[r][c]), _mm512_set1_ps(cs[c].d));
        if constexpr (F::k_min)
          f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(bsums, cs[c].g16)), _mm512_set1_ps(cs[c].dmin), f);
        acc[r][c] = _mm512_fmadd_ps(f, dx, acc[r][c]);
      }
    }
  }
  store_tile(acc, y, ldy, hsum16);
}


}  // namespace

std::size_t kq_act_row_bytes_avx512(tensor_type, std::int64_t n_in) {
  return plain_act_row_bytes(act_format::q8_k, n_in);
}

// The plain q8_K layout, then each super-block's values in the format's order.
void kq_prepare_avx512(tensor_type t, const float* x, std::int64_t m, std::int64_t n_in, std::byte* act,
                       std::size_t row_bytes) {
  prepare_plain(act_format::q8_k, x, m, n_in, act, row_bytes, quantize_block_q8);
  const perm_kind kind = perm_of(t);
  if (kind == perm_kind::natural) return;
  const perm_table& perm = kind == perm_kind::k4 ? k_perm_k4 : kind == perm_kind::k23 ? k_perm_k23 : k_perm_xs;
  std::int8_t natural[k_qk_k];
  for (std::int64_t i = 0; i < m; ++i) {
    auto* qs = reinterpret_cast<std::int8_t*>(act + static_cast<std::size_t>(i) * row_bytes);
    for (std::int64_t b = 0; b < n_in / k_qk_k; ++b) {
      std::int8_t* sb = qs + b * k_qk_k;
      std::memcpy(natural, sb, k_qk_k);
      for (int p = 0; p < k_qk_k; ++p) sb[p] = natural[perm.src[p]];
    }
  }
}

std::int64_t kq_col_tile_avx512(tensor_type) { return k_kc; }

int kq_act_element_avx512(tensor_type t, int p) { return permuted_element(perm_of(t), p); }

void kq_cols_avx512(const job& jb, std::int64_t c0, std::int64_t c1) {
  switch (jb.w->type) {
    case tensor_type::q2_k: return kq_cols<kq_tile<fmt_q2_k>::template shape, k_kr, k_kc>(jb, c0, c1);
    case tensor_type::q3_k: return kq_cols<kq_tile<fmt_q3_k>::template shape, k_kr, k_kc>(jb, c0, c1);
    case tensor_type::q4_k: return kq_cols<kq_tile<fmt_q4_k>::template shape, k_kr, k_kc>(jb, c0, c1);
    case tensor_type::q5_k: return kq_cols<kq_tile<fmt_q5_k>::template shape, k_kr, k_kc>(jb, c0, c1);
    case tensor_type::q6_k: return kq_cols<kq_tile<fmt_q6_k>::template shape, k_kr, k_kc>(jb, c0, c1);
    case tensor_type::iq4_xs: return kq_cols<kq_tile<fmt_iq4_xs>::template shape, k_kr, k_kc>(jb, c0, c1);
    case tensor_type::iq3_s: return kq_cols<kq_tile<fmt_iq3_s>::template shape, k_kr, k_kc>(jb, c0, c1);
    default: return;  // avx512_cols sends only these here
  }
}

}  // namespace pagoda::matmul_detail
