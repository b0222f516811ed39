// The statistical tests' helpers (chi_square_util.h).
#include "spec/chi_square_util.h"

#include <gtest/gtest.h>

namespace pagoda {

sampling_params plain_params(std::uint64_t seed) { return {1.0f, 0, 1.0f, 0.0f, seed}; }

std::vector<float> random_logits(std::mt19937_64& gen, int n_vocab, float sd) {
  std::vector<float> l(static_cast<std::size_t>(n_vocab));
  for (float& x : l) x = std::normal_distribution<float>(0.0f, sd)(gen);
  return l;
}

std::vector<double> dense(const token_distribution& d, int n_vocab) {
  std::vector<double> p(static_cast<std::size_t>(n_vocab), 0.0);
  for (const auto& [t, w] : d.tokens) p[static_cast<std::size_t>(t)] = w;
  return p;
}

double pearson(const std::vector<double>& seen, const std::vector<double>& p, int n) {
  double chi2 = 0;
  for (std::size_t t = 0; t < p.size(); ++t) {
    if (p[t] == 0.0) {
      EXPECT_EQ(seen[t], 0.0) << "token " << t << " has no probability under p";
      continue;
    }
    const double expect = p[t] * n;
    EXPECT_GT(expect, 5.0) << "cell " << t << " too small for chi-square";
    chi2 += (seen[t] - expect) * (seen[t] - expect) / expect;
  }
  return chi2;
}

}  // namespace pagoda
