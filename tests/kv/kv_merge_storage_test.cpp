// A merged KV layer's side data (kv/kv_merge.h) follows its block through
// the storage's block ops: a copy carries the copied slots' side data, a
// truncate drops retained tokens past the kept ones, a release clears it,
// and a block's bytes (read_block / write_block: the disk and Redis tiers)
// carry it, so a block written back reads as it did.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kv/kv_storage.h"

namespace pagoda {
namespace {

constexpr int H = 2, D = 8, B = 8;

// Two model layers over one KV layer, the upper one merged, in `flat`'s formats.
std::unique_ptr<kv_storage> merged_storage_of(const kv_layout& flat, int retain) {
  auto shared = share_kv_layers(flat, std::vector<int>{0, 0}, "minicache");
  EXPECT_TRUE(shared.ok());
  auto layout = merge_kv_layers(*shared, std::vector<int>{1}, 0.6f, retain);
  EXPECT_TRUE(layout.ok()) << layout.error().message();
  auto s = kv_storage::create(*layout, 6, 2);  // a step may hold two staging slots (kv_arena.h)
  EXPECT_TRUE(s.ok()) << s.error().message();
  return std::move(*s);
}

std::unique_ptr<kv_storage> merged_storage(int retain, kv_type type = kv_type::f16) {
  return merged_storage_of(kv_layout::uniform(2, H, D, B, type, type), retain);
}

// Slots [0, n) of `table` written by the lower and the upper layer (random rows).
void fill(kv_storage& s, std::span<const block_id> table, int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::vector<float> a(static_cast<std::size_t>(n) * H * D * 4);
  for (float& x : a) x = g(rng);
  const std::size_t m = static_cast<std::size_t>(n) * H * D;
  s.write(0, table, 0, n, a.data(), a.data() + m);
  s.merge_write(0, table, 0, n, a.data() + 2 * m, a.data() + 3 * m, a.data(), a.data() + m);
}

std::vector<std::byte> bytes_of(const kv_storage& s, block_id b) {
  std::vector<std::byte> out(s.block_bytes(b));
  s.read_block(b, out);
  return out;
}

kv_merge_ref side(const kv_storage& s, std::span<const block_id> table, int block_index, int head) {
  paged_kv_view k = s.k_view(0, table, static_cast<int>(table.size()) * B), v = s.v_view(0, table, static_cast<int>(table.size()) * B);
  s.attach_merge(0, k, v);
  EXPECT_NE(k.merge, nullptr);
  return k.merge_of(block_index, head);
}

int retained(const kv_merge_ref& m) {
  int n = 0;
  for (int e = 0; e < m.shape.retain; ++e) n += m.slot(e) >= 0;
  return n;
}

TEST(kv_merge_storage, side_data_follows_copy_truncate_release_and_block_bytes) {
  auto s = merged_storage(3);
  const std::vector<block_id> src = {block_id(1)}, dst = {block_id(4)}, other = {block_id(2)};
  fill(*s, src, B, 5);
  EXPECT_EQ(s->block_bytes(src[0]), s->layout().tile_bytes_per_block());
  EXPECT_EQ(retained(side(*s, src, 0, 0)), 3);
  EXPECT_EQ(retained(side(*s, src, 0, 1)), 3);

  // A whole block's bytes round-trip into another block, side data included.
  const std::vector<std::byte> whole = bytes_of(*s, src[0]);
  ASSERT_TRUE(s->write_block(other[0], whole).ok());
  EXPECT_EQ(bytes_of(*s, other[0]), whole);
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < B; ++j) EXPECT_EQ(side(*s, other, 0, h).ratio_k()[j], side(*s, src, 0, h).ratio_k()[j]);
  std::vector<std::byte> short_bytes(whole.size() - 4);
  EXPECT_FALSE(s->write_block(other[0], short_bytes).ok()) << "a block without its side data";

  // A partial copy keeps only retained tokens below the copied slots.
  s->copy_block(src[0], dst[0], 4);
  for (int h = 0; h < H; ++h) {
    const kv_merge_ref from = side(*s, src, 0, h), to = side(*s, dst, 0, h);
    int below = 0;
    for (int e = 0; e < 3; ++e) below += from.slot(e) >= 0 && from.slot(e) < 4;
    EXPECT_EQ(retained(to), below) << h;
    for (int e = 0; e < 3; ++e) EXPECT_LT(to.slot(e), 4);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(to.ratio_v()[j], from.ratio_v()[j]);
  }
  // A whole copy is the same bytes.
  s->copy_block(src[0], dst[0], B);
  EXPECT_EQ(bytes_of(*s, dst[0]), whole);

