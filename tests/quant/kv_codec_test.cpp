// Every KV codec and scale mode against its reference twin and against the exact
// values it stores, with stated error bounds.
//
// - round trip: decoded values within the codec's own rounding bound of the input;
// - SIMD vs reference on random shapes and runs of tiles;
// - lanes independent (the batch-invariance property attention relies on);
// - non-finite input: defined and contained in its element (kv_codec.h);
// - check() enforces the block-size limit each codec's kernels need.
// The kernel tests run at every SIMD level under test (core/simd_levels.h).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/aligned_buffer.h"
#include "core/cpu.h"
#include "core/half.h"
#include "core/simd_levels.h"
#include "quant/kv_codec.h"
#include "quant/kv_codec_float.h"
#include "quant/kv_codec_int.h"

// Counts heap allocations made on this thread while t_count_allocations is set
// (kernels_allocate_nothing_per_call). Replaces the global operator new of
// test_quant; every other allocation goes through unchanged.
namespace {
thread_local bool t_count_allocations = false;
std::atomic<long> g_allocations{0};
}  // namespace

// GCC sees operator new's malloc paired with operator delete's free and warns
// of a mismatch that the replacement makes deliberate.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
  if (t_count_allocations) ++g_allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace pagoda {
namespace {

using test::simd_level_guard;

// A codec configuration under test; group_size -1 picks one that divides head_dim.
struct case_t {
  kv_type type;
  kv_scale_mode mode;
  int group_size = 0;
};

std::string case_name(const case_t& c) {
  std::string n = std::string(kv_type_name(c.type)) + "_" + kv_scale_mode_name(c.mode);
  if (c.group_size > 0) n += std::to_string(c.group_size);
  return n;
}

kv_format format_of(const case_t& c, kv_role role, int head_dim) {
  kv_format f{c.type, role, c.mode, 0};
  if (c.mode == kv_scale_mode::group)
    f.group_size = c.group_size > 0 ? c.group_size : head_dim % 32 == 0 ? 32 : head_dim % 16 == 0 ? 16 : head_dim;
  return f;
}

// Values ~ N(0, 1), with a few outlier channels (x8, shifted by +3) as real keys have.
std::vector<float> kv_data(std::mt19937& rng, int n_tokens, int head_dim) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(n_tokens) * head_dim);
  for (int t = 0; t < n_tokens; ++t)
    for (int d = 0; d < head_dim; ++d) {
      float v = nd(rng);
      if (d % 7 == 3) v = 8.0f * v + 3.0f;
      x[static_cast<std::size_t>(t) * head_dim + d] = v;
    }
  return x;
}

// Static parameters from the data's exact per-channel ranges (no clipping).
struct static_holder {
  std::vector<float> scale, offset;
  kv_static_params params;
  static_holder(const kv_codec* c, const kv_format& f, const std::vector<float>& x, int head_dim) {
    std::vector<float> lo(head_dim, INFINITY), hi(head_dim, -INFINITY);
    for (std::size_t i = 0; i < x.size(); ++i) {
      lo[i % head_dim] = std::min(lo[i % head_dim], x[i]);
      hi[i % head_dim] = std::max(hi[i % head_dim], x[i]);
    }
    scale.resize(head_dim);
    offset.resize(head_dim);
    if (c->make_static) c->make_static(f, head_dim, lo.data(), hi.data(), scale.data(), offset.data());
    params = {scale.data(), offset.data()};
  }
  const kv_static_params* get(const kv_format& f) const {
    return f.scale_mode == kv_scale_mode::static_scales ? &params : nullptr;
  }
};

// The positions (t', d') that share a scale with element (t, d) of a block
// [B][D] (its scale group; for modes without one, its token).
std::vector<std::pair<int, int>> scale_group(const kv_format& f, int B, int D, int t, int d) {
  std::vector<std::pair<int, int>> g;
  if (f.type == kv_type::q8_0 || f.type == kv_type::q4_0) {
    for (int dd = d / 32 * 32; dd < std::min(D, d / 32 * 32 + 32); ++dd) g.emplace_back(t, dd);
    return g;
  }
  switch (f.scale_mode) {
    case kv_scale_mode::group: {
      int g0 = d / f.group_size * f.group_size;
      for (int dd = g0; dd < std::min(D, g0 + f.group_size); ++dd) g.emplace_back(t, dd);
      break;
    }
    case kv_scale_mode::per_channel:
    case kv_scale_mode::static_scales:
      for (int tt = 0; tt < B; ++tt) g.emplace_back(tt, d);
      break;
    default:
      for (int dd = 0; dd < D; ++dd) g.emplace_back(t, dd);
      break;
  }
  return g;
}

