// The sampler's distributions that speculative rejection sampling compares
// (sampler::probabilities, draw_from, uniform; model/sampler.h): the law
// sample() draws from, and draws from a given law with the sampler's stream.
// Statistical tests as chi_square_util.h states them.
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "model/sampler.h"
#include "spec/chi_square_util.h"

namespace pagoda {
namespace {

// probabilities() is the law sample() draws from, penalties and bias
// included: 200,000 draws of sample() against it, over 16 tokens. Case 0 has
// no cut (15 degrees of freedom, bound 50: false alarm 1.2e-5); case 1 keeps
// the top 6 (5 degrees of freedom, bound 35: 1.5e-6), and the other 10 tokens
// must never be drawn.
TEST(sampler_probabilities, is_the_law_sample_draws_from) {
  constexpr int V = 16, trials = 200000;
  std::mt19937_64 gen(7);
  const std::vector<token_id> prompt{1, 2, 9}, output{2, 5, 5, 11};
  for (int c = 0; c < 2; ++c) {
    std::vector<float> logits = random_logits(gen, V, 1.0f);
    logits[5] = 4.0f;  // kept by the top 6 penalised or not
    sampling_params params{0.8f, c == 0 ? 0 : 6, 1.0f, 0.0f, 31 + static_cast<std::uint64_t>(c)};
    params.presence_penalty = 0.5f;
    params.frequency_penalty = 0.3f;
    params.repetition_penalty = 1.3f;
    params.logit_bias = {{3, 1.5f}};
    sampling_params unadjusted = params;
    unadjusted.presence_penalty = unadjusted.frequency_penalty = 0.0f;
    unadjusted.repetition_penalty = 1.0f;
    unadjusted.logit_bias.clear();
    sampler s(params);
    const token_distribution d = s.probabilities(logits, prompt, output);
    ASSERT_EQ(d.tokens.size(), c == 0 ? 16u : 6u);
    const std::vector<double> p = dense(d, V);
    double sum = 0;
    for (double x : p) sum += x;
    EXPECT_NEAR(sum, 1.0, 1e-6);
    // The penalties moved the law: token 5, in the output twice, weighs less.
    EXPECT_LT(d.of(5), sampler(unadjusted).probabilities(logits, prompt, output).of(5));
    std::vector<double> seen(V, 0.0);
    for (int i = 0; i < trials; ++i) seen[static_cast<std::size_t>(s.sample(logits, prompt, output))] += 1;
    EXPECT_LT(pearson(seen, p, trials), c == 0 ? 50.0 : 35.0) << "case " << c;
  }
}

TEST(sampler_probabilities, greedy_is_the_point_mass_on_the_adjusted_argmax) {
  const std::vector<float> logits{0.5f, 2.0f, 1.9f, -1.0f};
  sampling_params params = sampling_params::greedy();
  params.logit_bias = {{2, 0.5f}};
  sampler s(params);
  const token_distribution d = s.probabilities(logits);
  ASSERT_EQ(d.tokens.size(), 1u);
  EXPECT_EQ(d.tokens[0], (std::pair<token_id, float>{2, 1.0f}));
  EXPECT_EQ(d.of(2), 1.0f);
  EXPECT_EQ(d.of(1), 0.0f);
  EXPECT_EQ(s.draw_from(d), 2);
}

// draw_from follows the distribution it is given (df 15, bound 50: 1.2e-5),
// with the sampler's own stream: the same seed draws the same tokens.
TEST(sampler_probabilities, draw_from_follows_the_given_distribution) {
  constexpr int V = 16, trials = 200000;
  std::mt19937_64 gen(8);
  sampler shaper(plain_params(0));
  const token_distribution d = shaper.probabilities(random_logits(gen, V, 1.2f));
  sampler s(plain_params(5)), twin(plain_params(5));
  std::vector<double> seen(V, 0.0);
  for (int i = 0; i < trials; ++i) {
    const token_id t = s.draw_from(d);
    ASSERT_EQ(t, twin.draw_from(d));
    seen[static_cast<std::size_t>(t)] += 1;
  }
  EXPECT_LT(pearson(seen, dense(d, V), trials), 50.0);
}

}  // namespace
}  // namespace pagoda
