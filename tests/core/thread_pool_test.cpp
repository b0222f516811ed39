#include "core/thread_pool.h"

#include <atomic>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

namespace pagoda {
namespace {

TEST(thread_pool, parallel_for_covers_each_index_once) {
  for (int n_threads : {1, 2, 3, 5}) {
    thread_pool pool(n_threads);
    for (std::size_t n : {0u, 1u, 7u, 64u, 1000u}) {
      std::vector<std::atomic<int>> hits(n);
      pool.parallel_for(n, [&](std::size_t b, std::size_t e) {
        for (std::size_t i = b; i < e; ++i) hits[i].fetch_add(1);
      });
      for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << n_threads << " " << n << " " << i;
    }
  }
}

TEST(thread_pool, run_gives_each_thread_its_index) {
  thread_pool pool(4);
  std::vector<int> seen(4, 0);
  for (int rep = 0; rep < 200; ++rep) {
    pool.run([&](int ith, int nth) {
      EXPECT_EQ(nth, 4);
      seen[ith] += 1;
    });
  }
  for (int v : seen) EXPECT_EQ(v, 200);
}

TEST(thread_pool, split_range_respects_grain) {
  std::size_t covered = 0;
  for (int ith = 0; ith < 3; ++ith) {
    std::size_t b, e;
    split_range(100, ith, 3, 16, b, e);
    EXPECT_EQ(b % 16, 0u);
    EXPECT_TRUE(e == 100 || e % 16 == 0);
    covered += e - b;
  }
  EXPECT_EQ(covered, 100u);
}

}  // namespace
}  // namespace pagoda
