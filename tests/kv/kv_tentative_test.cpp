// Tentative slots in sealed KV formats (kv_backend.h, "Tentative slots"): a
// verification step writes its drafts' K/V into held blocks; rolling the
// rejected ones back restores the exact f16 staging, so the block seals into
// the bytes plain decoding stores, and views inside a held block read what
// plain decoding's one-token steps read.
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/half.h"
#include "kv/kv_storage.h"

namespace pagoda {
namespace {

constexpr int L = 2, H = 2, D = 8, B = 4;
constexpr std::size_t row = static_cast<std::size_t>(H) * D;

// A storage of KIVI int4 (keys per channel: sealed) or int2, and one stream
// of K/V rows per token.
struct stream {
  std::unique_ptr<kv_storage> s;
  std::vector<float> k, v;  // [tokens][H][D]
  stream(kv_type type, int n_tokens, unsigned seed) {
    s = std::move(*kv_storage::create(kv_layout::uniform(L, H, D, B, type, type), 16, 2));
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    k.resize(static_cast<std::size_t>(n_tokens) * row);
    v.resize(k.size());
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
  }
  // Slots [pos, pos + n) get tokens [from, from + n) of `src`'s rows.
  void write(std::span<const block_id> table, int pos, int n, const stream& src, int from) {
    for (int l = 0; l < L; ++l)
      s->write(l, table, pos, n, &src.k[static_cast<std::size_t>(from) * row], &src.v[static_cast<std::size_t>(from) * row]);
  }
  void write(std::span<const block_id> table, int pos, int n) { write(table, pos, n, *this, pos); }
  std::vector<std::byte> bytes(block_id b) const {
    std::vector<std::byte> out(s->block_bytes(b));
    s->read_block(b, out);
    return out;
  }
};

// Decodes slot p of head h through a view (staged or sealed).
std::vector<float> read_slot(const paged_kv_view& v, int p, int h) {
  std::vector<float> out(D);
  const int b = p / B, slot = p % B;
  if (v.is_staged(b)) v.staged_codec->decode(v.staged_format, v.shape, nullptr, v.staged_tile(h), slot, 1, out.data());
  else v.codec_of(b)->decode(v.format_of(b), v.shape, v.params_of(b, h), v.tile(b, h), slot, 1, out.data());
  return out;
}

// Plain decoding writes tokens 0..7 one by one. The speculating run writes
// token 0, then verifies last token 1 with drafts at slots 2, 3, 4 (the draft at
// 3 seals block 0): draft 2 is accepted, 3 and 4 are rejected (their K/V
// differ from the true tokens'). The rollback truncates block 0 to 3 slots
// and frees block 1; true tokens 3..7 follow. Both blocks end with plain
// decoding's bytes. Without the hold, truncating reopens block 0 from its
// codes and requantizes tokens 0..2 under the scales of a block that held
// the rejected drafts.
void expect_rollback_restores_plain_bytes(kv_type type) {
  stream plain(type, 8, 1), spec(type, 8, 1), drafts(type, 8, 2);
  const std::vector<block_id> table{block_id(5), block_id(9)};
  for (int p = 0; p < 8; ++p) plain.write(table, p, 1);

  spec.write(table, 0, 1);
  spec.s->hold_staging(block_id(5));
  spec.s->hold_staging(block_id(9));
  spec.write(table, 1, 2);              // the last token and the accepted draft (its K/V are the true token's)
  spec.write(table, 3, 2, drafts, 3);   // two rejected drafts: block 0 seals, block 1 opens
  EXPECT_LE(spec.s->staging().slots_in_use, 2) << "a verification step holds at most two staging slots";
  // A view ending inside the held, sealed block reads it staged: the row of
  // slot 2 sees what plain decoding's step at slot 2 saw.
  for (int l = 0; l < L; ++l) {
    const paged_kv_view held = spec.s->k_view(l, table, 3);
    EXPECT_TRUE(held.is_staged(0));
    for (int p = 0; p < 3 && held.is_staged(0); ++p) {
      const std::vector<float> got = read_slot(held, p, 1);
      for (int d = 0; d < D; ++d)
        ASSERT_EQ(got[d], fp16_to_f32(f32_to_fp16(spec.k[(static_cast<std::size_t>(p) * H + 1) * D + d])))
            << "staged slots are the written keys in f16";
    }
  }
  // The next step's ops roll back, then the holds end.
  spec.s->truncate_block(block_id(5), 3);
  spec.s->release_block(block_id(9));
  spec.s->end_holds();
  for (int p = 3; p < 8; ++p) spec.write(table, p, 1);
  EXPECT_EQ(spec.s->staging().slots_in_use, 0);
  for (const block_id b : table) EXPECT_EQ(plain.bytes(b), spec.bytes(b)) << "block " << b.value;
}

TEST(kv_tentative, rollback_inside_a_sealed_int4_block_restores_plain_bytes) {
  expect_rollback_restores_plain_bytes(kv_type::int4);
}
TEST(kv_tentative, rollback_inside_a_sealed_int2_block_restores_plain_bytes) {
  expect_rollback_restores_plain_bytes(kv_type::int2);
}

// Every draft accepted: the held block stays sealed, reads as bytes (the
// commit hook may read it before the holds end) and gives its staging slot
// back when the holds end; so does a whole held block written at once.
TEST(kv_tentative, holds_end_with_the_staging_released) {
  stream plain(kv_type::int4, 12, 3), spec(kv_type::int4, 12, 3);
  const std::vector<block_id> table{block_id(0), block_id(1)};
  plain.write(table, 0, 8);
  spec.write(table, 0, 1);
  spec.s->hold_staging(block_id(0));
  spec.write(table, 1, 3);  // seals block 0, held
  EXPECT_EQ(spec.s->staging().slots_in_use, 1);
  EXPECT_EQ(plain.bytes(block_id(0)), spec.bytes(block_id(0)));
  spec.s->end_holds();
  EXPECT_EQ(spec.s->staging().slots_in_use, 0);
  spec.s->hold_staging(block_id(1));
  spec.write(table, 4, 4);  // a whole block in one write goes through staging while held
  EXPECT_EQ(spec.s->staging().slots_in_use, 1);
  EXPECT_TRUE(spec.s->k_view(0, table, 6).is_staged(1));
  spec.s->end_holds();
  EXPECT_EQ(spec.s->staging().slots_in_use, 0);
  EXPECT_FALSE(spec.s->k_view(0, table, 6).is_staged(1)) << "after the hold, a prefix of a sealed block reads codes";
  EXPECT_EQ(plain.bytes(block_id(1)), spec.bytes(block_id(1)));
  // Releasing a held block ends its hold: a new owner's block seals and
  // gives its slot back as usual.
  spec.s->hold_staging(block_id(2));
  const std::vector<block_id> third{block_id(0), block_id(1), block_id(2)};
  spec.write(third, 8, 2);
  spec.s->release_block(block_id(2));
  EXPECT_EQ(spec.s->staging().slots_in_use, 0);
  const std::vector<block_id> reused{block_id(2)};
  for (int p = 0; p < 4; ++p) spec.write(reused, p, 1);
  EXPECT_EQ(spec.s->staging().slots_in_use, 0);
  spec.s->end_holds();
}

// Copy-on-write of a prefix of a held, sealed block copies its exact staging.
TEST(kv_tentative, partial_copy_of_a_held_block_copies_its_staging) {
  stream s(kv_type::int4, 4, 4);
  const std::vector<block_id> src{block_id(2)}, dst{block_id(3)};
  s.s->hold_staging(block_id(2));
  s.write(src, 0, 4);
  s.s->copy_block(block_id(2), block_id(3), 2);
  const paged_kv_view held = s.s->k_view(1, src, 2), copy = s.s->k_view(1, dst, 2);
  ASSERT_TRUE(copy.is_staged(0));
  for (int p = 0; p < 2; ++p) EXPECT_EQ(read_slot(copy, p, 0), read_slot(held, p, 0));
  s.s->end_holds();
  EXPECT_EQ(s.s->staging().slots_in_use, 1) << "the copy's open block keeps its slot";
}

}  // namespace
}  // namespace pagoda