// The largest error decoding may show for element (t, d) of block x[B][D]: half
// a quantization step of the scale group that holds it, plus the fp16 rounding
// of the group's scale and offset. Scales are fitted to finite values only.
double error_bound(const kv_format& f, const std::vector<float>& x, int B, int D, int t, int d,
                   const static_holder& st) {
  auto at = [&](int tt, int dd) { return static_cast<double>(x[static_cast<std::size_t>(tt) * D + dd]); };
  std::vector<double> group;  // finite values sharing a scale with (t, d)
  if (f.scale_mode != kv_scale_mode::static_scales)
    for (auto [tt, dd] : scale_group(f, B, D, t, d))
      if (std::isfinite(at(tt, dd))) group.push_back(at(tt, dd));
  const double v = std::fabs(at(t, d));
  double lo = 0, hi = 0, amax = 0;
  if (!group.empty()) {
    lo = *std::min_element(group.begin(), group.end());
    hi = *std::max_element(group.begin(), group.end());
    amax = std::max(std::fabs(lo), std::fabs(hi));
  }
  switch (f.type) {
    case kv_type::f32: return 0;
    case kv_type::f16: return v * 0x1p-11 + 0x1p-25;  // half an ulp, or of the subnormal step
    case kv_type::bf16: return v * 0x1p-8;
    case kv_type::fp8_e4m3:
    case kv_type::fp8_e5m2: {
      const bool e4 = f.type == kv_type::fp8_e4m3;
      double s = f.scale_mode == kv_scale_mode::per_token ? amax / (e4 ? 448.0 : 57344.0)
                 : f.scale_mode == kv_scale_mode::static_scales ? st.scale[0]
                                                                : 1.0;
      // Half an ulp (2^-4 / 2^-3 relative), half a subnormal step, and the
      // saturation an fp16-rounded scale can cause.
      return v * (e4 ? 0x1p-4 : 0x1p-3) + s * (e4 ? 0x1p-10 : 0x1p-17) + amax * 0x1p-10;
    }
    case kv_type::int8:
    case kv_type::int4:
    case kv_type::int2: {
      const double levels = f.type == kv_type::int8 ? 255 : f.type == kv_type::int4 ? 15 : 3;
      if (f.scale_mode == kv_scale_mode::static_scales)
        return 0.5 * st.scale[d] * 1.0001 + 1e-6 * (std::fabs(st.offset[d]) + v);
      double step = (hi - lo) / levels;
      return 0.5 * step * (1 + 0x1p-9) + (std::fabs(lo) + std::fabs(hi)) * 0x1p-10 + 1e-7;
    }
    case kv_type::q8_0:
    case kv_type::q4_0: {
      const double a = amax;
      // q8_0: half a step of amax/127; q4_0: the positive end saturates at 7 of 8 steps.
      return f.type == kv_type::q8_0 ? 0.5 * a / 127.0 + a * 0x1p-10 : a / 8.0 + a * 0x1p-10;
    }
  }
  return 0;
}

// For integer codecs: the scale S and the code u of element (t, d), read from
// the tile (the terms of int_kv::operand_error's bound).
struct int_terms {
  double scale = 0;
  double code = 0;
  double offset = 0;
};
int_terms int_element(const kv_format& f, kv_tile_shape s, const kv_static_params* sp, const void* tile, int t, int d) {
  const int_kv::tile_layout L = int_kv::layout_of(f, s);
  const auto* b = static_cast<const std::uint8_t*>(tile);
  int shift = 0;
  const std::uint8_t byte = b[int_kv::code_byte(L, s, t, d, shift)];  // sets shift: read it after
  const int u = (byte >> shift) & ((1 << L.bits) - 1);
  int_terms it;
  it.code = u;
  if (f.scale_mode == kv_scale_mode::static_scales) {
    it.scale = sp->scale[d];
    it.offset = sp->offset[d];
  } else {
    fp16_t h;
    std::memcpy(&h, b + L.scale_off + 2 * int_kv::scale_index(L, s, t, d), 2);
    it.scale = fp16_to_f32(h);
    std::memcpy(&h, b + L.offset_off + 2 * int_kv::scale_index(L, s, t, d), 2);
    it.offset = fp16_to_f32(h);
  }
  return it;
}

std::vector<case_t> all_cases() {
  using m = kv_scale_mode;
  return {
      {kv_type::f32, m::none},          {kv_type::f16, m::none},           {kv_type::bf16, m::none},
      {kv_type::fp8_e4m3, m::per_token}, {kv_type::fp8_e4m3, m::none},     {kv_type::fp8_e4m3, m::static_scales},
      {kv_type::fp8_e5m2, m::per_token}, {kv_type::fp8_e5m2, m::static_scales},
      {kv_type::int8, m::per_token},    {kv_type::int8, m::per_channel},   {kv_type::int8, m::group, -1},
      {kv_type::int8, m::static_scales},
      {kv_type::int4, m::per_token},    {kv_type::int4, m::per_channel},   {kv_type::int4, m::group, -1},
      {kv_type::int4, m::static_scales},
      {kv_type::int2, m::per_token},    {kv_type::int2, m::per_channel},   {kv_type::int2, m::group, -1},
      {kv_type::int2, m::static_scales},
      {kv_type::q8_0, m::group, 32},    {kv_type::q4_0, m::group, 32},
  };
}

class codec_case : public ::testing::TestWithParam<case_t> {};

// The kernel tests: one codec configuration at one SIMD level.
class codec_level : public ::testing::TestWithParam<std::tuple<case_t, simd_level>> {
 protected:
  case_t cs() const { return std::get<0>(GetParam()); }
  simd_level level() const { return std::get<1>(GetParam()); }
  simd_level_guard guard_;
};

// Writes x[B][D] into a tile the way the pool does: whole for sealed formats,
// otherwise in three pieces (as a sequence fills a block over several steps).
void encode_block(const kv_codec* c, const kv_format& f, kv_tile_shape s, const kv_static_params* sp,
                  const std::vector<float>& x, void* tile) {
  if (kv_format_sealed(f) || s.block_size < 3) {
    c->encode(f, s, sp, x.data(), 0, s.block_size, tile);
    return;
  }
  int a = s.block_size / 3, b = s.block_size / 2;
  c->encode(f, s, sp, x.data(), 0, a, tile);
  c->encode(f, s, sp, x.data() + static_cast<std::size_t>(a) * s.head_dim, a, b - a, tile);
  c->encode(f, s, sp, x.data() + static_cast<std::size_t>(b) * s.head_dim, b, s.block_size - b, tile);
}

