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
  s->copy_block(block_id(2), block_id(7), 2);
  std::vector<block_id> copy{block_id(5), block_id(7)};
  auto kc = s->k_view(1, copy, 6);
  kc.codec->decode(kc.format, kc.shape, nullptr, kc.tile(1, 1), 1, 1, out);
  EXPECT_EQ(out[3], 513.0f);
}

// Decodes token p of head h through a view, staged or sealed, in its block's class.
std::vector<float> read_token(const paged_kv_view& v, int p, int h) {
  std::vector<float> out(v.shape.head_dim);
  int b = p / v.shape.block_size, slot = p % v.shape.block_size;
  if (v.is_staged(b)) v.staged_codec->decode(v.staged_format, v.shape, nullptr, v.staged_tile(h), slot, 1, out.data());
  else v.codec_of(b)->decode(v.format_of(b), v.shape, v.params_of(b, h), v.tile(b, h), slot, 1, out.data());
  return out;
}

// k and v get n normal values each.
void fill_normal(std::mt19937& rng, std::size_t n, std::vector<float>& k, std::vector<float>& v) {
  std::normal_distribution<float> nd;
  k.resize(n);
  v.resize(n);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
}

struct sealed_fixture {
  static constexpr int L = 2, H = 2, D = 8, B = 4;
  kv_layout layout = kv_layout::uniform(L, H, D, B, kv_type::int4, kv_type::int4);  // K per channel: sealed
  std::unique_ptr<kv_storage> s;
  std::vector<float> k, v;  // [n][H][D]
  explicit sealed_fixture(int n_tokens, int slots = 2) {
    s = std::move(*kv_storage::create(layout, 16, slots));
    std::mt19937 rng(9);
    fill_normal(rng, static_cast<std::size_t>(n_tokens) * H * D, k, v);
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
  sealed_fixture f(8, 2);
  std::vector<block_id> parent{block_id(4)}, child{block_id(5)};
  f.write(parent, 0, 2);
  f.s->copy_block(block_id(4), block_id(5), 2);
  EXPECT_EQ(f.s->staging().slots_in_use, 2);
  EXPECT_EQ(f.s->staging().slots_mapped, 2);
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

// Staging slots are all mapped at create(), counted in total_bytes(), and
// never grow: a write never maps memory. Running out means more open blocks
// than the storage was sized for (the engine sizes it for --max-num-seqs
// sequences, each with at most one open block): a broken invariant, stated.
TEST(kv_storage, staging_slots_are_mapped_up_front) {
  sealed_fixture f(8, 3);
  const std::size_t base = 16 * f.layout.bytes_per_block(), slot = f.layout.staging_bytes_per_slot();
  EXPECT_EQ(f.s->staging().slots_mapped, 3);
  EXPECT_EQ(f.s->total_bytes(), base + 3 * slot);
  std::vector<block_id> a{block_id(0)}, b{block_id(1)}, c{block_id(2)}, d{block_id(3)};
  f.write(a, 0, 1);
  f.write(b, 0, 1);
  f.write(c, 0, 1);
  EXPECT_EQ(f.s->staging().slots_in_use, 3);
  EXPECT_EQ(f.s->staging().slots_mapped, 3);
  EXPECT_DEATH(f.write(d, 0, 1), "staging slots are in use");
  // A chunk that fills its open block and opens the next holds two slots
  // until its later layers seal the first: two per sequence at most.
  sealed_fixture g(8, 2);
  std::vector<block_id> two{block_id(0), block_id(1)};
  g.write(two, 0, 3);
  g.write(two, 3, 3);
  EXPECT_EQ(g.s->staging().peak_slots_in_use, 2);
  EXPECT_EQ(g.s->staging().slots_in_use, 1);
}

// Truncating into a sealed block reopens it: the kept tokens go back to f16
// staging (decoded from their codes) and writing continues from there.
TEST(kv_storage, truncate_block_reopens_a_sealed_block) {
  sealed_fixture f(8, 2);
  std::vector<block_id> t{block_id(6), block_id(7)};
  f.write(t, 0, 6);  // block 6 sealed, block 7 staged with 2
  const auto before = read_token(f.s->k_view(0, t, 6), 1, 1);
  f.s->truncate_block(block_id(6), 2);
  f.s->release_block(block_id(7));
  EXPECT_EQ(f.s->staging().slots_in_use, 1);
  auto kv = f.s->k_view(0, t, 2);
  EXPECT_TRUE(kv.is_staged(0));
  const auto after = read_token(kv, 1, 1);
  for (int d = 0; d < 8; ++d) EXPECT_EQ(after[d], fp16_to_f32(f32_to_fp16(before[d])));
  // New tokens 2..3 seal it again.
  f.write(t, 2, 2);
  EXPECT_EQ(f.s->staging().slots_in_use, 0);
  EXPECT_FALSE(f.s->k_view(0, t, 4).is_staged(0));
  EXPECT_NEAR(read_token(f.s->k_view(0, t, 4), 3, 0)[2], f.key(3, 0, 2), 0.6);
  // A staged block truncates in place.
  f.write(t, 4, 3);
  f.s->truncate_block(block_id(7), 1);
  f.write(t, 5, 1);
  EXPECT_EQ(read_token(f.s->k_view(0, t, 6), 5, 0)[0], fp16_to_f32(f32_to_fp16(f.key(5, 0, 0))));
}

// Copying part of a sealed block (copy-on-write after a truncate into a cached
// block) stages the copied tokens in the destination.
TEST(kv_storage, partial_copy_of_a_sealed_block_stages_the_tokens) {
  sealed_fixture f(8, 2);
  std::vector<block_id> src{block_id(2)}, dst{block_id(3)};
  f.write(src, 0, 4);
  f.s->copy_block(block_id(2), block_id(3), 3);
  auto kd = f.s->k_view(1, dst, 3), ks = f.s->k_view(1, src, 4);
  EXPECT_TRUE(kd.is_staged(0));
  for (int p = 0; p < 3; ++p) {
    const auto a = read_token(kd, p, 0), b = read_token(ks, p, 0);
    for (int d = 0; d < 8; ++d) EXPECT_EQ(a[d], fp16_to_f32(f32_to_fp16(b[d])));
  }
  // A whole copy needs no staging.
  f.s->copy_block(block_id(2), block_id(4), 4);
  EXPECT_EQ(f.s->staging().slots_in_use, 1);
}

// A full block leaves as bytes and comes back in another storage of the same
// layout with the same contents; a wrong size is an error, not a crash.
TEST(kv_storage, whole_blocks_round_trip_as_bytes) {
  for (kv_type type : {kv_type::f16, kv_type::int4, kv_type::q8_0}) {
    auto layout = kv_layout::uniform(2, 2, 32, 4, type, type);
    auto a = *kv_storage::create(layout, 4, 2), b = *kv_storage::create(layout, 4, 2);
    std::vector<float> k(4 * 2 * 32), v(k.size());
    std::mt19937 rng(4);
    std::normal_distribution<float> nd;
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    std::vector<block_id> ta{block_id(1)}, tb{block_id(3)};
    for (int l = 0; l < 2; ++l) a->write(l, ta, 0, 4, k.data(), v.data());
    std::vector<std::byte> bytes(layout.tile_bytes_per_block());
    a->read_block(block_id(1), bytes);
    ASSERT_TRUE(b->write_block(block_id(3), bytes).ok());
    for (int l = 0; l < 2; ++l)
      for (int p = 0; p < 4; ++p)
        for (int h = 0; h < 2; ++h) {
          EXPECT_EQ(read_token(a->k_view(l, ta, 4), p, h), read_token(b->k_view(l, tb, 4), p, h));
          EXPECT_EQ(read_token(a->v_view(l, ta, 4), p, h), read_token(b->v_view(l, tb, 4), p, h));
        }
    std::vector<std::byte> short_bytes(bytes.size() - 1);
    EXPECT_EQ(b->write_block(block_id(0), short_bytes).code(), errc::invalid_argument);
  }
}

// Key summaries: written when a block's keys are full, from the stored
// (decoded) keys; gone when the block is reopened or released; recomputed for
// a block that arrives as bytes.
TEST(kv_storage, key_summaries_bound_the_stored_keys) {
  for (kv_type type : {kv_type::f32, kv_type::int4}) {
    auto layout = kv_layout::uniform(2, 2, 16, 8, type, type);
    layout.key_summaries = true;
    EXPECT_EQ(layout.summary_bytes_per_block(), 3u * 4 * 2 * 2 * 16);
    auto s = *kv_storage::create(layout, 4, 2);
    std::vector<float> k(12 * 2 * 16), v(k.size());
    std::mt19937 rng(8);
    std::normal_distribution<float> nd;
    for (float& x : k) x = nd(rng);
    std::vector<block_id> t{block_id(2), block_id(0)};
    for (int l = 0; l < 2; ++l) s->write(l, t, 0, 5, k.data(), v.data());
    EXPECT_FALSE(s->key_summary_of(block_id(2), 1, 0).has_value()) << "not full yet";
    for (int l = 0; l < 2; ++l) s->write(l, t, 5, 7, &k[5 * 32], &v[5 * 32]);
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) {
        const auto sum = s->key_summary_of(block_id(2), l, h);
        ASSERT_TRUE(sum.has_value());
        paged_kv_view kv = s->k_view(l, t, 12);
        for (int d = 0; d < 16; ++d) {
          float lo = INFINITY, hi = -INFINITY;
          double mean = 0;
          for (int p = 0; p < 8; ++p) {
            const float x = read_token(kv, p, h)[d];
            lo = std::min(lo, x);
            hi = std::max(hi, x);
            mean += x / 8.0;
          }
          EXPECT_EQ(sum->min[d], lo);
          EXPECT_EQ(sum->max[d], hi);
          EXPECT_NEAR(sum->mean[d], mean, 1e-6);
        }
      }
    EXPECT_FALSE(s->key_summary_of(block_id(0), 0, 0).has_value()) << "block 0 holds 4 of 8";
    std::vector<std::byte> bytes(layout.tile_bytes_per_block());
    s->read_block(block_id(2), bytes);
    s->truncate_block(block_id(2), 3);
    EXPECT_FALSE(s->key_summary_of(block_id(2), 0, 1).has_value());
    ASSERT_TRUE(s->write_block(block_id(3), bytes).ok());
    EXPECT_TRUE(s->key_summary_of(block_id(3), 1, 1).has_value());
    s->release_block(block_id(3));
    EXPECT_FALSE(s->key_summary_of(block_id(3), 1, 1).has_value());
  }
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

namespace pagoda {
namespace {

// Compaction: every format moves tokens to their new slots with what they
// held (float formats bit for bit; quantized ones within a re-encoding of
// values that were already codes), per row when rows keep different slots,
// with sealed blocks reopened and resealed. Row r = layer * H + head.
struct gather_case {
  kv_type k, v;
  float tol;  // what a token may move by when its decoded values are encoded again
};

class kv_storage_gather : public ::testing::TestWithParam<gather_case> {};

TEST_P(kv_storage_gather, moves_every_row_to_its_new_slots) {
  const gather_case gc = GetParam();
  constexpr int L = 2, H = 2, D = 32, B = 4, N = 11;
  const auto layout = kv_layout::uniform(L, H, D, B, gc.k, gc.v);
  auto s = *kv_storage::create(layout, 16, 4);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<std::size_t>(N) * H * D), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  const std::vector<block_id> table{block_id(7), block_id(2), block_id(11)};
  for (int l = 0; l < L; ++l) s->write(l, table, 0, N, k.data(), v.data());
  // What each slot decodes to before, per (layer, head).
  auto snapshot = [&](std::span<const block_id> t, int n) {
    std::vector<std::vector<float>> out;  // [l][h][slot] -> [D] for K, then V
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h)
        for (int p = 0; p < n; ++p) {
          out.push_back(read_token(s->k_view(l, t, n), p, h));
          out.push_back(read_token(s->v_view(l, t, n), p, h));
        }
    return out;
  };
  const auto before = snapshot(table, N);
  // Row-specific sources: rows keep 6 slots each, different ones, the first two alike.
  kv_gather g;
  g.n_rows = L * H;
  g.first = 2;
  g.n = 4;
  const std::int32_t keep[4][6] = {{0, 1, 3, 6, 9, 10}, {0, 1, 2, 7, 8, 10}, {0, 1, 4, 5, 9, 10}, {0, 1, 6, 7, 8, 9}};
  for (int r = 0; r < L * H; ++r)
    for (int i = 2; i < 6; ++i) g.sources.push_back(keep[r][i]);
  g.src_table = table;
  g.dst_table = {table[0], table[1]};
  s->gather(g, nullptr);
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < 6; ++i) {
        const int r = l * H + h;
        const std::size_t was = (static_cast<std::size_t>(r) * N + static_cast<std::size_t>(keep[r][i])) * 2;
        const auto nk = read_token(s->k_view(l, g.dst_table, 6), i, h);
        const auto nv = read_token(s->v_view(l, g.dst_table, 6), i, h);
        for (int d = 0; d < D; ++d) {
          ASSERT_NEAR(nk[d], before[was][d], gc.tol) << "K layer " << l << " head " << h << " slot " << i;
          ASSERT_NEAR(nv[d], before[was + 1][d], gc.tol) << "V layer " << l << " head " << h << " slot " << i;
        }
      }
  // The sequence goes on: two more tokens append after the compacted slots.
  for (int l = 0; l < L; ++l) s->write(l, g.dst_table, 6, 2, k.data(), v.data());
  const auto next = read_token(s->k_view(1, g.dst_table, 8), 7, 1);
  for (int d = 0; d < D; ++d) EXPECT_NEAR(next[d], k[static_cast<std::size_t>(1) * H * D + D + d], 0.6f);
  // Slots past the compaction's end are free to go: the third block is released.
  s->release_block(table[2]);
  EXPECT_LE(s->staging().slots_in_use, 1);
}

INSTANTIATE_TEST_SUITE_P(
    formats, kv_storage_gather,
    ::testing::Values(gather_case{kv_type::f32, kv_type::f32, 0.0f}, gather_case{kv_type::f16, kv_type::f16, 0.0f},
                      gather_case{kv_type::bf16, kv_type::bf16, 0.0f},
                      gather_case{kv_type::fp8_e4m3, kv_type::fp8_e5m2, 1e-6f},
                      gather_case{kv_type::int8, kv_type::int8, 2e-2f}, gather_case{kv_type::int4, kv_type::int4, 0.35f},
                      gather_case{kv_type::int2, kv_type::int2, 1.2f}, gather_case{kv_type::q8_0, kv_type::q4_0, 0.3f}),
    [](const auto& info) {
      return std::string(kv_type_name(info.param.k)) + "_" + kv_type_name(info.param.v);
    });

// Merged entries carry their mass as a per-slot bias (log m), moved with them.
TEST(kv_storage, nearest_fold_writes_means_and_log_mass) {
  constexpr int L = 1, H = 1, D = 4, B = 4;
  auto s = *kv_storage::create(kv_layout::uniform(L, H, D, B, kv_type::f32, kv_type::f32), 8);
  const std::vector<block_id> table{block_id(1), block_id(3)};
  // Tokens: 0 along x, 1 along y, 2 close to x, 3 along x again, 4 close to y.
  const std::vector<float> k = {1, 0, 0, 0, 0, 1, 0, 0, 0.9f, 0.1f, 0, 0, 2, 0, 0, 0, 0.1f, 0.9f, 0, 0};
  const std::vector<float> v = {1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5};
  s->write(0, table, 0, 5, k.data(), v.data());
  kv_gather g;
  g.src_table = table;
  g.dst_table = {table[0]};
  g.first = 0;
  g.n = 2;
  g.sources = {0, 1};
  g.fold = kv_fold::nearest;
  g.n_folded = 3;
  g.folded = {2, 3, 4};
  s->gather(g, nullptr);
  const float* bias = s->bias_of(table[0], 0, 0);
  ASSERT_NE(bias, nullptr);
  EXPECT_NEAR(bias[0], std::log(3.0f), 1e-6);  // 0 with 2 and 3
  EXPECT_NEAR(bias[1], std::log(2.0f), 1e-6);  // 1 with 4
  const auto k0 = read_token(s->k_view(0, g.dst_table, 2), 0, 0);
  EXPECT_NEAR(k0[0], (1 + 0.9f + 2) / 3, 1e-6);
  const auto v1 = read_token(s->v_view(0, g.dst_table, 2), 1, 0);
  EXPECT_NEAR(v1[0], (2 + 5) / 2.0f, 1e-6);
  // The view hands attention the biases; a new token written after them stands for one.
  paged_kv_view kv = s->k_view(0, g.dst_table, 2);
  ASSERT_NE(kv.bias_of(0, 0), nullptr);
  s->write(0, g.dst_table, 2, 1, k.data(), v.data());
  EXPECT_EQ(s->bias_of(table[0], 0, 0)[2], 0.0f);
  // A released block forgets them.
  s->release_block(table[0]);
  EXPECT_EQ(s->bias_of(table[0], 0, 0), nullptr);
}

}  // namespace
}  // namespace pagoda

