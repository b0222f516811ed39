#include "model/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
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

// --- Sampling without a sort: the weights, the cuts and the draws against
// plain references written here.

constexpr float k_max = std::numeric_limits<float>::max();
constexpr float k_inf = std::numeric_limits<float>::infinity();

// The first index of the largest logit by a plain loop of `>` (the sampler's
// greedy choice before it was vectorised).
token_id argmax_reference(const std::vector<float>& l) {
  token_id best = 0;
  for (std::size_t i = 1; i < l.size(); ++i)
    if (l[i] > l[best]) best = static_cast<token_id>(i);
  return best;
}

// What a draw picks among, by sampling_params' rules, with a full sort of
// the vocabulary: tempered logits ordered best first (lowest id on ties),
// top-k, then top-p (smallest head whose weight reaches top_p of the kept
// weight), then min-p (weight at least min_p x the best's, which is 1).
// Weights are the sampler's own sampling_weight, so sets and weights must be
// equal exactly. By id, weight-0 tokens (never drawn) left out.
std::vector<std::pair<token_id, float>> full_sort_reference(const std::vector<float>& logits,
                                                            const sampling_params& p) {
  if (p.is_greedy() || logits.size() <= 1) return {{argmax_reference(logits), 1.0f}};
  const float inv_t = 1.0f / p.temperature;
  struct entry {
    float x;
    token_id id;
    float w;
  };
  std::vector<entry> all;
  for (std::size_t i = 0; i < logits.size(); ++i)
    all.push_back({std::clamp(logits[i] * inv_t, -k_max, k_max), static_cast<token_id>(i), 0.0f});
  std::sort(all.begin(), all.end(), [](const entry& a, const entry& b) { return a.x > b.x || (a.x == b.x && a.id < b.id); });
  std::size_t n = all.size();
  if (p.top_k > 0 && static_cast<std::size_t>(p.top_k) < n) n = static_cast<std::size_t>(p.top_k);
  double z = 0;
  for (std::size_t i = 0; i < n; ++i) {
    all[i].w = sampling_weight(all[i].x - all[0].x);
    z += all[i].w;
  }
  if (p.top_p < 1.0f) {
    double cum = 0;
    for (std::size_t i = 0; i < n; ++i) {
      cum += all[i].w;
      if (cum >= static_cast<double>(p.top_p) * z) {
        n = i + 1;
        break;
      }
    }
  }
  std::vector<std::pair<token_id, float>> out;
  for (std::size_t i = 0; i < n; ++i)
    if (all[i].w > 0.0f && !(p.min_p > 0.0f && all[i].w < p.min_p)) out.emplace_back(all[i].id, all[i].w);
  std::sort(out.begin(), out.end());
  return out;
}

// Every float of [-87, 0] was checked once against std::exp (1,118,699,521
// values, at most 1 ulp apart, 1.02e-7 relative); this samples one in 997 and
// the ends.
TEST(sampler, sampling_weight_is_exp_within_one_ulp) {
  const auto ulps = [](float a, float b) {
    return std::abs(static_cast<std::int64_t>(std::bit_cast<std::int32_t>(a)) - std::bit_cast<std::int32_t>(b));
  };
  const std::uint32_t from = std::bit_cast<std::uint32_t>(-87.0f), to = std::bit_cast<std::uint32_t>(-0.0f);
  std::int64_t worst = 0;
  for (std::uint32_t b = from; b > to; b -= std::min<std::uint32_t>(997, b - to)) {
    const float x = std::bit_cast<float>(b);
    worst = std::max(worst, ulps(sampling_weight(x), static_cast<float>(std::exp(static_cast<double>(x)))));
  }
  EXPECT_LE(worst, 1);
  EXPECT_EQ(sampling_weight(0.0f), 1.0f);  // the best token weighs exactly 1
  EXPECT_EQ(sampling_weight(-0.0f), 1.0f);
  EXPECT_LE(ulps(sampling_weight(-87.0f), static_cast<float>(std::exp(-87.0))), 1);
  EXPECT_GE(sampling_weight(-87.0f), std::numeric_limits<float>::min());  // never a subnormal
  for (float x : {-87.001f, -100.0f, -k_max, -k_inf, std::nanf("")}) EXPECT_EQ(sampling_weight(x), 0.0f) << x;
}

// Random logits drawn from a few values (ties everywhere) or spread out.
std::vector<float> random_logits(std::size_t n, bool ties, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<float> l(n);
  for (float& x : l) {
    const std::uint32_t r = rng();
    x = ties ? static_cast<float>(static_cast<int>(r % 17) - 12) * 0.5f
             : static_cast<float>(static_cast<double>(r) / 4294967296.0 * 24.0 - 12.0);
  }
  return l;
}

