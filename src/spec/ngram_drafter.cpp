// The n-gram drafter (prompt lookup): the earlier occurrences of the
// sequence's last token are ranked by how many tokens before it also match
// (up to n); the tokens that followed the longest match (the newest among
// equally long ones) are proposed, so a longer match predicts better.
//
// How much to propose follows how often drafts were right (greedy
// stories260K continuations of dev-text openings, bench/RESULTS.md): after a
// match of length L the first draft was right 18% of the time for L = 1, 49%
// for L = 2, 61% for L = 3, 88% for L >= 6, and each further draft less often.
// A draft costs a verification row whether it is accepted or not, so:
//   - no proposal below min_n matched tokens (a one-token match mostly misses);
//   - at most L tokens after a match of length L (a short match predicts a
//     short run);
//   - when equally long matches were followed by different tokens, the
//     proposal stops where they part (at least one token: the newest's).
// A pure function of the tokens, as the drafter interface asks.
#include <algorithm>

#include "spec/speculative.h"

namespace pagoda {
namespace {

class ngram_drafter final : public drafter {
 public:
  ngram_drafter(int n, int min_n) : n_(n), min_n_(min_n) {}
  const char* name() const override { return "ngram"; }

  std::vector<token_id> propose(std::span<const token_id> tokens, int /*n_prompt*/, int k) const override {
    const auto size = static_cast<std::ptrdiff_t>(tokens.size());
    if (size < 2 || k < 1) return {};
    // Starts of the continuations after the longest matches, newest first.
    int best = 0;
    std::vector<std::ptrdiff_t> starts;
    for (std::ptrdiff_t j = size - 2; j >= 0; --j) {
      int len = 0;
      while (len < n_ && j - len >= 0 && tokens[static_cast<std::size_t>(j - len)] == tokens[static_cast<std::size_t>(size - 1 - len)])
        ++len;
      if (len == 0 || len < best) continue;
      if (len > best) starts.clear();
      best = len;
      starts.push_back(j + 1);
    }
    if (best < min_n_) return {};
    const std::ptrdiff_t from = starts.front();
    std::ptrdiff_t n_draft = std::min<std::ptrdiff_t>({k, best, size - from});
    // An older start has at least as many tokens after it as the newest.
    for (std::size_t c = 1; c < starts.size(); ++c) {
      std::ptrdiff_t same = 0;
      while (same < n_draft && tokens[static_cast<std::size_t>(starts[c] + same)] == tokens[static_cast<std::size_t>(from + same)])
        ++same;
      if (same < n_draft) n_draft = std::max<std::ptrdiff_t>(same, 1);
    }
    return std::vector<token_id>(tokens.begin() + from, tokens.begin() + from + n_draft);
  }

 private:
  int n_, min_n_;
};

}  // namespace

std::unique_ptr<drafter> make_drafter(const spec_config& config) {
  if (config.drafter == "ngram") return std::make_unique<ngram_drafter>(config.n, config.min_n);
  return nullptr;
}

}  // namespace pagoda
