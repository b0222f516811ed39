// The plan as plain data and deltas (step_plan.h, runner_sync.h): what the
// scheduler sends a runner per sequence, that a runner samples as the
// scheduler once did (seeds across preemption, forks, truncation), and the
// output step (output_processor.h) on the events that come back.
#include <gtest/gtest.h>

#include "sched/scheduler_harness.h"

namespace pagoda {
namespace {

using namespace test;

std::size_t n_entries(const scheduled_seq& q) {
  std::size_t n = 0;
  for (const table_update& u : q.tables) n += u.entries.size();
  return n;
}

// A sequence's first run carries it in full; every later step carries only
// what changed: no stored position again, and at most the one block it opened.
TEST(step_plan, decode_steps_carry_deltas_not_the_sequence) {
  harness h(config(256, 4, 64));
  h.add(req("a", prompt_of(41), 24));
  h.run();
  ASSERT_EQ(h.results["a"].tokens.size(), 24u);
  bool first = true;
  for (const step_plan& p : h.plans) {
    for (const scheduled_seq& q : p.seqs) {
      if (first) {
        ASSERT_TRUE(q.setup.has_value());
        EXPECT_EQ(q.setup->tokens, prompt_of(41));
        EXPECT_TRUE(q.fresh_kv);
        EXPECT_EQ(n_entries(q), 11u);  // 41 slots in blocks of 4
        first = false;
        continue;
      }
      EXPECT_FALSE(q.setup.has_value());
      EXPECT_FALSE(q.fresh_kv);
      EXPECT_EQ(q.keep_positions, q.n_stored);
      EXPECT_TRUE(q.stored_positions.empty());
      EXPECT_LE(n_entries(q), 1u);
      for (const table_update& u : q.tables) EXPECT_EQ(static_cast<std::size_t>(u.from) * 4, static_cast<std::size_t>(q.n_stored));
    }
  }
  EXPECT_FALSE(first);
  EXPECT_EQ(h.runner.state().size(), 0u) << "the finished sequence's state was freed";
}

request sampled(const std::string& id, std::vector<token_id> prompt, int max_tokens, std::uint64_t seed) {
  request r = req(id, std::move(prompt), max_tokens);
  r.sampling.temperature = 3.0f;
  r.sampling.top_k = 0;
  r.sampling.top_p = 1.0f;
  r.sampling.min_p = 0.0f;
  r.sampling.frequency_penalty = 0.5f;
  r.sampling.seed = seed;
  r.logprobs = 2;
  return r;
}

// Preempted sequences are recomputed; their samplers (seeded, with
// penalties) go on where they were, so every request draws what it draws
// alone. The runner hears of the preemption (its KV state goes) and gets the
// sequence's KV in full again, but no new sampler.
TEST(step_plan, preempted_sequences_sample_as_they_would_alone) {
  harness h(config(16, 8, 64));
  std::vector<request> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(sampled("r" + std::to_string(i), prompt_of(9, i), 18, 100 + i));
  for (const request& r : reqs) h.add(r);
  h.run();
  EXPECT_GT(h.s.kv().metrics().n_preemptions, 0) << "the pool never ran short: the test no longer preempts";
  for (const request& r : reqs) EXPECT_EQ(h.results[r.id].tokens, alone(r)) << r.id;
  bool resumed = false;
  for (std::size_t i = 0; i < h.plans.size(); ++i)
    for (const seq_id id : h.plans[i].preempted)
      for (std::size_t j = i + 1; j < h.plans.size() && !resumed; ++j)
        for (const scheduled_seq& q : h.plans[j].seqs)
          if (q.seq == id) {
            EXPECT_TRUE(q.fresh_kv);
            EXPECT_FALSE(q.setup.has_value()) << "a preempted sequence keeps its sampler";
            EXPECT_EQ(static_cast<std::int32_t>(q.stored_positions.size()), q.n_stored);
            resumed = true;
            break;
          }
  EXPECT_TRUE(resumed);
}

// n > 1: the children are forked at the first sample and draw their first
// token from the parent's logits row with seeds seed + i; completion 0 is
// what an n = 1 request with the same seed draws.
TEST(step_plan, forks_draw_like_completions_of_their_own) {
  harness h(config(128, 8, 64));
  request r = sampled("a", prompt_of(10), 12, 7);
  r.n = 3;
  h.add(r);
  std::map<int, std::vector<token_id>> by_index;
  while (h.s.has_work()) {
    h.step();
    for (const engine_event& e : h.last_events) {
      auto& t = by_index[e.index];
      t.insert(t.end(), e.tokens.begin(), e.tokens.end());
    }
  }
  ASSERT_EQ(by_index.size(), 3u);
  request one = r;
  one.n = 1;
  EXPECT_EQ(by_index[0], alone(one));
  EXPECT_NE(by_index[1], by_index[2]);
  const auto fork_plan = std::find_if(h.plans.begin(), h.plans.end(),
                                      [](const step_plan& p) { return !p.seqs.empty() && !p.seqs[0].forks.empty(); });
  ASSERT_NE(fork_plan, h.plans.end());
  ASSERT_EQ(fork_plan->seqs[0].forks.size(), 2u);
  EXPECT_EQ(fork_plan->seqs[0].forks[1].seed, 9u);
}

// A truncated sequence: the runner's history is cut with it, so what it
// samples next reads the kept tokens only.
TEST(step_plan, a_truncation_cuts_the_runners_history) {
  harness h(config(64, 4, 64));
  h.add(sampled("a", prompt_of(7), 20, 3));
  for (int i = 0; i < 6; ++i) h.step();
  const seq_id a = *h.s.find_sequence("a");
  ASSERT_EQ(h.runner.state().size(), 1u);
  std::vector<token_id> tokens = prompt_of(7);
  tokens.insert(tokens.end(), h.results["a"].tokens.begin(), h.results["a"].tokens.end());
  ASSERT_EQ(tokens.size(), 13u);
  ASSERT_TRUE(h.s.truncate(a, 10).ok());
  const step_plan& p = h.step();
  ASSERT_EQ(p.seqs.size(), 1u);
  EXPECT_EQ(p.seqs[0].n_tokens, 10);
  EXPECT_EQ(p.seqs[0].keep_positions, 9);
  auto* s = const_cast<runner_state&>(h.runner.state()).find(a);
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->history.size(), 11u);
  EXPECT_TRUE(std::equal(tokens.begin(), tokens.begin() + 10, s->history.begin()));
  EXPECT_EQ(s->history.back(), h.results["a"].tokens.back());
}

// The completions of one step: completion 0 meets a stop string (the output
// step ends it), completion 1 a stop token (update ends it). As before the
// output step existed, the request ends on the last finishing event, with
// its usage, and nothing of it comes after.
TEST(step_plan, a_stop_string_ending_a_request_ends_it_on_its_last_event) {
  request r = sampled("a", prompt_of(6, 2), 24, 11);
  r.n = 2;
  // Learn each completion's tokens and text per step.
  std::map<int, std::vector<token_id>> toks;
  std::map<int, std::vector<std::string>> texts;
  {
    harness h(config(128, 8, 64));
    h.add(r);
    while (h.s.has_work()) {
      h.step();
      for (const engine_event& e : h.last_events)
        if (!e.tokens.empty()) {
          toks[e.index].push_back(e.tokens[0]);
          texts[e.index].push_back(e.text);
        }
    }
  }
  ASSERT_EQ(toks[0].size(), 24u);
  ASSERT_EQ(toks[1].size(), 24u);
  auto joined = [&](int index, std::size_t n) {
    std::string s;
    for (std::size_t k = 0; k < n; ++k) s += texts[index][k];
    return s;
  };
  // A step j where completion 0's text is a stop string met there first, not
  // met by completion 1, and completion 1's token a stop token new to both.
  std::size_t j = 1;
  for (; j < 24; ++j) {
    const std::string& stop = texts[0][j];
    if (stop.empty() || joined(0, j + 1).find(stop) != joined(0, j).size()) continue;
    if (joined(1, j + 1).find(stop) != std::string::npos) continue;
    const token_id t = toks[1][j];
    if (std::count(toks[0].begin(), toks[0].begin() + static_cast<std::ptrdiff_t>(j) + 1, t) ||
        std::count(toks[1].begin(), toks[1].begin() + static_cast<std::ptrdiff_t>(j), t))
      continue;
    break;
  }
  ASSERT_LT(j, 24u) << "no step fits: change the seed";
  r.stop = {texts[0][j]};
  r.stop_token_ids = {toks[1][j]};
  harness h(config(128, 8, 64));
  h.add(r);
  std::vector<engine_event> last;
  while (h.s.has_work()) {
    h.step();
    if (!h.last_events.empty()) last = h.last_events;
  }
  ASSERT_EQ(last.size(), 2u);
  EXPECT_EQ(last[0].index, 0);
  EXPECT_EQ(last[0].finish_reason, "stop");
  EXPECT_FALSE(last[0].request_finished);
  EXPECT_EQ(last[0].usage.completion_tokens, 0);
  EXPECT_EQ(last[1].index, 1);
  EXPECT_EQ(last[1].finish_reason, "stop");
  EXPECT_TRUE(last[1].request_finished);
  EXPECT_EQ(last[1].usage.completion_tokens, static_cast<int>(2 * (j + 1)));
  EXPECT_EQ(h.results["a"].text.size(), joined(0, j).size() + joined(1, j).size());
  EXPECT_EQ(h.output.n_requests(), 0u);
}

}  // namespace
}  // namespace pagoda