// The cuts equal the full-sort reference's exactly, token by token and weight
// by weight, over every mode on logits with many ties.
TEST(sampler, truncation_equals_a_full_sort) {
  int cases = 0;
  for (std::size_t n : {2u, 3u, 17u, 300u, 4099u})
    for (bool ties : {true, false}) {
      const auto l = random_logits(n, ties, static_cast<unsigned>(n) * 2 + ties);
      const int ni = static_cast<int>(n);
      for (float t : {0.25f, 1.0f, 3.0f})
        for (int k : {0, 1, 4, ni - 1, ni})
          for (float top_p : {1.0f, 0.999f, 0.9f, 0.5f, 0.05f})
            for (float min_p : {0.0f, 0.01f, 0.3f, 1.0f}) {
              const sampling_params p{t, k, top_p, min_p, 3};
              sampler s(p);
              ASSERT_EQ(s.distribution(l), full_sort_reference(l, p))
                  << "n " << n << " ties " << ties << " T " << t << " k " << k << " p " << top_p << " min_p " << min_p;
              ++cases;
            }
    }
  EXPECT_EQ(cases, 3000);
}

// top-p over a large vocabulary: the bucket that holds the cut has many
// tokens and ties (a Zipf-like spread, 1/4 of the logits on a grid).
TEST(sampler, top_p_on_a_large_vocabulary_equals_a_full_sort) {
  std::vector<float> l(70000);
  std::mt19937 rng(5);
  for (std::size_t i = 0; i < l.size(); ++i) {
    const float x = static_cast<float>(-1.1 * std::log(static_cast<double>(rng() % 70000 + 1)));
    l[i] = i % 4 == 0 ? std::round(x * 4.0f) / 4.0f : x;
  }
  for (float top_p : {0.99f, 0.95f, 0.6f, 0.2f})
    for (float min_p : {0.0f, 0.001f, 0.05f})
      for (float t : {0.5f, 1.5f}) {
        const sampling_params p{t, 0, top_p, min_p, 3};
        sampler s(p);
        const auto got = s.distribution(l);
        EXPECT_EQ(got, full_sort_reference(l, p)) << "p " << top_p << " min_p " << min_p << " T " << t;
        EXPECT_GT(got.size(), 0u);
      }
}

// Greedy is the plain loop's choice, NaNs and signed zeros included.
TEST(sampler, greedy_equals_the_plain_loop) {
  std::mt19937 rng(9);
  for (int round = 0; round < 300; ++round) {
    auto l = random_logits(1 + rng() % 700, round % 2 == 0, static_cast<unsigned>(round));
    if (round % 3 == 0) l[rng() % l.size()] = std::nanf("");
    if (round % 5 == 0) l[0] = std::nanf("");
    if (round % 7 == 0) std::fill(l.begin(), l.end(), round % 2 ? -k_inf : -0.0f);
    if (round % 11 == 0) l[rng() % l.size()] = 0.0f;
    ASSERT_EQ(argmax(l), argmax_reference(l)) << "round " << round;
    ASSERT_EQ(sampler(sampling_params::greedy()).sample(l), argmax_reference(l));
  }
}

// The chi-square statistic's bound that a correct sampler exceeds with a
// probability of about 1e-6 (Wilson-Hilferty's approximation of the
// quantile, z = 4.75): the seeds are fixed, so a pass is not luck.
double chi_square_bound(int df) {
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1.0 - a + 4.753 * std::sqrt(a), 3.0);
}

// The probability of each token under sampling_params' rules, from the
// logits in double precision (std::exp; no float weights, no sampler code).
std::vector<double> exact_probabilities(const std::vector<float>& logits, const sampling_params& p) {
  std::vector<std::size_t> order(logits.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return logits[a] > logits[b]; });
  std::size_t n = order.size();
  if (p.top_k > 0 && static_cast<std::size_t>(p.top_k) < n) n = static_cast<std::size_t>(p.top_k);
  std::vector<double> w(logits.size(), 0.0);
  double z = 0;
  for (std::size_t i = 0; i < n; ++i) {
    w[order[i]] = std::exp((static_cast<double>(logits[order[i]]) - logits[order[0]]) / p.temperature);
    z += w[order[i]];
  }
  double cum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (p.top_p < 1.0f && cum >= p.top_p * z) w[order[i]] = 0;  // past the head that reached top_p
    cum += w[order[i]];
  }
  for (double& x : w)
    if (x < p.min_p) x = 0;  // the best weighs 1
  double kept = 0;
  for (double x : w) kept += x;
  for (double& x : w) x /= kept;
  return w;
}

