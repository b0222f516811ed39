// Cache-aware scheduling (scheduler_config::scheduling): waiting requests
// with a longer cached prefix go first, and no request is passed over by
// later arrivals in more than max_passed_steps steps. Fake runner, no model.
#include <set>

#include <gtest/gtest.h>

#include "sched/scheduler_harness.h"

namespace pagoda::test {
namespace {

std::vector<token_id> hot_prompt(int suffix) {
  std::vector<token_id> p = prompt_of(32, 1);  // 8 blocks of 4, shared
  for (int i = 0; i < 6; ++i) p.push_back(static_cast<token_id>(3 + (suffix * 17 + i * 5) % 300));
  return p;
}

// The step at which each request was first planned.
std::map<std::string, int> first_planned(harness& h, const std::vector<std::string>& ids) {
  std::map<std::string, int> at;
  for (int step = 0; h.s.has_work() && step < 1000; ++step) {
    const step_plan& p = h.step();
    for (const std::string& id : ids)
      if (!at.contains(id)) {
        const std::optional<seq_id> s = h.s.find_sequence(id);
        if (s && harness::planned(p, *s)) at[id] = step;
      }
  }
  return at;
}

// One sequence at a time, so the queue builds up: after a hot prompt is
// cached, FCFS admits in arrival order, cache-aware the cached prefixes first.
TEST(scheduling_policy, cache_aware_admits_cached_prefixes_first) {
  for (const scheduling_policy policy : {scheduling_policy::fcfs, scheduling_policy::cache_aware}) {
    scheduler_config c = config(512, 1, 64);
    c.scheduling = policy;
    harness h(c);
    h.add(req("warm", hot_prompt(0), 1));
    h.run();
    const std::vector<std::string> ids = {"cold1", "hot1", "cold2", "hot2"};
    h.add(req("cold1", prompt_of(38, 5), 2));
    h.add(req("hot1", hot_prompt(1), 2));
    h.add(req("cold2", prompt_of(38, 6), 2));
    h.add(req("hot2", hot_prompt(2), 2));
    const auto at = first_planned(h, ids);
    ASSERT_EQ(at.size(), ids.size());
    if (policy == scheduling_policy::fcfs) {
      EXPECT_LT(at.at("cold1"), at.at("hot1"));
      EXPECT_LT(at.at("hot1"), at.at("cold2"));
      EXPECT_LT(at.at("cold2"), at.at("hot2"));
    } else {
      EXPECT_LT(at.at("hot1"), at.at("cold1"));
      EXPECT_LT(at.at("hot2"), at.at("cold1"));
      EXPECT_LT(at.at("cold1"), at.at("cold2"));
    }
    for (const std::string& id : ids) EXPECT_EQ(h.results[id].tokens.size(), 2u) << id;
  }
}

// A cold request under a stream of hot ones arriving every step: later
// arrivals pass it in at most max_passed_steps steps, then it goes in
// arrival order (bound 0: FCFS).
TEST(scheduling_policy, no_request_is_passed_over_beyond_the_bound) {
  for (const int bound : {0, 1, 3, 6}) {
    scheduler_config c = config(1024, 1, 64);
    c.scheduling = scheduling_policy::cache_aware;
    c.max_passed_steps = bound;
    harness h(c);
    h.add(req("warm", hot_prompt(0), 1));
    h.run();
    h.add(req("first", hot_prompt(100), 1));  // running while the queue forms
    h.step();
    h.add(req("cold", prompt_of(38, 9), 1));
    // Every request here finishes in the step that admits it (one token):
    // the step of its first token is the step of its admission.
    int n_hot = 0, passed = 0;
    bool cold_started = false;
    std::set<std::string> done;
    for (int step = 0; step < 200 && h.s.has_work() && !cold_started; ++step) {
      if (n_hot < 20) h.add(req("hot" + std::to_string(n_hot), hot_prompt(n_hot + 1), 1)), ++n_hot;
      h.step();
      for (const auto& [id, r] : h.results) {
        if (r.tokens.empty() || !done.insert(id).second) continue;
        if (id == "cold") cold_started = true;
        else if (id.starts_with("hot")) ++passed;
      }
    }
    EXPECT_TRUE(cold_started) << bound;
    EXPECT_LE(passed, bound) << "later arrivals admitted before the cold request";
    if (bound > 0) EXPECT_GT(passed, 0) << bound << ": cache-aware never preferred a hot prefix";
    h.run();
    EXPECT_EQ(h.results["cold"].tokens.size(), 1u);
  }
}

}  // namespace
}  // namespace pagoda::test
