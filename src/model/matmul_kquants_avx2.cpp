// AVX2 kernels for the super-block formats q2_K to q6_K (the K-quant files:
// Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K), iq4_xs and iq3_s, against q8_K
// activations in the plain layout (natural order).
//
// Per pair and super-block, with 32-byte vectors of unsigned weight values u
// (q2_K: 0..3; q3_K: w + 4 in 0..7; q4_K: the nibble 0..15; q5_K: the nibble plus qh's
// bit, 0..31; q6_K: the 6-bit value 0..63, i.e. w + 32; iq3_s: the signed grid
// value + 16 in 1..31) and the int16 group scale of each lane (one per 32
// values for q4_K, q5_K, iq4_xs and iq3_s, per 16 for q2_K, q3_K and q6_K):
//   s = sum over the 8 vectors of madd(maddubs(u, x), sc)        (exact int32)
//   q6_K: s -= 32 * madd(bsums, sc16), q3_K: 4 *, iq3_s: 16 *       (the offset)
//   f = float(s) * d
//   q2_K, q4_K, q5_K: f = fnmadd(float(madd(bsums, mins16)), dmin, f)
//   acc = fma(f, dx, acc)
// then hsum8. iq4_xs's table values (-127..113) do not fit maddubs as value +
// 128, so it multiplies u = |w| by x with w's signs (k_signed; |w| <= 127).
// maddubs cannot saturate (2 x 127 x 127 < 2^15) and the int32 sums stay
// below 2^26. Every pair's sequence is fixed by n_in alone.
#include <immintrin.h>

#include <cstddef>
#include <cstring>

#include "model/matmul_internal.h"
#include "model/matmul_simd_avx2.h"

namespace pagoda::matmul_detail {
namespace {

constexpr int k_kr = 2;  // rows per tile
constexpr int k_kc = 2;  // columns per tile
// Decode (one row): one column at a time, one stream of weights prefetched
// k_decode_prefetch_bytes ahead (matmul_internal.h); 1.04-1.2x the 2 x 2
// tile's speed from memory for q4_K and q6_K (bench/RESULTS.md).
constexpr int k_decode_kc = 1;

inline __m256i load256(const std::byte* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The f32 term of a super-block whose unsigned values carry the offset
// 2^log2_offset (q3_K, q6_K, iq3_s): the offset's share, 2^log2_offset x the
// group scales (sc16, one per 16 values) x bsums, comes off the exact sum first.
inline __m256 fold_offset(__m256i s, __m256i bsums, __m256i sc16, int log2_offset, float d) {
  const __m256i sum = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), log2_offset));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d));
}


// Formats. Each provides the per-column state of one super-block (col, load),
// the 32 values and int16 lane scales of vector v < 8 (values(), scales(),
// elements offset(v) .. offset(v) + 31 of the natural order; the values are
// unsigned, or signed bytes when k_signed), and fold(): the f32 term of the
// super-block from its integer sum s and the row's bsums.

// q4_K: vector v is chunk v / 2, low (v even) or high nibbles: sub-block v.
struct fmt_q4_k {
  static constexpr std::size_t bytes = sizeof(block_q4_k);
  static constexpr bool k_signed = false;
  struct col {
    const std::byte* qs;
    alignas(32) std::int16_t sc[8];
    __m256i mins16;  // the min of each group of 16 (each sub-block's twice)
    float d, dmin;
  };
  static void load(const std::byte* p, col& c) {
    load_scales(p, c);
    c.qs = p + 16;
  }
  // d, dmin and the 6-bit scales and mins (bytes 0 .. 15; q5_K's too).
  static void load_scales(const std::byte* p, col& c) {
    std::uint32_t w0, w1, w2;
    std::memcpy(&w0, p + 4, 4);
    std::memcpy(&w1, p + 8, 4);
    std::memcpy(&w2, p + 12, 4);
    const std::uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    const std::uint64_t sc = (w0 & m6) | static_cast<std::uint64_t>((w2 & m4) | ((w0 >> 6) & m2) << 4) << 32;
    const std::uint64_t mn = (w1 & m6) | static_cast<std::uint64_t>(((w2 >> 4) & m4) | ((w1 >> 6) & m2) << 4) << 32;
    _mm_store_si128(reinterpret_cast<__m128i*>(c.sc), _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc))));
    const __m128i m8 = _mm_cvtsi64_si128(static_cast<long long>(mn));
    c.mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    c.d = load_half(p);
    c.dmin = load_half(p + 2);
  }
  static int offset(int v) { return 32 * v; }
  static __m256i values(const col& c, int v) {
    __m256i q = load256(c.qs + 32 * (v / 2));
    if (v % 2) q = _mm256_srli_epi16(q, 4);
    return _mm256_and_si256(q, _mm256_set1_epi8(0x0f));
  }
  static __m256i scales(const col& c, int v) { return _mm256_set1_epi16(c.sc[v]); }
  static __m256 fold(__m256i s, __m256i bsums, const col& c) {
    const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(c.d));
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, c.mins16)), _mm256_set1_ps(c.dmin), f);
  }
};

