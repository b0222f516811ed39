// AVX-512 (BW, VL, VNNI) kernels for the super-block formats: q2_K, q3_K,
// q4_K, q5_K, q6_K, iq4_xs and iq3_s, against q8_K activations. Weights are
// read in the file's layout (nothing is packed or repacked).
//
// A super-block of 256 weights is decoded in registers in four k-steps of 64
// bytes. Each format's bytes unpack most cheaply into some fixed order of its
// elements (q4_K's low nibbles of 64 bytes are elements 0..31 and 64..95, for
// instance), so the activations are stored in that order instead: the q8_K
// quantizer writes each super-block's 256 values there (perm_of), once per row,
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
// Bounds: per lane and super-block, four dpwssd steps of two products each,
// |s| <= 4 x 2 x (2 x 63 x 127) x 128 < 2^24 (q6_K, the largest), so the int32
// sums never overflow and convert to f32 exactly before the bsums term. Every
// pair's sequence is fixed by n_in alone (batch invariance, model/matmul.h):
// tile shapes and threads only decide which pairs run side by side.
//
// Decode reads every weight once: its tiles take one column at a time and
// prefetch k_decode_prefetch_bytes ahead in the column range's stream of rows
// (matmul_internal.h); batch tiles prefetch each column's next super-block one
// tile ahead.
#include <immintrin.h>

#include <cstring>

#include "model/matmul_internal.h"
#include "model/matmul_simd_avx512.h"

namespace pagoda::matmul_detail {
namespace {

// Tile shapes: one row by one column for decode (m < 3), reading one stream
// of weights: from L2 four columns side by side give more independent work
// (q4_K 1.2x, q6_K 1.1x faster), but from memory, where decode runs, the one
// column was 1.04-1.35x faster at one and two threads but for q5_K at one
// thread (0.97x; bench/RESULTS.md); three rows by two columns
// for batches (weights decoded once for three rows). Threads split columns on
// multiples of four, so both shapes keep whole tiles.
constexpr int k_decode_rows = 1, k_decode_cols = 1;
constexpr int k_batch_rows = 3, k_batch_cols = 2;
constexpr int k_col_tile = 4;

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
// Group g (of 16) -> lane 8 + g / 2, where k4_scales keeps the mins.
constexpr lane_map k_map_k4_mins = make_map([](int, int t) { return t < 16 ? 8 + t / 2 : 0; });
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

// q4_K / q5_K scales and mins (ggml's get_scale_min_k4) in one xmm: with b
// the 12 scale bytes, scale j is b[j] & 63 (j < 4) or (b[j + 4] & 15) |
// (b[j - 4] >> 6) << 4, min j is b[j + 4] & 63 (j < 4) or (b[j + 4] >> 4) |
// (b[j] >> 6) << 4. Lanes 0..7 of c.sc get the scales, 8..15 the mins; c.g16
// has each group of 16's min.
inline void k4_scales(const std::byte* p, col_state& c) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));  // d, dmin, b[0..11]
  // low bits: b[j] / b[j + 4] (6 bits) or the nibble of b[j + 4]
  const __m128i lo_src = _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m128i lo = _mm_shuffle_epi8(v, lo_src);
  const __m128i low6 = _mm_and_si128(lo, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  const __m128i high_nib = _mm_and_si128(_mm_srli_epi16(lo, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
  // high 2 bits from b[j - 4] (scales 4..7) and b[j] (mins 4..7), moved to bits 4..5
  const __m128i hi_src = _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(_mm_shuffle_epi8(v, hi_src), 2), _mm_set1_epi8(0x30));
  const __m128i bytes = _mm_or_si128(_mm_or_si128(low6, high_nib), hi);
  c.sc = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(bytes));
  c.g16 = _mm512_maskz_permutexvar_epi16(0xffff, map_vec(k_map_k4_mins, 0), c.sc);
  const __m128 dm = _mm_cvtph_ps(v);  // d, dmin
  c.d = _mm_cvtss_f32(dm);
  c.dmin = _mm_cvtss_f32(_mm_movehdup_ps(dm));
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


// Stream: the decode tiles' prefetch (k_decode_prefetch_bytes down the
// stream) instead of the same super-block one tile ahead.
template <typename F, bool Stream>
struct kq_tile {
  template <int R, int C>
  struct shape {
    static void run(const kq_act_rows& a, const std::byte* w, std::size_t w_stride, std::int64_t nsb, float* y,
                    std::int64_t ldy);
  };
};

template <typename F, bool Stream>
template <int R, int C>
void kq_tile<F, Stream>::shape<R, C>::run(const kq_act_rows& a, const std::byte* w, std::size_t w_stride,
                                          std::int64_t nsb, float* y, std::int64_t ldy) {
  __m512 acc[R][C];
  zero_tile(acc, _mm512_setzero_ps());
  for (std::int64_t b = 0; b < nsb; ++b) {
    col_state cs[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const std::byte* p = w + c * w_stride + static_cast<std::size_t>(b) * F::bytes;
      // Into L1 as it goes (the tiles of a column range are consecutive rows);
      // where batch tiles fetched the next tile into L2 at the tile's start,
      // q6_K reached half the read bandwidth.
      const std::size_t ahead = Stream ? k_decode_prefetch_bytes : C * w_stride;
      for (std::size_t o = 0; o < F::bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + ahead + o), _MM_HINT_T0);
      cs[c] = F::load(p);
    }
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
  store_tile_hsum16(acc, y, ldy);
}


// Where each group of 16 natural values starts in the permuted order (every
// order above moves groups of 16 whole, onto 16 consecutive bytes).
struct group_starts {
  int dst[16];
};
constexpr group_starts make_group_starts(perm_kind kind) {
  group_starts out{};
  for (int p = 0; p < k_qk_k; ++p)
    if (permuted_element(kind, p) % 16 == 0) out.dst[permuted_element(kind, p) / 16] = p;
  return out;
}
constexpr group_starts k_starts[] = {make_group_starts(perm_kind::natural), make_group_starts(perm_kind::k4),
                                     make_group_starts(perm_kind::k23), make_group_starts(perm_kind::xs)};

// One q8_K super-block, bit-exact with quantize_row_q8_k: the element of
// largest magnitude (the first on ties) sets iscale = -127 / m; q =
// round-half-even(clamp(iscale * x, -127, 127)) (the clamp changes nothing for
// finite x), d = 1 / iscale. Group g's 16 values go to qs + dst[g].
void quantize_q8_k(const float* x, std::int8_t* qs, const int* dst, float* d, std::int16_t* bsums) {
  __m512 v[16];
  __m512 amax = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int g = 0; g < 16; ++g) {
    v[g] = _mm512_loadu_ps(x + 16 * g);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[g]));
  }
  const float top = _mm512_reduce_max_ps(amax);
  if (top == 0.0f) {
    for (int g = 0; g < 16; ++g) _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + dst[g]), _mm_setzero_si128());
    *d = 0.0f;
    std::memset(bsums, 0, 16 * sizeof(std::int16_t));
    return;
  }
  int first = 0;
  for (int g = 0; g < 16; ++g) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(v[g]), _mm512_set1_ps(top), _CMP_EQ_OQ);
    if (hit) {
      first = 16 * g + __builtin_ctz(hit);
      break;
    }
  }
  const float iscale = -127.0f / x[first];
  const __m512 vs = _mm512_set1_ps(iscale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  alignas(64) std::int32_t sums[16];
#pragma GCC unroll 16
  for (int g = 0; g < 16; ++g) {
    __m512 s = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v[g], vs), lo), hi);
    s = _mm512_roundscale_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q = _mm512_cvttps_epi32(s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + dst[g]), _mm512_cvtsepi32_epi8(q));
    sums[g] = _mm512_reduce_add_epi32(q);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(bsums), _mm512_cvtepi32_epi16(_mm512_load_si512(sums)));
  *d = 1.0f / iscale;
}