TEST_P(codec_case, decode_is_within_the_rounding_bound) {
  const case_t cs = GetParam();
  const kv_codec* c = get_kv_codec(cs.type);
  ASSERT_NE(c, nullptr);
  std::mt19937 rng(1);
  for (kv_role role : {kv_role::key, kv_role::value})
    for (kv_tile_shape shape : {kv_tile_shape{16, 8}, kv_tile_shape{16, 128}, kv_tile_shape{8, 40}, kv_tile_shape{32, 64}}) {
      kv_format f = format_of(cs, role, shape.head_dim);
      ASSERT_TRUE(c->check(f, shape).ok()) << c->check(f, shape).message();
      auto x = kv_data(rng, shape.block_size, shape.head_dim);
      static_holder st(c, f, x, shape.head_dim);
      aligned_buffer tile(c->tile_bytes(f, shape));
      std::memset(tile.data(), 0xa5, c->tile_bytes(f, shape));  // stale bytes must not leak through
      encode_block(c, f, shape, st.get(f), x, tile.data());
      std::vector<float> y(x.size());
      c->decode(f, shape, st.get(f), tile.data(), 0, shape.block_size, y.data());
      double worst = 0;
      for (int t = 0; t < shape.block_size; ++t)
        for (int d = 0; d < shape.head_dim; ++d) {
          std::size_t i = static_cast<std::size_t>(t) * shape.head_dim + d;
          double bound = error_bound(f, x, shape.block_size, shape.head_dim, t, d, st);
          ASSERT_LE(std::fabs(y[i] - x[i]), bound) << kv_format_name(f) << " t=" << t << " d=" << d << " x=" << x[i];
          worst = std::max(worst, std::fabs(static_cast<double>(y[i]) - x[i]));
        }
      if (cs.type != kv_type::f32) {
        EXPECT_GT(worst, 0) << "a lossy codec stored values exactly: not encoding?";
      }
    }
}

// Non-finite input (kv_codec.h): encoding is defined (this test runs under
// UBSan with float-cast-overflow in the asan preset), and a NaN or inf stays in
// its element: every finite element decodes within the bound of its scale group
// taken over the group's finite values. The bad elements themselves: float
// types keep NaN and inf (fp8 saturates inf to its largest finite magnitude);
// quantized types store NaN as the code nearest 0 (exactly 0 for q8_0/q4_0,
// whose range holds 0) and saturate +-inf to the group's largest / smallest
// value. A token that is NaN throughout decodes to zeros where its scale
// group is the token.
TEST_P(codec_case, non_finite_input_is_defined_and_contained) {
  const case_t cs = GetParam();
  const kv_codec* c = get_kv_codec(cs.type);
  const bool floats = cs.type == kv_type::f32 || cs.type == kv_type::f16 || cs.type == kv_type::bf16;
  const bool fp8 = cs.type == kv_type::fp8_e4m3 || cs.type == kv_type::fp8_e5m2;
  std::mt19937 rng(13);
  for (kv_role role : {kv_role::key, kv_role::value}) {
    const kv_tile_shape shape{16, 64};
    const int B = shape.block_size, D = shape.head_dim;
    kv_format f = format_of(cs, role, D);
    auto clean = kv_data(rng, B, D);
    static_holder st(c, f, clean, D);  // static ranges from the finite data
    auto x = clean;
    auto at = [&](int t, int d) -> float& { return x[static_cast<std::size_t>(t) * D + d]; };
    at(1, 5) = NAN;
    at(2, 9) = INFINITY;
    at(3, 20) = -INFINITY;
    at(5, 40) = NAN;
    at(5, 41) = INFINITY;
    for (int d = 0; d < D; ++d) at(7, d) = NAN;  // a whole token
    aligned_buffer tile(c->tile_bytes(f, shape));
    encode_block(c, f, shape, st.get(f), x, tile.data());
    std::vector<float> y(x.size());
    c->decode(f, shape, st.get(f), tile.data(), 0, B, y.data());
    auto got = [&](int t, int d) { return y[static_cast<std::size_t>(t) * D + d]; };
    const std::string name = kv_format_name(f);
    for (int t = 0; t < B; ++t)
      for (int d = 0; d < D; ++d) {
        const float v = at(t, d);
        if (std::isfinite(v)) {
          ASSERT_LE(std::fabs(got(t, d) - v), error_bound(f, x, B, D, t, d, st)) << name << " t " << t << " d " << d;
          continue;
        }
        if (floats || fp8) {
          if (std::isnan(v)) {
            EXPECT_TRUE(std::isnan(got(t, d))) << name << " t " << t << " d " << d;
          } else if (floats) {
            EXPECT_EQ(got(t, d), v) << name << " t " << t << " d " << d;
          } else {  // fp8 saturates: finite, same sign, at least every finite magnitude of its token
            EXPECT_TRUE(std::isfinite(got(t, d))) << name;
            EXPECT_EQ(std::signbit(got(t, d)), std::signbit(v)) << name;
            for (int dd = 0; dd < D; ++dd)
              if (std::isfinite(at(t, dd))) {
                EXPECT_GE(std::fabs(got(t, d)), std::fabs(got(t, dd))) << name;
              }
          }
          continue;
        }
        // Quantized: the group's decoded values of finite inputs bound it.
        ASSERT_TRUE(std::isfinite(got(t, d))) << name << " t " << t << " d " << d;
        float lo = INFINITY, hi = -INFINITY;
        for (auto [tt, dd] : scale_group(f, B, D, t, d))
          if (std::isfinite(at(tt, dd))) {
            lo = std::min(lo, got(tt, dd));
            hi = std::max(hi, got(tt, dd));
          }
        if (lo > hi) {  // no finite element in the group
          EXPECT_EQ(got(t, d), 0.0f) << name << " t " << t << " d " << d;
        } else if (std::isnan(v)) {
          if (cs.type == kv_type::q8_0 || cs.type == kv_type::q4_0) {
            EXPECT_EQ(got(t, d), 0.0f) << name;
          }
          // The code nearest 0: within the group's decoded range, and no
          // further from 0 than half a step past the nearest end.
          const double levels = cs.type == kv_type::int8 ? 255 : cs.type == kv_type::int4 ? 15 : 3;
          const double step = f.scale_mode == kv_scale_mode::static_scales ? st.scale[d] : (hi - lo) / levels;
          EXPECT_LE(std::fabs(got(t, d) - std::clamp(0.0f, lo, hi)), 0.5 * step + 1e-5) << name << " t " << t;
        } else if (v > 0) {
          EXPECT_GE(got(t, d), hi) << name << " t " << t << " d " << d;
        } else {
          EXPECT_LE(got(t, d), lo) << name << " t " << t << " d " << d;
        }
      }
    if (!floats && !fp8 && (f.scale_mode == kv_scale_mode::per_token || f.scale_mode == kv_scale_mode::group)) {
      for (int d = 0; d < D; ++d) EXPECT_EQ(got(7, d), 0.0f) << name << " all-NaN token, d " << d;
    }
  }
}