// Draws from `p` on `logits`, n_draws times: the frequencies pass a
// chi-square test against the exact probabilities, and no token they exclude
// is ever drawn.
void expect_draws_follow(const std::vector<float>& logits, const sampling_params& p, int n_draws) {
  const auto probs = exact_probabilities(logits, p);
  std::vector<int> counts(logits.size(), 0);
  sampler s(p);
  for (int i = 0; i < n_draws; ++i) ++counts[static_cast<std::size_t>(s.sample(logits))];
  double chi2 = 0;
  int df = -1;
  for (std::size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " is cut, yet drawn";
      continue;
    }
    const double expected = probs[i] * n_draws;
    chi2 += (counts[i] - expected) * (counts[i] - expected) / expected;
    ++df;
  }
  if (df > 0) {
    EXPECT_LT(chi2, chi_square_bound(df)) << "df " << df;
  }
}

TEST(sampler, draws_follow_the_exact_distribution_of_each_mode) {
  // Ten tokens, ids not in probability order, every cut well clear of a tie.
  const auto l = logits_of({0.06, 0.3, 0.01, 0.15, 0.08, 0.2, 0.03, 0.1, 0.05, 0.02});
  const std::vector<sampling_params> modes = {
      {1.0f, 0, 1.0f, 0.0f, 1},    // temperature alone (dense)
      {0.7f, 0, 1.0f, 0.0f, 2},    // colder
      {1.0f, 4, 1.0f, 0.0f, 3},    // top-k
      {1.0f, 0, 0.8f, 0.0f, 4},    // top-p (dense, bucketed)
      {1.0f, 0, 1.0f, 0.25f, 5},   // min-p (dense)
      {1.3f, 5, 0.9f, 0.0f, 6},    // top-k + top-p
      {1.0f, 0, 0.9f, 0.2f, 7},    // top-p + min-p
      {0.8f, 40, 0.95f, 0.05f, 8}, // sampling_params' defaults (top-k above the vocabulary)
  };
  for (const sampling_params& p : modes) {
    SCOPED_TRACE(testing::Message() << "T " << p.temperature << " k " << p.top_k << " p " << p.top_p << " min_p "
                                    << p.min_p);
    expect_draws_follow(l, p, 100000);
  }
}

// 700 tokens span three blocks of the dense draw's partial sums.
TEST(sampler, draws_over_several_blocks_follow_the_exact_distribution) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<float> l(700);
  for (float& x : l) x = normal(rng);
  expect_draws_follow(l, {1.0f, 0, 1.0f, 0.0f, 21}, 100000);
  expect_draws_follow(l, {1.0f, 0, 0.9f, 0.0f, 22}, 100000);
}

TEST(sampler, same_seed_same_draws_in_every_mode) {
  const auto l = random_logits(5000, false, 8);
  for (const sampling_params& base : {sampling_params{1.0f, 0, 1.0f, 0.0f, 0}, sampling_params{1.0f, 40, 1.0f, 0.0f, 0},
                                      sampling_params{1.0f, 0, 0.9f, 0.0f, 0}, sampling_params{1.0f, 0, 1.0f, 0.05f, 0},
                                      sampling_params{}}) {
    sampling_params p = base;
    p.seed = 99;
    sampler a(p), b(p);
    p.seed = 100;
    sampler c(p);
    std::vector<token_id> da, db, dc;
    for (int i = 0; i < 100; ++i) {
      da.push_back(a.sample(l));
      db.push_back(b.sample(l));
      dc.push_back(c.sample(l));
    }
    EXPECT_EQ(da, db);
    EXPECT_NE(da, dc);
  }
}

const std::vector<sampling_params>& every_mode() {
  static const std::vector<sampling_params> m = {
      sampling_params::greedy(),   {1.0f, 0, 1.0f, 0.0f, 1},    {1.0f, 3, 1.0f, 0.0f, 1},
      {1.0f, 0, 0.9f, 0.0f, 1},    {1.0f, 0, 1.0f, 0.1f, 1},    {1.0f, 3, 0.9f, 0.1f, 1},
      {1e-5f, 0, 1.0f, 0.0f, 1},   {100.0f, 0, 0.5f, 0.0f, 1},  sampling_params{},
  };
  return m;
}