namespace pagoda {
namespace {

// Block classes: f16 (the default), a class with int8 but KIVI int2 keys in
// layer 1 (one sealed tensor) and KIVI int4 (both layers' keys sealed), so
// the classes number their sealed tensors differently. Every block of the
// mixed storage must hold what a storage of its class alone holds for the
// same tokens.
struct class_fixture {
  static constexpr int L = 2, H = 2, D = 16, B = 4;
  std::vector<kv_class_spec> extra;
  kv_layout base;
  std::unique_ptr<kv_storage> s;                 // classes 0: [0, 6), 1: [6, 11), 2: [11, 17)
  std::vector<std::unique_ptr<kv_storage>> ref;  // [class]: 8 blocks of that class alone
  std::vector<float> k, v;                       // [n][H][D]
  // Sequence A mixes every class and ends in a staged class 2 block; B is one staged class 1 block.
  std::vector<block_id> a{block_id(7), block_id(2), block_id(12), block_id(8), block_id(3), block_id(13)};
  std::vector<block_id> b{block_id(9)};
  std::vector<block_id> ref_a{block_id(0), block_id(1), block_id(2), block_id(3), block_id(4), block_id(5)};
  std::vector<block_id> ref_b{block_id(6)};
  static constexpr int n_a = 22, n_b = 3;