// Each codec's check() enforces the block-size limit its own kernels' stack
// arrays need, whoever calls it, and rejects empty shapes.
TEST(kv_codec, check_enforces_each_codecs_block_size_limit) {
  for (int i = 0; i < k_n_kv_types; ++i) {
    const kv_type type = static_cast<kv_type>(i);
    const kv_codec* c = get_kv_codec(type);
    const kv_format f = default_kv_format(type, kv_role::value);
    const bool is_float = type == kv_type::f32 || type == kv_type::f16 || type == kv_type::bf16 ||
                          type == kv_type::fp8_e4m3 || type == kv_type::fp8_e5m2;
    const bool is_int = type == kv_type::int8 || type == kv_type::int4 || type == kv_type::int2;
    const int limit = is_float ? float_kv::k_max_block_size : is_int ? int_kv::k_max_block_size : 1 << 20;
    EXPECT_TRUE(c->check(f, {limit, 64}).ok()) << kv_type_name(type);
    status over = c->check(f, {limit + 1, 64});
    ASSERT_FALSE(over.ok()) << kv_type_name(type);
    EXPECT_NE(over.message().find("block size"), std::string::npos) << over.message();
    EXPECT_FALSE(c->check(f, {0, 64}).ok()) << kv_type_name(type);
    EXPECT_FALSE(c->check(f, {16, 0}).ok()) << kv_type_name(type);
  }
}

