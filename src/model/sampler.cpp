#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace pagoda {

status sampling_params::validate() const {
  if (!(temperature >= 0.0f) || temperature > 100.0f)
    return error(errc::invalid_argument, "temperature must be in [0, 100], got {}", temperature);
  if (!(top_p > 0.0f) || top_p > 1.0f) return error(errc::invalid_argument, "top_p must be in (0, 1], got {}", top_p);
  if (!(min_p >= 0.0f) || min_p > 1.0f) return error(errc::invalid_argument, "min_p must be in [0, 1], got {}", min_p);
  if (top_k < -1) return error(errc::invalid_argument, "top_k must be -1, 0 (disabled) or positive, got {}", top_k);
  if (!(presence_penalty >= -2.0f) || presence_penalty > 2.0f)
    return error(errc::invalid_argument, "presence_penalty must be in [-2, 2], got {}", presence_penalty);
  if (!(frequency_penalty >= -2.0f) || frequency_penalty > 2.0f)
    return error(errc::invalid_argument, "frequency_penalty must be in [-2, 2], got {}", frequency_penalty);
  if (!(repetition_penalty > 0.0f) || repetition_penalty > 2.0f)
    return error(errc::invalid_argument, "repetition_penalty must be in (0, 2], got {}", repetition_penalty);
  for (const auto& [token, bias] : logit_bias) {
    if (token < 0) return error(errc::invalid_argument, "logit_bias: token id {} is negative", token);
    if (!(bias >= -100.0f) || bias > 100.0f)
      return error(errc::invalid_argument, "logit_bias of token {} must be in [-100, 100], got {}", token, bias);
  }
  return {};
}

namespace {

// Keeps an adjusted logit finite (a tiny repetition_penalty divides a logit
// past FLT_MAX), so the softmax below never sees inf - inf.
float finite(float x) { return std::clamp(x, -std::numeric_limits<float>::max(), std::numeric_limits<float>::max()); }

// log sum exp(logits), in double.
double log_z(std::span<const float> logits) {
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - mx);
  return mx + std::log(sum);
}

float log_softmax_at(std::span<const float> logits, double lz, token_id token) {
  return static_cast<float>(static_cast<double>(logits[token]) - lz);
}

}  // namespace

token_id argmax(std::span<const float> logits) {
  token_id best = 0;
  for (std::size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = static_cast<token_id>(i);
  return best;
}

sampler::sampler(const sampling_params& params) : params_(params), rng_(params.seed) {}

std::span<const float> sampler::adjust(std::span<const float> logits, std::span<const token_id> prompt,
                                      std::span<const token_id> output) {
  if (!params_.adjusts_logits()) return logits;
  const std::size_t n = logits.size();
  adjusted_.assign(logits.begin(), logits.end());
  for (const auto& [token, bias] : params_.logit_bias)
    if (static_cast<std::size_t>(token) < n) adjusted_[token] += bias;
  const bool repetition = params_.repetition_penalty != 1.0f;
  const bool counted = params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f;
  if (!repetition && !counted) return adjusted_;
  counts_.resize(n, 0);
  seen_.resize(n, 0);
  for (token_id t : output) {
    ++counts_[t];
    seen_[t] = 1;
  }
  if (repetition)
    for (token_id t : prompt) seen_[t] = 1;
  // Each distinct token once: the first time it is met, its mark is cleared.
  auto penalise = [&](token_id t) {
    if (!seen_[t]) return;
    seen_[t] = 0;
    float& l = adjusted_[t];
    if (repetition) l = finite(l > 0.0f ? l / params_.repetition_penalty : l * params_.repetition_penalty);
    if (counts_[t] > 0) {
      l -= params_.frequency_penalty * static_cast<float>(counts_[t]) + params_.presence_penalty;
      counts_[t] = 0;
    }
  };
  for (token_id t : output) penalise(t);
  if (repetition)
    for (token_id t : prompt) penalise(t);
  return adjusted_;
}

token_id sampler::sample(std::span<const float> logits, std::span<const token_id> prompt,
                         std::span<const token_id> output) {
  return draw(adjust(logits, prompt, output));
}

token_id sampler::draw(std::span<const float> logits) {
  if (params_.is_greedy() || logits.size() <= 1) return argmax(logits);
  const float inv_t = 1.0f / params_.temperature;
  candidates_.clear();
  candidates_.reserve(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i)
    candidates_.emplace_back(finite(logits[i] * inv_t), static_cast<token_id>(i));
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };

  std::size_t n = candidates_.size();
  if (params_.top_k > 0 && static_cast<std::size_t>(params_.top_k) < n) {
    n = static_cast<std::size_t>(params_.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + n, candidates_.end(), by_logit);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_logit);
  }
  // Softmax over the kept candidates (sorted, so the first is the maximum).
  const float mx = candidates_[0].first;
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    candidates_[i].first = std::exp(candidates_[i].first - mx);
    sum += candidates_[i].first;
  }
  if (params_.top_p < 1.0f) {
    double cum = 0;
    std::size_t keep = n;
    for (std::size_t i = 0; i < n; ++i) {
      cum += candidates_[i].first / sum;
      if (cum >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
    n = keep;
  }
  if (params_.min_p > 0.0f) {
    const float threshold = candidates_[0].first * params_.min_p;  // relative to the top probability
    std::size_t keep = 1;
    while (keep < n && candidates_[keep].first >= threshold) ++keep;
    n = keep;
  }
  double total = 0;
  for (std::size_t i = 0; i < n; ++i) total += candidates_[i].first;
  std::uniform_real_distribution<double> uniform(0.0, total);
  double u = uniform(rng_);
  for (std::size_t i = 0; i < n; ++i) {
    u -= candidates_[i].first;
    if (u < 0) return candidates_[i].second;
  }
  return candidates_[n - 1].second;
}

float sampler::log_prob(std::span<const float> logits, token_id token) {
  return log_softmax_at(logits, log_z(logits), token);
}

std::vector<std::pair<token_id, float>> sampler::top_log_probs(std::span<const float> logits, int k) {
  const double lz = log_z(logits);
  std::vector<std::pair<token_id, float>> all;
  all.reserve(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) all.emplace_back(static_cast<token_id>(i), logits[i]);
  std::size_t n = std::min<std::size_t>(std::max(k, 0), all.size());
  std::partial_sort(all.begin(), all.begin() + n, all.end(), [](const auto& a, const auto& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  });
  all.resize(n);
  for (auto& [t, l] : all) l = log_softmax_at(logits, lz, t);
  return all;
}

}  // namespace pagoda
