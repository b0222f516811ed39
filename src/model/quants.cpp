// Quantized weight formats: traits, integer decoding, ggml's activation
// quantizers, and simple weight quantizers. See model/quants.h.
#include "model/quants.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"

namespace pagoda {

using gguf::tensor_type;

act_format act_format_of(tensor_type t) {
  switch (t) {
    case tensor_type::q8_0:
    case tensor_type::q4_0:
    case tensor_type::q5_0:
    case tensor_type::iq4_nl:
    case tensor_type::mxfp4: return act_format::q8_0;
    case tensor_type::q4_1:
    case tensor_type::q5_1: return act_format::q8_1;
    case tensor_type::q2_k:
    case tensor_type::q3_k:
    case tensor_type::q4_k:
    case tensor_type::q5_k:
    case tensor_type::q6_k:
    case tensor_type::iq4_xs:
    case tensor_type::iq3_s: return act_format::q8_k;
    default: return act_format::f32;
  }
}

int weight_block_elems(tensor_type t) {
  switch (act_format_of(t)) {
    case act_format::f32: return 1;
    case act_format::q8_k: return k_qk_k;
    default: return k_qk_legacy;
  }
}

// ggml's iq3s_grid (ggml-common.h), the table that defines the iq3_s format.
// Its entries are sorted and every byte is odd in 1..15; tests check both.
const std::uint32_t k_iq3s_grid[512] = {
    0x01010101, 0x01010103, 0x01010105, 0x0101010b, 0x0101010f, 0x01010301, 0x01010303, 0x01010305,
    0x01010309, 0x0101030d, 0x01010501, 0x01010503, 0x0101050b, 0x01010707, 0x01010901, 0x01010905,
    0x0101090b, 0x0101090f, 0x01010b03, 0x01010b07, 0x01010d01, 0x01010d05, 0x01010f03, 0x01010f09,
    0x01010f0f, 0x01030101, 0x01030103, 0x01030105, 0x01030109, 0x01030301, 0x01030303, 0x0103030b,
    0x01030501, 0x01030507, 0x0103050f, 0x01030703, 0x0103070b, 0x01030909, 0x01030d03, 0x01030d0b,
    0x01030f05, 0x01050101, 0x01050103, 0x0105010b, 0x0105010f, 0x01050301, 0x01050307, 0x0105030d,
    0x01050503, 0x0105050b, 0x01050701, 0x01050709, 0x01050905, 0x0105090b, 0x0105090f, 0x01050b03,
    0x01050b07, 0x01050f01, 0x01050f07, 0x01070107, 0x01070303, 0x0107030b, 0x01070501, 0x01070505,
    0x01070703, 0x01070707, 0x0107070d, 0x01070909, 0x01070b01, 0x01070b05, 0x01070d0f, 0x01070f03,
    0x01070f0b, 0x01090101, 0x01090307, 0x0109030f, 0x01090503, 0x01090509, 0x01090705, 0x01090901,
    0x01090907, 0x01090b03, 0x01090f01, 0x010b0105, 0x010b0109, 0x010b0501, 0x010b0505, 0x010b050d,
    0x010b0707, 0x010b0903, 0x010b090b, 0x010b090f, 0x010b0d0d, 0x010b0f07, 0x010d010d, 0x010d0303,
    0x010d0307, 0x010d0703, 0x010d0b05, 0x010d0f03, 0x010f0101, 0x010f0105, 0x010f0109, 0x010f0501,
    0x010f0505, 0x010f050d, 0x010f0707, 0x010f0b01, 0x010f0b09, 0x03010101, 0x03010103, 0x03010105,
    0x03010109, 0x03010301, 0x03010303, 0x03010307, 0x0301030b, 0x0301030f, 0x03010501, 0x03010505,
    0x03010703, 0x03010709, 0x0301070d, 0x03010b09, 0x03010b0d, 0x03010d03, 0x03010f05, 0x03030101,
    0x03030103, 0x03030107, 0x0303010d, 0x03030301, 0x03030309, 0x03030503, 0x03030701, 0x03030707,
    0x03030903, 0x03030b01, 0x03030b05, 0x03030f01, 0x03030f0d, 0x03050101, 0x03050305, 0x0305030b,
    0x0305030f, 0x03050501, 0x03050509, 0x03050705, 0x03050901, 0x03050907, 0x03050b0b, 0x03050d01,
    0x03050f05, 0x03070103, 0x03070109, 0x0307010f, 0x03070301, 0x03070307, 0x03070503, 0x0307050f,
    0x03070701, 0x03070709, 0x03070903, 0x03070d05, 0x03070f01, 0x03090107, 0x0309010b, 0x03090305,
    0x03090309, 0x03090703, 0x03090707, 0x03090905, 0x0309090d, 0x03090b01, 0x03090b09, 0x030b0103,
    0x030b0301, 0x030b0307, 0x030b0503, 0x030b0701, 0x030b0705, 0x030b0b03, 0x030d0501, 0x030d0509,
    0x030d050f, 0x030d0909, 0x030d090d, 0x030f0103, 0x030f0107, 0x030f0301, 0x030f0305, 0x030f0503,
    0x030f070b, 0x030f0903, 0x030f0d05, 0x030f0f01, 0x05010101, 0x05010103, 0x05010107, 0x0501010b,
    0x0501010f, 0x05010301, 0x05010305, 0x05010309, 0x0501030d, 0x05010503, 0x05010507, 0x0501050f,
    0x05010701, 0x05010705, 0x05010903, 0x05010907, 0x0501090b, 0x05010b01, 0x05010b05, 0x05010d0f,
    0x05010f01, 0x05010f07, 0x05010f0b, 0x05030101, 0x05030105, 0x05030301, 0x05030307, 0x0503030f,
    0x05030505, 0x0503050b, 0x05030703, 0x05030709, 0x05030905, 0x05030b03, 0x05050103, 0x05050109,
    0x0505010f, 0x05050503, 0x05050507, 0x05050701, 0x0505070f, 0x05050903, 0x05050b07, 0x05050b0f,
    0x05050f03, 0x05050f09, 0x05070101, 0x05070105, 0x0507010b, 0x05070303, 0x05070505, 0x05070509,
    0x05070703, 0x05070707, 0x05070905, 0x05070b01, 0x05070d0d, 0x05090103, 0x0509010f, 0x05090501,
    0x05090507, 0x05090705, 0x0509070b, 0x05090903, 0x05090f05, 0x05090f0b, 0x050b0109, 0x050b0303,
    0x050b0505, 0x050b070f, 0x050b0901, 0x050b0b07, 0x050b0f01, 0x050d0101, 0x050d0105, 0x050d010f,
    0x050d0503, 0x050d0b0b, 0x050d0d03, 0x050f010b, 0x050f0303, 0x050f050d, 0x050f0701, 0x050f0907,
    0x050f0b01, 0x07010105, 0x07010303, 0x07010307, 0x0701030b, 0x0701030f, 0x07010505, 0x07010703,
    0x07010707, 0x0701070b, 0x07010905, 0x07010909, 0x0701090f, 0x07010b03, 0x07010d07, 0x07010f03,
    0x07030103, 0x07030107, 0x0703010b, 0x07030309, 0x07030503, 0x07030507, 0x07030901, 0x07030d01,
    0x07030f05, 0x07030f0d, 0x07050101, 0x07050305, 0x07050501, 0x07050705, 0x07050709, 0x07050b01,
    0x07070103, 0x07070301, 0x07070309, 0x07070503, 0x07070507, 0x0707050f, 0x07070701, 0x07070903,
    0x07070907, 0x0707090f, 0x07070b0b, 0x07070f07, 0x07090107, 0x07090303, 0x0709030d, 0x07090505,
    0x07090703, 0x07090b05, 0x07090d01, 0x07090d09, 0x070b0103, 0x070b0301, 0x070b0305, 0x070b050b,
    0x070b0705, 0x070b0909, 0x070b0b0d, 0x070b0f07, 0x070d030d, 0x070d0903, 0x070f0103, 0x070f0107,
    0x070f0501, 0x070f0505, 0x070f070b, 0x09010101, 0x09010109, 0x09010305, 0x09010501, 0x09010509,
    0x0901050f, 0x09010705, 0x09010903, 0x09010b01, 0x09010f01, 0x09030105, 0x0903010f, 0x09030303,
    0x09030307, 0x09030505, 0x09030701, 0x0903070b, 0x09030907, 0x09030b03, 0x09030b0b, 0x09050103,
    0x09050107, 0x09050301, 0x0905030b, 0x09050503, 0x09050707, 0x09050901, 0x09050b0f, 0x09050d05,
    0x09050f01, 0x09070109, 0x09070303, 0x09070307, 0x09070501, 0x09070505, 0x09070703, 0x0907070b,
    0x09090101, 0x09090105, 0x09090509, 0x0909070f, 0x09090901, 0x09090f03, 0x090b010b, 0x090b010f,
    0x090b0503, 0x090b0d05, 0x090d0307, 0x090d0709, 0x090d0d01, 0x090f0301, 0x090f030b, 0x090f0701,
    0x090f0907, 0x090f0b03, 0x0b010105, 0x0b010301, 0x0b010309, 0x0b010505, 0x0b010901, 0x0b010909,
    0x0b01090f, 0x0b010b05, 0x0b010d0d, 0x0b010f09, 0x0b030103, 0x0b030107, 0x0b03010b, 0x0b030305,
    0x0b030503, 0x0b030705, 0x0b030f05, 0x0b050101, 0x0b050303, 0x0b050507, 0x0b050701, 0x0b05070d,
    0x0b050b07, 0x0b070105, 0x0b07010f, 0x0b070301, 0x0b07050f, 0x0b070909, 0x0b070b03, 0x0b070d0b,
    0x0b070f07, 0x0b090103, 0x0b090109, 0x0b090501, 0x0b090705, 0x0b09090d, 0x0b0b0305, 0x0b0b050d,
    0x0b0b0b03, 0x0b0b0b07, 0x0b0d0905, 0x0b0f0105, 0x0b0f0109, 0x0b0f0505, 0x0d010303, 0x0d010307,
    0x0d01030b, 0x0d010703, 0x0d010707, 0x0d010d01, 0x0d030101, 0x0d030501, 0x0d03050f, 0x0d030d09,
    0x0d050305, 0x0d050709, 0x0d050905, 0x0d050b0b, 0x0d050d05, 0x0d050f01, 0x0d070101, 0x0d070309,
    0x0d070503, 0x0d070901, 0x0d09050b, 0x0d090907, 0x0d090d05, 0x0d0b0101, 0x0d0b0107, 0x0d0b0709,
    0x0d0b0d01, 0x0d0d010b, 0x0d0d0901, 0x0d0f0303, 0x0d0f0307, 0x0f010101, 0x0f010109, 0x0f01010f,
    0x0f010501, 0x0f010505, 0x0f01070d, 0x0f010901, 0x0f010b09, 0x0f010d05, 0x0f030105, 0x0f030303,
    0x0f030509, 0x0f030907, 0x0f03090b, 0x0f050103, 0x0f050109, 0x0f050301, 0x0f05030d, 0x0f050503,
    0x0f050701, 0x0f050b03, 0x0f070105, 0x0f070705, 0x0f07070b, 0x0f070b07, 0x0f090103, 0x0f09010b,
    0x0f090307, 0x0f090501, 0x0f090b01, 0x0f0b0505, 0x0f0b0905, 0x0f0d0105, 0x0f0d0703, 0x0f0f0101,
};

namespace {

// Round half to even for |v| < 2^22 (larger values come back unchanged or off
// by one, and every caller clamps to a small range): adding 1.5 * 2^23 leaves
// no fraction bits, so the sum rounds to an integer (to even, the default
// rounding mode) and the subtraction is exact. Strict IEEE evaluation (no
// -ffast-math) keeps the compiler from folding the pair; std::nearbyint would
// be a library call per value.
float round_half_even(float v) {
  constexpr float k_magic = 12582912.0f;
  return (v + k_magic) - k_magic;
}

// Super-blocks: 16 groups, scales and mins filled by the caller.
void set_super(int_block& out, float da, float db) {
  out.n = k_qk_k;
  out.da = da;
  out.db = db;
}

// Legacy blocks: two groups of 16 with the same scale and min.
void set_legacy(int_block& out, float da, float db, std::int16_t mn) {
  out.n = k_qk_legacy;
  out.sc[0] = out.sc[1] = 1;
  out.mn[0] = out.mn[1] = mn;
  out.da = da;
  out.db = db;
}

// Low nibble of qs[j] is element j, high nibble element j + 16.
template <typename F>
void legacy_nibbles(const std::uint8_t* qs, std::int8_t* q, F&& value) {
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<std::int8_t>(value(qs[j] & 15, j));
    q[j + 16] = static_cast<std::int8_t>(value(qs[j] >> 4, j + 16));
  }
}

// iq4_nl / mxfp4: 32 nibble indices into a 16-entry table under one scale.
void table_block(const std::uint8_t* qs, const std::int8_t (&table)[16], float da, int_block& out) {
  set_legacy(out, da, 0, 0);
  legacy_nibbles(qs, out.q, [&table](int v, int) { return table[v]; });
}

std::uint32_t load_u32(const std::uint8_t* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// q2_K / q3_K: element 128n + 32j + l is (qs[32n + l] >> 2j) & 3, group 8n + 2j + l / 16.
template <typename F>
void two_bit_values(const std::uint8_t* qs, std::int8_t* q, F&& adjust) {
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        const int e = 128 * n + 32 * j + l;
        q[e] = static_cast<std::int8_t>(adjust((qs[32 * n + l] >> (2 * j)) & 3, n, j, l));
      }
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j of q4_K/q5_K.
void scale_min_k4(int j, const std::uint8_t* s, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode_k4_scales(const std::uint8_t* scales, float d, float dmin, int_block& out) {
  set_super(out, d, dmin);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(j, scales, sc, mn);
    out.sc[2 * j] = out.sc[2 * j + 1] = static_cast<std::int16_t>(sc);
    out.mn[2 * j] = out.mn[2 * j + 1] = static_cast<std::int16_t>(mn);
  }
}

// q4_K / q5_K nibbles: chunk c of 32 bytes, low nibble element 64c + l, high 64c + 32 + l.
template <typename F>
void k4_values(const std::uint8_t* qs, std::int8_t* q, F&& high_bit) {
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      q[64 * c + l] = static_cast<std::int8_t>((qs[32 * c + l] & 15) + high_bit(c, 0, l));
      q[64 * c + 32 + l] = static_cast<std::int8_t>((qs[32 * c + l] >> 4) + high_bit(c, 1, l));
    }
}

}  // namespace

