// The spec parser, the n-gram drafter, the adaptive k and the acceptance rule
// (spec/speculative.h), with a statistical test that verification keeps the
// target's distribution.
#include "spec/speculative.h"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "model/sampler.h"

namespace pagoda {
namespace {

TEST(spec_config, parses_the_kv_policy_syntax) {
  auto c = parse_spec_config("ngram:k=5,n=3");
  ASSERT_TRUE(c.ok()) << c.error().message();
  EXPECT_EQ(c->drafter, "ngram");
  EXPECT_EQ(c->k, 5);
  EXPECT_EQ(c->n, 3);
  EXPECT_FALSE(parse_spec_config("none")->enabled());
  EXPECT_FALSE(parse_spec_config("")->enabled());
  EXPECT_TRUE(parse_spec_config("ngram")->enabled());
}

TEST(spec_config, mirror_views_name_their_kv_type_and_combine_with_layers) {
  auto c = parse_spec_config("self:k=3,view=int4,layers=2");
  ASSERT_TRUE(c.ok()) << c.error().message();
  EXPECT_EQ(c->view, draft_view::int4);
  EXPECT_STREQ(c->mirror(), "int4");
  EXPECT_EQ(c->layers, 2);
  EXPECT_EQ(c->to_string(), "self:k=3,layers=2,view=int4");
  EXPECT_EQ(parse_spec_config(c->to_string())->to_string(), c->to_string());
  EXPECT_STREQ(parse_spec_config("self:view=int2")->mirror(), "int2");
  EXPECT_EQ(parse_spec_config("self:view=window")->mirror(), nullptr);
  EXPECT_EQ(parse_spec_config("ngram")->mirror(), nullptr);
  // A mirror view reads every slot of the mirror: window sizes do not apply.
  EXPECT_NE(parse_spec_config("self:view=int4,window=8").error().message().find("window"), std::string::npos);
}

TEST(spec_config, bad_input_names_the_parameter) {
  auto message = [](const char* text) {
    auto c = parse_spec_config(text);
    EXPECT_FALSE(c.ok()) << text;
    return c.ok() ? std::string() : c.error().message();
  };
  EXPECT_NE(message("ngram:k=0").find("k=0"), std::string::npos);
  EXPECT_NE(message("ngram:k=16").find("[1, 15]"), std::string::npos);
  EXPECT_NE(message("ngram:k=x").find("k=x"), std::string::npos);
  EXPECT_NE(message("ngram:kk=2").find("unknown parameter 'kk'"), std::string::npos);
  EXPECT_NE(message("ngram:n=2,min_n=3").find("min_n"), std::string::npos);
  EXPECT_NE(message("medusa").find("unknown drafter 'medusa'"), std::string::npos);
  EXPECT_NE(message("draft:k=2,layers=3").find("unknown parameter 'layers'"), std::string::npos);
  EXPECT_NE(message("ngram:k").find("key=value"), std::string::npos);
}

TEST(ngram_drafter, proposes_what_followed_the_longest_newest_match) {
  auto d = make_drafter(*parse_spec_config("ngram:k=5,n=3"));
  // The last three (1, 2, 3) occur at 0; only (2, 3) at 5: the longer match
  // wins though older, and proposes at most its length (3) tokens.
  const std::vector<token_id> t{1, 2, 3, 9, 4, 2, 3, 8, 6, 1, 2, 3};
  EXPECT_EQ(d->propose(t, 4, 5), (std::vector<token_id>{9, 4, 2}));
  EXPECT_EQ(d->propose(t, 4, 1), (std::vector<token_id>{9}));
  // Equally long matches: the newest, when both were followed alike.
  const std::vector<token_id> u{1, 2, 7, 8, 9, 1, 2, 7, 8, 5, 1, 2};
  EXPECT_EQ(d->propose(u, 4, 5), (std::vector<token_id>{7, 8}));
  // Nothing repeats: no guess. The proposal stops at the end of the sequence.
  EXPECT_TRUE(d->propose(std::vector<token_id>{1, 2, 3, 4}, 2, 3).empty());
  EXPECT_EQ(d->propose(std::vector<token_id>{3, 3, 3}, 1, 5), (std::vector<token_id>{3}));
}

TEST(ngram_drafter, a_match_shorter_than_min_n_proposes_nothing) {
  // Only the last token (6) occurred before: a one-token match, under min_n = 2 (the default).
  const std::vector<token_id> t{5, 6, 7, 5, 8, 6};
  EXPECT_TRUE(make_drafter(*parse_spec_config("ngram:k=3,n=3"))->propose(t, 3, 3).empty());
  EXPECT_EQ(make_drafter(*parse_spec_config("ngram:k=3,n=3,min_n=1"))->propose(t, 3, 3), (std::vector<token_id>{7}));
  // n = 1 lowers the default min_n with it.
  EXPECT_EQ(make_drafter(*parse_spec_config("ngram:k=3,n=1"))->propose(t, 3, 3), (std::vector<token_id>{7}));
}

TEST(ngram_drafter, stops_where_equally_long_matches_were_followed_differently) {
  auto d = make_drafter(*parse_spec_config("ngram:k=5,n=2"));
  // (1, 2) was followed by 7, 8 (newest) and by 7, 9: the runs agree on 7 only.
  const std::vector<token_id> t{1, 2, 7, 9, 4, 1, 2, 7, 8, 5, 1, 2};
  EXPECT_EQ(d->propose(t, 4, 5), (std::vector<token_id>{7}));
  // Followed by 3 and by 7: they part at once, the newest's first token stays.
  const std::vector<token_id> u{1, 2, 3, 4, 9, 1, 2, 7, 8, 5, 1, 2};
  EXPECT_EQ(d->propose(u, 4, 5), (std::vector<token_id>{7}));
  // Shorter matches do not count: (2) alone was followed by 4.
  const std::vector<token_id> w{2, 4, 1, 2, 7, 8, 3, 1, 2};
  EXPECT_EQ(d->propose(w, 2, 5), (std::vector<token_id>{7, 8}));
}

TEST(adaptive_k, follows_acceptance_within_its_bounds) {
  adaptive_k k(6);
  EXPECT_EQ(k.next(), 6);
  for (int i = 0; i < 10; ++i) k.observe(k.next(), 0);
  EXPECT_EQ(k.next(), 1);  // never below 1
  for (int i = 0; i < 10; ++i) k.observe(k.next(), k.next());
  EXPECT_GE(k.next(), 5);
  for (int i = 0; i < 10; ++i) k.observe(6, 6);
  EXPECT_EQ(k.next(), 6);  // capped
  k.observe(0, 0);        // no drafts: nothing learned
  EXPECT_EQ(k.next(), 6);
}

TEST(accept_point_drafts, greedy_takes_the_agreeing_prefix_and_the_targets_token) {
  const std::vector<token_id> target{4, 5, 6, 7};  // the target's token after each row
  auto draw = [&](int row) { return target[static_cast<std::size_t>(row)]; };
  EXPECT_EQ(accept_point_drafts(std::vector<token_id>{4, 5, 6}, draw), (std::vector<token_id>{4, 5, 6, 7}));
  EXPECT_EQ(accept_point_drafts(std::vector<token_id>{4, 9, 6}, draw), (std::vector<token_id>{4, 5}));
  EXPECT_EQ(accept_point_drafts(std::vector<token_id>{9}, draw), (std::vector<token_id>{4}));
  EXPECT_EQ(accept_point_drafts(std::vector<token_id>{}, draw), (std::vector<token_id>{4}));
}

// Sampled verification keeps the target's law. For 5 random target
// distributions p over a 16-token vocabulary and a draft d each, 200,000
// seeded trials of one speculative position; the first emitted token is
// tested against p with Pearson's chi-square (15 degrees of freedom): fail
// above 50, which a correct sampler exceeds with probability 1.2e-5 per
// case (about 6e-5 for the five). Seeds are fixed, so the test is
// deterministic; the bound says how unlikely a false alarm was when it was
// written. The acceptance rate must be p(d) within 5 standard errors.
TEST(accept_point_drafts, sampled_verification_keeps_the_target_distribution) {
  constexpr int V = 16, trials = 200000;
  std::mt19937_64 gen(2026);
  for (int c = 0; c < 5; ++c) {
    std::vector<float> logits(V);
    for (float& x : logits) x = std::normal_distribution<float>(0.0f, 1.5f)(gen);
    sampling_params params{1.0f, 0, 1.0f, 0.0f, 1000 + static_cast<std::uint64_t>(c)};
    sampler smp(params);
    std::vector<double> p(V, 0.0);
    double total = 0;
    for (const auto& [t, w] : smp.distribution(logits)) total += w;
    for (const auto& [t, w] : smp.distribution(logits)) p[static_cast<std::size_t>(t)] = w / total;
    const token_id d = static_cast<token_id>(gen() % V);
    std::vector<double> seen(V, 0.0);
    int accepted = 0;
    for (int i = 0; i < trials; ++i) {
      const std::vector<token_id> drafts{d};
      const auto out = accept_point_drafts(drafts, [&](int) { return smp.sample(logits); });
      seen[static_cast<std::size_t>(out[0])] += 1;
      accepted += out.size() == 2;
    }
    double chi2 = 0;
    for (int t = 0; t < V; ++t) {
      const double expect = p[static_cast<std::size_t>(t)] * trials;
      ASSERT_GT(expect, 5.0) << "cell too small for chi-square";
      chi2 += (seen[static_cast<std::size_t>(t)] - expect) * (seen[static_cast<std::size_t>(t)] - expect) / expect;
    }
    EXPECT_LT(chi2, 50.0) << "case " << c;
    const double pd = p[static_cast<std::size_t>(d)];
    EXPECT_NEAR(static_cast<double>(accepted) / trials, pd, 5 * std::sqrt(pd * (1 - pd) / trials)) << "case " << c;
  }
}

}  // namespace
}  // namespace pagoda