// The dispatched kernels (whatever runs at the level) vs the reference twins on
// random shapes and runs of tiles. At the scalar level the dispatched kernel is
// the reference: bitwise equal. The float-like kernels differ from the
// reference only by fused rounding (1e-5 of sum |q_d k_d|). The integer
// kernels apply scales and offsets after the code sums, so their rounding is
// relative to the expanded terms sum |q_d| (S_d u_d + |M_d|). They also round
// their f32 operand to integers (AVX-512: int8 halves, int_kv::operand_error;
// AVX2: int16, int_kv::avx2_operand_error, 0 for its f32 folded keys), so on
// top we allow eps * max(|x| * S) * sum u from the stored terms.
TEST_P(codec_level, simd_matches_reference) {
  PAGODA_USE_SIMD_LEVEL(level());
  const case_t cs = this->cs();
  const kv_codec* c = get_kv_codec(cs.type);
  const bool integer = cs.type == kv_type::int8 || cs.type == kv_type::int4 || cs.type == kv_type::int2;
  const bool exact = level() == simd_level::scalar;
  const bool operand_rounding = integer && level() != simd_level::scalar;
  auto eps_of = [&](const kv_format& f, kv_tile_shape shape) {
    if (!operand_rounding) return 0.0;
    const int_kv::tile_layout L = int_kv::layout_of(f, shape);
    return level() == simd_level::avx512 ? int_kv::operand_error(L) : int_kv::avx2_operand_error(L, shape);
  };
  std::mt19937 rng(7);
  for (int trial = 0; trial < 48; ++trial) {
    const int bs = std::vector<int>{1, 8, 16, 32, 16, 17}[trial % 6];
    // 160 and 96 as well: head sizes past 128 and between the common ones.
    const int hd = std::vector<int>{8, 64, 80, 128, 32, 160, 96}[trial % 7];
    const int n_q = 1 + trial % 7;
    // Every fourth trial a longer run: past the kernels' spans and operand
    // groups of 128 tokens, and for 16-token f16 and int8 tiles past their
    // prefetch distance (32 KiB).
    const int n_tiles = 1 + static_cast<int>(rng() % (trial % 4 == 3 ? 24 : 4));
    const int n_tok = (n_tiles - 1) * bs + 1 + static_cast<int>(rng() % bs);
    kv_tile_shape shape{bs, hd};
    kv_format kf = format_of(cs, kv_role::key, hd), vf = format_of(cs, kv_role::value, hd);
    if (!c->check(kf, shape).ok()) continue;
    std::vector<aligned_buffer> kt, vt;
    std::vector<const void*> kp, vp;
    std::vector<float> kd(static_cast<std::size_t>(n_tiles) * bs * hd), vd(kd.size());
    auto all_k = kv_data(rng, n_tiles * bs, hd), all_v = kv_data(rng, n_tiles * bs, hd);
    static_holder sk(c, kf, all_k, hd), sv(c, vf, all_v, hd);
    for (int i = 0; i < n_tiles; ++i) {
      std::vector<float> xk(all_k.begin() + static_cast<std::ptrdiff_t>(i) * bs * hd,
                            all_k.begin() + static_cast<std::ptrdiff_t>(i + 1) * bs * hd);
      std::vector<float> xv(all_v.begin() + static_cast<std::ptrdiff_t>(i) * bs * hd,
                            all_v.begin() + static_cast<std::ptrdiff_t>(i + 1) * bs * hd);
      kt.emplace_back(c->tile_bytes(kf, shape));
      vt.emplace_back(c->tile_bytes(vf, shape));
      encode_block(c, kf, shape, sk.get(kf), xk, kt.back().data());
      encode_block(c, vf, shape, sv.get(vf), xv, vt.back().data());
      c->decode(kf, shape, sk.get(kf), kt.back().data(), 0, bs, kd.data() + static_cast<std::size_t>(i) * bs * hd);
      c->decode(vf, shape, sv.get(vf), vt.back().data(), 0, bs, vd.data() + static_cast<std::size_t>(i) * bs * hd);
      kp.push_back(kt.back().data());
      vp.push_back(vt.back().data());
    }
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> q(static_cast<std::size_t>(n_q) * hd), w(static_cast<std::size_t>(n_q) * n_tiles * bs);
    for (float& x : q) x = nd(rng);
    for (float& x : w) x = std::exp(nd(rng) - 2.0f);  // softmax-like weights, all positive
    const int ld = n_tiles * bs;
    std::vector<float> s_ref(n_q * ld, -1.0f), s_simd(n_q * ld, -1.0f);
    std::vector<float> a_ref(n_q * hd, 0.5f), a_simd(n_q * hd, 0.5f);
    c->qk_ref(kf, shape, sk.get(kf), kp.data(), n_tok, q.data(), n_q, s_ref.data(), ld);
    c->av_ref(vf, shape, sv.get(vf), vp.data(), n_tok, w.data(), ld, n_q, a_ref.data());
    c->qk(kf, shape, sk.get(kf), kp.data(), n_tok, q.data(), n_q, s_simd.data(), ld);
    c->av(vf, shape, sv.get(vf), vp.data(), n_tok, w.data(), ld, n_q, a_simd.data());
    if (exact) {
      ASSERT_EQ(s_simd, s_ref) << kv_format_name(kf) << " trial " << trial;
      ASSERT_EQ(a_simd, a_ref) << kv_format_name(vf) << " trial " << trial;
      continue;
    }
    auto k_terms = [&](int t, int d) { return int_element(kf, shape, sk.get(kf), kp[t / bs], t % bs, d); };
    auto v_terms = [&](int t, int d) { return int_element(vf, shape, sv.get(vf), vp[t / bs], t % bs, d); };
    const double k_eps = eps_of(kf, shape), v_eps = eps_of(vf, shape);
    const bool k_folded = kf.scale_mode == kv_scale_mode::per_channel || kf.scale_mode == kv_scale_mode::static_scales;
    for (int r = 0; r < n_q; ++r) {
      const float* qr = &q[static_cast<std::size_t>(r) * hd];
      for (int t = 0; t < n_tok; ++t) {
        const float* k = &kd[static_cast<std::size_t>(t) * hd];
        double mag = 0, xs_max = 0, codes = 0, q_max = 0, s_max = 0;
        for (int d = 0; d < hd; ++d) {
          mag += std::fabs(qr[d] * k[d]);
          if (integer) {
            int_terms it = k_terms(t, d);
            xs_max = std::max(xs_max, std::fabs(qr[d]) * it.scale);
            q_max = std::max(q_max, static_cast<double>(std::fabs(qr[d])));
            s_max = std::max(s_max, static_cast<double>(it.scale));
            codes += it.code;
            mag += std::fabs(qr[d]) * (it.scale * it.code + std::fabs(it.offset));
          }
        }
        // Folded keys round q * S in units of max|q| * max S (operand_error).
        if (k_folded) xs_max = q_max * s_max;
        double tol = 1e-5 * mag + 1e-6 + k_eps * xs_max * codes * 1.001;
        ASSERT_NEAR(s_simd[r * ld + t], s_ref[r * ld + t], tol) << kv_format_name(kf) << " trial " << trial;
      }
      for (int t = n_tok; t < ld; ++t) ASSERT_EQ(s_simd[r * ld + t], -1.0f) << "wrote past n_tokens";
      for (int d = 0; d < hd; ++d) {
        double mag = 0.5, xs_max = 0, codes = 0;
        for (int t = 0; t < n_tok; ++t) {
          mag += std::fabs(w[r * ld + t] * vd[static_cast<std::size_t>(t) * hd + d]);
          if (integer) {
            int_terms it = v_terms(t, d);
            xs_max = std::max(xs_max, std::fabs(w[r * ld + t]) * it.scale);
            codes += it.code;
            mag += std::fabs(w[r * ld + t]) * (it.scale * it.code + std::fabs(it.offset));
          }
        }
        double tol = 1e-5 * mag + v_eps * xs_max * codes * 1.001;
        ASSERT_NEAR(a_simd[r * hd + d], a_ref[r * hd + d], tol) << kv_format_name(vf) << " trial " << trial;
      }
    }
  }
}