void decode_int_block(tensor_type t, const std::byte* block, int_block& out) {
  std::memset(out.mn, 0, sizeof out.mn);
  switch (t) {
    case tensor_type::q8_0: {
      const auto& b = *reinterpret_cast<const block_q8_0*>(block);
      set_legacy(out, fp16_to_f32(b.d), 0, 0);
      std::memcpy(out.q, b.qs, k_qk_legacy);
      return;
    }
    case tensor_type::q4_0: {
      const auto& b = *reinterpret_cast<const block_q4_0*>(block);
      set_legacy(out, fp16_to_f32(b.d), 0, 0);
      legacy_nibbles(b.qs, out.q, [](int v, int) { return v - 8; });
      return;
    }
    case tensor_type::q4_1: {
      const auto& b = *reinterpret_cast<const block_q4_1*>(block);
      set_legacy(out, fp16_to_f32(b.d), -fp16_to_f32(b.m), 1);
      legacy_nibbles(b.qs, out.q, [](int v, int) { return v; });
      return;
    }
    case tensor_type::q5_0: {
      const auto& b = *reinterpret_cast<const block_q5_0*>(block);
      const std::uint32_t qh = load_u32(b.qh);
      set_legacy(out, fp16_to_f32(b.d), 0, 0);
      legacy_nibbles(b.qs, out.q, [qh](int v, int e) { return (v | ((qh >> e) & 1) << 4) - 16; });
      return;
    }
    case tensor_type::q5_1: {
      const auto& b = *reinterpret_cast<const block_q5_1*>(block);
      const std::uint32_t qh = load_u32(b.qh);
      set_legacy(out, fp16_to_f32(b.d), -fp16_to_f32(b.m), 1);
      legacy_nibbles(b.qs, out.q, [qh](int v, int e) { return v | ((qh >> e) & 1) << 4; });
      return;
    }
    case tensor_type::iq4_nl: {
      const auto& b = *reinterpret_cast<const block_iq4_nl*>(block);
      return table_block(b.qs, k_iq4nl_values, fp16_to_f32(b.d), out);
    }
    case tensor_type::mxfp4: {
      const auto& b = *reinterpret_cast<const block_mxfp4*>(block);
      return table_block(b.qs, k_mxfp4_values, e8m0_half_to_f32(b.e), out);
    }
    case tensor_type::q2_k: {
      const auto& b = *reinterpret_cast<const block_q2_k*>(block);
      set_super(out, fp16_to_f32(b.d), fp16_to_f32(b.dmin));
      for (int g = 0; g < 16; ++g) {
        out.sc[g] = static_cast<std::int16_t>(b.scales[g] & 15);
        out.mn[g] = static_cast<std::int16_t>(b.scales[g] >> 4);
      }
      two_bit_values(b.qs, out.q, [](int v, int, int, int) { return v; });
      return;
    }
    case tensor_type::q3_k: {
      const auto& b = *reinterpret_cast<const block_q3_k*>(block);
      set_super(out, fp16_to_f32(b.d), 0);
      for (int i = 0; i < 16; ++i) {
        const int lo = i < 8 ? b.scales[i] & 15 : b.scales[i - 8] >> 4;
        const int hi = (b.scales[8 + i % 4] >> (2 * (i / 4))) & 3;
        out.sc[i] = static_cast<std::int16_t>((lo | hi << 4) - 32);
      }
      two_bit_values(b.qs, out.q, [&](int v, int n, int j, int l) {
        return v - (((b.hmask[l] >> (4 * n + j)) & 1) ? 0 : 4);
      });
      return;
    }
    case tensor_type::q4_k: {
      const auto& b = *reinterpret_cast<const block_q4_k*>(block);
      decode_k4_scales(b.scales, fp16_to_f32(b.d), fp16_to_f32(b.dmin), out);
      k4_values(b.qs, out.q, [](int, int, int) { return 0; });
      return;
    }
    case tensor_type::q5_k: {
      const auto& b = *reinterpret_cast<const block_q5_k*>(block);
      decode_k4_scales(b.scales, fp16_to_f32(b.d), fp16_to_f32(b.dmin), out);
      k4_values(b.qs, out.q, [&](int c, int h, int l) { return ((b.qh[l] >> (2 * c + h)) & 1) << 4; });
      return;
    }
    case tensor_type::q6_k: {
      const auto& b = *reinterpret_cast<const block_q6_k*>(block);
      set_super(out, fp16_to_f32(b.d), 0);
      for (int g = 0; g < 16; ++g) out.sc[g] = b.scales[g];
      for (int n = 0; n < 2; ++n)
        for (int i = 0; i < 4; ++i)
          for (int l = 0; l < 32; ++l) {
            const std::uint8_t lo = b.ql[64 * n + 32 * (i % 2) + l];
            const int low4 = i < 2 ? lo & 15 : lo >> 4;
            const int high2 = (b.qh[32 * n + l] >> (2 * i)) & 3;
            out.q[128 * n + 32 * i + l] = static_cast<std::int8_t>((low4 | high2 << 4) - 32);
          }
      return;
    }
    case tensor_type::iq4_xs: {
      const auto& b = *reinterpret_cast<const block_iq4_xs*>(block);
      set_super(out, fp16_to_f32(b.d), 0);
      for (int s = 0; s < 8; ++s) {
        const int ls = ((b.scales_l[s / 2] >> (4 * (s % 2))) & 15) | ((b.scales_h >> (2 * s)) & 3) << 4;
        out.sc[2 * s] = out.sc[2 * s + 1] = static_cast<std::int16_t>(ls - 32);
        legacy_nibbles(b.qs + 16 * s, out.q + 32 * s, [](int v, int) { return k_iq4nl_values[v]; });
      }
      return;
    }
    case tensor_type::iq3_s: {
      const auto& b = *reinterpret_cast<const block_iq3_s*>(block);
      set_super(out, fp16_to_f32(b.d), 0);
      for (int s = 0; s < 8; ++s)
        out.sc[2 * s] = out.sc[2 * s + 1] = static_cast<std::int16_t>(1 + 2 * ((b.scales[s / 2] >> (4 * (s % 2))) & 15));
      for (int g = 0; g < 64; ++g) {
        const std::uint32_t entry = k_iq3s_grid[b.qs[g] | ((b.qh[g / 8] >> (g % 8)) & 1) << 8];
        for (int k = 0; k < 4; ++k) {
          const int e = 4 * g + k;
          const int v = static_cast<int>((entry >> (8 * k)) & 0xff);
          out.q[e] = static_cast<std::int8_t>(((b.signs[e / 8] >> (e % 8)) & 1) ? -v : v);
        }
      }
      return;
    }
    default: break;
  }
  PAGODA_ASSERT(false, "decode_int_block: {} is not a quantized weight type", gguf::tensor_type_name(t));
}

