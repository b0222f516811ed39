#include "kv/kv_storage.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include <gtest/gtest.h>

#include "core/half.h"

namespace pagoda {
namespace {

TEST(kv_storage, bytes_per_block_follow_the_formula) {
  // stories260K: 5 layers, 4 KV heads, head_dim 8: 2*5*4*8*4 = 1280 bytes per token in f32.
  auto f32 = kv_layout::uniform(5, 4, 8, 16, kv_type::f32, kv_type::f32);
  EXPECT_EQ(f32.bytes_per_block(), 1280u * 16);
  EXPECT_DOUBLE_EQ(f32.bytes_per_token(), 1280.0);
  EXPECT_EQ(f32.staging_bytes_per_slot(), 0u);
  auto f16 = kv_layout::uniform(5, 4, 8, 16, kv_type::f16, kv_type::f16);
  EXPECT_DOUBLE_EQ(f16.bytes_per_token(), 640.0);
  auto mixed = kv_layout::uniform(5, 4, 8, 16, kv_type::f32, kv_type::f16);
  EXPECT_DOUBLE_EQ(mixed.bytes_per_token(), 960.0);
  auto s = kv_storage::create(f16, 10);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->total_bytes(), 10 * f16.bytes_per_block());
}

// Quantized formats: codes plus in-tile scales; a sealed format adds one f16
// staging slot per sequence, which the pool maps and counts.
TEST(kv_storage, quantized_bytes_include_scales_and_the_staging_window) {
  // llama3-8b shape, 2 layers: int8 per token = 128 codes + fp16 scale and offset per token and head.
  auto int8 = kv_layout::uniform(2, 8, 128, 16, kv_type::int8, kv_type::int8);
  EXPECT_DOUBLE_EQ(int8.bytes_per_token(), 2.0 * 2 * 8 * (128 + 4));
  EXPECT_FALSE(int8.has_sealed());
  // KIVI int4: keys per channel (fp16 scale + offset per channel per block of 16), values per token.
  auto kivi = kv_layout::uniform(2, 8, 128, 16, kv_type::int4, kv_type::int4);
  const double k_bytes = (16 * 128 / 2 + 2 * 2 * 128) / 16.0, v_bytes = 128 / 2 + 2 * 2;
  EXPECT_DOUBLE_EQ(kivi.bytes_per_token(), 2 * 8 * (k_bytes + v_bytes));
  EXPECT_EQ(kivi.staging_bytes_per_slot(), 2u * 8 * 16 * 128 * 2);  // K of both layers, f16
  EXPECT_DOUBLE_EQ(kivi.bytes_per_token_at(1000),
                   (63.0 * kivi.bytes_per_block() + kivi.staging_bytes_per_slot()) / 1000);
  auto s = *kv_storage::create(kivi, 100, 4);
  EXPECT_EQ(s->total_bytes(), 100 * kivi.bytes_per_block() + 4 * kivi.staging_bytes_per_slot());
  EXPECT_EQ(s->staging().slots_mapped, 4);
}

TEST(kv_storage, rejects_bad_layouts) {
  auto l = kv_layout::uniform(2, 2, 8, 16, kv_type::f32, kv_type::f32);
  EXPECT_EQ(kv_storage::create(l, 0).error().code(), errc::invalid_argument);
  l.block_size = 0;
  EXPECT_FALSE(kv_storage::create(l, 4).ok());
  auto g = kv_layout::uniform(2, 2, 8, 16, kv_type::int4, kv_type::int4);
  g.v_formats[1] = {kv_type::int4, kv_role::value, kv_scale_mode::group, 3};
  auto bad = kv_storage::create(g, 4);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("layer 1 V"), std::string::npos) << bad.error().message();
  auto st = kv_layout::uniform(2, 2, 8, 16, kv_type::int8, kv_type::int8);
  st.k_formats[0].scale_mode = kv_scale_mode::static_scales;
  auto no_scales = kv_storage::create(st, 4);
  ASSERT_FALSE(no_scales.ok());
  EXPECT_NE(no_scales.error().message().find("--kv-scales"), std::string::npos) << no_scales.error().message();
}

