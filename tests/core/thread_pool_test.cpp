#include "core/thread_pool.h"

#include <atomic>
#include <chrono>
#include <thread>
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

// A shared job's work comes from a counter: every item is done once, whichever
// threads join, and the call returns only after every thread that joined is out.
TEST(thread_pool, run_shared_covers_each_item_once) {
  for (int n_threads : {1, 2, 3}) {
    thread_pool pool(n_threads);
    for (int rep = 0; rep < 2000; ++rep) {
      constexpr int k_items = 37;
      std::vector<std::atomic<int>> hits(k_items);
      std::atomic<int> next{0}, inside{0};
      std::vector<int> per_thread(static_cast<std::size_t>(n_threads), 0);
      pool.run_shared([&](int ith, int nth) {
        EXPECT_EQ(nth, n_threads);
        inside.fetch_add(1);
        per_thread[static_cast<std::size_t>(ith)] += 1;  // distinct ith: no race
        for (int i = next.fetch_add(1); i < k_items; i = next.fetch_add(1)) hits[static_cast<std::size_t>(i)].fetch_add(1);
        inside.fetch_sub(1);
      });
      EXPECT_EQ(inside.load(), 0);
      EXPECT_EQ(per_thread[0], 1);
      for (int v : per_thread) EXPECT_LE(v, 1);
      for (auto& h : hits) ASSERT_EQ(h.load(), 1) << n_threads << " " << rep;
    }
    // A worker that joins and is slow holds the call until it is out.
    for (int rep = 0; rep < 20; ++rep) {
      std::atomic<int> inside{0};
      pool.run_shared([&](int ith, int) {
        inside.fetch_add(1);
        if (ith != 0) std::this_thread::sleep_for(std::chrono::microseconds(300));
        inside.fetch_sub(1);
      });
      ASSERT_EQ(inside.load(), 0);
    }
    // Shared and waiting jobs interleave: run() still reaches every thread once.
    std::vector<int> seen(static_cast<std::size_t>(n_threads), 0);
    for (int rep = 0; rep < 500; ++rep) {
      pool.run_shared([](int, int) {});
      pool.run([&](int ith, int) { seen[static_cast<std::size_t>(ith)] += 1; });
    }
    for (int v : seen) EXPECT_EQ(v, 500);
  }
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