void dequantize_quantized_row(tensor_type t, const std::byte* src, std::int64_t n, float* out) {
  const int be = weight_block_elems(t);
  PAGODA_ASSERT(be > 1 && n % be == 0, "dequantize: {} row of {} elements", gguf::tensor_type_name(t), n);
  const std::size_t bb = gguf::get_tensor_type_traits(static_cast<std::uint32_t>(t))->block_bytes;
  int_block ib;
  for (std::int64_t b = 0; b < n / be; ++b) {
    decode_int_block(t, src + static_cast<std::size_t>(b) * bb, ib);
    float* o = out + b * be;
    for (int e = 0; e < be; ++e)
      o[e] = (ib.da * static_cast<float>(ib.sc[e / 16])) * static_cast<float>(ib.q[e]) -
             ib.db * static_cast<float>(ib.mn[e / 16]);
  }
}

// ---------------------------------------------------------------------------
// Activation quantizers
// ---------------------------------------------------------------------------

fp16_t quantize_block_q8(const float* x, std::int8_t* q, float* d_f32) {
  float amax = 0.0f;
  for (int j = 0; j < k_qk_legacy; ++j) {
    const float a = std::fabs(x[j]);
    amax = a > amax ? a : amax;
  }
  const float d = amax / 127.0f;
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  for (int j = 0; j < k_qk_legacy; ++j) {
    float v = x[j] * id;
    v = v > -127.0f ? v : -127.0f;  // written as SIMD max/min behave (NaN -> -127)
    v = v < 127.0f ? v : 127.0f;
    q[j] = static_cast<std::int8_t>(round_half_even(v));
  }
  *d_f32 = d;
  return f32_to_fp16(d);
}

