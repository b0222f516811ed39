// Speculative rejection sampling (spec/rejection.h): statistical tests that
// the emitted tokens follow the target's law (chi_square_util.h says how they
// are stated), and exact tests of greedy verification and of the edge cases.
#include "spec/rejection.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "model/sampler.h"
#include "spec/chi_square_util.h"

namespace pagoda {
namespace {

// The acceptance rate of one position: sum over x of min(p(x), q(x)).
double overlap(const std::vector<double>& p, const std::vector<double>& q) {
  double a = 0;
  for (std::size_t t = 0; t < p.size(); ++t) a += std::min(p[t], q[t]);
  return a;
}

// One speculative position drawn from q and verified against p: the first
// emitted token follows p. Six (p, q) pairs over 16 tokens, 200,000 trials
// each: four with p and q from independent random logits, one with q close to
// p, and one with q a point mass (the n-gram drafter's case). Pearson's
// chi-square of the first token against p at 15 degrees of freedom: fail
// above 50 (false alarm 1.2e-5 per case, 7e-5 for the six). The acceptance
// rate must be sum min(p, q) within 5 standard errors.
TEST(accept_distribution_drafts, the_first_emitted_token_follows_the_target) {
  constexpr int V = 16, trials = 200000;
  std::mt19937_64 gen(2027);
  for (int c = 0; c < 6; ++c) {
    const std::vector<float> p_logits = random_logits(gen, V, 1.5f);
    std::vector<float> q_logits = random_logits(gen, V, 1.5f);
    if (c == 4)
      for (int t = 0; t < V; ++t) q_logits[t] = p_logits[t] + 0.3f * q_logits[t];
    const std::vector<float> bonus_logits = random_logits(gen, V, 1.5f);
    const sampling_params params = plain_params(100 + static_cast<std::uint64_t>(c));
    sampler target(params), draft(draft_sampling_params(params));
    const std::vector<double> p = dense(target.probabilities(p_logits), V);
    const token_id point = static_cast<token_id>(gen() % V);
    const std::vector<double> q =
        c == 5 ? dense(token_distribution::point(point), V) : dense(draft.probabilities(q_logits), V);
    std::vector<double> seen(V, 0.0);
    int accepted = 0;
    for (int i = 0; i < trials; ++i) {
      draft_draw dd{point, token_distribution::point(point)};
      if (c != 5) dd = draw_draft(draft, q_logits, {}, {});
      const auto out = accept_distribution_drafts(
          std::span(&dd.token, 1), std::span(&dd.q, 1),
          [&](int row) { return target.probabilities(row == 0 ? p_logits : bonus_logits); }, target);
      ASSERT_TRUE(out.size() == 1 || (out.size() == 2 && out[0] == dd.token));
      seen[static_cast<std::size_t>(out[0])] += 1;
      accepted += out.size() == 2;
    }
    EXPECT_LT(pearson(seen, p, trials), 50.0) << "case " << c;
    const double a = overlap(p, q);
    EXPECT_NEAR(static_cast<double>(accepted) / trials, a, 5 * std::sqrt(a * (1 - a) / trials)) << "case " << c;
  }
}

// The joint law of two positions, with a target and a draft whose second
// distribution depends on the first token (as a model's does): two drafts
// d0 ~ q0, d1 ~ q1(. | d0) verified against p0 and p1(. | d0); when only one
// token is emitted, the second comes from the next plain step,
// sample(p1(. | t0)). The pair (t0, t1) must follow p0(t0) p1(t1 | t0): 36
// cells, 300,000 trials, chi-square at 35 degrees of freedom: fail above 85
// (false alarm 4.8e-6).
TEST(accept_distribution_drafts, two_positions_follow_the_targets_joint_law) {
  constexpr int V = 6, trials = 300000;
  std::mt19937_64 gen(4242);
  const std::vector<float> p0 = random_logits(gen, V, 1.0f), q0 = random_logits(gen, V, 1.0f);
  std::vector<std::vector<float>> p1, q1;
  for (int t = 0; t < V; ++t) {
    p1.push_back(random_logits(gen, V, 1.0f));
    q1.push_back(random_logits(gen, V, 1.0f));
  }
  const std::vector<float> bonus = random_logits(gen, V, 1.0f);
  const sampling_params params = plain_params(77);
  sampler target(params), draft(draft_sampling_params(params));
  std::vector<double> joint(V * V, 0.0);
  const std::vector<double> first = dense(target.probabilities(p0), V);
  for (int a = 0; a < V; ++a) {
    const std::vector<double> second = dense(target.probabilities(p1[static_cast<std::size_t>(a)]), V);
    for (int b = 0; b < V; ++b) joint[static_cast<std::size_t>(a * V + b)] = first[a] * second[b];
  }
  std::vector<double> seen(V * V, 0.0);
  int both_accepted = 0;
  for (int i = 0; i < trials; ++i) {
    std::vector<token_id> drafts;
    std::vector<token_distribution> qs;
    for (int j = 0; j < 2; ++j) {
      draft_draw dd = draw_draft(draft, j == 0 ? q0 : q1[static_cast<std::size_t>(drafts[0])], {}, {});
      drafts.push_back(dd.token);
      qs.push_back(std::move(dd.q));
    }
    int rows = 0;
    const auto out = accept_distribution_drafts(drafts, qs, [&](int row) {
      EXPECT_EQ(row, rows++);  // each row once, in order
      return target.probabilities(row == 0 ? p0 : row == 1 ? p1[static_cast<std::size_t>(drafts[0])] : bonus);
    }, target);
    ASSERT_EQ(static_cast<int>(out.size()), rows);  // only the rows reached were computed
    const token_id t0 = out[0];
    const token_id t1 = out.size() >= 2 ? out[1] : target.sample(p1[static_cast<std::size_t>(t0)]);
    seen[static_cast<std::size_t>(t0 * V + t1)] += 1;
    both_accepted += out.size() == 3;
  }
  EXPECT_LT(pearson(seen, joint, trials), 85.0);
  EXPECT_GT(both_accepted, trials / 20);  // the second position was verified, not only drawn plainly
}

// A model's logits after `prefix`: a fixed function of the prefix.
std::vector<float> model_logits(std::span<const token_id> prefix, std::uint64_t salt, int n_vocab) {
  std::uint64_t h = salt;
  for (token_id t : prefix) h = h * 1000003u ^ static_cast<std::uint64_t>(t);
  std::mt19937_64 gen(h);
  return random_logits(gen, n_vocab, 1.0f);
}

// Greedy target and draft: the emitted tokens are exactly the target's argmax
// chain, as long as the drafts agree with it plus one, and the verification
// draws no random number (the target's stream is where it started).
TEST(accept_distribution_drafts, greedy_emits_exactly_the_targets_argmax_chain) {
  constexpr int V = 8;
  std::mt19937_64 gen(99);
  int partial = 0, full = 0;
  for (int c = 0; c < 300; ++c) {
    const int k = 1 + static_cast<int>(gen() % 6);
    std::vector<token_id> prefix{static_cast<token_id>(gen() % V), static_cast<token_id>(gen() % V)};
    auto target_logits = [](std::span<const token_id> s) { return model_logits(s, 1, V); };
    auto draft_logits = [&](std::span<const token_id> s) {
      std::vector<float> l = target_logits(s);
      const std::vector<float> noise = model_logits(s, 2, V);
      for (int t = 0; t < V; ++t) l[t] += 0.6f * noise[t];
      return l;
    };
    // Plain greedy decoding: k + 1 tokens.
    std::vector<token_id> chain = prefix;
    for (int j = 0; j <= k; ++j) chain.push_back(argmax(target_logits(chain)));
    // The drafts, each after the drafts before it.
    sampling_params params = sampling_params::greedy();
    params.seed = static_cast<std::uint64_t>(c);
    sampler target(params), draft(draft_sampling_params(params));
    std::vector<token_id> seq = prefix, drafts;
    std::vector<token_distribution> qs;
    for (int j = 0; j < k; ++j) {
      draft_draw dd = draw_draft(draft, draft_logits(seq), {}, {});
      ASSERT_EQ(dd.q.tokens.size(), 1u);
      seq.push_back(dd.token);
      drafts.push_back(dd.token);
      qs.push_back(std::move(dd.q));
    }
    int rows = 0;
    const auto out = accept_distribution_drafts(drafts, qs, [&](int row) {
      ++rows;
      std::vector<token_id> s = prefix;
      s.insert(s.end(), drafts.begin(), drafts.begin() + row);
      return target.probabilities(target_logits(s));
    }, target);
    std::size_t agree = 0;
    while (agree < drafts.size() && drafts[agree] == chain[prefix.size() + agree]) ++agree;
    ASSERT_EQ(out.size(), agree + 1) << "case " << c;
    EXPECT_EQ(rows, static_cast<int>(out.size()));
    for (std::size_t j = 0; j < out.size(); ++j) EXPECT_EQ(out[j], chain[prefix.size() + j]) << "case " << c;
    EXPECT_EQ(target.uniform(), sampler(params).uniform()) << "greedy verification drew a random number";
    partial += agree > 0 && agree < drafts.size();
    full += agree == drafts.size();
  }
  // Both outcomes occurred, so the chain was checked past accepted drafts.
  EXPECT_GT(partial, 10);
  EXPECT_GT(full, 10);
}

// A draft whose q has mass where p has none: p keeps its top 4 of 10 tokens,
// q none cut. A draft outside p's support is always rejected; the first
// token follows p (zero outside its support; chi-square at 3 degrees of
// freedom over 200,000 trials: fail above 28, false alarm 3.6e-6); the
// acceptance rate is sum min(p, q) within 5 standard errors.
TEST(accept_distribution_drafts, draft_mass_where_the_target_has_none_is_rejected) {
  constexpr int V = 10, trials = 200000;
  std::mt19937_64 gen(555);
  const std::vector<float> p_logits = random_logits(gen, V, 1.0f), q_logits = random_logits(gen, V, 1.0f);
  sampler target({1.0f, 4, 1.0f, 0.0f, 3}), draft(plain_params(4));
  const token_distribution pd = target.probabilities(p_logits);
  ASSERT_EQ(pd.tokens.size(), 4u);
  const std::vector<double> p = dense(pd, V), q = dense(draft.probabilities(q_logits), V);
  std::vector<double> seen(V, 0.0);
  int accepted = 0, outside = 0;
  for (int i = 0; i < trials; ++i) {
    const draft_draw dd = draw_draft(draft, q_logits, {}, {});
    const auto out = accept_distribution_drafts(std::span(&dd.token, 1), std::span(&dd.q, 1),
                                                [&](int) { return target.probabilities(p_logits); }, target);
    if (pd.of(dd.token) == 0.0f) {
      ++outside;
      ASSERT_EQ(out.size(), 1u) << "a draft the target cannot emit was accepted";
    }
    seen[static_cast<std::size_t>(out[0])] += 1;
    accepted += out.size() == 2;
  }
  EXPECT_GT(outside, trials / 10);
  EXPECT_LT(pearson(seen, p, trials), 28.0);
  const double a = overlap(p, q);
  EXPECT_NEAR(static_cast<double>(accepted) / trials, a, 5 * std::sqrt(a * (1 - a) / trials));
}

// p == q at every position: every draft is accepted (the ratio is 1), and
// each step emits all k drafts plus the bonus token.
TEST(accept_distribution_drafts, a_draft_equal_to_the_target_is_always_accepted) {
  constexpr int V = 12, k = 4;
  std::mt19937_64 gen(31);
  std::vector<std::vector<float>> rows;
  for (int j = 0; j <= k; ++j) rows.push_back(random_logits(gen, V, 1.0f));
  const sampling_params params{0.9f, 8, 0.95f, 0.02f, 11};
  sampler target(params), draft(draft_sampling_params(params));
  for (int i = 0; i < 2000; ++i) {
    std::vector<token_id> drafts;
    std::vector<token_distribution> qs;
    for (int j = 0; j < k; ++j) {
      draft_draw dd = draw_draft(draft, rows[static_cast<std::size_t>(j)], {}, {});
      drafts.push_back(dd.token);
      qs.push_back(std::move(dd.q));
    }
    const auto out = accept_distribution_drafts(
        drafts, qs, [&](int row) { return target.probabilities(rows[static_cast<std::size_t>(row)]); }, target);
    ASSERT_EQ(out.size(), static_cast<std::size_t>(k + 1));
    EXPECT_TRUE(std::equal(drafts.begin(), drafts.end(), out.begin()));
    EXPECT_GT(target.probabilities(rows[k]).of(out[k]), 0.0f);
  }
}

TEST(draft_sampling_params, keeps_the_shape_with_a_seed_of_its_own) {
  sampling_params t{0.7f, 20, 0.9f, 0.05f, 42};
  t.repetition_penalty = 1.1f;
  const sampling_params d = draft_sampling_params(t);
  EXPECT_NE(d.seed, t.seed);
  EXPECT_NE(draft_sampling_params({0.7f, 20, 0.9f, 0.05f, 43}).seed, d.seed);
  EXPECT_EQ(d.temperature, t.temperature);
  EXPECT_EQ(d.top_k, t.top_k);
  EXPECT_EQ(d.top_p, t.top_p);
  EXPECT_EQ(d.min_p, t.min_p);
  EXPECT_EQ(d.repetition_penalty, t.repetition_penalty);
}

}  // namespace
}  // namespace pagoda