TEST(sampler, edge_cases_in_every_mode) {
  std::vector<float> one_finite(1000, -k_inf);
  one_finite[617] = 0.5f;
  const std::vector<float> single{-3.0f};
  const std::vector<float> tied_top{1.0f, 3.0f, 3.0f, 2.0f};
  for (const sampling_params& p : every_mode()) {
    SCOPED_TRACE(testing::Message() << "T " << p.temperature << " k " << p.top_k << " p " << p.top_p);
    sampler s(p);
    for (int i = 0; i < 20; ++i) {
      EXPECT_EQ(s.sample(one_finite), 617);  // all -inf but one
      EXPECT_EQ(s.sample(single), 0);        // a vocabulary of 1
    }
    EXPECT_EQ(s.distribution(one_finite), (std::vector<std::pair<token_id, float>>{{617, 1.0f}}));
    // top_p that only the best token reaches, top-k 1: the lowest id of the tied best.
    for (sampling_params q : {sampling_params{p.temperature, p.top_k, std::numeric_limits<float>::denorm_min(), p.min_p, 1},
                              sampling_params{p.temperature, 1, p.top_p, p.min_p, 1}}) {
      if (p.is_greedy()) continue;
      sampler t(q);
      for (int i = 0; i < 20; ++i) EXPECT_EQ(t.sample(tied_top), 1);
      EXPECT_EQ(t.distribution(tied_top), (std::vector<std::pair<token_id, float>>{{1, 1.0f}}));
    }
  }
}

// min_p past its domain (validate() rejects it; code may still pass it)
// keeps the best token rather than cutting every one.
TEST(sampler, min_p_above_one_keeps_the_best_token) {
  const auto l = logits_of({0.2, 0.5, 0.3});
  for (const sampling_params& p : {sampling_params{1.0f, 0, 1.0f, 2.0f, 1}, sampling_params{1.0f, 2, 1.0f, 2.0f, 1},
                                   sampling_params{1.0f, 0, 0.5f, 2.0f, 1}}) {
    sampler s(p);
    for (int i = 0; i < 10; ++i) EXPECT_EQ(s.sample(l), 1);
  }
}

// Infinite, saturated and NaN logits at the extreme temperatures: every
// weight finite, a NaN logit never drawn, every draw a real token.
TEST(sampler, extreme_logits_give_finite_weights) {
  const std::vector<float> l{k_max, -k_max, k_inf, -k_inf, 0.0f, 1e30f, std::nanf(""), -1e30f, 5.0f, std::nanf("")};
  for (const sampling_params& p : every_mode()) {
    if (p.is_greedy()) continue;
    SCOPED_TRACE(testing::Message() << "T " << p.temperature << " k " << p.top_k << " p " << p.top_p);
    sampler s(p);
    const auto d = s.distribution(l);
    ASSERT_FALSE(d.empty());
    for (const auto& [t, w] : d) {
      EXPECT_TRUE(std::isfinite(w) && w > 0.0f) << t;
      EXPECT_NE(t, 6);
      EXPECT_NE(t, 9);
    }
    EXPECT_EQ(d, full_sort_reference(std::vector<float>{k_max, -k_max, k_inf, -k_inf, 0.0f, 1e30f, -k_inf, -1e30f, 5.0f, -k_inf}, p));
    for (int i = 0; i < 50; ++i) {
      const token_id t = s.sample(l);
      EXPECT_TRUE(t == 0 || t == 2 || t == 5 || t == 8 || t == 4) << t;
    }
  }
}

// top_log_probs keeps its outputs: the old full partial_sort's ids, and each
// log-probability bit-identical to log_prob's.
TEST(sampler, top_log_probs_equal_a_full_partial_sort) {
  for (std::size_t n : {1u, 5u, 300u, 3000u})
    for (bool ties : {true, false}) {
      auto l = random_logits(n, ties, static_cast<unsigned>(n) + ties);
      if (n > 5) l[n / 2] = -k_inf;
      for (int k : {0, 1, 5, 64, static_cast<int>(n), static_cast<int>(n) + 3, -2}) {
        std::vector<std::pair<token_id, float>> all;
        for (std::size_t i = 0; i < n; ++i) all.emplace_back(static_cast<token_id>(i), l[i]);
        const std::size_t m = std::min<std::size_t>(std::max(k, 0), n);
        std::partial_sort(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(m), all.end(), [](const auto& a, const auto& b) {
          return a.second > b.second || (a.second == b.second && a.first < b.first);
        });
        all.resize(m);
        for (auto& [t, lp] : all) lp = sampler::log_prob(l, t);
        ASSERT_EQ(sampler::top_log_probs(l, k), all) << "n " << n << " ties " << ties << " k " << k;
      }
    }
}

}  // namespace
}  // namespace pagoda