  static kv_layout layout_of(int c) {
    kv_layout l = kv_layout::uniform(L, H, D, B, kv_type::f16, kv_type::f16);
    if (c == 1) {
      l = kv_layout::uniform(L, H, D, B, kv_type::int8, kv_type::int8);
      l.k_formats[1] = default_kv_format(kv_type::int2, kv_role::key);  // per channel: sealed
    }
    if (c == 2) l = kv_layout::uniform(L, H, D, B, kv_type::int4, kv_type::int4);
    l.key_summaries = true;
    return l;
  }
  static std::unique_ptr<kv_storage> make_mixed() {
    const std::vector<kv_class_spec> extra{{layout_of(1), 5}, {layout_of(2), 6}};
    return std::move(*kv_storage::create(layout_of(0), 6, 4, extra));
  }

  class_fixture() {
    s = make_mixed();
    for (int c = 0; c < 3; ++c) ref.push_back(std::move(*kv_storage::create(layout_of(c), 8, 4)));
    std::mt19937 rng(17);
    fill_normal(rng, static_cast<std::size_t>(n_a) * H * D, k, v);
    // Uneven chunks, the same for every storage.
    for (int p = 0; p < n_a;) {
      const int n = std::min(n_a - p, 1 + static_cast<int>(rng() % 7));
      write_all(a, ref_a, p, n);
      p += n;
    }
    write_all(b, ref_b, 0, n_b);
  }
  void write_all(std::span<const block_id> t, std::span<const block_id> rt, int p, int n) {
    const std::size_t at = static_cast<std::size_t>(p) * H * D;
    for (int l = 0; l < L; ++l) {
      s->write(l, t, p, n, &k[at], &v[at]);
      for (auto& r : ref) r->write(l, rt, p, n, &k[at], &v[at]);
    }
  }
};

// Table block i of x (n tokens) holds what table block i of y does: the same
// format and tile bytes when full, the same staged tokens when open, the same
// decoded values either way, every layer, K and V, head.
void expect_same_block(const kv_backend& x, std::span<const block_id> xt, const kv_backend& y,
                       std::span<const block_id> yt, int n, int i) {
  const int bs = x.layout().block_size;
  const int n_in = std::min(bs, n - i * bs);
  for (int l = 0; l < x.layout().n_layers; ++l)
    for (bool key : {true, false}) {
      const paged_kv_view xv = key ? x.k_view(l, xt, n) : x.v_view(l, xt, n);
      const paged_kv_view yv = key ? y.k_view(l, yt, n) : y.v_view(l, yt, n);
      ASSERT_EQ(xv.format_of(i), yv.format_of(i)) << "layer " << l << " block " << i;
      ASSERT_EQ(xv.is_staged(i), yv.is_staged(i)) << "layer " << l << " block " << i;
      for (int h = 0; h < x.layout().n_kv_heads; ++h) {
        if (n_in == bs) {
          const std::size_t bytes = xv.codec_of(i)->tile_bytes(xv.format_of(i), xv.shape);
          EXPECT_EQ(std::memcmp(xv.tile(i, h), yv.tile(i, h), bytes), 0)
              << "layer " << l << (key ? " K" : " V") << " block " << i << " head " << h;
        }
        for (int p = i * bs; p < i * bs + n_in; ++p)
          ASSERT_EQ(read_token(xv, p, h), read_token(yv, p, h))
              << "layer " << l << (key ? " K" : " V") << " slot " << p << " head " << h;
      }
    }
}

TEST(kv_storage_classes, each_block_is_stored_in_its_class) {
  class_fixture f;
  kv_storage& s = *f.s;
  ASSERT_EQ(s.n_classes(), 3);
  EXPECT_EQ(s.n_blocks(), 17);
  EXPECT_EQ(s.arena(0).class_first_block(1), 6);
  EXPECT_EQ(s.arena(0).class_n_blocks(1), 5);
  EXPECT_EQ(s.arena(0).class_first_block(2), 11);
  EXPECT_EQ(s.arena(0).class_n_blocks(2), 6);
  EXPECT_EQ(s.block_class(block_id(5)), 0);
  EXPECT_EQ(s.block_class(block_id(6)), 1);
  EXPECT_EQ(s.block_class(block_id(16)), 2);
  EXPECT_EQ(s.layout().k_formats[0].type, kv_type::f16);
  EXPECT_EQ(s.arena(0).class_layout(1).k_formats[1].type, kv_type::int2);
  EXPECT_EQ(s.block_layout(block_id(7)).k_formats[1].type, kv_type::int2);
  EXPECT_EQ(s.block_bytes(block_id(12)), class_fixture::layout_of(2).tile_bytes_per_block());
  // Every class's blocks, and staging slots sized for the class that stages most.
  std::size_t want = 0;
  const std::int64_t counts[3] = {6, 5, 6};
  for (int c = 0; c < 3; ++c) want += counts[c] * class_fixture::layout_of(c).bytes_per_block();
  const std::size_t slot = class_fixture::layout_of(2).staging_bytes_per_slot();
  EXPECT_GT(slot, class_fixture::layout_of(1).staging_bytes_per_slot());
  EXPECT_EQ(s.total_bytes(), want + 4 * slot);
  EXPECT_EQ(s.staging().slots_in_use, 2) << "A's last block (class 2) and B's (class 1) are open";

  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE("block " + std::to_string(i));
    expect_same_block(s, f.a, *f.ref[s.block_class(f.a[static_cast<std::size_t>(i)])], f.ref_a, class_fixture::n_a,
                      i);
  }
  expect_same_block(s, f.b, *f.ref[1], f.ref_b, class_fixture::n_b, 0);
  // Which tensors stage follows the last block's class: class 2 keys of both
  // layers, class 1 keys of layer 1 only; values never.
  EXPECT_TRUE(s.k_view(0, f.a, class_fixture::n_a).is_staged(5));
  EXPECT_FALSE(s.v_view(1, f.a, class_fixture::n_a).is_staged(5));
  EXPECT_FALSE(s.k_view(0, f.b, class_fixture::n_b).is_staged(0));
  EXPECT_TRUE(s.k_view(1, f.b, class_fixture::n_b).is_staged(0));
  // Key summaries come from each block's decoded keys.
  for (int l = 0; l < 2; ++l) {
    const auto got = s.key_summary_of(block_id(12), l, 1), want_sum = f.ref[2]->key_summary_of(block_id(2), l, 1);
    ASSERT_TRUE(got.has_value() && want_sum.has_value());
    for (int d = 0; d < class_fixture::D; ++d) {
      EXPECT_EQ(got->min[d], want_sum->min[d]);
      EXPECT_EQ(got->mean[d], want_sum->mean[d]);
    }
  }
  // Sealing B's block (class 1) frees its slot.
  std::vector<float> more(static_cast<std::size_t>(class_fixture::H) * class_fixture::D, 0.25f);
  for (int l = 0; l < 2; ++l) s.write(l, f.b, 3, 1, more.data(), more.data());
  EXPECT_EQ(s.staging().slots_in_use, 1);
}

TEST(kv_storage_classes, block_ops_stay_within_a_class) {
  class_fixture f;
  kv_storage& s = *f.s;
  // Copy-on-write of the open class 2 block and of a full class 1 block.
  s.copy_block(block_id(13), block_id(14), 2);
  s.copy_block(block_id(7), block_id(10), 4);
  for (auto& r : f.ref) {
    r->copy_block(block_id(5), block_id(7), 2);
    r->copy_block(block_id(0), block_id(6), 4);
  }
  std::vector<block_id> a2 = f.a, ra2 = f.ref_a;
  a2[5] = block_id(14);
  ra2[5] = block_id(7);
  expect_same_block(s, a2, *f.ref[2], ra2, class_fixture::n_a, 5);
  std::vector<block_id> c1{block_id(10)}, rc1{block_id(6)};
  expect_same_block(s, c1, *f.ref[1], rc1, 4, 0);
  EXPECT_DEATH(s.copy_block(block_id(2), block_id(9), 4), "copy_block from block 2 of class 0 to block 9 of class 1");

  // Truncating a sealed class 2 block reopens it in staging; new tokens seal it again.
  s.truncate_block(block_id(12), 2);
  f.ref[2]->truncate_block(block_id(2), 2);
  expect_same_block(s, f.a, *f.ref[2], f.ref_a, 10, 2);
  std::vector<float> nk(2 * class_fixture::H * class_fixture::D), nv(nk.size());
  for (std::size_t i = 0; i < nk.size(); ++i) {
    nk[i] = std::sin(static_cast<float>(i));
    nv[i] = std::cos(static_cast<float>(i));
  }
  for (int l = 0; l < 2; ++l) {
    s.write(l, f.a, 10, 2, nk.data(), nv.data());
    f.ref[2]->write(l, f.ref_a, 10, 2, nk.data(), nv.data());
  }
  expect_same_block(s, f.a, *f.ref[2], f.ref_a, 12, 2);

  // Whole blocks as bytes, each class its own size; a size of another class is an error.
  for (block_id blk : {block_id(2), block_id(7), block_id(12)}) {
    const int c = s.block_class(blk);
    const block_id to(static_cast<std::int32_t>(s.arena(0).class_first_block(c) + s.arena(0).class_n_blocks(c) - 1));
    std::vector<std::byte> bytes(s.block_bytes(blk));
    EXPECT_EQ(bytes.size(), class_fixture::layout_of(c).tile_bytes_per_block());
    s.read_block(blk, bytes);
    ASSERT_TRUE(s.write_block(to, bytes).ok());
    std::vector<std::byte> back(bytes.size());
    s.read_block(to, back);
    EXPECT_EQ(back, bytes) << "class " << c;
    std::vector<block_id> from_t{blk}, to_t{to};
    expect_same_block(s, to_t, s, from_t, 4, 0);
    EXPECT_TRUE(s.key_summary_of(to, 1, 0).has_value());
  }
  std::vector<std::byte> class2(s.block_bytes(block_id(12)));
  const status wrong = s.write_block(block_id(7), class2);
  EXPECT_EQ(wrong.code(), errc::invalid_argument);
  EXPECT_NE(wrong.message().find("block class 1"), std::string::npos) << wrong.message();
  EXPECT_DEATH(s.read_block(block_id(7), class2), "block 7 \\(class 1\\) has");

  // Releasing blocks of every class gives back their staging slots.
  s.release_block(block_id(13));
  s.release_block(block_id(14));
  s.release_block(block_id(9));
  s.release_block(block_id(12));
  EXPECT_EQ(s.staging().slots_in_use, 0);
}

// Compaction across classes: each source slot is decoded in its block's class
// and encoded in its destination block's, exactly as writing the decoded
// values there would encode them.
TEST(kv_storage_classes, gather_decodes_in_the_source_class_and_encodes_in_the_destination_class) {
  class_fixture f;
  constexpr int H = class_fixture::H, D = class_fixture::D, L = class_fixture::L;
  kv_gather g;
  g.src_table = f.a;
  g.dst_table = {block_id(2), block_id(12), block_id(10)};  // classes 0, 2, 1
  g.first = 0;
  g.n = 10;
  g.sources = {0, 1, 5, 6, 9, 10, 13, 17, 20, 21};  // from every class, the last two staged
  // What the sources decode to, per layer, as [n][H][D] rows.
  std::vector<std::vector<float>> dk(L), dv(L);
  for (int l = 0; l < L; ++l) {
    const paged_kv_view kv = f.s->k_view(l, f.a, class_fixture::n_a), vv = f.s->v_view(l, f.a, class_fixture::n_a);
    for (std::int32_t src : g.sources)
      for (int h = 0; h < H; ++h) {
        const auto kr = read_token(kv, src, h), vr = read_token(vv, src, h);
        dk[l].insert(dk[l].end(), kr.begin(), kr.end());
        dv[l].insert(dv[l].end(), vr.begin(), vr.end());
      }
  }
  f.s->gather(g, nullptr);
  auto want = class_fixture::make_mixed();
  for (int l = 0; l < L; ++l) want->write(l, g.dst_table, 0, g.n, dk[l].data(), dv[l].data());
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE("block " + std::to_string(i));
    expect_same_block(*f.s, g.dst_table, *want, g.dst_table, g.n, i);
  }
  // The int2 keys of block 10 (class 1, layer 1) are open: two tokens staged.
  EXPECT_TRUE(f.s->k_view(1, g.dst_table, g.n).is_staged(2));
  // Into the f16 block: an f16 source (slot 5) comes back exactly, an int8
  // one (slot 0) as its decoded value rounded to f16.
  const paged_kv_view moved = f.s->v_view(0, g.dst_table, g.n);
  for (int d = 0; d < D; ++d) {
    EXPECT_EQ(read_token(moved, 2, 1)[d], dv[0][static_cast<std::size_t>(2 * H + 1) * D + d]);
    EXPECT_EQ(read_token(moved, 0, 1)[d], fp16_to_f32(f32_to_fp16(dv[0][static_cast<std::size_t>(1) * D + d])));
  }
}