// q5_K: q4_K's scales, mins and nibbles (at byte 48), and a fifth bit per
// value: bit v of qh[l] (bytes 16 .. 47) is bit 4 of element l of sub-block v.
// Values 0..31: maddubs pairs stay below 2 x 31 x 127.
struct fmt_q5_k : fmt_q4_k {
  static constexpr std::size_t bytes = sizeof(block_q5_k);
  struct col : fmt_q4_k::col {
    const std::byte* qh;
  };
  static void load(const std::byte* p, col& c) {
    load_scales(p, c);
    c.qh = p + 16;
    c.qs = p + 48;
  }
  static __m256i values(const col& c, int v) {
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(load256(c.qh), v), _mm256_set1_epi8(1));
    return _mm256_or_si256(fmt_q4_k::values(c, v), _mm256_slli_epi16(hi, 4));
  }
};

// Formats with 16 signed group scales of 16 values (q3_K, q6_K): vector v's
// lanes 0..7 (bytes 0..15) scale by group 2v, lanes 8..15 by 2v + 1; sc16 holds
// all 16 for the offset term.
inline void spread_group_scales(__m128i sc, __m256i (&sv)[8], __m256i& sc16) {
  for (int v = 0; v < 8; ++v) {
    const __m128i pick =
        _mm_unpacklo_epi64(_mm_set1_epi8(static_cast<char>(2 * v)), _mm_set1_epi8(static_cast<char>(2 * v + 1)));
    sv[v] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, pick));
  }
  sc16 = _mm256_cvtepi8_epi16(sc);
}

// q2_K: vector v = 4n + j holds elements 128n + 32j .. + 31, the 2-bit value
// (qs[32n + l] >> 2j) & 3; scales[g] holds group g's 4-bit scale (low) and
// min (high), the mins taken off as q4_K's are, one per group of 16.
struct fmt_q2_k {
  static constexpr std::size_t bytes = sizeof(block_q2_k);
  static constexpr bool k_signed = false;
  struct col {
    const std::byte* qs;
    __m256i sv[8];
    __m256i sc16;  // unused (q2_K has no offset term)
    __m256i mins16;
    float d, dmin;
  };
  static void load(const std::byte* p, col& c) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i m4 = _mm_set1_epi8(0x0f);
    spread_group_scales(_mm_and_si128(b, m4), c.sv, c.sc16);
    c.mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), m4));
    c.qs = p + 16;
    c.d = load_half(p + 80);
    c.dmin = load_half(p + 82);
  }
  static int offset(int v) { return 32 * v; }
  static __m256i values(const col& c, int v) {
    return _mm256_and_si256(_mm256_srli_epi16(load256(c.qs + 32 * (v / 4)), 2 * (v % 4)), _mm256_set1_epi8(3));
  }
  static __m256i scales(const col& c, int v) { return c.sv[v]; }
  static __m256 fold(__m256i s, __m256i bsums, const col& c) {
    const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(c.d));
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, c.mins16)), _mm256_set1_ps(c.dmin), f);
  }
};

