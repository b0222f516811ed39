#include "grammar/token_mask.h"

#include <gtest/gtest.h>

#include <random>

#include "grammar/convert.h"
#include "grammar/grammars.h"

namespace pagoda::grammar {
namespace {

std::shared_ptr<compiled_grammar> compile(const std::string& text, std::shared_ptr<const vocabulary> v) {
  auto g = parse_gbnf(text);
  EXPECT_TRUE(g.ok()) << g.error().message();
  return std::make_shared<compiled_grammar>(std::move(*g), std::move(v));
}

// The mask as a token-by-token check would give it.
std::vector<bool> reference_mask(const compiled_grammar& g, const match_state& s) {
  const vocabulary& v = g.vocab();
  std::vector<bool> out(v.size(), false);
  for (std::size_t t = 0; t < v.size(); ++t) {
    if (v.is_eog(static_cast<token_id>(t))) {
      out[t] = s.accepts();
      continue;
    }
    if (v.piece(static_cast<token_id>(t)).empty()) continue;
    match_state x = s;
    out[t] = advance(g.grammar(), x, v.piece(static_cast<token_id>(t)));
  }
  return out;
}

std::shared_ptr<const vocabulary> random_vocab(std::mt19937& rng, std::size_t n) {
  const std::string alphabet = "{}[]\":, \n0123456789.-eEtrufalsn\\abcxyz\xc3\xa9\xe2\x82\xac";
  std::vector<std::string> pieces = {"", "</s>"};
  for (unsigned char c = 0; c < 128; ++c) pieces.push_back(std::string(1, static_cast<char>(c)));
  pieces.push_back("\xc3");
  pieces.push_back("\xa9");
  while (pieces.size() < n) {
    std::string p;
    const std::size_t len = 1 + rng() % 6;
    for (std::size_t i = 0; i < len; ++i) p += alphabet[rng() % alphabet.size()];
    pieces.push_back(p);
  }
  pieces[1] = "";  // the EOG token renders as nothing
  return std::make_shared<const vocabulary>(std::move(pieces), std::vector<token_id>{1});
}

TEST(token_mask, equals_a_token_by_token_check_along_random_walks) {
  std::mt19937 rng(7);
  const auto v = random_vocab(rng, 3000);
  for (const char* text : {testing::k_json, testing::k_arithmetic, testing::k_list}) {
    auto g = compile(text, v);
    for (int walk = 0; walk < 4; ++walk) {
      token_matcher m(g);
      for (int step = 0; step < 40; ++step) {
        const token_mask& mask = m.mask();
        const token_mask& coarse = m.coarse_mask();
        const std::vector<bool> ref = reference_mask(*g, m.state());
        std::vector<token_id> allowed;
        for (std::size_t t = 0; t < v->size(); ++t) {
          const auto id = static_cast<token_id>(t);
          ASSERT_EQ(mask.allowed(id), ref[t]) << "token " << t << " '" << v->piece(id) << "' step " << step;
          ASSERT_EQ(m.allows(id), ref[t]) << "token " << t << " step " << step;
          if (ref[t]) {
            ASSERT_TRUE(coarse.allowed(id)) << "the coarse mask drops token " << t << " step " << step;
            allowed.push_back(id);
          }
        }
        ASSERT_GE(coarse.n_allowed, mask.n_allowed);
        ASSERT_EQ(mask.n_allowed, allowed.size());
        if (allowed.empty()) break;
        const token_id t = allowed[rng() % allowed.size()];
        ASSERT_TRUE(m.accept(t));
        if (v->is_eog(t)) break;
      }
    }
  }
}

TEST(token_mask, eog_only_where_the_grammar_accepts_and_masks_are_cached) {
  auto v = std::make_shared<const vocabulary>(std::vector<std::string>{"", "a", "b", "ab", "c", "<ctl>"},
                                              std::vector<token_id>{0});
  // "<ctl>" stands for a control token: its piece here is text, but token 0 (EOG) has none.
  auto g = compile("root ::= \"a\" \"b\"*\n", v);
  token_matcher m(g);
  const token_mask& first = m.mask();
  EXPECT_FALSE(first.allowed(0));  // nothing matched yet
  EXPECT_TRUE(first.allowed(1));
  EXPECT_TRUE(first.allowed(3));
  EXPECT_FALSE(first.allowed(2));
  EXPECT_FALSE(first.allowed(4));
  ASSERT_TRUE(m.accept(3));
  const token_mask& after = m.mask();
  EXPECT_TRUE(after.allowed(0));  // "ab" is a sentence
  EXPECT_TRUE(after.allowed(2));
  EXPECT_FALSE(after.allowed(1));
  const std::size_t computed = g->n_computed_masks();
  ASSERT_TRUE(m.accept(2));  // "abb": the same stacks as after "ab"
  m.mask();
  EXPECT_EQ(g->n_computed_masks(), computed);
  // A second matcher of the same grammar reuses the masks too.
  token_matcher other(g);
  other.mask();
  EXPECT_EQ(g->n_computed_masks(), computed);
  EXPECT_FALSE(m.accept(4));
  EXPECT_TRUE(m.dead());
  token_matcher ended(g);
  ASSERT_TRUE(ended.accept(1));
  EXPECT_TRUE(ended.accept(0));  // EOG where "a" is a sentence
  token_matcher early(g);
  EXPECT_FALSE(early.accept(0));  // EOG before anything matched
}

TEST(token_mask, a_state_with_no_token_has_an_empty_mask) {
  auto v = std::make_shared<const vocabulary>(std::vector<std::string>{"", "a"}, std::vector<token_id>{0});
  auto g = compile("root ::= \"a\" \"z\"\n", v);
  token_matcher m(g);
  ASSERT_TRUE(m.accept(1));
  EXPECT_EQ(m.mask().n_allowed, 0u);  // "z" is in no token, and "a" is not a sentence
}

TEST(token_mask, multibyte_characters_split_across_tokens) {
  auto v = std::make_shared<const vocabulary>(std::vector<std::string>{"", "\xc3", "\xa9", "\xc3\xa9", "\xa8", "e"},
                                              std::vector<token_id>{0});
  auto g = compile("root ::= [\\u00e9]+\n", v);
  token_matcher m(g);
  const token_mask& mask = m.mask();
  EXPECT_TRUE(mask.allowed(1));
  EXPECT_TRUE(mask.allowed(3));
  EXPECT_FALSE(mask.allowed(2));
  EXPECT_FALSE(mask.allowed(5));
  ASSERT_TRUE(m.accept(1));
  const token_mask& mid = m.mask();
  EXPECT_TRUE(mid.allowed(2));
  EXPECT_FALSE(mid.allowed(4));  // é is C3 A9; C3 A8 is è
  EXPECT_FALSE(mid.allowed(0));
}

TEST(token_mask, grammar_cache_shares_compiled_grammars_by_text) {
  auto v = std::make_shared<const vocabulary>(std::vector<std::string>{"", "a"}, std::vector<token_id>{0});
  grammar_cache cache(v);
  auto a = cache.get("root ::= \"a\"\n");
  auto b = cache.get("root ::= \"a\"\n");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_FALSE(cache.get("root ::= x\n").ok());
  for (std::size_t i = 0; i < grammar_cache::k_max_grammars + 3; ++i)
    ASSERT_TRUE(cache.get("root ::= \"a\"{" + std::to_string(i + 1) + "}\n").ok());
  EXPECT_EQ(cache.size(), grammar_cache::k_max_grammars);
}

}  // namespace
}  // namespace pagoda::grammar