// A score or value sum of one query row is bitwise the same whether computed
// alone or with other rows, whatever the number of valid tokens after it, and
// zero weights leave the sum exactly as if their tokens were not there.
TEST_P(codec_level, lanes_are_independent) {
  PAGODA_USE_SIMD_LEVEL(level());
  const case_t cs = this->cs();
  const kv_codec* c = get_kv_codec(cs.type);
  {
    std::mt19937 rng(3);
    kv_tile_shape shape{16, 64};
    kv_format kf = format_of(cs, kv_role::key, 64), vf = format_of(cs, kv_role::value, 64);
    std::vector<aligned_buffer> kt, vt;
    std::vector<const void*> kp, vp;
    auto xk = kv_data(rng, 48, 64), xv = kv_data(rng, 48, 64);
    static_holder sk(c, kf, xk, 64), sv(c, vf, xv, 64);
    for (int i = 0; i < 3; ++i) {
      kt.emplace_back(c->tile_bytes(kf, shape));
      vt.emplace_back(c->tile_bytes(vf, shape));
      c->encode(kf, shape, sk.get(kf), xk.data() + i * 16 * 64, 0, 16, kt.back().data());
      c->encode(vf, shape, sv.get(vf), xv.data() + i * 16 * 64, 0, 16, vt.back().data());
      kp.push_back(kt.back().data());
      vp.push_back(vt.back().data());
    }
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> q(6 * 64);
    for (float& x : q) x = nd(rng);
    std::vector<float> all(6 * 48), one(48);
    c->qk(kf, shape, sk.get(kf), kp.data(), 48, q.data(), 6, all.data(), 48);
    for (int r = 0; r < 6; ++r) {
      c->qk(kf, shape, sk.get(kf), kp.data(), 21, q.data() + r * 64, 1, one.data(), 48);
      for (int t = 0; t < 21; ++t) ASSERT_EQ(one[t], all[r * 48 + t]) << "row " << r << " t " << t;
    }
    std::vector<float> w(6 * 48);
    for (float& x : w) x = std::exp(nd(rng));
    for (int r = 0; r < 6; ++r)
      for (int t = 21 + r; t < 48; ++t) w[r * 48 + t] = 0.0f;
    std::vector<float> acc_all(6 * 64, 0.25f), acc_one(64, 0.25f);
    c->av(vf, shape, sv.get(vf), vp.data(), 48, w.data(), 48, 6, acc_all.data());
    c->av(vf, shape, sv.get(vf), vp.data(), 24, w.data() + 3 * 48, 48, 1, acc_one.data());
    for (int d = 0; d < 64; ++d) ASSERT_EQ(acc_one[d], acc_all[3 * 64 + d]) << " d " << d;
  }
}

// The scalar level (the references) and the AVX2 float kernels allocate
// nothing, whatever the shape (head_dim past the references' 64-channel chunk,
// odd block sizes); the integer kernels keep grow-only per-thread operand
// buffers (AVX-512: every operand; AVX2: the query's), so at every level a
// second call of the same shape allocates nothing.
TEST_P(codec_level, kernels_allocate_nothing_per_call) {
  PAGODA_USE_SIMD_LEVEL(level());
  const case_t cs = this->cs();
  const kv_codec* c = get_kv_codec(cs.type);
  std::mt19937 rng(17);
  for (kv_tile_shape shape : {kv_tile_shape{16, 160}, kv_tile_shape{17, 40}}) {
    kv_format kf = format_of(cs, kv_role::key, shape.head_dim), vf = format_of(cs, kv_role::value, shape.head_dim);
    if (!c->check(kf, shape).ok()) continue;
    const int n_tiles = 3, n_tok = 2 * shape.block_size + 5, n_q = 5, ld = n_tiles * shape.block_size;
    auto xk = kv_data(rng, ld, shape.head_dim), xv = kv_data(rng, ld, shape.head_dim);
    static_holder sk(c, kf, xk, shape.head_dim), sv(c, vf, xv, shape.head_dim);
    std::vector<aligned_buffer> tiles;
    std::vector<const void*> kp, vp;
    for (int i = 0; i < n_tiles; ++i) {
      const std::size_t at = static_cast<std::size_t>(i) * shape.block_size * shape.head_dim;
      tiles.emplace_back(c->tile_bytes(kf, shape));
      c->encode(kf, shape, sk.get(kf), xk.data() + at, 0, shape.block_size, tiles.back().data());
      kp.push_back(tiles.back().data());
      tiles.emplace_back(c->tile_bytes(vf, shape));
      c->encode(vf, shape, sv.get(vf), xv.data() + at, 0, shape.block_size, tiles.back().data());
      vp.push_back(tiles.back().data());
    }
    std::vector<float> q(static_cast<std::size_t>(n_q) * shape.head_dim, 0.5f), w(static_cast<std::size_t>(n_q) * ld, 0.25f);
    std::vector<float> scores(static_cast<std::size_t>(n_q) * ld), acc(static_cast<std::size_t>(n_q) * shape.head_dim);
    // Kernels with per-thread scratch (the AVX-512 operands, the AVX2 integer
    // keys' query operand) size it on a thread's first call; never again after.
    const bool integer = cs.type == kv_type::int8 || cs.type == kv_type::int4 || cs.type == kv_type::int2;
    const bool grows_scratch = level() == simd_level::avx512 || (level() == simd_level::avx2 && integer);
    for (int call = 0; call < 2; ++call) {
      g_allocations = 0;
      t_count_allocations = true;
      c->qk(kf, shape, sk.get(kf), kp.data(), n_tok, q.data(), n_q, scores.data(), ld);
      c->av(vf, shape, sv.get(vf), vp.data(), n_tok, w.data(), ld, n_q, acc.data());
      t_count_allocations = false;
      if (call == 1 || !grows_scratch) {
        EXPECT_EQ(g_allocations.load(), 0) << kv_format_name(kf) << " block " << shape.block_size << " head_dim "
                                            << shape.head_dim << " call " << call;
      }
    }
  }
}