// q3_K: vector v = 4n + j holds elements 128n + 32j .. + 31, the 2-bit value
// (qs[32n + l] >> 2j) & 3 with bit v of hmask[l] as its third: u = w + 4 in
// 0..7 (the offset term takes the 4 back). The 16 scales are unpacked from
// their 12 bytes once per super-block (block_q3_k), in four 32-bit words.
struct fmt_q3_k {
  static constexpr std::size_t bytes = sizeof(block_q3_k);
  static constexpr bool k_signed = false;
  struct col {
    const std::byte* p;
    __m256i sv[8];
    __m256i sc16;
    float d;
  };
  static void load(const std::byte* p, col& c) {
    // Scales 4j .. 4j + 3 are word j: low 4 bits from bytes 0..7 (the low
    // nibbles of words 0, 1, then their high nibbles), high 2 bits from bits
    // 2j of bytes 8..11 (word 2).
    std::uint32_t w0, w1, w2;
    std::memcpy(&w0, p + 96, 4);
    std::memcpy(&w1, p + 100, 4);
    std::memcpy(&w2, p + 104, 4);
    const std::uint32_t m4 = 0x0f0f0f0f, m2 = 0x03030303;
    const __m128i raw = _mm_setr_epi32(static_cast<int>((w0 & m4) | (w2 & m2) << 4),
                                       static_cast<int>((w1 & m4) | ((w2 >> 2) & m2) << 4),
                                       static_cast<int>(((w0 >> 4) & m4) | ((w2 >> 4) & m2) << 4),
                                       static_cast<int>(((w1 >> 4) & m4) | ((w2 >> 6) & m2) << 4));
    spread_group_scales(_mm_sub_epi8(raw, _mm_set1_epi8(32)), c.sv, c.sc16);
    c.p = p;
    c.d = load_half(p + 108);
  }
  static int offset(int v) { return 32 * v; }
  static __m256i values(const col& c, int v) {
    const int n = v / 4, j = v % 4;
    const __m256i q = _mm256_and_si256(_mm256_srli_epi16(load256(c.p + 32 + 32 * n), 2 * j), _mm256_set1_epi8(3));
    const __m256i h = _mm256_and_si256(_mm256_srli_epi16(load256(c.p), v), _mm256_set1_epi8(1));
    return _mm256_or_si256(q, _mm256_slli_epi16(h, 2));
  }
  static __m256i scales(const col& c, int v) { return c.sv[v]; }
  static __m256 fold(__m256i s, __m256i bsums, const col& c) { return fold_offset(s, bsums, c.sc16, 2, c.d); }
};

// q6_K: vector v = 4n + i holds elements 128n + 32i .. of half n, the 6-bit
// value w + 32; lanes 0..7 belong to group 2v, 8..15 to group 2v + 1.
struct fmt_q6_k {
  static constexpr std::size_t bytes = sizeof(block_q6_k);
  static constexpr bool k_signed = false;
  struct col {
    const std::byte* p;
    __m256i sv[8];
    __m256i sc16;  // the 16 group scales, for the offset term
    float d;
  };
  static void load(const std::byte* p, col& c) {
    spread_group_scales(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)), c.sv, c.sc16);
    c.p = p;
    c.d = load_half(p + 208);
  }
  static int offset(int v) { return 32 * v; }
  static __m256i values(const col& c, int v) {
    const int n = v / 4, i = v % 4;
    __m256i lo = load256(c.p + 64 * n + 32 * (i % 2));
    if (i >= 2) lo = _mm256_srli_epi16(lo, 4);
    __m256i qh = load256(c.p + 128 + 32 * n);  // bits 2i..2i+1 -> 4..5
    switch (i) {
      case 0: qh = _mm256_slli_epi16(qh, 4); break;
      case 1: qh = _mm256_slli_epi16(qh, 2); break;
      case 3: qh = _mm256_srli_epi16(qh, 2); break;
      default: break;
    }
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(0x0f)), _mm256_and_si256(qh, _mm256_set1_epi8(0x30)));
  }
  static __m256i scales(const col& c, int v) { return c.sv[v]; }
  static __m256 fold(__m256i s, __m256i bsums, const col& c) { return fold_offset(s, bsums, c.sc16, 5, c.d); }
};

// Formats with one scale per sub-block of 32 values (iq4_xs, iq3_s): vector v
// is sub-block v, all its lanes scaled by sc[v].
struct per_sub_block {
  struct col {
    const std::byte* p;
    alignas(16) std::int16_t sc[8];
    float d;
  };
  static int offset(int v) { return 32 * v; }
  static __m256i scales(const col& c, int v) { return _mm256_set1_epi16(c.sc[v]); }
  // The 8 nibbles of w as bytes 0..7, byte 0's low nibble first (the
  // 4-bit scale fields). pdep would do it in one instruction, but Zen 1 and 2,
  // AVX2-only CPUs, run it in microcode.
  static __m128i nibbles8(std::uint32_t w) {
    const __m128i v = _mm_cvtsi32_si128(static_cast<int>(w));
    return _mm_and_si128(_mm_unpacklo_epi8(v, _mm_srli_epi16(v, 4)), _mm_set1_epi8(0x0f));
  }
  // p, d (the fp16 at byte 0 of both formats) and the eight int16 scales.
  static void set(col& c, const std::byte* p, __m128i sc) {
    _mm_store_si128(reinterpret_cast<__m128i*>(c.sc), sc);
    c.p = p;
    c.d = load_half(p);
  }
};

