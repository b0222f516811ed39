#include "model/sampler.h"

#include <cmath>
#include <limits>
#include <map>
#include <random>

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

// The chosen token's log-probability is bit-identical to its own entry among
// the alternatives, for every token of random logits.
TEST(sampler, log_prob_equals_its_top_entry) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> l(1000);
  for (float& x : l) x = normal(rng);
  auto top = sampler::top_log_probs(l, static_cast<int>(l.size()));
  ASSERT_EQ(top.size(), l.size());
  double total = 0;
  for (const auto& [t, lp] : top) {
    EXPECT_EQ(sampler::log_prob(l, t), lp) << "token " << t;
    total += std::exp(static_cast<double>(lp));
  }
  EXPECT_NEAR(total, 1.0, 1e-5);
}

TEST(sampler, logit_bias_forces_and_bans) {
  std::vector<float> l{1.0f, 3.0f, 2.0f, 0.0f};
  sampling_params p = sampling_params::greedy();
  p.logit_bias = {{3, 100.0f}};
  EXPECT_EQ(sampler(p).sample(l), 3);
  p.logit_bias = {{1, -100.0f}};
  EXPECT_EQ(sampler(p).sample(l), 2);
  // With sampling: a banned token is never drawn (e^-100 relative weight).
  sampling_params q{1.0f, 0, 1.0f, 0.0f, 11};
  q.logit_bias = {{1, -100.0f}, {2, -100.0f}};
  auto h = histogram_of(q, l, 2000);
  EXPECT_EQ(h.count(1), 0u);
  EXPECT_EQ(h.count(2), 0u);
  EXPECT_NEAR(h[0] / 2000.0, std::exp(1.0) / (std::exp(1.0) + 1.0), 0.04);
  // Bias is added: +0.5 on token 2 gives exactly logit 2.5.
  q.logit_bias = {{2, 0.5f}};
  sampler s(q);
  EXPECT_EQ(s.adjust(l, {}, {})[2], 2.5f);
}

// vLLM's formulas, checked value by value: repetition divides positive logits
// and multiplies negative ones of tokens in the prompt or output; frequency
// subtracts per occurrence in the output; presence once per token in it.
TEST(sampler, penalties_follow_vllm_formulas) {
  const std::vector<float> l{2.0f, -1.0f, 4.0f, 0.5f, 3.0f, -2.0f};
  const std::vector<token_id> prompt{0, 1};
  const std::vector<token_id> output{2, 2, 2, 3, 1};
  sampling_params p = sampling_params::greedy();
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.25f;
  p.presence_penalty = 0.5f;
  sampler s(p);
  auto a = s.adjust(l, prompt, output);
  ASSERT_EQ(a.size(), l.size());
  EXPECT_FLOAT_EQ(a[0], 2.0f / 2.0f);                      // prompt only: repetition
  EXPECT_FLOAT_EQ(a[1], -1.0f * 2.0f - 0.25f * 1 - 0.5f);  // both, once in the output
  EXPECT_FLOAT_EQ(a[2], 4.0f / 2.0f - 0.25f * 3 - 0.5f);   // three times in the output
  EXPECT_FLOAT_EQ(a[3], 0.5f / 2.0f - 0.25f - 0.5f);
  EXPECT_FLOAT_EQ(a[4], 3.0f);                             // never seen: untouched
  EXPECT_FLOAT_EQ(a[5], -2.0f);
  // Greedy picks the argmax of the adjusted logits: 4 (3.0), not 2 (4.0).
  EXPECT_EQ(s.sample(l, prompt, output), 4);
  // A second call starts from clean counts (the scratch state is reset).
  auto b = s.adjust(l, prompt, output);
  EXPECT_FLOAT_EQ(b[2], 4.0f / 2.0f - 0.25f * 3 - 0.5f);
  // Presence and frequency look at the output only.
  sampling_params f = sampling_params::greedy();
  f.frequency_penalty = 1.0f;
  sampler sf(f);
  EXPECT_FLOAT_EQ(sf.adjust(l, prompt, {})[0], 2.0f);
  // Negative penalties encourage repetition.
  f.frequency_penalty = -2.0f;
  sampler sn(f);
  EXPECT_EQ(sn.sample(l, {}, std::vector<token_id>{3, 3}), 3);  // 0.5 + 4 beats 4.0
}

// Values at the edge of their ranges never yield a NaN or a failed draw.
TEST(sampler, extreme_values_stay_finite) {
  std::vector<float> l{30.0f, -30.0f, 29.0f, 1.0f};
  sampling_params p{1.0f, 0, 1.0f, 0.0f, 2};
  p.repetition_penalty = std::numeric_limits<float>::denorm_min();
  sampler s(p);
  for (float x : s.adjust(l, std::vector<token_id>{0, 1, 2, 3}, {})) EXPECT_TRUE(std::isfinite(x));
  std::map<token_id, int> h;
  for (int i = 0; i < 100; ++i) ++h[s.sample(l, std::vector<token_id>{0, 1, 2, 3}, {})];
  // 30, 29 and 1 divided by a denormal saturate at FLT_MAX; -30 x it is ~0.
  EXPECT_EQ(h.count(1), 0u);
  for (const auto& [t, n] : h) EXPECT_LT(t, 4);
  sampling_params t{1e-5f, 0, std::numeric_limits<float>::denorm_min(), 0.0f, 2};
  EXPECT_TRUE(t.validate().ok());
  auto ht = histogram_of(t, l, 50);
  ASSERT_EQ(ht.size(), 1u);
  EXPECT_EQ(ht.begin()->first, 0);  // the top token only
  sampling_params g{5e-6f, 0, 1.0f, 0.0f, 2};
  EXPECT_TRUE(g.is_greedy());  // below vLLM's epsilon
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
  p = {};
  p.presence_penalty = 2.5f;
  EXPECT_NE(p.validate().message().find("presence_penalty"), std::string::npos);
  p = {};
  p.frequency_penalty = std::nanf("");
  EXPECT_NE(p.validate().message().find("frequency_penalty"), std::string::npos);
  p = {};
  p.repetition_penalty = 0.0f;
  EXPECT_NE(p.validate().message().find("repetition_penalty"), std::string::npos);
  p = {};
  p.logit_bias = {{3, 100.5f}};
  EXPECT_NE(p.validate().message().find("logit_bias"), std::string::npos);
  p.logit_bias = {{-1, 1.0f}};
  EXPECT_NE(p.validate().message().find("logit_bias"), std::string::npos);
  EXPECT_TRUE(sampling_params{}.validate().ok());
}

}  // namespace
}  // namespace pagoda