TEST(kv_storage, write_view_and_copy_block) {
  auto layout = kv_layout::uniform(2, 2, 4, 4, kv_type::f32, kv_type::f32);
  auto s = *kv_storage::create(layout, 8);
  std::vector<block_id> table{block_id(5), block_id(2)};
  // 6 tokens x 2 heads x 4 dims; value = token*100 + head*10 + dim.
  std::vector<float> k(6 * 8), v(6 * 8);
  for (int t = 0; t < 6; ++t)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 4; ++d) {
        k[t * 8 + h * 4 + d] = t * 100 + h * 10 + d;
        v[t * 8 + h * 4 + d] = -(t * 100 + h * 10 + d);
      }
  s->write(1, table, 0, 6, k.data(), v.data());
  auto kv = s->k_view(1, table, 6);
  auto vv = s->v_view(1, table, 6);
  float out[4];
  kv.codec->decode(kv.format, kv.shape, nullptr, kv.tile(1, 1), 1, 1, out);  // token 5, head 1
  EXPECT_EQ(out[3], 513.0f);
  vv.codec->decode(vv.format, vv.shape, nullptr, vv.tile(0, 0), 2, 1, out);  // token 2, head 0
  EXPECT_EQ(out[1], -201.0f);
  s->copy_block(block_id(2), block_id(7));
  std::vector<block_id> copy{block_id(5), block_id(7)};
  auto kc = s->k_view(1, copy, 6);
  kc.codec->decode(kc.format, kc.shape, nullptr, kc.tile(1, 1), 1, 1, out);
  EXPECT_EQ(out[3], 513.0f);
}

// Decodes token p of head h through a view, staged or sealed.
std::vector<float> read_token(const paged_kv_view& v, int p, int h) {
  std::vector<float> out(v.shape.head_dim);
  int b = p / v.shape.block_size, slot = p % v.shape.block_size;
  if (v.is_staged(b)) v.staged_codec->decode(v.staged_format, v.shape, nullptr, v.staged_tile(h), slot, 1, out.data());
  else v.codec->decode(v.format, v.shape, v.params(h), v.tile(b, h), slot, 1, out.data());
  return out;
}

struct sealed_fixture {
  static constexpr int L = 2, H = 2, D = 8, B = 4;
  kv_layout layout = kv_layout::uniform(L, H, D, B, kv_type::int4, kv_type::int4);  // K per channel: sealed
  std::unique_ptr<kv_storage> s;
  std::vector<float> k, v;  // [n][H][D]
  explicit sealed_fixture(int n_tokens, int slots = 2) {
    s = std::move(*kv_storage::create(layout, 16, slots));
    std::mt19937 rng(9);
    std::normal_distribution<float> nd;
    k.resize(static_cast<std::size_t>(n_tokens) * H * D);
    v.resize(k.size());
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
  }
  void write(std::span<const block_id> table, int pos, int n) {
    for (int l = 0; l < L; ++l)
      s->write(l, table, pos, n, &k[static_cast<std::size_t>(pos) * H * D], &v[static_cast<std::size_t>(pos) * H * D]);
  }
  float key(int p, int h, int d) const { return k[(static_cast<std::size_t>(p) * H + h) * D + d]; }
};

// The newest block of a sealed format is readable as f16 while it fills, then
// sealed into codes; its slot goes back when every sealed tensor is sealed.
TEST(kv_storage, partly_filled_blocks_stay_in_f16_until_sealed) {
  sealed_fixture f(6);
  std::vector<block_id> table{block_id(3), block_id(9)};
  for (int p = 0; p < 6; ++p) {
    f.write(table, p, 1);
    for (int l = 0; l < 2; ++l) {
      paged_kv_view kv = f.s->k_view(l, table, p + 1);
      const bool open = (p + 1) % 4 != 0;
      EXPECT_EQ(kv.is_staged(p / 4), open) << "p " << p;
      for (int q = (p / 4) * 4; q <= p; ++q) {
        auto got = read_token(kv, q, 1);
        for (int d = 0; d < 8; ++d) {
          float x = f.key(q, 1, d);
          if (open) ASSERT_EQ(got[d], fp16_to_f32(f32_to_fp16(x))) << "staged tokens are exact f16";
          else ASSERT_NEAR(got[d], x, 0.6) << "sealed int4";
        }
      }
      // Values (per token, not sealed) are never staged.
      EXPECT_FALSE(f.s->v_view(l, table, p + 1).is_staged(p / 4));
    }
    EXPECT_EQ(f.s->staging().slots_in_use, (p + 1) % 4 != 0 ? 1 : 0) << "p " << p;
  }
}