// iq4_xs: iq4_nl's table values of the 16 bytes at qs + 16v (low nibbles, then
// high), signed; scale ls - 32 (6 bits: 4 from scales_l, 2 from scales_h), no
// min or offset.
struct fmt_iq4_xs : per_sub_block {
  static constexpr std::size_t bytes = sizeof(block_iq4_xs);
  static constexpr bool k_signed = true;
  static void load(const std::byte* p, col& c) {
    std::uint16_t sh;
    std::uint32_t sl;
    std::memcpy(&sh, p + offsetof(block_iq4_xs, scales_h), 2);
    std::memcpy(&sl, p + offsetof(block_iq4_xs, scales_l), 4);
    // Lane b: bits 2b, 2b + 1 of scales_h moved to the top of the word, then down to 0..1.
    const __m128i shifts = _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4, 1 << 2, 1);
    const __m128i hi = _mm_srli_epi16(_mm_mullo_epi16(_mm_set1_epi16(static_cast<short>(sh)), shifts), 14);
    const __m128i ls = _mm_or_si128(_mm_cvtepu8_epi16(nibbles8(sl)), _mm_slli_epi16(hi, 4));
    set(c, p, _mm_sub_epi16(ls, _mm_set1_epi16(32)));
  }
  static __m256i values(const col& c, int v) {
    const __m256i table =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k_iq4nl_values)));
    return _mm256_shuffle_epi8(table, nibbles32(c.p + offsetof(block_iq4_xs, qs) + 16 * v));
  }
  static __m256 fold(__m256i s, __m256i, const col& c) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(c.d));
  }
};

// iq3_s: grid groups 8v .. 8v + 7 (four values each, one gathered 32-bit grid
// entry per lane: index qs[g] with bit g % 8 of qh[v] as bit 8), negated where
// the 32 sign bits at signs + 4v say so, + 16: u in 1..31. Scale 1 + 2 x
// nibble per sub-block; the offset 16 comes off in fold (sc16: each
// sub-block's scale for both its groups of 16).
struct fmt_iq3_s : per_sub_block {
  static constexpr std::size_t bytes = sizeof(block_iq3_s);
  static constexpr bool k_signed = false;
  struct col : per_sub_block::col {
    __m256i sc16;
  };
  static void load(const std::byte* p, col& c) {
    std::uint32_t nib;
    std::memcpy(&nib, p + offsetof(block_iq3_s, scales), 4);
    const __m128i n8 = nibbles8(nib);
    const __m128i sc8 = _mm_add_epi8(_mm_add_epi8(n8, n8), _mm_set1_epi8(1));
    set(c, p, _mm_cvtepu8_epi16(sc8));
    c.sc16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));
  }
  static __m256i values(const col& c, int v) {
    const __m256i lo = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c.p + offsetof(block_iq3_s, qs) + 8 * v)));
    const int qh = std::to_integer<int>(c.p[offsetof(block_iq3_s, qh) + v]);
    const __m256i bit = _mm256_srlv_epi32(_mm256_set1_epi32(qh), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i hi = _mm256_and_si256(bit, _mm256_set1_epi32(1));
    const __m256i grid = _mm256_i32gather_epi32(reinterpret_cast<const int*>(k_iq3s_grid),
                                                _mm256_or_si256(lo, _mm256_slli_epi32(hi, 8)), 4);
    const __m256i neg = bits32_to_bytes(c.p + offsetof(block_iq3_s, signs) + 4 * v);
    return _mm256_add_epi8(_mm256_sub_epi8(_mm256_xor_si256(grid, neg), neg), _mm256_set1_epi8(16));
  }
  static __m256 fold(__m256i s, __m256i bsums, const col& c) { return fold_offset(s, bsums, c.sc16, 4, c.d); }
};

