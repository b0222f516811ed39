// Prompt logprobs, the compact form of prompt scoring (request::prompt_logprobs):
// the runner reduces each logits row to the next prompt token's logprob, its
// rank and the top k, and these equal what the full rows (request::prompt_logits)
// give; each prompt token's entry comes once, through chunking and
// preemption; the scored prompt's blocks enter the prefix cache.
#include <algorithm>
#include <cmath>
#include <map>

#include <gtest/gtest.h>

#include "common/engine_configs.h"
#include "common/requests.h"
#include "common/stories.h"
#include "model/sampler.h"
#include "sched/engine_core.h"

namespace pagoda {
namespace {

using test::greedy_ids;
using test::stories;
using test::story_tokens;

engine_core_config config(std::int64_t n_blocks, int budget = 2048) {
  const llama_hparams& hp = stories().hparams();
  return test::uniform_engine(hp, {.n_blocks = n_blocks, .max_num_seqs = 16, .max_num_batched_tokens = budget});
}

struct scored {
  std::vector<token_logprob> prompt;  // [1, n_prompt): entry i - 1 for prompt token i
  std::vector<int> firsts;            // first_prompt_logprob of each event that carried some
  std::vector<token_id> tokens;       // generated
  std::string finish;
  request_usage usage;
  std::vector<float> rows;            // prompt_logits, when asked
};

std::map<std::string, scored> run(engine_core& e, std::vector<request> reqs) {
  std::map<std::string, scored> out;
  for (request& r : reqs) {
    status st = e.add_request(std::move(r));
    EXPECT_TRUE(st.ok()) << st.message();
  }
  std::vector<engine_event> events;
  for (int guard = 0; e.has_work() && guard < 100000; ++guard) {
    events.clear();
    e.step(events);
    for (const engine_event& ev : events) {
      scored& s = out[ev.request_id];
      if (!ev.prompt_logprobs.empty()) {
        // In order, each token once.
        EXPECT_EQ(ev.first_prompt_logprob, 1 + static_cast<int>(s.prompt.size())) << ev.request_id;
        s.firsts.push_back(ev.first_prompt_logprob);
        s.prompt.insert(s.prompt.end(), ev.prompt_logprobs.begin(), ev.prompt_logprobs.end());
      }
      s.tokens.insert(s.tokens.end(), ev.tokens.begin(), ev.tokens.end());
      s.rows.insert(s.rows.end(), ev.prompt_logits.begin(), ev.prompt_logits.end());
      if (!ev.finish_reason.empty()) s.finish = ev.finish_reason;
      if (ev.request_finished) s.usage = ev.usage;
    }
  }
  return out;
}

request scoring(const std::string& id, std::vector<token_id> prompt, int k, int max_tokens = 0) {
  request r = greedy_ids(id, std::move(prompt), max_tokens);
  r.prompt_logprobs = k;
  return r;
}

// What the full rows say of prompt token p (row p - 1).
token_logprob from_row(std::span<const float> row, token_id token, int k) {
  token_logprob lp{token, sampler::log_prob(row, token), sampler::top_log_probs(row, k)};
  lp.rank = 1 + static_cast<int>(std::count_if(row.begin(), row.end(), [&](float v) { return v > row[token]; }));
  return lp;
}

TEST(prompt_logprobs, equal_what_the_full_rows_give) {
  const std::vector<token_id> prompt = story_tokens(300);  // past one step's 128 scored tokens
  const int V = stories().hparams().n_vocab;
  auto e = *engine_core::create(stories(), config(256));
  request full = greedy_ids("full", prompt, 0);
  full.prompt_logits = true;
  auto res = run(*e, {full, scoring("lp", prompt, 5)});
  const scored& rows = res["full"];
  const scored& lp = res["lp"];
  ASSERT_EQ(rows.rows.size(), prompt.size() * static_cast<std::size_t>(V));
  ASSERT_EQ(lp.prompt.size(), prompt.size() - 1);
  EXPECT_GE(lp.firsts.size(), 3u);  // 299 scored tokens in steps of at most 128
  EXPECT_EQ(lp.finish, "length");
  EXPECT_TRUE(lp.tokens.empty());
  for (std::size_t p = 1; p < prompt.size(); ++p) {
    const token_logprob want =
        from_row(std::span<const float>(rows.rows).subspan((p - 1) * V, V), prompt[p], 5);
    const token_logprob& got = lp.prompt[p - 1];
    ASSERT_EQ(got.token, prompt[p]) << p;
    // Steps of other sizes: the same rows to float rounding (f32 KV).
    EXPECT_NEAR(got.logprob, want.logprob, 1e-4) << p;
    EXPECT_EQ(got.rank, want.rank) << p;
    ASSERT_EQ(got.top.size(), 5u);
    for (std::size_t j = 0; j < 5; ++j) {
      EXPECT_NEAR(got.top[j].second, want.top[j].second, 1e-4) << p;
      // The token at j, unless a near tie with the next lets rounding swap them.
      if (std::abs(want.top[j].second - (j + 1 < 5 ? want.top[j + 1].second : -1e9f)) > 1e-3f) {
        EXPECT_EQ(got.top[j].first, want.top[j].first) << p << " " << j;
      }
    }
    // The token's own logprob sits among the top at its rank.
    if (got.rank <= 5) {
      EXPECT_NEAR(got.top[static_cast<std::size_t>(got.rank - 1)].second, got.logprob, 1e-4) << p;
    }
  }
}

TEST(prompt_logprobs, k_zero_scores_the_tokens_alone_and_generation_follows) {
  const std::vector<token_id> prompt = story_tokens(40);
  auto e = *engine_core::create(stories(), config(64));
  const request plain = greedy_ids("plain", prompt, 4);
  auto res = run(*e, {scoring("lp", prompt, 0, 4), plain});
  const scored& lp = res["lp"];
  ASSERT_EQ(lp.prompt.size(), prompt.size() - 1);
  for (const token_logprob& t : lp.prompt) {
    EXPECT_TRUE(t.top.empty());
    EXPECT_LE(t.logprob, 0.0f);
    EXPECT_GE(t.rank, 1);
  }
  // Scoring changes nothing of what is generated.
  EXPECT_EQ(lp.tokens, res["plain"].tokens);
  EXPECT_EQ(lp.tokens.size(), 4u);
}

TEST(prompt_logprobs, a_preempted_prompt_sends_each_token_once) {
  // Eight 300-token prompts in a pool of 100 blocks (each needs 19):
  // sequences are preempted part way through their prompts and computed again.
  auto big = *engine_core::create(stories(), config(1024));
  auto small = *engine_core::create(stories(), config(100));
  std::vector<request> reqs;
  for (int i = 0; i < 8; ++i) {
    std::vector<token_id> p = story_tokens(300 - static_cast<std::size_t>(i));
    reqs.push_back(scoring("s" + std::to_string(i), std::move(p), 2));
  }
  auto want = run(*big, reqs);
  auto got = run(*small, reqs);
  EXPECT_GT(small->kv_stats().n_preemptions, 0);
  for (const request& r : reqs) {
    const scored& g = got[r.id];
    const scored& w = want[r.id];
    ASSERT_EQ(g.prompt.size(), r.prompt.size() - 1) << r.id;
    for (std::size_t i = 0; i < g.prompt.size(); ++i) {
      EXPECT_EQ(g.prompt[i].token, r.prompt[i + 1]);
      EXPECT_NEAR(g.prompt[i].logprob, w.prompt[i].logprob, 1e-4) << r.id << " " << i;
    }
  }
}

// The prefix cache: a hit skips computing the cached positions, so the
// scheduler keeps each scored block's scores (prompt_score_cache.h) and a
// scoring request takes the cached blocks whose scores are kept, the block
// after them included.
TEST(prompt_logprobs, a_second_scoring_hits_the_prefix_cache_and_says_the_same) {
  const std::vector<token_id> prompt = story_tokens(100);
  auto e = *engine_core::create(stories(), config(64));
  auto first = run(*e, {scoring("a", prompt, 2)});
  EXPECT_EQ(first["a"].usage.cached_tokens, 0);
  auto second = run(*e, {scoring("b", prompt, 2)});
  // 6 full blocks (96 tokens) have scores; the hit stops one block short of
  // them: the first computed token's predecessor is scored by block 5.
  EXPECT_EQ(second["b"].usage.cached_tokens, 80);
  ASSERT_EQ(second["b"].prompt.size(), first["a"].prompt.size());
  for (std::size_t i = 0; i < first["a"].prompt.size(); ++i) {
    EXPECT_EQ(second["b"].prompt[i].token, first["a"].prompt[i].token) << i;
    EXPECT_NEAR(second["b"].prompt[i].logprob, first["a"].prompt[i].logprob, 1e-5) << i;
    EXPECT_EQ(second["b"].prompt[i].rank, first["a"].prompt[i].rank) << i;
    ASSERT_EQ(second["b"].prompt[i].top.size(), 2u) << i;
  }
  // Fewer alternatives are served from the same entries; more are not there.
  auto fewer = run(*e, {scoring("c", prompt, 1)});
  EXPECT_EQ(fewer["c"].usage.cached_tokens, 80);
  ASSERT_EQ(fewer["c"].prompt.size(), prompt.size() - 1);
  EXPECT_EQ(fewer["c"].prompt[10].top.size(), 1u);
  EXPECT_EQ(fewer["c"].prompt[10].top[0], first["a"].prompt[10].top[0]);
  auto more = run(*e, {scoring("d", prompt, 3)});
  EXPECT_EQ(more["d"].usage.cached_tokens, 0);
  // A generation request takes every cached block, as for any prompt.
  auto gen = run(*e, {greedy_ids("gen", prompt, 2)});
  EXPECT_EQ(gen["gen"].usage.cached_tokens, 96);
}

// lm-eval's multiple choice: one context, several continuations. Each
// request takes the context's blocks and scores what a fresh engine scores.
TEST(prompt_logprobs, shared_contexts_hit_and_score_as_computed_whole) {
  const std::vector<token_id> story = story_tokens(200);
  const std::vector<token_id> context(story.begin(), story.begin() + 70);
  std::vector<std::vector<token_id>> prompts;
  for (std::size_t c = 0; c < 3; ++c) {
    std::vector<token_id> p = context;
    p.insert(p.end(), story.begin() + 70 + static_cast<std::ptrdiff_t>(c * 30),
             story.begin() + 100 + static_cast<std::ptrdiff_t>(c * 30));
    prompts.push_back(std::move(p));
  }
  auto cached = *engine_core::create(stories(), config(256));
  for (std::size_t c = 0; c < prompts.size(); ++c) {
    const std::string id = "c" + std::to_string(c);
    auto fresh_engine = *engine_core::create(stories(), config(256));
    auto want = run(*fresh_engine, {scoring(id, prompts[c], 1)});
    auto got = run(*cached, {scoring(id, prompts[c], 1)});
    // The context's 4 full blocks have scores after the first request; the hit takes 3.
    EXPECT_EQ(got[id].usage.cached_tokens, c == 0 ? 0 : 48) << id;
    ASSERT_EQ(got[id].prompt.size(), prompts[c].size() - 1);
    for (std::size_t i = 0; i < got[id].prompt.size(); ++i) {
      EXPECT_EQ(got[id].prompt[i].token, prompts[c][i + 1]);
      EXPECT_NEAR(got[id].prompt[i].logprob, want[id].prompt[i].logprob, 1e-5) << id << " " << i;
    }
  }
}

// Under a KV policy a token's scores depend on what the policy kept: no kept scores, no hit.
TEST(prompt_logprobs, a_policy_request_neither_keeps_nor_takes_scores) {
  const std::vector<token_id> prompt = story_tokens(100);
  auto e = *engine_core::create(stories(), config(64));
  request a = scoring("a", prompt, 1);
  a.kv_policy = "h2o:budget=24,slack=0";
  run(*e, {a});
  auto b = run(*e, {scoring("b", prompt, 1)});
  EXPECT_EQ(b["b"].usage.cached_tokens, 0);
  auto c = run(*e, {scoring("c", prompt, 1)});
  EXPECT_EQ(c["c"].usage.cached_tokens, 80);
  request d = scoring("d", prompt, 1);
  d.kv_policy = "h2o:budget=24,slack=0";
  auto dr = run(*e, {d});
  EXPECT_EQ(dr["d"].usage.cached_tokens, 0);
  EXPECT_EQ(dr["d"].prompt.size(), prompt.size() - 1);
}

TEST(prompt_logprobs, out_of_range_is_refused) {
  auto e = *engine_core::create(stories(), config(64));
  request r = scoring("x", story_tokens(10), request::k_max_prompt_logprobs + 1);
  status st = e->add_request(r);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("prompt_logprobs"), std::string::npos) << st.message();
  r.prompt_logprobs = -2;
  EXPECT_FALSE(e->add_request(r).ok());
}

}  // namespace
}  // namespace pagoda