// Sealed codes do not depend on how the block was written.
TEST(kv_storage, sealed_tiles_do_not_depend_on_write_chunks) {
  sealed_fixture a(8), b(8);
  std::vector<block_id> table{block_id(1), block_id(2)};
  a.write(table, 0, 8);
  for (int p = 0; p < 8; p += 3) b.write(table, p, std::min(3, 8 - p));
  for (int blk = 0; blk < 2; ++blk)
    for (int h = 0; h < 2; ++h) {
      paged_kv_view ka = a.s->k_view(1, table, 8), kb = b.s->k_view(1, table, 8);
      EXPECT_EQ(std::memcmp(ka.tile(blk, h), kb.tile(blk, h), ka.tile_bytes), 0) << "block " << blk << " head " << h;
    }
}

// Copy-on-write of a partly filled block copies its staged tokens into a slot
// of its own; writes after the copy do not leak across.
TEST(kv_storage, copy_block_copies_staged_tokens) {
  sealed_fixture f(8, 1);
  std::vector<block_id> parent{block_id(4)}, child{block_id(5)};
  f.write(parent, 0, 2);
  f.s->copy_block(block_id(4), block_id(5));
  EXPECT_EQ(f.s->staging().slots_in_use, 2);
  EXPECT_EQ(f.s->staging().slots_mapped, 2) << "one more slot mapped on demand";
  EXPECT_EQ(f.s->total_bytes(), 16 * f.layout.bytes_per_block() + 2 * f.layout.staging_bytes_per_slot());
  // The child continues with other tokens (2..3 of a different stream).
  std::vector<float> k2(f.k.begin() + 4 * 16, f.k.end()), v2(f.v.begin() + 4 * 16, f.v.end());
  for (int l = 0; l < 2; ++l) f.s->write(l, child, 2, 1, k2.data(), v2.data());
  auto pk = f.s->k_view(0, parent, 2), ck = f.s->k_view(0, child, 3);
  for (int p = 0; p < 2; ++p) EXPECT_EQ(read_token(pk, p, 0), read_token(ck, p, 0));
  EXPECT_EQ(read_token(ck, 2, 0)[0], fp16_to_f32(f32_to_fp16(k2[0])));
  f.write(parent, 2, 1);
  EXPECT_EQ(read_token(f.s->k_view(0, parent, 3), 2, 0)[0], fp16_to_f32(f32_to_fp16(f.key(2, 0, 0))));
}

// A freed partial block gives its slot back at release_block, or when a new
// owner writes the block from its first position.
TEST(kv_storage, staging_slots_are_released_and_reclaimed) {
  sealed_fixture f(8, 1);
  std::vector<block_id> a{block_id(0)}, b{block_id(1)};
  f.write(a, 0, 3);
  EXPECT_EQ(f.s->staging().slots_in_use, 1);
  f.s->release_block(block_id(0));
  EXPECT_EQ(f.s->staging().slots_in_use, 0);
  f.s->release_block(block_id(0));  // idempotent
  f.write(b, 0, 2);                 // reuses the freed slot: nothing new mapped
  EXPECT_EQ(f.s->staging().slots_mapped, 1);
  // Block 1 freed without the hook, then written again from its start by a new owner.
  f.write(b, 0, 1);
  EXPECT_EQ(f.s->staging().slots_in_use, 1);
  f.write(b, 1, 3);  // fills and seals it
  EXPECT_EQ(f.s->staging().slots_in_use, 0);
  EXPECT_EQ(f.s->staging().peak_slots_in_use, 1);
}