// Merged entries in a class block: the fold writes their log mass as the
// block's per-slot bias, which views of a mixed table hand to attention.
TEST(kv_storage_classes, folded_entries_carry_their_bias_in_any_class) {
  class_fixture f;
  kv_gather g;
  g.src_table = f.a;
  g.dst_table = {block_id(14)};  // class 2, open after the fold
  g.n = 2;
  g.sources = {1, 5};                      // class 1 and class 0 sources
  g.fold = kv_fold::nearest;
  g.n_folded = 3;
  g.folded = {0, 4, 13};
  f.s->gather(g, nullptr);
  for (int l = 0; l < class_fixture::L; ++l)
    for (int h = 0; h < class_fixture::H; ++h) {
      const float* bias = f.s->bias_of(block_id(14), l, h);
      ASSERT_NE(bias, nullptr);
      EXPECT_NEAR(std::exp(bias[0]) + std::exp(bias[1]), 5.0, 1e-5) << "two kept entries stand for five tokens";
      const paged_kv_view kv = f.s->k_view(l, g.dst_table, 2);
      ASSERT_EQ(kv.bias_of(0, h), bias);
      EXPECT_TRUE(kv.is_staged(0));
    }
  EXPECT_EQ(f.s->bias_of(block_id(12), 0, 0), nullptr);
  f.s->release_block(block_id(14));
  EXPECT_EQ(f.s->bias_of(block_id(14), 1, 1), nullptr);
}

