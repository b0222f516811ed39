// Folding evicted entries into kept ones (kv_fold.h), on hand-built rows.
#include <gtest/gtest.h>

#include <vector>

#include "kv/kv_fold.h"

namespace pagoda {
namespace {

// Each evicted key joins the most similar kept key; the kept entry becomes the
// mass-weighted mean, and masses add up.
TEST(kv_fold, nearest_joins_the_most_similar_key_and_keeps_mass) {
  // Two kept keys along x and y; evicted ones close to x (twice) and to y.
  std::vector<float> kk = {1, 0, 0, 1};
  std::vector<float> kv = {10, 0, 0, 20};
  std::vector<float> km = {1, 2};  // the second already stands for two tokens
  const std::vector<float> ek = {0.9f, 0.1f, 2.0f, 0.0f, 0.1f, 0.8f};
  const std::vector<float> ev = {4, 4, 6, 6, 8, 8};
  const std::vector<float> em = {1, 1, 3};
  kv_fold_rows r{2, kk.data(), kv.data(), km.data(), 2, ek.data(), ev.data(), em.data(), 3};
  fold_nearest(r);
  EXPECT_FLOAT_EQ(km[0], 3.0f);  // itself + two evicted
  EXPECT_FLOAT_EQ(km[1], 5.0f);  // 2 + 3
  EXPECT_FLOAT_EQ(km[0] + km[1], 1 + 2 + 1 + 1 + 3);
  EXPECT_FLOAT_EQ(kk[0], (1 + 0.9f + 2.0f) / 3);
  EXPECT_FLOAT_EQ(kk[1], (0 + 0.1f + 0.0f) / 3);
  EXPECT_FLOAT_EQ(kv[0], (10 + 4 + 6) / 3.0f);
  EXPECT_FLOAT_EQ(kk[2], (2 * 0 + 3 * 0.1f) / 5);
  EXPECT_FLOAT_EQ(kk[3], (2 * 1 + 3 * 0.8f) / 5);
  EXPECT_FLOAT_EQ(kv[3], (2 * 20 + 3 * 8) / 5.0f);
}

// Identical copies folded together change neither key nor value: the merged
// entry is the token itself with mass 2.
TEST(kv_fold, nearest_of_identical_copies_is_the_token_with_more_mass) {
  std::vector<float> kk = {0.5f, -1.5f, 3};
  std::vector<float> kv = {7, 8, 9};
  std::vector<float> km = {1};
  const std::vector<float> ek = kk, ev = kv, em = {1};
  kv_fold_rows r{3, kk.data(), kv.data(), km.data(), 1, ek.data(), ev.data(), em.data(), 1};
  fold_nearest(r);
  EXPECT_EQ(kk, ek);
  EXPECT_EQ(kv, ev);
  EXPECT_FLOAT_EQ(km[0], 2.0f);
}

// k-means from the anchors: two well-separated groups end as their means.
TEST(kv_fold, cluster_gathers_each_group_at_its_anchor) {
  // Kept: three entries; anchors are kept entries 0 and 2.
  std::vector<float> kk = {0, 0, 5, 5, 10, 10};
  std::vector<float> kv = {1, 1, 2, 2, 3, 3};
  std::vector<float> km = {1, 1, 1};
  // Evicted: two near the first anchor, one near the second.
  const std::vector<float> ek = {0.5f, 0, 0, 0.5f, 9, 10};
  const std::vector<float> ev = {1, 1, 1, 1, 5, 5};
  const std::vector<float> em = {1, 1, 2};
  kv_fold_rows r{2, kk.data(), kv.data(), km.data(), 3, ek.data(), ev.data(), em.data(), 3};
  const std::int32_t anchors[] = {0, 2};
  fold_cluster(r, anchors);
  EXPECT_FLOAT_EQ(km[0], 3.0f);
  EXPECT_FLOAT_EQ(km[2], 3.0f);
  EXPECT_FLOAT_EQ(kk[0], (0 + 0.5f + 0) / 3);
  EXPECT_FLOAT_EQ(kk[1], (0 + 0 + 0.5f) / 3);
  EXPECT_FLOAT_EQ(kk[4], (10 + 2 * 9) / 3.0f);
  EXPECT_FLOAT_EQ(kv[4], (3 + 2 * 5) / 3.0f);
  // The kept entry that is no anchor is untouched.
  EXPECT_FLOAT_EQ(kk[2], 5.0f);
  EXPECT_FLOAT_EQ(km[1], 1.0f);
}

}  // namespace
}  // namespace pagoda