void quantize_row_q8_0(const float* x, std::int64_t n, void* out) {
  PAGODA_ASSERT(n % k_qk_legacy == 0, "quantize_row_q8_0: n = {} is not a multiple of 32", n);
  auto* y = static_cast<block_q8_0*>(out);
  float d;
  for (std::int64_t b = 0; b < n / k_qk_legacy; ++b) y[b].d = quantize_block_q8(x + b * k_qk_legacy, y[b].qs, &d);
}

void quantize_row_q8_1(const float* x, std::int64_t n, void* out) {
  PAGODA_ASSERT(n % k_qk_legacy == 0, "quantize_row_q8_1: n = {} is not a multiple of 32", n);
  auto* y = static_cast<block_q8_1*>(out);
  for (std::int64_t b = 0; b < n / k_qk_legacy; ++b) {
    float d;
    y[b].d = quantize_block_q8(x + b * k_qk_legacy, y[b].qs, &d);
    int sum = 0;
    for (int j = 0; j < k_qk_legacy; ++j) sum += y[b].qs[j];
    y[b].s = f32_to_fp16(d * static_cast<float>(sum));
  }
}

void quantize_row_q8_k(const float* x, std::int64_t n, void* out) {
  PAGODA_ASSERT(n % k_qk_k == 0, "quantize_row_q8_K: n = {} is not a multiple of 256", n);
  auto* y = static_cast<block_q8_k*>(out);
  for (std::int64_t b = 0; b < n / k_qk_k; ++b) {
    const float* xb = x + b * k_qk_k;
    block_q8_k& yb = y[b];
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < k_qk_k; ++j) {
      const float a = std::fabs(xb[j]);
      if (a > amax) {
        amax = a;
        max = xb[j];
      }
    }
    if (amax == 0.0f) {
      std::memset(&yb, 0, sizeof yb);
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < k_qk_k; ++j) {
      float v = iscale * xb[j];
      v = v > -127.0f ? v : -127.0f;  // no-ops for finite x: |iscale * x| rounds to at most 127
      v = v < 127.0f ? v : 127.0f;
      yb.qs[j] = static_cast<std::int8_t>(round_half_even(v));
    }
    for (int g = 0; g < k_qk_k / 16; ++g) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += yb.qs[16 * g + j];
      yb.bsums[g] = static_cast<std::int16_t>(sum);
    }
    yb.d = 1.0f / iscale;
  }
}

