#include "model/sampler.h"

#include <cmath>
#include <map>

#include <gtest/gtest.h>

namespace pagoda {
namespace {

std::vector<float> logits_of(std::vector<double> probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

std::map<token_id, int> histogram_of(sampling_params p, const std::vector<float>& logits, int n) {
  sampler s(p);
  std::map<token_id, int> h;
  for (int i = 0; i < n; ++i) ++h[s.sample(logits)];
  return h;
}

TEST(sampler, greedy_is_argmax_with_lowest_id_on_ties) {
  std::vector<float> l{0.1f, 3.0f, -1.0f, 3.0f};
  sampler s(sampling_params::greedy());
  EXPECT_EQ(s.sample(l), 1);
  EXPECT_EQ(argmax(l), 1);
}

TEST(sampler, top_k_one_is_greedy) {
  std::vector<float> l{0.1f, 0.3f, 2.0f, 0.2f};
  sampling_params p{1.0f, 1, 1.0f, 0.0f, 9};
  auto h = histogram_of(p, l, 200);
  EXPECT_EQ(h.size(), 1u);
  EXPECT_EQ(h.begin()->first, 2);
}

// With no filtering, draw frequencies follow softmax(logits / T). 20,000 draws:
// a frequency's standard error is below 0.0036, so 0.015 is over 4 sigma.
TEST(sampler, frequencies_follow_the_tempered_softmax) {
  std::vector<double> probs{0.5, 0.3, 0.15, 0.05};
  auto l = logits_of(probs);
  for (float t : {1.0f, 0.5f, 2.0f}) {
    auto h = histogram_of({t, 0, 1.0f, 0.0f, 1234}, l, 20000);
    double z = 0;
    for (double p : probs) z += std::pow(p, 1.0 / t);
    for (int i = 0; i < 4; ++i)
      EXPECT_NEAR(h[i] / 20000.0, std::pow(probs[i], 1.0 / t) / z, 0.015) << "T=" << t << " token " << i;
  }
}

TEST(sampler, top_p_keeps_the_smallest_set_reaching_p) {
  auto l = logits_of({0.5, 0.3, 0.15, 0.05});
  auto h = histogram_of({1.0f, 0, 0.7f, 0.0f, 5}, l, 5000);  // 0.5 + 0.3 >= 0.7: tokens 0 and 1
  EXPECT_EQ(h.count(2), 0u);
  EXPECT_EQ(h.count(3), 0u);
  EXPECT_NEAR(h[0] / 5000.0, 0.5 / 0.8, 0.03);
}

TEST(sampler, min_p_drops_tokens_below_a_fraction_of_the_best) {
  auto l = logits_of({0.5, 0.3, 0.15, 0.05});
  auto h = histogram_of({1.0f, 0, 1.0f, 0.2f, 5}, l, 5000);  // threshold 0.1: drops token 3 only
  EXPECT_EQ(h.count(3), 0u);
  EXPECT_GT(h[2], 0);
}

TEST(sampler, same_seed_same_draws) {
  auto l = logits_of({0.25, 0.25, 0.25, 0.25});
  sampling_params p{1.0f, 0, 1.0f, 0.0f, 77};
  sampler a(p), b(p);
  std::vector<token_id> da, db;
  for (int i = 0; i < 50; ++i) {
    da.push_back(a.sample(l));
    db.push_back(b.sample(l));
  }
  EXPECT_EQ(da, db);
  p.seed = 78;
  sampler c(p);
  std::vector<token_id> dc;
  for (int i = 0; i < 50; ++i) dc.push_back(c.sample(l));
  EXPECT_NE(da, dc);
}

TEST(sampler, log_probs) {
  auto l = logits_of({0.5, 0.3, 0.15, 0.05});
  EXPECT_NEAR(sampler::log_prob(l, 1), std::log(0.3), 1e-5);
  auto top = sampler::top_log_probs(l, 2);
  ASSERT_EQ(top.size(), 2u);
  EXPECT_EQ(top[0].first, 0);
  EXPECT_EQ(top[1].first, 1);
  EXPECT_NEAR(top[1].second, std::log(0.3), 1e-5);
}

TEST(sampler, validation_names_the_field) {
  sampling_params p;
  p.temperature = -1;
  EXPECT_NE(p.validate().message().find("temperature"), std::string::npos);
  p = {};
  p.top_p = 0;
  EXPECT_NE(p.validate().message().find("top_p"), std::string::npos);
  p = {};
  p.min_p = 2;
  EXPECT_NE(p.validate().message().find("min_p"), std::string::npos);
  p = {};
  p.top_k = -5;
  EXPECT_NE(p.validate().message().find("top_k"), std::string::npos);
  EXPECT_TRUE(sampling_params{}.validate().ok());
}

}  // namespace
}  // namespace pagoda