// Decode-sized calls (up to four rows) over a long run take their own spans
// in the float kernels (one tile, from 2 MiB of values per head on:
// kv_simd::av_span_tiles); each row must still come out bitwise as it does in
// a call of six rows, which takes the short-run spans. 2.5 MiB of tiles here.
// Every level keeps the property.
TEST_P(codec_level, long_runs_match_six_row_calls) {
  PAGODA_USE_SIMD_LEVEL(level());
  const case_t cs = this->cs();
  const kv_codec* c = get_kv_codec(cs.type);
  std::mt19937 rng(5);
  for (int hd : {128, 160}) {
    kv_tile_shape shape{16, hd};
    kv_format vf = format_of(cs, kv_role::value, hd);
    if (!c->check(vf, shape).ok()) continue;
    const std::size_t tb = c->tile_bytes(vf, shape);
    const int n_tiles = static_cast<int>((std::size_t{5} << 19) / tb) + 1;
    const int n_tok = n_tiles * 16 - 5;
    auto xv = kv_data(rng, n_tiles * 16, hd);
    static_holder sv(c, vf, xv, hd);
    std::vector<aligned_buffer> vt;
    std::vector<const void*> vp;
    for (int i = 0; i < n_tiles; ++i) {
      vt.emplace_back(tb);
      c->encode(vf, shape, sv.get(vf), xv.data() + static_cast<std::size_t>(i) * 16 * hd, 0, 16, vt.back().data());
      vp.push_back(vt.back().data());
    }
    const int ld = n_tiles * 16;
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> w(static_cast<std::size_t>(6) * ld);
    for (float& x : w) x = std::exp(nd(rng) - 2.0f);
    std::vector<float> six(static_cast<std::size_t>(6) * hd, 0.25f);
    c->av(vf, shape, sv.get(vf), vp.data(), n_tok, w.data(), ld, 6, six.data());
    for (int n_q : {1, 2, 3, 4}) {
      std::vector<float> few(static_cast<std::size_t>(n_q) * hd, 0.25f);
      c->av(vf, shape, sv.get(vf), vp.data(), n_tok, w.data(), ld, n_q, few.data());
      for (int r = 0; r < n_q; ++r)
        for (int d = 0; d < hd; ++d)
          ASSERT_EQ(few[static_cast<std::size_t>(r) * hd + d], six[static_cast<std::size_t>(r) * hd + d])
              << kv_format_name(vf) << " hd " << hd << " n_q " << n_q << " row " << r << " d " << d;
    }
  }
}

