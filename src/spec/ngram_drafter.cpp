// The n-gram drafter (prompt lookup): the sequence's last n tokens are looked
// for earlier in its prompt and output; the tokens that followed the most
// recent earlier occurrence are proposed. Longer suffixes first (n down to
// min_n): a longer match predicts better.
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
    for (int n = std::min<std::ptrdiff_t>(n_, size - 1); n >= min_n_; --n) {
      const auto suffix = tokens.subspan(static_cast<std::size_t>(size - n));
      // Occurrences starting at i < size - n, newest first (i + n <= size - 1:
      // at least the one token after it exists).
      for (std::ptrdiff_t i = size - n - 1; i >= 0; --i) {
        if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + i)) continue;
        const std::ptrdiff_t from = i + n;
        const std::ptrdiff_t to = std::min<std::ptrdiff_t>(from + k, size);
        return std::vector<token_id>(tokens.begin() + from, tokens.begin() + to);
      }
    }
    return {};
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
