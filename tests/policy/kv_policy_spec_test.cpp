// Policy specs, budgets and the factory: what users type, what it means, and
// the messages for what it cannot mean.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "policy/kv_policy.h"
#include "policy/policy_test_util.h"

namespace pagoda {
namespace {

using ::testing::HasSubstr;
using test::make_policy;

std::string spec_error(std::string_view text) {
  const result<kv_policy_spec> s = parse_kv_policy_spec(text);
  EXPECT_FALSE(s.ok()) << text << " parsed";
  return s.ok() ? "" : s.error().message();
}

std::string budget_error(std::string_view text) {
  const result<kv_budget> b = parse_kv_budget(text);
  EXPECT_FALSE(b.ok()) << text << " parsed";
  return b.ok() ? "" : b.error().message();
}

std::string policy_error(std::string_view text) {
  const result<kv_policy_spec> s = parse_kv_policy_spec(text);
  EXPECT_TRUE(s.ok()) << text << ": " << s.error().message();
  if (!s.ok()) return "";
  const status st = check_kv_policy(*s);
  EXPECT_FALSE(st.ok()) << text << " was accepted";
  EXPECT_EQ(st.code(), st.ok() ? errc::ok : errc::invalid_argument);
  return st.message();
}

TEST(kv_policy_spec, empty_and_none_are_full_kv) {
  for (const std::string_view text : {"", "  ", "none", "NONE"}) {
    const result<kv_policy_spec> s = parse_kv_policy_spec(text);
    ASSERT_TRUE(s.ok()) << text;
    EXPECT_TRUE(s->is_none()) << text;
    EXPECT_TRUE(s->params.empty());
    EXPECT_EQ(s->to_string(), "none");
  }
}

TEST(kv_policy_spec, parameters_in_order_with_canonical_spacing) {
  const result<kv_policy_spec> s = parse_kv_policy_spec(" H2O : budget = 25% , recent=8 ");
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_EQ(s->name, "h2o");
  ASSERT_EQ(s->params.size(), 2u);
  EXPECT_EQ(s->params[0], (std::pair<std::string, std::string>("budget", "25%")));
  EXPECT_EQ(s->params[1], (std::pair<std::string, std::string>("recent", "8")));
  EXPECT_EQ(s->to_string(), "h2o:budget=25%,recent=8");
  ASSERT_NE(s->find("recent"), nullptr);
  EXPECT_EQ(*s->find("recent"), "8");
  EXPECT_EQ(s->find("sinks"), nullptr);
  const result<kv_policy_spec> again = parse_kv_policy_spec(s->to_string());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->params, s->params);
}

TEST(kv_policy_spec, malformed_specs_say_what_is_wrong) {
  EXPECT_EQ(spec_error("h2o:budget"), "h2o:budget: expected key=value, got 'budget'");
  EXPECT_THAT(spec_error("h2o:"), HasSubstr("expected key=value after ':'"));
  EXPECT_THAT(spec_error("h2o:budget=0.1,"), HasSubstr("expected key=value, got ''"));
  EXPECT_THAT(spec_error("h2o:=3"), HasSubstr("expected key=value, got '=3'"));
  EXPECT_THAT(spec_error("h2o:budget="), HasSubstr("expected key=value, got 'budget='"));
  EXPECT_THAT(spec_error("h2o:a=b=c"), HasSubstr("got 'a=b=c'"));
  EXPECT_THAT(spec_error("h2o:budget=0.1,budget=0.2"), HasSubstr("'budget' given twice"));
  EXPECT_THAT(spec_error(":budget=1"), HasSubstr("expected a policy name"));
  EXPECT_THAT(spec_error("h 2o"), HasSubstr("expected a policy name"));
  EXPECT_THAT(spec_error("h2o:bud get=1"), HasSubstr("'bud get' is not a parameter name"));
}

TEST(kv_budget, fractions_percentages_and_counts) {
  const auto parse = [](std::string_view t) {
    const result<kv_budget> b = parse_kv_budget(t);
    EXPECT_TRUE(b.ok()) << t << ": " << b.error().message();
    return b.ok() ? *b : kv_budget{};
  };
  EXPECT_DOUBLE_EQ(parse("0.25").fraction, 0.25);
  EXPECT_EQ(parse("0.25").tokens, 0);
  EXPECT_DOUBLE_EQ(parse("25%").fraction, 0.25);
  EXPECT_DOUBLE_EQ(parse("12.5%").fraction, 0.125);
  EXPECT_EQ(parse("256").tokens, 256);
  EXPECT_EQ(parse("1").tokens, 1);  // a whole number is a count
  EXPECT_DOUBLE_EQ(parse("1.0").fraction, 1.0);
  EXPECT_DOUBLE_EQ(parse("100%").fraction, 1.0);
  EXPECT_DOUBLE_EQ(parse(" 0.5 ").fraction, 0.5);
}

TEST(kv_budget, bad_budgets_are_refused) {
  EXPECT_THAT(budget_error("0"), HasSubstr("keeps nothing"));
  EXPECT_THAT(budget_error("0.0"), HasSubstr("must be more than 0"));
  EXPECT_THAT(budget_error("0%"), HasSubstr("must be more than 0"));
  EXPECT_THAT(budget_error("-0.5"), HasSubstr("must be more than 0"));
  EXPECT_THAT(budget_error("-3"), HasSubstr("must be more than 0"));
  EXPECT_THAT(budget_error("1.5"), HasSubstr("at most 1"));
  EXPECT_THAT(budget_error("150%"), HasSubstr("at most 1"));
  EXPECT_THAT(budget_error("256.0"), HasSubstr("a token count is a whole number"));
  for (const std::string_view garbage : {"", "abc", "nan", "inf", "0x10", "25 %", "1/4", "99999999999999999999"}) {
    EXPECT_THAT(budget_error(garbage), HasSubstr("budget")) << garbage;
  }
}

TEST(kv_budget, resolve_rounds_up_within_one_and_the_context) {
  EXPECT_EQ((kv_budget{0.25, 0}).resolve(100), 25);
  EXPECT_EQ((kv_budget{0.25, 0}).resolve(10), 3);   // 2.5 rounds up
  EXPECT_EQ((kv_budget{0.1, 0}).resolve(30), 3);    // 3.0000000000000004 is 3
  EXPECT_EQ((kv_budget{0.001, 0}).resolve(10), 1);  // at least one
  EXPECT_EQ((kv_budget{1.0, 0}).resolve(10), 10);
  EXPECT_EQ((kv_budget{0, 256}).resolve(100), 100);  // at most what was seen
  EXPECT_EQ((kv_budget{0, 5}).resolve(100), 5);
  EXPECT_EQ((kv_budget{0.5, 0}).resolve(0), 0);  // nothing seen, nothing to keep
}

TEST(kv_budget, to_string_reads_back) {
  for (const kv_budget b : {kv_budget{0.25, 0}, kv_budget{1.0, 0}, kv_budget{1e-5, 0}, kv_budget{0, 256}}) {
    const result<kv_budget> back = parse_kv_budget(b.to_string());
    ASSERT_TRUE(back.ok()) << b.to_string();
    EXPECT_EQ(back->tokens, b.tokens) << b.to_string();
    EXPECT_DOUBLE_EQ(back->fraction, b.fraction) << b.to_string();
  }
  EXPECT_EQ((kv_budget{1.0, 0}).to_string(), "1.0");
}

TEST(kv_policy_factory, names_and_unknown_names) {
  EXPECT_EQ(kv_policy_names(),
            (std::vector<std::string>{"none", "window", "h2o", "snapkv", "pyramid", "merge", "cluster", "quest", "retrieval"}));
  EXPECT_EQ(policy_error("lru"), "unknown KV policy 'lru'; known: none, window, h2o, snapkv, pyramid, merge, cluster, quest, retrieval");
}

TEST(kv_policy_factory, every_policy_builds_with_defaults_and_parameters) {
  for (const std::string_view text :
       {"none", "window", "window:budget=256,sinks=0,positions=cache,slack=0", "h2o", "h2o:budget=0.2,recent=0.1",
        "h2o:recent=32", "snapkv", "snapkv:window=8,kernel=5,once=1", "pyramid", "pyramid:base=h2o,recent=4,ratio=2",
        "pyramid:base=snapkv,window=4,ada=0,floor=0.5,cap=1.5", "merge:budget=12.5%", "cluster:k=4,recent=2"}) {
    const std::unique_ptr<kv_policy> p = make_policy(text);
    ASSERT_NE(p, nullptr) << text;
    EXPECT_EQ(p->lossy(), text != "none") << text;
    EXPECT_EQ(p->make_selector(2, 2, 8), nullptr) << text;
  }
}

TEST(kv_policy_factory, unknown_and_bad_parameters_name_the_known_ones) {
  EXPECT_EQ(policy_error("h2o:bugdet=0.3"), "h2o: unknown parameter 'bugdet'; known: budget, slack, chunk, recent");
  EXPECT_EQ(policy_error("window:recent=4"),
            "window: unknown parameter 'recent'; known: budget, slack, chunk, sinks, positions");
  // pyramid takes its base's parameters, and only those.
  EXPECT_THAT(policy_error("pyramid:base=h2o,window=8"), HasSubstr("unknown parameter 'window'"));
  EXPECT_THAT(policy_error("pyramid:base=h2o,window=8"), HasSubstr("recent"));
  EXPECT_EQ(policy_error("none:budget=0.5"), "none: takes no parameters (got 'budget')");
  EXPECT_EQ(policy_error("h2o:budget=2.5"),
            "h2o: budget=2.5: a fraction must be at most 1 (100%); a token count is a whole number");
  EXPECT_EQ(policy_error("h2o:recent=0"), "h2o: recent=0: a budget of 0 tokens keeps nothing");
  EXPECT_EQ(policy_error("window:sinks=-1"), "window: sinks=-1: must be in [0, 1048576]");
  EXPECT_EQ(policy_error("h2o:chunk=-1"), "h2o: chunk=-1: must be in [0, 16777216]");
  EXPECT_EQ(policy_error("window:sinks=four"), "window: sinks=four: expected a whole number in [0, 1048576]");
  EXPECT_EQ(policy_error("window:positions=shift"), "window: positions=shift: expected one of keep, cache");
  EXPECT_EQ(policy_error("snapkv:kernel=4"), "snapkv: kernel=4: the pooling kernel must be odd");
  EXPECT_EQ(policy_error("snapkv:once=yes"), "snapkv: once=yes: expected 0 or 1");
  EXPECT_EQ(policy_error("pyramid:base=window"), "pyramid: base=window: expected one of snapkv, h2o");
  EXPECT_EQ(policy_error("pyramid:ratio=0.5"), "pyramid: ratio=0.5: must be in [1, 10000]");
  EXPECT_EQ(policy_error("pyramid:floor=nan"), "pyramid: floor=nan: expected a number in [0, 1]");
  EXPECT_EQ(policy_error("cluster:k=0"), "cluster: k=0: must be in [1, 4096]");
  EXPECT_EQ(policy_error("h2o:slack=-2"), "h2o: slack=-2: must be in [0, 16777216]");
}

TEST(kv_policy_factory, needs_follow_the_policy) {
  EXPECT_FALSE(make_policy("window")->needs().totals);
  EXPECT_EQ(make_policy("window")->needs().window_rows, -1);
  EXPECT_TRUE(make_policy("h2o")->needs().totals);
  EXPECT_TRUE(make_policy("merge")->needs().totals);
  EXPECT_TRUE(make_policy("cluster")->needs().totals);
  EXPECT_EQ(make_policy("snapkv")->needs().window_rows, 16);
  EXPECT_EQ(make_policy("snapkv:window=8")->needs().window_rows, 8);
  EXPECT_FALSE(make_policy("snapkv")->needs().totals);
  EXPECT_EQ(make_policy("pyramid")->needs().window_rows, 16);
  EXPECT_TRUE(make_policy("pyramid:base=h2o")->needs().totals);
  EXPECT_FALSE(make_policy("none")->needs().totals);
  EXPECT_FALSE(make_policy("none")->lossy());
}

TEST(eviction_decision, uniform_when_every_row_keeps_the_same_slots) {
  eviction_decision d;
  EXPECT_TRUE(d.uniform());  // empty: keeps everything
  d.n_rows = 2;
  d.width = 3;
  d.keep = {0, 2, 5, 0, 2, 5};
  d.count = {3, 3};
  EXPECT_TRUE(d.uniform());
  d.keep = {0, 2, 5, 0, 2, 6};
  EXPECT_FALSE(d.uniform());
  d.keep = {0, 2, 5, 2, 5, -1};
  d.count = {3, 2};
  EXPECT_FALSE(d.uniform());
}

}  // namespace
}  // namespace pagoda
