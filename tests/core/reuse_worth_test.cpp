// The worth rule both cache tiers evict by (core/reuse_worth.h).
#include "core/reuse_worth.h"

#include <gtest/gtest.h>

namespace pagoda {
namespace {

TEST(reuse_worth, uses_halved_every_period) {
  EXPECT_DOUBLE_EQ(reuse::worth(0, 0), 1.0);
  EXPECT_DOUBLE_EQ(reuse::worth(7, 0), 8.0);
  EXPECT_DOUBLE_EQ(reuse::worth(7, 1), 4.0);
  EXPECT_DOUBLE_EQ(reuse::worth(3, 2), 1.0);
  EXPECT_NEAR(reuse::worth(5, 0.5), 6.0 / std::sqrt(2.0), 1e-12);
  // Reused 7 times 2 periods ago outranks never reused now; 3 periods ago it does not.
  EXPECT_GT(reuse::worth(7, 2), reuse::worth(0, 0));
  EXPECT_EQ(reuse::worth(7, 3), reuse::worth(0, 0));
}

TEST(reuse_worth, levels_are_floor_log2_of_one_plus_uses) {
  const std::int32_t expect[] = {0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 4};
  for (std::uint32_t u = 0; u < 16; ++u) {
    EXPECT_EQ(reuse::level(u, 10), expect[u]) << u;
    EXPECT_EQ(reuse::level(u, 3), std::min(expect[u], 3)) << u;
    EXPECT_EQ(reuse::level(u, 10), static_cast<std::int32_t>(std::floor(reuse::log2_worth(u, 0)))) << u;
  }
  EXPECT_EQ(reuse::uses_cap(3), 7u);
  EXPECT_EQ(reuse::level(reuse::uses_cap(3), 3), 3);
  EXPECT_EQ(reuse::level(reuse::uses_cap(3) - 1, 3), 2);
  EXPECT_EQ(reuse::add_use(6, 7), 7u);
  EXPECT_EQ(reuse::add_use(7, 7), 7u);
}

}  // namespace
}  // namespace pagoda