// ---------------------------------------------------------------------------
// Weight quantizers
// ---------------------------------------------------------------------------

// ggml's quantize_row_q4_0_ref: the element of largest magnitude (first one on
// ties) maps to -8 exactly, d = max / -8, q = min(15, trunc(x/d + 8.5)). Values
// are clamped before the integer conversion so NaN/inf cannot be undefined
// behaviour; finite inputs give ggml's bytes.
void quantize_row_q4_0(const float* x, std::int64_t n, void* out) {
  PAGODA_ASSERT(n % k_qk4_0 == 0, "quantize_row_q4_0: n = {} is not a multiple of 32", n);
  auto* y = static_cast<block_q4_0*>(out);
  for (std::int64_t b = 0; b < n / k_qk4_0; ++b) {
    const float* xb = x + b * k_qk4_0;
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < k_qk4_0; ++j) {
      if (amax < std::fabs(xb[j])) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    for (int j = 0; j < k_qk4_0 / 2; ++j) {
      auto nib = [&](float v) {
        float t = v * id + 8.5f;
        t = t > 0.0f ? t : 0.0f;
        t = t < 15.0f ? t : 15.0f;
        return static_cast<std::uint8_t>(t);  // truncation, as ggml's (int8_t) cast
      };
      y[b].qs[j] = static_cast<std::uint8_t>(nib(xb[j]) | nib(xb[j + k_qk4_0 / 2]) << 4);
    }
  }
}

