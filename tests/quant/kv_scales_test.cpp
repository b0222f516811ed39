#include "quant/kv_scales.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <random>

#include <gtest/gtest.h>

namespace pagoda {
namespace {

std::string temp_path(const char* name) { return "/tmp/pagoda_kv_scales_" + std::to_string(getpid()) + "_" + name; }

TEST(kv_scales, calibrator_keeps_exact_ranges_and_percentiles) {
  // 1 layer, 1 head, 2 channels; channel 0 = 0..999, channel 1 = -(0..999).
  const int n = 1000;
  kv_range_calibrator exact(1, 1, 2, 100.0, n), clipped(1, 1, 2, 99.0, n);
  std::vector<float> x(2 * n);
  for (int t = 0; t < n; ++t) {
    x[2 * t] = static_cast<float>(t);
    x[2 * t + 1] = -static_cast<float>(t);
  }
  // Fed in shuffled chunks: order must not matter.
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = (i * 617) % n;
  std::vector<float> shuffled(2 * n);
  for (int i = 0; i < n; ++i) {
    shuffled[2 * i] = x[2 * order[i]];
    shuffled[2 * i + 1] = x[2 * order[i] + 1];
  }
  for (int i = 0; i < n; i += 100)
    for (auto* c : {&exact, &clipped}) {
      c->add(0, kv_role::key, &shuffled[2 * i], 100);
      c->add(0, kv_role::value, &shuffled[2 * i], 100);
    }
  kv_scales e = exact.finish(), p = clipped.finish();
  EXPECT_EQ(e.n_tokens, n);
  EXPECT_EQ(e.clip, "max");
  EXPECT_EQ(e.lo(kv_role::key, 0, 0)[0], 0.0f);
  EXPECT_EQ(e.hi(kv_role::key, 0, 0)[0], 999.0f);
  EXPECT_EQ(e.lo(kv_role::value, 0, 0)[1], -999.0f);
  // 99th percentile of 1000 values: the 10 most extreme on each side are clipped.
  EXPECT_EQ(p.hi(kv_role::key, 0, 0)[0], 989.0f);
  EXPECT_EQ(p.lo(kv_role::key, 0, 0)[0], 10.0f);
  EXPECT_EQ(p.lo(kv_role::key, 0, 0)[1], -989.0f);
}

TEST(kv_scales, save_and_load_round_trip) {
  kv_range_calibrator c(2, 3, 4, 100.0, 10);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> x(10 * 3 * 4);
  for (float& v : x) v = nd(rng);
  for (int l = 0; l < 2; ++l) {
    c.add(l, kv_role::key, x.data(), 10);
    c.add(l, kv_role::value, x.data(), 10);
  }
  kv_scales s = c.finish();
  s.model = "test";
  std::string path = temp_path("ok.json");
  ASSERT_TRUE(save_kv_scales(s, path).ok());
  auto back = load_kv_scales(path);
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->k_lo, s.k_lo);
  EXPECT_EQ(back->v_hi, s.v_hi);
  EXPECT_EQ(back->model, "test");
  EXPECT_TRUE(back->check_shape(2, 3, 4).ok());
  auto wrong = back->check_shape(2, 3, 8);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.message().find("2 x 3 x 8"), std::string::npos) << wrong.message();
  std::remove(path.c_str());
}

TEST(kv_scales, malformed_files_get_clear_errors) {
  EXPECT_EQ(load_kv_scales("/nonexistent/scales.json").error().code(), errc::not_found);
  struct bad_case {
    const char* text;
    const char* expect;
  };
  for (bad_case b : {bad_case{"not json", "not a JSON object"},
                     bad_case{R"({"format": "x", "version": 1})", "format"},
                     bad_case{R"({"format": "pagoda-kv-scales", "version": 2})", "version"},
                     bad_case{R"({"format": "pagoda-kv-scales", "version": 1, "n_layers": 1, "n_kv_heads": 1, "head_dim": 2, "layers": []})", "layers"},
                     bad_case{R"({"format": "pagoda-kv-scales", "version": 1, "n_layers": 1, "n_kv_heads": 1, "head_dim": 2,
                                 "layers": [{"k": {"lo": [[0, 0]], "hi": [[1]]}, "v": {"lo": [[0, 0]], "hi": [[1, 1]]}}]})", "2 numbers"},
                     bad_case{R"({"format": "pagoda-kv-scales", "version": 1, "n_layers": 1, "n_kv_heads": 1, "head_dim": 2,
                                 "layers": [{"k": {"lo": [[0, 2]], "hi": [[1, 1]]}, "v": {"lo": [[0, 0]], "hi": [[1, 1]]}}]})", "lo > hi"}}) {
    std::string path = temp_path("bad.json");
    std::ofstream(path) << b.text;
    auto r = load_kv_scales(path);
    ASSERT_FALSE(r.ok()) << b.text;
    EXPECT_NE(r.error().message().find(b.expect), std::string::npos) << r.error().message();
    EXPECT_NE(r.error().message().find(path), std::string::npos);
    std::remove(path.c_str());
  }
}

}  // namespace
}  // namespace pagoda