TEST(kv_storage_classes, rejects_classes_it_cannot_hold) {
  const kv_layout base = class_fixture::layout_of(0);
  auto create = [&](kv_layout extra, std::int64_t n = 4) {
    const std::vector<kv_class_spec> spec{{std::move(extra), n}};
    return kv_storage::create(base, 4, 1, spec);
  };
  auto heads = class_fixture::layout_of(2);
  heads.n_kv_heads = 1;
  heads.k_formats.resize(2);
  auto r = create(heads);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), errc::invalid_argument);
  EXPECT_NE(r.error().message().find("KV block class 1"), std::string::npos) << r.error().message();
  auto block = class_fixture::layout_of(2);
  block.block_size = 8;
  EXPECT_EQ(create(block).error().code(), errc::invalid_argument);
  auto summaries = class_fixture::layout_of(2);
  summaries.key_summaries = false;
  EXPECT_EQ(create(summaries).error().code(), errc::invalid_argument);
  auto layers = kv_layout::uniform(3, 2, 16, 4, kv_type::int8, kv_type::int8);
  layers.key_summaries = true;
  EXPECT_EQ(create(layers).error().code(), errc::invalid_argument);
  auto bad_format = class_fixture::layout_of(2);
  bad_format.v_formats[1] = {kv_type::int4, kv_role::value, kv_scale_mode::group, 3};
  auto bf = create(bad_format);
  ASSERT_FALSE(bf.ok());
  EXPECT_NE(bf.error().message().find("KV block class 1: "), std::string::npos) << bf.error().message();
  EXPECT_EQ(create(class_fixture::layout_of(2), 0).error().code(), errc::invalid_argument);
  // One class behaves as before: no class arrays in views.
  auto one = *kv_storage::create(base, 4);
  EXPECT_EQ(one->n_classes(), 1);
  std::vector<block_id> t{block_id(1)};
  EXPECT_EQ(one->k_view(0, t, 0).classes, nullptr);
}