// A group of 128 tokens whose weights are all zero adds exactly nothing in
// a.v (the AVX-512 kernels quantize weights per such group, and an all-zero
// group has no largest weight to scale by): a row with zeros over the middle
// of three groups comes out bitwise as a call over the other two groups'
// tiles alone, and an all-zero row leaves its accumulator as it was.
TEST_P(codec_level, av_zero_weight_groups_add_nothing) {
  PAGODA_USE_SIMD_LEVEL(level());
  const case_t cs = this->cs();
  const kv_codec* c = get_kv_codec(cs.type);
  std::mt19937 rng(11);
  for (int bs : {16, 32}) {
    const int hd = 128;
    kv_tile_shape shape{bs, hd};
    kv_format vf = format_of(cs, kv_role::value, hd);
    if (!c->check(vf, shape).ok()) continue;
    const int n_tiles = 3 * 128 / bs, ld = n_tiles * bs, group = 128 / bs;
    auto xv = kv_data(rng, ld, hd);
    static_holder sv(c, vf, xv, hd);
    std::vector<aligned_buffer> vt;
    std::vector<const void*> vp, outer;  // outer: the first and last groups' tiles
    for (int i = 0; i < n_tiles; ++i) {
      vt.emplace_back(c->tile_bytes(vf, shape));
      c->encode(vf, shape, sv.get(vf), xv.data() + static_cast<std::size_t>(i) * bs * hd, 0, bs, vt.back().data());
      vp.push_back(vt.back().data());
      if (i < group || i >= 2 * group) outer.push_back(vt.back().data());
    }
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> w(static_cast<std::size_t>(2) * ld);  // row 0: middle group zero; row 1: all zero
    for (int t = 0; t < ld; ++t) w[t] = t >= 128 && t < 256 ? 0.0f : std::exp(nd(rng) - 2.0f);
    std::vector<float> w_outer(256);
    for (int t = 0; t < 256; ++t) w_outer[t] = w[t < 128 ? t : t + 128];
    std::vector<float> acc(static_cast<std::size_t>(2) * hd, 0.25f), acc_outer(hd, 0.25f);
    c->av(vf, shape, sv.get(vf), vp.data(), ld, w.data(), ld, 2, acc.data());
    c->av(vf, shape, sv.get(vf), outer.data(), 256, w_outer.data(), 256, 1, acc_outer.data());
    for (int d = 0; d < hd; ++d) {
      ASSERT_EQ(acc[d], acc_outer[d]) << kv_format_name(vf) << " block " << bs << " d " << d;
      ASSERT_EQ(acc[hd + d], 0.25f) << kv_format_name(vf) << " block " << bs << " d " << d;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(codecs, codec_case, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return case_name(info.param); });
INSTANTIATE_TEST_SUITE_P(codecs, codec_level,
                         ::testing::Combine(::testing::ValuesIn(all_cases()),
                                            ::testing::ValuesIn(test::simd_levels_under_test())),
                         [](const auto& info) {
                           return case_name(std::get<0>(info.param)) + "_" + simd_level_name(std::get<1>(info.param));
                         });

TEST(kv_codec, every_type_has_a_codec_and_a_default_format) {
  for (int i = 0; i < k_n_kv_types; ++i) {
    kv_type t = static_cast<kv_type>(i);
    const kv_codec* c = get_kv_codec(t);
    ASSERT_NE(c, nullptr) << kv_type_name(t);
    EXPECT_STREQ(c->name, kv_type_name(t));
    for (kv_role role : {kv_role::key, kv_role::value})
      EXPECT_TRUE(c->check(default_kv_format(t, role), {16, 8}).ok()) << kv_type_name(t);
  }
  EXPECT_TRUE(kv_format_sealed(default_kv_format(kv_type::int4, kv_role::key)));   // KIVI keys per channel
  EXPECT_FALSE(kv_format_sealed(default_kv_format(kv_type::int4, kv_role::value)));  // values per token
  EXPECT_FALSE(kv_format_sealed(default_kv_format(kv_type::int8, kv_role::key)));
}

TEST(kv_codec, parse_names_and_aliases) {
  EXPECT_EQ(*parse_kv_type("f16"), kv_type::f16);
  EXPECT_EQ(*parse_kv_type("FP16"), kv_type::f16);
  EXPECT_EQ(*parse_kv_type("float32"), kv_type::f32);
  EXPECT_EQ(*parse_kv_type("fp8"), kv_type::fp8_e4m3);
  EXPECT_EQ(*parse_kv_type("fp8_e5m2"), kv_type::fp8_e5m2);
  EXPECT_EQ(*parse_kv_type("q8_0"), kv_type::q8_0);
  EXPECT_EQ(*parse_kv_type("bfloat16"), kv_type::bf16);
  auto bad = parse_kv_type("f7");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code(), errc::invalid_argument);
  EXPECT_NE(bad.error().message().find("f7"), std::string::npos);
}

// Tile sizes are what the layouts say; bits per element include the scales.
TEST(kv_codec, tile_bytes_and_bits_per_element) {
  auto bits = [](kv_type t, kv_role r, kv_tile_shape s) { return kv_format_bits_per_element(default_kv_format(t, r), s); };
  kv_tile_shape llama{16, 128}, stories{16, 8};
  EXPECT_DOUBLE_EQ(bits(kv_type::f16, kv_role::key, llama), 16.0);
  EXPECT_DOUBLE_EQ(bits(kv_type::fp8_e4m3, kv_role::key, llama), 8.0 + 16.0 / 128);  // fp16 scale per token
  EXPECT_DOUBLE_EQ(bits(kv_type::int8, kv_role::key, llama), 8.0 + 32.0 / 128);      // fp16 scale + offset per token
  EXPECT_DOUBLE_EQ(bits(kv_type::int4, kv_role::key, llama), 4.0 + 32.0 / 16);       // per channel over 16 tokens
  EXPECT_DOUBLE_EQ(bits(kv_type::int4, kv_role::value, llama), 4.0 + 32.0 / 128);    // per token
  EXPECT_DOUBLE_EQ(bits(kv_type::int2, kv_role::key, llama), 2.0 + 32.0 / 16);
  EXPECT_DOUBLE_EQ(bits(kv_type::q8_0, kv_role::key, llama), 8.5);                   // ggml: 34 bytes / 32
  EXPECT_DOUBLE_EQ(bits(kv_type::q4_0, kv_role::key, llama), 4.5);
  // head_dim 8: q8_0 pads each token to one 32-value block.
  EXPECT_DOUBLE_EQ(bits(kv_type::q8_0, kv_role::key, stories), 34.0);
  EXPECT_DOUBLE_EQ(bits(kv_type::int4, kv_role::value, stories), 4.0 + 32.0 / 8);
}

TEST(kv_codec, group_size_must_divide_head_dim) {
  const kv_codec* c = get_kv_codec(kv_type::int4);
  auto st = c->check({kv_type::int4, kv_role::value, kv_scale_mode::group, 3}, {16, 8});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("does not divide"), std::string::npos) << st.message();
  EXPECT_FALSE(get_kv_codec(kv_type::f16)->check({kv_type::f16, kv_role::key, kv_scale_mode::per_token, 0}, {16, 8}).ok());
  EXPECT_FALSE(get_kv_codec(kv_type::q8_0)->check({kv_type::q8_0, kv_role::key, kv_scale_mode::per_token, 0}, {16, 8}).ok());
}

}  // namespace
}  // namespace pagoda
