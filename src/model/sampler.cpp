#include "model/sampler.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>

#include "core/assert.h"
#include "grammar/gbnf.h"

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
  if (!grammar.empty()) PAGODA_RETURN_IF_ERROR(grammar::parse_gbnf(grammar).take_status());
  return {};
}

namespace {

constexpr float k_float_max = std::numeric_limits<float>::max();
constexpr float k_inf = std::numeric_limits<float>::infinity();

// Keeps an adjusted or tempered logit finite (a tiny repetition_penalty
// divides a logit past FLT_MAX, a tiny temperature multiplies one past it), so
// the softmax below never sees inf - inf; a NaN becomes the lowest logit.
// Written as a max then a min so that loops over it vectorise (maxps, minps).
float finite(float x) {
  const float y = -k_float_max < x ? x : -k_float_max;
  return y < k_float_max ? y : k_float_max;
}

// c ? a : b by a bit mask. A plain select on a computed float lets the
// compiler move that computation into a branch (it may raise a floating-point
// flag, which -ftrapping-math keeps exact), and a branch stops vectorisation.
float select(bool c, float a, float b) {
  const std::uint32_t m = c ? ~0u : 0u;
  return std::bit_cast<float>((std::bit_cast<std::uint32_t>(a) & m) | (std::bit_cast<std::uint32_t>(b) & ~m));
}

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

// Floats as signed integers in the same order (NaN aside): the negative
// ones have their magnitude bits flipped. Integer maxima vectorise where float
// ones do not (without -ffast-math), and the map is its own inverse.
std::int32_t order_key(std::int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }

// The largest of x[0, n), NaNs skipped (-inf when there is nothing else;
// +0 over -0).
float max_of(const float* x, std::size_t n) {
  const std::int32_t lowest = order_key(std::bit_cast<std::int32_t>(-k_inf));
  std::int32_t m = lowest;
  for (std::size_t i = 0; i < n; ++i) {
    const std::int32_t b = std::bit_cast<std::int32_t>(x[i]);
    const std::int32_t number = -static_cast<std::int32_t>((b & 0x7fffffff) <= 0x7f800000);  // ~0 unless NaN
    const std::int32_t key = (order_key(b) & number) | (lowest & ~number);
    m = key > m ? key : m;
  }
  return std::bit_cast<float>(order_key(m));
}

// sum x[0, n) in double, in eight lanes (a fixed order: the same sum on every
// machine, and a loop that vectorises).
double sum_of(const float* x, std::size_t n) {
  double lanes[8] = {};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (std::size_t j = 0; j < 8; ++j) lanes[j] += x[i + j];
  for (; i < n; ++i) lanes[0] += x[i];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// The order top-k and top-p cut: higher logit first, lowest id on ties.
template <class C>
bool better(const C& a, const C& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

// The min(k, n) tokens with the highest key(logit), best first (`better`),
// into out, in one pass and without copying the vocabulary: a heap holds the
// k best so far, its front the worst of them. Ids come in increasing order, so
// a token ties the front only to lose; and a span of ids whose largest logit
// does not beat the front is skipped whole. REQUIRES: key is non-decreasing
// and maps NaN to its lowest value (what it gives -inf).
template <class C, class Key>
void select_top(std::span<const float> logits, std::size_t k, Key key, std::vector<C>& out) {
  constexpr std::size_t k_span = 64;
  out.clear();
  if (k == 0) return;
  const auto heap_order = [](const C& a, const C& b) { return better(a, b); };
  for (std::size_t begin = 0; begin < logits.size(); begin += k_span) {
    const std::size_t end = std::min(begin + k_span, logits.size());
    if (out.size() == k && !(key(max_of(logits.data() + begin, end - begin)) > out.front().logit)) continue;
    for (std::size_t i = begin; i < end; ++i) {
      const float x = key(logits[i]);
      if (out.size() < k) {
        out.push_back({x, 0.0f, static_cast<token_id>(i)});
        std::push_heap(out.begin(), out.end(), heap_order);
      } else if (x > out.front().logit) {
        std::pop_heap(out.begin(), out.end(), heap_order);
        out.back() = {x, 0.0f, static_cast<token_id>(i)};
        std::push_heap(out.begin(), out.end(), heap_order);
      }
    }
  }
  std::sort_heap(out.begin(), out.end(), heap_order);
}

// The eight bytes at p as one word.
std::uint64_t eight_bytes(const std::uint8_t* p) {
  std::uint64_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// Whether one of the eight bytes of x is `b` (the classic "has a zero byte"
// test on x ^ b in every byte).
bool has_byte(std::uint64_t x, std::uint8_t b) {
  constexpr std::uint64_t k_ones = 0x0101010101010101u;
  const std::uint64_t y = x ^ (k_ones * b);
  return ((y - k_ones) & ~y & (k_ones << 7)) != 0;
}

// The index past the last of w[begin, end) that is positive. REQUIRES: one is.
template <class Weight>
std::size_t past_last_positive(std::size_t begin, std::size_t end, Weight w) {
  while (end > begin && !(w(end - 1) > 0.0f)) --end;
  PAGODA_ASSERT(end > begin, "sampler: no token with a positive weight to fall back on");
  return end;
}

}  // namespace

float sampling_weight(float x) {
  // x = k ln2 + r with |r| <= ln2/2; exp(r) by its Taylor polynomial of
  // degree 7 (truncation below 1e-8 relative), times 2^k built in the
  // exponent bits. No branch, no table: loops over it vectorise.
  constexpr float k_log2e = 1.44269504088896341f;
  constexpr float k_ln2_hi = 0.693145751953125f;  // 16 significant bits: k * k_ln2_hi is exact
  constexpr float k_ln2_lo = 1.428606765330187e-06f;
  constexpr float k_round = 12582912.0f;  // 1.5 * 2^23: adding it and taking it away rounds to an integer
  constexpr float k_lowest = -87.0f;      // exp(-87) = 1.6e-38, still a normal float
  const bool in_range = x >= k_lowest;    // false for NaN as well
  const float xc = select(in_range, x, k_lowest);
  const float k = (xc * k_log2e + k_round) - k_round;  // an integer in [-126, 0]
  const float r = (xc - k * k_ln2_hi) - k * k_ln2_lo;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float e = p * std::bit_cast<float>((static_cast<std::int32_t>(k) + 127) << 23);
  return select(in_range, e, 0.0f);
}

token_id argmax(std::span<const float> logits) {
  // The first index of the largest logit, NaNs never chosen, except a NaN at
  // index 0, which nothing beats (what a plain loop of `>` gives).
  if (logits.empty() || std::isnan(logits[0])) return 0;
  const float best = max_of(logits.data(), logits.size());
  constexpr std::size_t k_span = 64;
  for (std::size_t begin = 0; begin < logits.size(); begin += k_span) {
    const std::size_t end = std::min(begin + k_span, logits.size());
    int found = 0;
    for (std::size_t i = begin; i < end; ++i) found |= logits[i] == best;
    if (!found) continue;
    for (std::size_t i = begin; i < end; ++i)
      if (logits[i] == best) return static_cast<token_id>(i);
  }
  return 0;
}

sampler::sampler(const sampling_params& params) : params_(params), rng_(params.seed) {
  // validate() keeps min_p in [0, 1]; above 1 it would cut the best token
  // too, and a draw must always have one.
  params_.min_p = params.min_p > 0.0f ? std::min(params.min_p, 1.0f) : 0.0f;
}

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
  return weigh(logits) == weighed::dense ? pick_dense() : pick_sparse();
}

sampler::weighed sampler::weigh(std::span<const float> logits) {
  const std::size_t n = logits.size();
  const float inv_t = 1.0f / params_.temperature;
  if (params_.top_k > 0 && static_cast<std::size_t>(params_.top_k) < n) {
    // Top-k: the k best in one pass, then top-p and min-p over them alone.
    select_top(logits, static_cast<std::size_t>(params_.top_k), [inv_t](float l) { return finite(l * inv_t); },
               candidates_);
    const float top = candidates_[0].logit;
    double total = 0;
    for (candidate& c : candidates_) {
      c.weight = sampling_weight(c.logit - top);
      total += c.weight;
    }
    n_kept_ = candidates_.size();
    if (params_.top_p < 1.0f) {
      const double target = static_cast<double>(params_.top_p) * total;
      double cum = 0;
      for (std::size_t i = 0; i < n_kept_; ++i) {
        cum += candidates_[i].weight;
        if (cum >= target) {
          n_kept_ = i + 1;
          break;
        }
      }
    }
    if (params_.min_p > 0.0f) {
      // Relative to the best token's weight, which is sampling_weight(0) = 1.
      const auto kept_end = candidates_.begin() + static_cast<std::ptrdiff_t>(n_kept_);
      n_kept_ = static_cast<std::size_t>(
          std::remove_if(candidates_.begin(), kept_end,
                         [threshold = params_.min_p](const candidate& c) { return c.weight < threshold; }) -
          candidates_.begin());
    }
    return weighed::sparse;
  }
  // The tempered maximum: tempering is non-decreasing, so it is the tempered
  // largest logit (and the best token's weight is exactly 1).
  const float top = finite(max_of(logits.data(), n) * inv_t);
  if (params_.top_p < 1.0f) {
    weigh_all(logits, inv_t, top, 0.0f);
    cut_top_p(logits, inv_t, top);
  } else {
    // Nothing truncates but min-p, which is a threshold on each weight alone.
    weigh_all(logits, inv_t, top, params_.min_p);
  }
  return weighed::dense;
}

void sampler::weigh_all(std::span<const float> logits, float inv_t, float top, float min_weight) {
  const std::size_t n = logits.size();
  weights_.resize(n);
  // Plain pointers: with -fno-strict-aliasing a store through weights_[i]
  // could change weights_ itself, which would stop the vectorisation.
  const float* l = logits.data();
  float* w = weights_.data();
  for (std::size_t i = 0; i < n; ++i) {
    const float v = sampling_weight(finite(l[i] * inv_t) - top);
    w[i] = v >= min_weight ? v : 0.0f;
  }
  sum_blocks();
}

void sampler::sum_blocks() {
  block_sums_.resize((weights_.size() + k_block - 1) / k_block);
  total_ = 0;
  for (std::size_t b = 0; b < block_sums_.size(); ++b) {
    const std::size_t begin = b * k_block;
    block_sums_[b] = sum_of(weights_.data() + begin, std::min(k_block, weights_.size() - begin));
    total_ += block_sums_[b];
  }
}

void sampler::cut_top_p(std::span<const float> logits, float inv_t, float top) {
  const std::size_t n = logits.size();
  const double target = static_cast<double>(params_.top_p) * total_;
  // Tokens lighter than tau_p weigh less than (1 - top_p) of the total
  // together, so the top-p set lies among the heavier ones; tokens lighter
  // than min_p (the best token weighs 1) are cut anyway. Candidates are the
  // tokens above the larger of the two, found by their distance d to the top
  // logit rather than by weight: d >= d_min holds for every token of weight
  // >= tau (sampling_weight's error and d_min's rounding are far below the
  // 1e-4 of slack), and a threshold on the logit keeps them a head of the
  // order `better` sorts by.
  const double tau_p = (1.0 - static_cast<double>(params_.top_p)) * total_ / static_cast<double>(n);
  const float min_weight = params_.min_p;
  const float d_min = static_cast<float>(std::log(std::max(tau_p, static_cast<double>(min_weight))) - 1e-4);
  // Bucket 0 holds the tokens below d_min; buckets 1 to 255 split [d_min, 0]
  // in equal widths of d, the best last (llama.cpp's bucketed top-p, with the
  // range set by tau). A bucket never decreases with d, so each holds a run
  // of the order `better` sorts by.
  const float scale = static_cast<float>(k_buckets - 1) / -d_min;
  buckets_.resize(n);
  const float* l = logits.data();
  float* w = weights_.data();
  std::uint8_t* bucket = buckets_.data();
  for (std::size_t i = 0; i < n; ++i) {
    const float d = finite(l[i] * inv_t) - top;
    const bool candidate = d >= d_min;
    const int b = std::min(k_buckets - 1, 1 + static_cast<int>((select(candidate, d, d_min) - d_min) * scale));
    bucket[i] = static_cast<std::uint8_t>(b & -static_cast<int>(candidate));  // a mask, as in select
  }
  // Each bucket's weight, in four interleaved partial sums (consecutive
  // tokens of one bucket would otherwise wait on each other's additions).
  // Eight tokens at a time below the candidates (bucket 0, most of a peaked
  // vocabulary) are skipped at once; otherwise no branch (bucket 0's sum is
  // never read).
  std::array<std::array<double, k_buckets>, 4> parts{};
  std::size_t at = 0;
  for (; at + 8 <= n; at += 8)
    if (eight_bytes(bucket + at) != 0)
      for (std::size_t i = at; i < at + 8; ++i) parts[i & 3][bucket[i]] += w[i];
  for (; at < n; ++at) parts[at & 3][bucket[at]] += w[at];
  const auto mass = [&parts](int b) {
    const auto i = static_cast<std::size_t>(b);
    return (parts[0][i] + parts[1][i]) + (parts[2][i] + parts[3][i]);
  };
  // The buckets above the edge are kept whole; the edge bucket, sorted, is
  // walked to the cut, and the tokens past it weigh nothing from then on.
  // When no bucket reaches top_p, every candidate is kept: if min_p set the
  // threshold, the tokens left out are all lighter than min_p, which cuts
  // them; otherwise only rounding gets here (the candidates weigh more than
  // top_p of the total), and the tokens kept beyond the exact cut weigh less
  // than the rounding error, as when a walk of the edge bucket falls short.
  double cum = 0;
  int edge = k_buckets - 1;
  while (edge > 0 && cum + mass(edge) < target) cum += mass(edge--);
  if (edge > 0) {
    candidates_.clear();
    const auto take = [&](std::size_t i) {
      if (bucket[i] == edge) candidates_.push_back({finite(l[i] * inv_t), w[i], static_cast<token_id>(i)});
    };
    for (at = 0; at + 8 <= n; at += 8)
      if (has_byte(eight_bytes(bucket + at), static_cast<std::uint8_t>(edge)))
        for (std::size_t i = at; i < at + 8; ++i) take(i);
    for (; at < n; ++at) take(at);
    std::sort(candidates_.begin(), candidates_.end(), [](const candidate& a, const candidate& b) { return better(a, b); });
    std::size_t cut = 0;
    while (cut < candidates_.size() && cum < target) cum += candidates_[cut++].weight;
    for (std::size_t i = cut; i < candidates_.size(); ++i) w[candidates_[i].id] = 0.0f;
  } else {
    edge = 1;
  }
  // Min-p as well: the best token weighs 1.
  const auto lowest = static_cast<std::uint8_t>(edge);
  for (std::size_t i = 0; i < n; ++i) w[i] = bucket[i] >= lowest && w[i] >= min_weight ? w[i] : 0.0f;
  sum_blocks();
}

token_id sampler::pick_dense() {
  std::uniform_real_distribution<double> uniform(0.0, total_);
  double u = uniform(rng_);
  // The block where the cumulative sum passes u, then the token within it. A
  // token of weight 0 is never returned: u only goes below 0 past a weight
  // larger than it.
  for (std::size_t b = 0; b < block_sums_.size(); ++b) {
    if (u >= block_sums_[b]) {
      u -= block_sums_[b];
      continue;
    }
    const std::size_t begin = b * k_block;
    const std::size_t end = std::min(begin + k_block, weights_.size());
    for (std::size_t i = begin; i < end; ++i) {
      u -= weights_[i];
      if (u < 0) return static_cast<token_id>(i);
    }
    // The block's sum (added in lanes) and this walk round differently.
    return static_cast<token_id>(past_last_positive(begin, end, [&](std::size_t i) { return weights_[i]; }) - 1);
  }
  return static_cast<token_id>(past_last_positive(0, weights_.size(), [&](std::size_t i) { return weights_[i]; }) - 1);
}

token_id sampler::pick_sparse() {
  double total = 0;
  for (std::size_t i = 0; i < n_kept_; ++i) total += candidates_[i].weight;
  std::uniform_real_distribution<double> uniform(0.0, total);
  double u = uniform(rng_);
  for (std::size_t i = 0; i < n_kept_; ++i) {
    u -= candidates_[i].weight;
    if (u < 0) return candidates_[i].id;
  }
  return candidates_[past_last_positive(0, n_kept_, [&](std::size_t i) { return candidates_[i].weight; }) - 1].id;
}

std::vector<std::pair<token_id, float>> sampler::distribution(std::span<const float> logits) {
  if (params_.is_greedy() || logits.size() <= 1) return {{argmax(logits), 1.0f}};
  std::vector<std::pair<token_id, float>> out;
  if (weigh(logits) == weighed::dense) {
    for (std::size_t i = 0; i < weights_.size(); ++i)
      if (weights_[i] > 0.0f) out.emplace_back(static_cast<token_id>(i), weights_[i]);
    return out;
  }
  for (std::size_t i = 0; i < n_kept_; ++i)
    if (candidates_[i].weight > 0.0f) out.emplace_back(candidates_[i].id, candidates_[i].weight);
  std::sort(out.begin(), out.end());
  return out;
}

token_distribution sampler::probabilities(std::span<const float> logits, std::span<const token_id> prompt,
                                          std::span<const token_id> output) {
  token_distribution d{distribution(adjust(logits, prompt, output))};
  double total = 0;
  for (const auto& [t, w] : d.tokens) total += w;
  for (auto& [t, w] : d.tokens) w = static_cast<float>(w / total);
  return d;
}

token_id sampler::draw_from(const token_distribution& d) {
  PAGODA_ASSERT(!d.tokens.empty(), "sampler: drawing from an empty distribution");
  if (d.tokens.size() == 1) return d.tokens[0].first;
  double total = 0;
  for (const auto& [t, p] : d.tokens) total += p;
  std::uniform_real_distribution<double> uniform(0.0, total);
  double u = uniform(rng_);
  for (const auto& [t, p] : d.tokens) {
    u -= p;
    if (u < 0) return t;
  }
  return d.tokens[past_last_positive(0, d.tokens.size(), [&](std::size_t i) { return d.tokens[i].second; }) - 1].first;
}

double sampler::uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }

float token_distribution::of(token_id t) const {
  const auto it = std::lower_bound(tokens.begin(), tokens.end(), t,
                                   [](const std::pair<token_id, float>& e, token_id id) { return e.first < id; });
  return it != tokens.end() && it->first == t ? it->second : 0.0f;
}

float sampler::log_prob(std::span<const float> logits, token_id token) {
  return log_softmax_at(logits, log_z(logits), token);
}

std::vector<std::pair<token_id, float>> sampler::top_log_probs(std::span<const float> logits, int k) {
  const double lz = log_z(logits);
  std::vector<candidate> best;
  // NaN (a broken row) orders below -inf rather than breaking the heap's order.
  select_top(logits, std::min<std::size_t>(std::max(k, 0), logits.size()),
             [](float l) { return l == l ? l : -k_inf; }, best);
  std::vector<std::pair<token_id, float>> out;
  out.reserve(best.size());
  for (const candidate& c : best) out.emplace_back(c.id, log_softmax_at(logits, lz, c.id));
  return out;
}

}  // namespace pagoda