// KV groups: layers 0 and 2 in group 0 (8 blocks, ids 0..7), layer 1 in
// group 1 (4 blocks, ids 8..11), each with a second class. Each layer reads
// and writes its group's table, read back equal to a one-group storage fed
// the same; a block's bytes are its group's layers in its class's formats;
// ops stay in their group; views take tables with leading NULL entries.
TEST(kv_storage_groups, each_layer_lives_in_its_group) {
  const kv_layout f16 = kv_layout::uniform(3, 2, 8, 4, kv_type::f16, kv_type::f16);
  const kv_layout int8 = kv_layout::uniform(3, 2, 8, 4, kv_type::int8, kv_type::int8);
  const std::vector<kv_layout> layouts{f16, int8};
  const std::vector<kv_group_blocks> groups{{{0, 2}, {6, 2}}, {{1}, {3, 1}}};
  auto s = *kv_storage::create(layouts, groups, 2);
  EXPECT_EQ(s->n_groups(), 2);
  EXPECT_EQ(s->n_blocks(), 12);
  EXPECT_EQ(s->layer_group(0), 0);
  EXPECT_EQ(s->layer_group(1), 1);
  EXPECT_EQ(s->layer_group(2), 0);
  EXPECT_EQ(s->group_of(block_id(7)), 0);
  EXPECT_EQ(s->group_of(block_id(8)), 1);
  EXPECT_EQ(s->block_class(block_id(6)), 1);
  EXPECT_EQ(s->block_class(block_id(11)), 1);
  EXPECT_EQ(s->block_bytes(block_id(2)), f16.select_layers(std::vector<int>{0, 2}).tile_bytes_per_block());
  EXPECT_EQ(s->block_bytes(block_id(9)), f16.select_layers(std::vector<int>{1}).tile_bytes_per_block());
  EXPECT_EQ(s->block_bytes(block_id(11)), int8.select_layers(std::vector<int>{1}).tile_bytes_per_block());
  EXPECT_EQ(s->total_bytes(),
            6 * f16.select_layers(std::vector<int>{0, 2}).bytes_per_block() +
                2 * int8.select_layers(std::vector<int>{0, 2}).bytes_per_block() +
                3 * f16.select_layers(std::vector<int>{1}).bytes_per_block() +
                1 * int8.select_layers(std::vector<int>{1}).bytes_per_block());

  auto ref = *kv_storage::create(f16, 8, 2);
  std::mt19937 rng(5);
  std::vector<float> k, v;
  fill_normal(rng, 7 * 2 * 8, k, v);
  const std::vector<block_id> t0{block_id(3), block_id(1)}, t1{block_id(9), block_id(10)}, tr{block_id(0), block_id(1)};
  for (int l = 0; l < 3; ++l) {
    s->write(l, s->layer_group(l) == 0 ? t0 : t1, 0, 7, k.data(), v.data());
    ref->write(l, tr, 0, 7, k.data(), v.data());
  }
  for (int l = 0; l < 3; ++l) {
    const auto& table = s->layer_group(l) == 0 ? t0 : t1;
    const paged_kv_view a = s->k_view(l, table, 7), b = ref->k_view(l, tr, 7);
    EXPECT_EQ(a.first_block, s->layer_group(l) == 0 ? 0 : 8);
    for (int p = 0; p < 7; ++p)
      for (int h = 0; h < 2; ++h) ASSERT_EQ(read_token(a, p, h), read_token(b, p, h)) << "layer " << l << " slot " << p;
  }
  // A sliding window's table: a NULL first entry, never read; the live block reads as before.
  const std::vector<block_id> windowed{block_id(), block_id(10)};
  const paged_kv_view w = s->k_view(1, windowed, 7), r = ref->k_view(1, tr, 7);
  for (int p = 4; p < 7; ++p)
    for (int h = 0; h < 2; ++h) ASSERT_EQ(read_token(w, p, h), read_token(r, p, h)) << "slot " << p;
  // Whole blocks as bytes, each its group's size; copies stay in their group.
  std::vector<std::byte> bytes(s->block_bytes(block_id(9)));
  s->read_block(block_id(9), bytes);
  ASSERT_TRUE(s->write_block(block_id(8), bytes).ok());
  std::vector<std::byte> back(bytes.size());
  s->read_block(block_id(8), back);
  EXPECT_EQ(back, bytes);
  EXPECT_FALSE(s->write_block(block_id(2), bytes).ok());  // group 0's blocks have two layers
  s->copy_block(block_id(3), block_id(4), 4);
  std::vector<float> x(8), y(8);
  const std::vector<block_id> c0{block_id(4)}, c1{block_id(3)};
  for (int l : {0, 2}) {
    const paged_kv_view a = s->k_view(l, c0, 4), b = s->k_view(l, c1, 4);
    EXPECT_EQ(read_token(a, 3, 1), read_token(b, 3, 1));
  }
  EXPECT_DEATH(s->copy_block(block_id(3), block_id(8), 4), "group");
}

TEST(kv_storage_groups, rejects_groups_that_do_not_split_the_layers) {
  const kv_layout f16 = kv_layout::uniform(3, 2, 8, 4, kv_type::f16, kv_type::f16);
  const std::vector<kv_layout> layouts{f16};
  const std::vector<kv_group_blocks> twice{{{0, 1}, {4}}, {{1, 2}, {4}}};
  auto r = kv_storage::create(layouts, twice);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("two groups"), std::string::npos) << r.error().message();
  const std::vector<kv_group_blocks> missing{{{0, 1}, {4}}};
  r = kv_storage::create(layouts, missing);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("layer 2 is in no KV group"), std::string::npos) << r.error().message();
  const std::vector<kv_group_blocks> empty{{{0, 1}, {4}}, {{2}, {0}}};
  r = kv_storage::create(layouts, empty);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("KV group 1"), std::string::npos) << r.error().message();
}

}  // namespace
}  // namespace pagoda