namespace {

// round(v / step) clamped to [lo, hi]; 0 when step is 0 or the result is NaN.
int quantize_to(float v, float step, int lo, int hi) {
  if (step == 0.0f) return 0;
  float r = round_half_even(v / step);
  r = r > static_cast<float>(lo) ? r : static_cast<float>(lo);
  r = r < static_cast<float>(hi) ? r : static_cast<float>(hi);
  return static_cast<int>(r);
}

// One q4_K / q5_K super-block's scales, mins and values 0..max_q (15 or 31):
// per sub-block of 32, min m = min(0, min x), scale (max x - m) / max_q; the
// eight scales and mins are quantized to 6 bits under fp16 d = max scale / 63
// and dmin = max min / 63 (packed as ggml's get_scale_min_k4 reads them), then
// each value to round((x + dmin * min) / (d * scale)).
void quantize_k4_super_block(const float* xb, int max_q, fp16_t& d16, fp16_t& dmin16, std::uint8_t (&scales)[12],
                             std::uint8_t (&q)[k_qk_k]) {
  float scale[8], min[8], max_scale = 0, max_min = 0;
  for (int s = 0; s < 8; ++s) {
    float lo = 0, hi = xb[32 * s];
    for (int l = 0; l < 32; ++l) {
      lo = xb[32 * s + l] < lo ? xb[32 * s + l] : lo;
      hi = xb[32 * s + l] > hi ? xb[32 * s + l] : hi;
    }
    scale[s] = hi > lo ? (hi - lo) / static_cast<float>(max_q) : 0.0f;
    min[s] = -lo;
    max_scale = scale[s] > max_scale ? scale[s] : max_scale;
    max_min = min[s] > max_min ? min[s] : max_min;
  }
  d16 = f32_to_fp16(max_scale / 63.0f);
  dmin16 = f32_to_fp16(max_min / 63.0f);
  const float d = fp16_to_f32(d16), dmin = fp16_to_f32(dmin16);
  int ls[8], lm[8];
  std::memset(scales, 0, sizeof scales);
  for (int s = 0; s < 8; ++s) {
    ls[s] = quantize_to(scale[s], d, 0, 63);
    lm[s] = quantize_to(min[s], dmin, 0, 63);
    if (s < 4) {
      scales[s] = static_cast<std::uint8_t>(ls[s]);
      scales[s + 4] = static_cast<std::uint8_t>(lm[s]);
    } else {
      scales[s + 4] = static_cast<std::uint8_t>((ls[s] & 15) | (lm[s] & 15) << 4);
      scales[s - 4] |= static_cast<std::uint8_t>((ls[s] >> 4) << 6);
      scales[s] |= static_cast<std::uint8_t>((lm[s] >> 4) << 6);
    }
  }
  for (int e = 0; e < k_qk_k; ++e) {
    const int s = e / 32;
    q[e] = static_cast<std::uint8_t>(quantize_to(xb[e] + dmin * static_cast<float>(lm[s]),
                                                 d * static_cast<float>(ls[s]), 0, max_q));
  }
}

}  // namespace