  // Truncation drops what lies past the kept tokens; release clears all.
  s->truncate_block(src[0], 2);
  for (int h = 0; h < H; ++h)
    for (int e = 0; e < 3; ++e) EXPECT_LT(side(*s, src, 0, h).slot(e), 2);
  s->release_block(dst[0]);
  for (int h = 0; h < H; ++h) {
    EXPECT_EQ(retained(side(*s, dst, 0, h)), 0);
    for (int j = 0; j < B; ++j) EXPECT_EQ(side(*s, dst, 0, h).ratio_k()[j], 0.0f);
  }
  // Written again after a release: the same bytes as the first time.
  fill(*s, dst, B, 5);
  EXPECT_EQ(bytes_of(*s, dst[0]), whole);
}

// What the upper layer reads at a slot of one head: its own row where
// retained, else the stored row times its ratio; and the stored row.
struct restored {
  std::vector<float> k, v, stored_k;
  bool retained = false;
};
restored read_slot(const kv_storage& s, std::span<const block_id> table, int slot, int h) {
  const int n = static_cast<int>(table.size()) * B;
  paged_kv_view k = s.k_view(0, table, n), v = s.v_view(0, table, n);
  s.attach_merge(0, k, v);
  restored r;
  r.stored_k.resize(D);
  std::vector<float> sv(D);
  for (auto [view, out] : {std::pair{&k, r.stored_k.data()}, std::pair{&v, sv.data()}})
    view->codec_of(slot / B)->decode(view->format_of(slot / B), view->shape, view->params_of(slot / B, h),
                                     view->tile(slot / B, h), slot % B, 1, out);
  const kv_merge_ref m = k.merge_of(slot / B, h);
  for (int e = 0; e < m.shape.retain; ++e)
    if (m.slot(e) == slot % B) {
      r.retained = true;
      r.k.assign(m.k(e), m.k(e) + D);
      r.v.assign(m.v(e), m.v(e) + D);
      return r;
    }
  for (int d = 0; d < D; ++d) {
    r.k.push_back(m.ratio_k()[slot % B] * r.stored_k[d]);
    r.v.push_back(m.ratio_v()[slot % B] * sv[d]);
  }
  return r;
}

double norm(const std::vector<float>& x) {
  double s = 0;
  for (float f : x) s += static_cast<double>(f) * f;
  return std::sqrt(s);
}

// A compaction (kept slots gathered to the front, others dropped) moves each
// slot's side data with it: the upper layer reads at the destination what it
// read at the source; a retained token that finds its new block full is
// merged there (the lower layer's row becomes the merge, the upper layer
// keeps its magnitude).
TEST(kv_merge_storage, a_compaction_moves_side_data_with_the_slots) {
  auto s = merged_storage(2, kv_type::f32);
  const std::vector<block_id> table = {block_id(0), block_id(3), block_id(5)};
  fill(*s, table, 3 * B, 9);
  // Kept: the 4 tokens head 0 retains in blocks 0-1 and 4 others of them
  // (destination block 0: 4 retained for 2 places), then 4 of block 2.
  std::vector<std::int32_t> kept, others;
  for (int slot = 0; slot < 2 * B; ++slot) (read_slot(*s, table, slot, 0).retained ? kept : others).push_back(slot);
  ASSERT_EQ(kept.size(), 4u);
  kept.insert(kept.end(), others.begin(), others.begin() + 4);
  std::sort(kept.begin(), kept.end());
  for (int slot = 2 * B; slot < 2 * B + 4; ++slot) kept.push_back(slot);
  std::vector<std::vector<restored>> before(kept.size());
  for (std::size_t i = 0; i < kept.size(); ++i)
    for (int h = 0; h < H; ++h) before[i].push_back(read_slot(*s, table, kept[i], h));
  kv_gather g;
  g.src_table = table;
  g.dst_table = table;
  g.first = 0;
  g.n = static_cast<std::int32_t>(kept.size());
  g.sources = kept;
  s->gather(g, nullptr);
  int same = 0, overflowed = 0;
  for (std::size_t i = 0; i < kept.size(); ++i)
    for (int h = 0; h < H; ++h) {
      const restored& was = before[i][static_cast<std::size_t>(h)];
      const restored now = read_slot(*s, table, static_cast<int>(i), h);
      if (!was.retained || now.retained) {
        EXPECT_EQ(now.retained, was.retained) << i << " " << h;
        EXPECT_EQ(now.k, was.k) << "slot " << i << " head " << h;
        EXPECT_EQ(now.v, was.v) << "slot " << i << " head " << h;
        EXPECT_EQ(now.stored_k, was.stored_k) << "slot " << i << " head " << h;
        ++same;
        continue;
      }
      ++overflowed;  // merged at its new place: the upper layer keeps its magnitude
      EXPECT_NEAR(norm(now.k), norm(was.k), 1e-4 * norm(was.k));
      EXPECT_NEAR(norm(now.v), norm(was.v), 1e-4 * norm(was.v));
      EXPECT_NEAR(norm(now.stored_k), norm(was.stored_k), 1e-4 * norm(was.stored_k)) << "the lower layer too";
    }
  EXPECT_GT(same, 0);
  EXPECT_GE(overflowed, 2) << "4 retained tokens of head 0 moved into one block of 2 places";
}

// A merged layer of a sealed type (int4 and int2, per-channel key scales):
// the reader merges from the producer's staged f16 copy, or from the step's
// rows when the step writes the block whole, and the block is encoded once
// merged. So at every slot it stores what a merged layer stores whose sealed
// formats are f16 instead, and a full block's tile is that block encoded once: the same side data, the open
// block's staged rows equal to the f16 rows, and every full tile the codec's
// encoding of them. Steps: a whole block, a partial one filled a token at a
// time, and a chunk from inside a block across a whole one into the next.
TEST(kv_merge_storage, a_sealed_merged_layer_is_the_f16_merge_encoded_once) {
  for (const kv_type sealed_type : {kv_type::int4, kv_type::int2}) {
    SCOPED_TRACE(kv_type_name(sealed_type));
    kv_layout flat = kv_layout::uniform(2, H, D, B, sealed_type, sealed_type), unsealed = flat;
    for (auto* formats : {&unsealed.k_formats, &unsealed.v_formats})
      for (kv_format& f : *formats)
        if (kv_format_sealed(f)) f = default_kv_format(kv_type::f16, f.role);
    auto sealed = merged_storage_of(flat, 2);
    auto f16 = merged_storage_of(unsealed, 2);
    ASSERT_TRUE(sealed->layout().has_sealed());
    const std::vector<block_id> table = {block_id(0), block_id(2), block_id(3), block_id(5), block_id(4)};
    std::mt19937 rng(17);
    std::normal_distribution<float> g;
    auto step = [&](int slot, int n) {
      std::vector<float> a(static_cast<std::size_t>(n) * H * D * 4);
      for (float& x : a) x = g(rng);
      const std::size_t m = static_cast<std::size_t>(n) * H * D;
      for (kv_storage* s : {sealed.get(), f16.get()}) {
        s->write(0, table, slot, n, a.data(), a.data() + m);
        s->merge_write(0, table, slot, n, a.data() + 2 * m, a.data() + 3 * m, a.data(), a.data() + m);
      }
    };
    auto check = [&](int n_slots, const char* when) {
      SCOPED_TRACE(when);
      const paged_kv_view sk = sealed->k_view(0, table, n_slots), sv = sealed->v_view(0, table, n_slots);
      const paged_kv_view fk = f16->k_view(0, table, n_slots), fv = f16->v_view(0, table, n_slots);
      for (int b = 0; b * B < n_slots; ++b)
        for (int h = 0; h < H; ++h) {
          const int n = std::min(B, n_slots - b * B);
          for (auto [s, f] : {std::pair{&sk, &fk}, std::pair{&sv, &fv}}) {
            std::vector<float> want(static_cast<std::size_t>(B) * D), got(want.size());
            f->codec_of(b)->decode(f->format_of(b), f->shape, f->params_of(b, h), f->tile(b, h), 0, n, want.data());
            if (s->is_staged(b)) {
              s->staged_codec->decode(s->staged_format, s->shape, nullptr, s->staged_tile(h), 0, n, got.data());
            } else if (!kv_format_sealed(s->format_of(b))) {  // a per-token format, the same in both
              s->codec_of(b)->decode(s->format_of(b), s->shape, s->params_of(b, h), s->tile(b, h), 0, n, got.data());
            } else {  // sealed: the f16 rows encoded once
              ASSERT_EQ(n, B) << "block " << b << " is partly filled but not staged";
              std::vector<std::byte> tile(s->tile_bytes);
              s->codec_of(b)->encode(s->format_of(b), s->shape, nullptr, want.data(), 0, B, tile.data());
              s->codec_of(b)->decode(s->format_of(b), s->shape, nullptr, tile.data(), 0, B, want.data());
              s->codec_of(b)->decode(s->format_of(b), s->shape, nullptr, s->tile(b, h), 0, B, got.data());
            }
            EXPECT_EQ(got, want) << "block " << b << " head " << h << (s == &sk ? " K" : " V");
          }
          const kv_merge_ref ms = side(*sealed, table, b, h), mf = side(*f16, table, b, h);
          EXPECT_TRUE(std::equal(ms.data, ms.data + ms.shape.head_floats(), mf.data)) << "side data of block " << b << " head " << h;
        }
    };
    step(0, B);  // a whole block: merged from the step's rows
    check(B, "a whole block");
    step(B, 5);  // a partial block, then a token at a time: merged in staging
    check(B + 5, "a partial block");
    for (int p = B + 5; p < 2 * B; ++p) step(p, 1);
    check(2 * B, "filled a token at a time");
    step(2 * B, 3);
    step(2 * B + 3, 2 * B + 1);  // from inside block 2, across block 3 (whole) into block 4
    check(4 * B + 4, "a chunk across blocks");
    EXPECT_EQ(sealed->staging().slots_in_use, 1) << "the open block's alone";
    step(4 * B + 4, B - 4);
    check(5 * B, "all full");
    EXPECT_EQ(sealed->staging().slots_in_use, 0) << "every staging slot given back once merged and sealed";
  }
}

}  // namespace
}  // namespace pagoda