// By default one staging slot is mapped up front; more are mapped one at a
// time as open blocks need them, and total_bytes() counts what is mapped.
TEST(kv_storage, staging_grows_one_slot_at_a_time_from_one) {
  sealed_fixture f(8);
  f.s = std::move(*kv_storage::create(f.layout, 16));
  const std::size_t base = 16 * f.layout.bytes_per_block(), slot = f.layout.staging_bytes_per_slot();
  EXPECT_EQ(f.s->staging().slots_mapped, 1);
  EXPECT_EQ(f.s->total_bytes(), base + slot);
  std::vector<block_id> a{block_id(0)}, b{block_id(1)}, c{block_id(2)};
  f.write(a, 0, 1);
  EXPECT_EQ(f.s->staging().slots_mapped, 1);
  f.write(b, 0, 1);
  f.write(c, 0, 1);
  EXPECT_EQ(f.s->staging().slots_mapped, 3);
  EXPECT_EQ(f.s->total_bytes(), base + 3 * slot);
}

// Layers may differ; each layer's tiles use its own format.
TEST(kv_storage, per_layer_formats) {
  auto layout = kv_layout::uniform(3, 2, 8, 16, kv_type::f16, kv_type::f16);
  layout.k_formats[2] = default_kv_format(kv_type::int8, kv_role::key);
  layout.v_formats[2] = default_kv_format(kv_type::int4, kv_role::value);
  EXPECT_EQ(layout.describe(), "0-1:f16+f16,2:int8/token+int4/token");
  auto uniform = kv_layout::uniform(3, 2, 8, 16, kv_type::int4, kv_type::int2);
  EXPECT_EQ(uniform.describe(), "int4/channel+int2/token");
  auto s = *kv_storage::create(layout, 4);
  std::vector<block_id> table{block_id(0)};
  std::vector<float> k(2 * 8, 1.5f), v(2 * 8, -0.5f);
  for (int l = 0; l < 3; ++l) s->write(l, table, 0, 1, k.data(), v.data());
  EXPECT_EQ(s->k_view(0, table, 1).format.type, kv_type::f16);
  auto k2 = s->k_view(2, table, 1);
  EXPECT_EQ(k2.format.type, kv_type::int8);
  EXPECT_NEAR(read_token(k2, 0, 1)[3], 1.5f, 1e-3);  // the fp16 scale rounds
  EXPECT_EQ(read_token(s->v_view(2, table, 1), 0, 0)[7], -0.5f);
}

TEST(kv_storage, static_scales_come_from_the_layout) {
  auto scales = std::make_shared<kv_scales>();
  scales->n_layers = 1;
  scales->n_kv_heads = 1;
  scales->head_dim = 4;
  scales->k_lo = {-1, -2, -4, -8};
  scales->k_hi = {1, 2, 4, 8};
  scales->v_lo = scales->k_lo;
  scales->v_hi = scales->k_hi;
  auto layout = kv_layout::uniform(1, 1, 4, 16, kv_type::int8, kv_type::int8);
  layout.k_formats[0].scale_mode = kv_scale_mode::static_scales;
  layout.scales = scales;
  auto s = *kv_storage::create(layout, 2);
  EXPECT_EQ(s->total_bytes(), 2 * layout.bytes_per_block() + layout.static_bytes());
  std::vector<block_id> table{block_id(1)};
  std::vector<float> k{0.5f, -1.0f, 100.0f, 3.0f}, v(4, 0.0f);
  s->write(0, table, 0, 1, k.data(), v.data());
  auto got = read_token(s->k_view(0, table, 1), 0, 0);
  EXPECT_NEAR(got[0], 0.5f, 1.0 / 255);  // half a step of 2 / 255
  EXPECT_NEAR(got[1], -1.0f, 2.0 / 255);
  EXPECT_NEAR(got[2], 4.0f, 1e-5) << "clipped to the calibrated range";
  EXPECT_NEAR(got[3], 3.0f, 8.0 / 255);
  scales->head_dim = 8;
  EXPECT_FALSE(kv_storage::create(layout, 2).ok());
}

}  // namespace
}  // namespace pagoda