void quantize_row_q4_k(const float* x, std::int64_t n, void* out) {
  PAGODA_ASSERT(n % k_qk_k == 0, "quantize_row_q4_K: n = {} is not a multiple of 256", n);
  auto* y = static_cast<block_q4_k*>(out);
  for (std::int64_t b = 0; b < n / k_qk_k; ++b) {
    block_q4_k& yb = y[b];
    std::uint8_t q[k_qk_k];
    quantize_k4_super_block(x + b * k_qk_k, 15, yb.d, yb.dmin, yb.scales, q);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l)
        yb.qs[32 * c + l] = static_cast<std::uint8_t>(q[64 * c + l] | q[64 * c + 32 + l] << 4);
  }
}

// q4_K's scheme with 32 levels: the low 4 bits as q4_K's nibbles, the fifth
// bit of element 64c + 32h + l in bit 2c + h of qh[l].
void quantize_row_q5_k(const float* x, std::int64_t n, void* out) {
  PAGODA_ASSERT(n % k_qk_k == 0, "quantize_row_q5_K: n = {} is not a multiple of 256", n);
  auto* y = static_cast<block_q5_k*>(out);
  for (std::int64_t b = 0; b < n / k_qk_k; ++b) {
    block_q5_k& yb = y[b];
    std::uint8_t q[k_qk_k];
    quantize_k4_super_block(x + b * k_qk_k, 31, yb.d, yb.dmin, yb.scales, q);
    std::memset(yb.qh, 0, sizeof yb.qh);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        const std::uint8_t lo = q[64 * c + l], hi = q[64 * c + 32 + l];
        yb.qs[32 * c + l] = static_cast<std::uint8_t>((lo & 15) | (hi & 15) << 4);
        yb.qh[l] |= static_cast<std::uint8_t>((lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1));
      }
  }
}