// y[r][c] for r < R, c < C. Stream: the decode tile's prefetch down the
// stream instead of the same super-block one tile ahead.
template <typename F, bool Stream>
struct kq_tile {
  template <int R, int C>
  struct shape {
    static void run(const kq_act_rows& a, const std::byte* w, std::size_t w_stride, std::int64_t nsb, float* y,
                    std::int64_t ldy) {
      __m256 acc[R][C];
      zero_tile(acc, _mm256_setzero_ps());
      for (std::int64_t b = 0; b < nsb; ++b) {
        typename F::col cs[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const std::byte* p = w + c * w_stride + static_cast<std::size_t>(b) * F::bytes;
          const std::size_t ahead = Stream ? k_decode_prefetch_bytes : C * w_stride;
          for (std::size_t o = 0; o < F::bytes; o += 64)  // into L1 as it goes
            _mm_prefetch(reinterpret_cast<const char*>(p + ahead + o), _MM_HINT_T0);
          F::load(p, cs[c]);
        }
        __m256i s[R][C];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) s[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
          __m256i wv[C], ws[C], sv[C];  // unsigned operand; k_signed: the signed values
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) {
            wv[c] = ws[c] = F::values(cs[c], v);
            if constexpr (F::k_signed) wv[c] = _mm256_sign_epi8(ws[c], ws[c]);
            sv[c] = F::scales(cs[c], v);
          }
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.qs(r, b, F::offset(v))));
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
              const __m256i xs = F::k_signed ? _mm256_sign_epi8(x, ws[c]) : x;
              s[r][c] = _mm256_add_epi32(s[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(wv[c], xs), sv[c]));
            }
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i bsums = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.bsums(r, b)));
          const __m256 dx = _mm256_set1_ps(a.dx(r, b));
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(F::fold(s[r][c], bsums, cs[c]), dx, acc[r][c]);
        }
      }
      store_tile(acc, y, ldy, hsum8);
    }
  };
};


}  // namespace

// The element of largest magnitude (the first on ties) sets iscale = -127 / m;
// q = round-half-even(clamp(iscale * x, -127, 127)) (the clamp changes nothing
// for finite x), d = 1 / iscale, bsums from the int32 values.
void quantize_q8_k_avx2(const float* x, block_q8_k& out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 32; ++j) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float top = _mm_cvtss_f32(m4);
  if (top == 0.0f) {
    std::memset(&out, 0, sizeof out);
    return;
  }
  int first = 0;
  for (int j = 0; j < 32; ++j) {
    const int hit = _mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)), _mm256_set1_ps(top), _CMP_EQ_OQ));
    if (hit) {
      first = 8 * j + __builtin_ctz(static_cast<unsigned>(hit));
      break;
    }
  }
  const float iscale = -127.0f / x[first];
  const __m256 vs = _mm256_set1_ps(iscale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int g = 0; g < 16; g += 2) {  // 32 values: two groups of 16
    __m256i qi[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * g + 8 * j), vs), lo), hi);
      qi[j] = _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i s8 = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
      out.bsums[g + h] = static_cast<std::int16_t>(_mm_cvtsi128_si32(s4));
    }
    // packs interleave 128-bit lanes; the dword permute restores element order.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.qs + 16 * g),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  out.d = 1.0f / iscale;
}

bool has_kq_kernel_avx2(tensor_type t) {
  return t == tensor_type::q2_k || t == tensor_type::q3_k || t == tensor_type::q4_k || t == tensor_type::q5_k ||
         t == tensor_type::q6_k || t == tensor_type::iq4_xs || t == tensor_type::iq3_s;
}

namespace {

template <typename F>
void run_cols(const job& jb, std::int64_t c0, std::int64_t c1) {
  if (jb.m == 1) return kq_cols<kq_tile<F, true>::template shape, 1, k_decode_kc>(jb, c0, c1);
  kq_cols<kq_tile<F, false>::template shape, k_kr, k_kc>(jb, c0, c1);
}

}  // namespace

void kq_cols_avx2(const job& jb, std::int64_t c0, std::int64_t c1) {
  if (jb.w->type == tensor_type::q4_k) return run_cols<fmt_q4_k>(jb, c0, c1);
  if (jb.w->type == tensor_type::q5_k) return run_cols<fmt_q5_k>(jb, c0, c1);
  if (jb.w->type == tensor_type::q3_k) return run_cols<fmt_q3_k>(jb, c0, c1);
  if (jb.w->type == tensor_type::q2_k) return run_cols<fmt_q2_k>(jb, c0, c1);
  if (jb.w->type == tensor_type::iq4_xs) return run_cols<fmt_iq4_xs>(jb, c0, c1);
  if (jb.w->type == tensor_type::iq3_s) return run_cols<fmt_iq3_s>(jb, c0, c1);
  run_cols<fmt_q6_k>(jb, c0, c1);
}

}  // namespace pagoda::matmul_detail