template <typename F>
void run_cols(const job& jb, std::int64_t c0, std::int64_t c1) {
  if (jb.m < k_batch_rows)
    return kq_cols<kq_tile<F, true>::template shape, k_decode_rows, k_decode_cols>(jb, c0, c1);
  kq_cols<kq_tile<F, false>::template shape, k_batch_rows, k_batch_cols>(jb, c0, c1);
}

}  // namespace

std::size_t kq_act_row_bytes_avx512(tensor_type, std::int64_t n_in) {
  return plain_act_row_bytes(act_format::q8_k, n_in);
}

// The plain q8_K layout with each super-block's values in the format's order,
// written there directly by the quantizer.
void kq_prepare_avx512(tensor_type t, const float* x, std::int64_t m, std::int64_t n_in, std::byte* act,
                       std::size_t row_bytes) {
  const plain_layout l = plain_layout_of(act_format::q8_k, n_in);
  const int* dst = k_starts[static_cast<int>(perm_of(t))].dst;
  for (std::int64_t i = 0; i < m; ++i) {
    std::byte* row = act + static_cast<std::size_t>(i) * row_bytes;
    for (std::int64_t b = 0; b < n_in / k_qk_k; ++b)
      quantize_q8_k(x + i * n_in + b * k_qk_k, reinterpret_cast<std::int8_t*>(row) + b * k_qk_k, dst,
                    reinterpret_cast<float*>(row + l.d_off) + b,
                    reinterpret_cast<std::int16_t*>(row + l.bsums_off) + 16 * b);
  }
}

std::int64_t kq_col_tile_avx512(tensor_type) { return k_col_tile; }

int kq_act_element_avx512(tensor_type t, int p) { return permuted_element(perm_of(t), p); }

void kq_cols_avx512(const job& jb, std::int64_t c0, std::int64_t c1) {
  switch (jb.w->type) {
    case tensor_type::q2_k: return run_cols<fmt_q2_k>(jb, c0, c1);
    case tensor_type::q3_k: return run_cols<fmt_q3_k>(jb, c0, c1);
    case tensor_type::q4_k: return run_cols<fmt_q4_k>(jb, c0, c1);
    case tensor_type::q5_k: return run_cols<fmt_q5_k>(jb, c0, c1);
    case tensor_type::q6_k: return run_cols<fmt_q6_k>(jb, c0, c1);
    case tensor_type::iq4_xs: return run_cols<fmt_iq4_xs>(jb, c0, c1);
    case tensor_type::iq3_s: return run_cols<fmt_iq3_s>(jb, c0, c1);
    default: return;  // avx512_cols sends only these here
  }
}

}  // namespace pagoda::matmul_detail