// Per group of 16: scale max|x| / 31; the 16 scales are quantized to int8 under
// fp16 d = max scale / 127, then each value to round(x / (d * scale)) in -32..31.
void quantize_row_q6_k(const float* x, std::int64_t n, void* out) {
  PAGODA_ASSERT(n % k_qk_k == 0, "quantize_row_q6_K: n = {} is not a multiple of 256", n);
  auto* y = static_cast<block_q6_k*>(out);
  for (std::int64_t b = 0; b < n / k_qk_k; ++b) {
    const float* xb = x + b * k_qk_k;
    block_q6_k& yb = y[b];
    float scale[16], max_scale = 0;
    for (int g = 0; g < 16; ++g) {
      float amax = 0;
      for (int l = 0; l < 16; ++l) amax = std::fabs(xb[16 * g + l]) > amax ? std::fabs(xb[16 * g + l]) : amax;
      scale[g] = amax / 31.0f;
      max_scale = scale[g] > max_scale ? scale[g] : max_scale;
    }
    yb.d = f32_to_fp16(max_scale / 127.0f);
    const float d = fp16_to_f32(yb.d);
    std::uint8_t q[k_qk_k];
    for (int g = 0; g < 16; ++g) {
      yb.scales[g] = static_cast<std::int8_t>(quantize_to(scale[g], d, -128, 127));
      for (int l = 0; l < 16; ++l)
        q[16 * g + l] = static_cast<std::uint8_t>(
            quantize_to(xb[16 * g + l], d * static_cast<float>(yb.scales[g]), -32, 31) + 32);
    }
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const std::uint8_t* qh = q + 128 * h;
        yb.ql[64 * h + l] = static_cast<std::uint8_t>((qh[l] & 15) | (qh[64 + l] & 15) << 4);
        yb.ql[64 * h + 32 + l] = static_cast<std::uint8_t>((qh[32 + l] & 15) | (qh[96 + l] & 15) << 4);
        yb.qh[32 * h + l] = static_cast<std::uint8_t>((qh[l] >> 4) | (qh[32 + l] >> 4) << 2 | (qh[64 + l] >> 4) << 4 |
                                                      (qh[96 + l] >> 4) << 6);
      }
  }
}

namespace {

// The E2M1 code (0..7) nearest to t >= 0 in doubled units (k_mxfp4_values
// 0..7), ties to the even code; NaN gives 0.
int nearest_e2m1(double t) {
  int code = 0;
  for (int c = 0; c < 7; ++c) {
    const double mid = 0.5 * (k_mxfp4_values[c] + k_mxfp4_values[c + 1]);
    if (t > mid || (t == mid && (c + 1) % 2 == 0)) code = c + 1;
  }
  return code;
}

// The smallest E8M0 exponent whose largest code 6 * 2^(e - 127) is >= amax (0 for amax = 0).
// With amax = m * 2^k (m in [0.5, 1)), 6 * 2^(k - 3) = 0.75 * 2^k covers amax
// or the next exponent does, and 6 * 2^(k - 4) < amax: start there and step.
std::uint8_t mxfp4_exponent(float amax) {
  if (amax == 0.0f) return 0;
  if (!std::isfinite(amax)) return 254;
  int k = 0;
  std::frexp(amax, &k);
  int e = std::max(0, 127 + k - 3);
  while (e < 254 && std::ldexp(6.0, e - 127) < static_cast<double>(amax)) ++e;
  return static_cast<std::uint8_t>(e);
}

}  // namespace

void quantize_row_mxfp4(const float* x, std::int64_t n, void* out) {
  PAGODA_ASSERT(n % k_qk_legacy == 0, "quantize_row_mxfp4: n = {} is not a multiple of 32", n);
  auto* y = static_cast<block_mxfp4*>(out);
  for (std::int64_t b = 0; b < n / k_qk_legacy; ++b) {
    const float* xb = x + b * k_qk_legacy;
    float amax = 0.0f;
    for (int j = 0; j < k_qk_legacy; ++j) amax = std::fabs(xb[j]) > amax ? std::fabs(xb[j]) : amax;
    y[b].e = mxfp4_exponent(amax);
    const double half = e8m0_half_to_f32(y[b].e);
    auto code = [&](float v) {
      const int c = nearest_e2m1(std::fabs(static_cast<double>(v)) / half);
      return static_cast<std::uint8_t>(c != 0 && std::signbit(v) ? c + 8 : c);
    };
    for (int j = 0; j < k_qk_legacy / 2; ++j)
      y[b].qs[j] = static_cast<std::uint8_t>(code(xb[j]) | code(xb[j + k_qk_legacy / 2]) << 4);
  }
}

}  // namespace pagoda
