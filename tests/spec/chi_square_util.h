// Helpers of the statistical tests of tests/spec: random logits rows, a
// distribution as a dense vector, and Pearson's chi-square statistic.
//
// Each statistical test states its degrees of freedom and a bound a correct
// implementation exceeds with the false-alarm probability it gives (from the
// chi-square distribution). Seeds are fixed, so every test is deterministic;
// the probability says how unlikely a false alarm was when it was written.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "model/sampler.h"
#include "pagoda/request.h"

namespace pagoda {

// Temperature 1 and no cut: every token of a row is in the support.
sampling_params plain_params(std::uint64_t seed);

// n_vocab logits drawn from N(0, sd).
std::vector<float> random_logits(std::mt19937_64& gen, int n_vocab, float sd);

// A distribution as a dense vector of n_vocab probabilities.
std::vector<double> dense(const token_distribution& d, int n_vocab);

// Pearson's statistic of `seen` (counts over n trials) against p. A cell p
// gives 0 must stay empty (it adds no degree of freedom); every other cell
// must expect more than 5, as the chi-square approximation needs (both
// checked with gtest's EXPECT).
double pearson(const std::vector<double>& seen, const std::vector<double>& p, int n);

}  // namespace pagoda
