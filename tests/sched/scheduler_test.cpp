// The scheduler alone, with a fake runner and no model (fake_runner.h): the
// tokenizer of stories260K gives it a vocabulary, nothing more. Every test
// checks the KV manager's invariants after every step, and compares generated
// tokens with the same request run alone, so a bookkeeping slip shows up as
// different tokens.
#include "sched/scheduler.h"

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>

#include <gtest/gtest.h>

#include "sched/scheduler_harness.h"

namespace pagoda {
namespace {

using namespace test;

TEST(scheduler, chunked_prefill_under_the_token_budget) {
  harness h(config(64, 4, 8));
  h.add(req("a", prompt_of(19), 3));
  // 19 prompt tokens at 8 a step: 8, 8, 3 (the last chunk samples), then 2 decode tokens.
  std::vector<std::size_t> sizes;
  while (h.s.has_work()) {
    const step_plan& p = h.step();
    ASSERT_EQ(p.seqs.size(), 1u);
    sizes.push_back(p.seqs[0].tokens.size());
    EXPECT_EQ(p.seqs[0].positions.front(), static_cast<int>(std::accumulate(sizes.begin(), sizes.end() - 1, 0)));
  }
  EXPECT_EQ(sizes, (std::vector<std::size_t>{8, 8, 3, 1, 1}));
  EXPECT_EQ(h.results["a"].tokens, alone(req("a", prompt_of(19), 3)));
  EXPECT_EQ(h.results["a"].finish, "length");
}

TEST(scheduler, continuous_batching_matches_each_request_alone) {
  harness h(config(256, 8, 24));
  std::vector<request> reqs;
  for (int i = 0; i < 20; ++i) reqs.push_back(req("r" + std::to_string(i), prompt_of(5 + i % 13, i), 4 + i % 7));
  for (const request& r : reqs) h.add(r);
  h.run();
  for (const request& r : reqs) EXPECT_EQ(h.results[r.id].tokens, alone(r)) << r.id;
  // Decode tokens and prompt chunks shared steps, under the budget and the cap.
  bool mixed = false;
  for (const step_plan& p : h.plans) {
    int tokens = 0;
    bool prefill = false, decode = false;
    for (const scheduled_seq& q : p.seqs) {
      tokens += static_cast<int>(q.tokens.size());
      (q.tokens.size() > 1 ? prefill : decode) = true;
    }
    EXPECT_LE(tokens, 24);
    EXPECT_LE(p.seqs.size(), 8u);
    mixed = mixed || (prefill && decode);
  }
  EXPECT_TRUE(mixed);
}

TEST(scheduler, preemption_under_a_small_pool_still_matches) {
  harness h(config(14, 8, 64));
  std::vector<request> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(req("r" + std::to_string(i), prompt_of(9, i), 14));
  for (const request& r : reqs) h.add(r);
  h.run();
  EXPECT_GT(h.s.kv().metrics().n_preemptions, 0);
  for (const request& r : reqs) EXPECT_EQ(h.results[r.id].tokens, alone(r)) << r.id;
  EXPECT_EQ(h.s.kv().metrics().n_blocks_used, 0);
}

// Under quota pressure every request still finishes with its own tokens.
TEST(scheduler, quota_pressure_preempts_and_everyone_still_matches) {
  scheduler_config c = config(64, 8, 64);
  c.tenant_quota_blocks["small"] = 8;
  harness h(c);
  h.add(req("s1", prompt_of(8, 1), 20, "small"));
  h.add(req("s2", prompt_of(8, 2), 20, "small"));
  h.add(req("b1", prompt_of(8, 3), 20, "big"));
  h.run();
  EXPECT_GT(h.s.kv().metrics().n_preemptions, 0) << "the quota never bit";
  EXPECT_EQ(h.results["b1"].tokens, alone(req("b1", prompt_of(8, 3), 20, "big")));
  EXPECT_EQ(h.results["s1"].tokens, alone(req("s1", prompt_of(8, 1), 20, "small")));
  EXPECT_EQ(h.results["s2"].tokens, alone(req("s2", prompt_of(8, 2), 20, "small")));
  for (const tenant_kv_usage& t : h.s.kv().metrics().tenants) EXPECT_EQ(t.n_used_blocks, 0);
}

// A tenant at its quota preempts only its own sequences: the other tenant's
// sequence keeps its KV from admission to the end (its stored slots never fall).
TEST(scheduler, only_the_tenant_over_its_quota_is_preempted) {
  scheduler_config c = config(64, 8, 64);
  c.tenant_quota_blocks["small"] = 8;
  harness h(c);
  // "big" starts last, so a victim chosen without regard to tenants (the most
  // recently started) would be its sequence.
  h.add(req("s1", prompt_of(8, 1), 20, "small"));
  h.add(req("s2", prompt_of(8, 2), 20, "small"));
  h.add(req("b1", prompt_of(8, 3), 40, "big"));
  // Once admitted, b1 holds KV until it finishes; losing it means a preemption.
  bool big_admitted = false, big_preempted = false;
  while (h.s.has_work()) {
    h.step();
    const bool in_kv = h.s.find_sequence("b1").has_value();
    if (big_admitted && !in_kv && h.results["b1"].finish.empty()) big_preempted = true;
    big_admitted = big_admitted || in_kv;
  }
  EXPECT_TRUE(big_admitted);
  EXPECT_GT(h.s.kv().metrics().n_preemptions, 0);
  EXPECT_FALSE(big_preempted) << "the big tenant was preempted for the small tenant's quota";
}

TEST(scheduler, a_quota_blocked_request_does_not_block_other_tenants) {
  scheduler_config c = config(64, 8, 64);
  c.tenant_quota_blocks["t"] = 6;
  harness h(c);
  h.add(req("t1", prompt_of(16, 1), 8, "t"));  // 6 blocks: the tenant's whole quota
  h.step();
  h.add(req("t2", prompt_of(16, 2), 8, "t"));  // waits for t1
  h.add(req("o1", prompt_of(8, 3), 4, "other"));
  const step_plan& p = h.step();
  const auto o1 = h.s.find_sequence("o1");
  ASSERT_TRUE(o1.has_value()) << "o1 was held back behind t2";
  EXPECT_TRUE(harness::planned(p, *o1));
  EXPECT_FALSE(h.s.find_sequence("t2").has_value());
  h.run();
  EXPECT_EQ(h.results["t2"].tokens, alone(req("t2", prompt_of(16, 2), 8, "t")));
}

// Two requests arrive together with a shared 3-block prefix: the second waits
// (pending) while the first computes it, then takes it from the cache.
TEST(scheduler, a_shared_prefix_in_flight_is_waited_for_not_recomputed) {
  harness h(config(64, 8, 64));
  std::vector<token_id> shared = prompt_of(12, 5), a = shared, b = shared;
  a.push_back(77);
  b.push_back(88);
  h.add(req("a", a, 4));
  h.add(req("b", b, 4));
  const step_plan& first = h.step();
  ASSERT_EQ(first.seqs.size(), 1u) << "b must not run with a's prefix uncommitted";
  h.run();
  EXPECT_EQ(h.results["b"].usage.cached_tokens, 12);
  EXPECT_EQ(h.results["a"].usage.cached_tokens, 0);
  EXPECT_EQ(h.results["a"].tokens, alone(req("a", a, 4)));
  EXPECT_EQ(h.results["b"].tokens, alone(req("b", b, 4)));
  // Computed once: 13 + 1 prompt tokens through the model, not 26.
  EXPECT_EQ(h.s.stats().n_computed_prompt_tokens, 14);
}

// A failure in the middle of a step: its requests end with an error, no block
// it wrote is in the prefix index, and later requests get the right tokens.
TEST(scheduler, a_failed_step_commits_nothing_and_fails_its_requests) {
  harness h(config(64, 8, 64));
  h.runner.fail_at = 0;
  h.add(req("a", prompt_of(12, 1), 4));
  h.add(req("b", prompt_of(9, 2), 4));
  const step_plan& failed = h.step();
  ASSERT_EQ(failed.seqs.size(), 2u);
  ASSERT_EQ(h.last_blocks.size(), 3u + 3u);
  for (const block_id b : h.last_blocks) EXPECT_FALSE(h.s.kv().index().contains(b)) << "block " << b.value;
  EXPECT_EQ(h.s.kv().index().size(), 0u);
  EXPECT_EQ(h.results["a"].finish, "error");
  EXPECT_EQ(h.results["b"].finish, "error");
  EXPECT_NE(h.results["a"].error.find("injected failure"), std::string::npos) << h.results["a"].error;
  EXPECT_EQ(h.s.kv().metrics().n_blocks_used, 0);
  EXPECT_FALSE(h.s.has_work());
  // The same prompts again: correct tokens, nothing stale served from the cache.
  h.add(req("a2", prompt_of(12, 1), 4));
  h.run();
  EXPECT_EQ(h.results["a2"].usage.cached_tokens, 0);
  EXPECT_EQ(h.results["a2"].tokens, alone(req("a2", prompt_of(12, 1), 4)));
  EXPECT_EQ(h.s.stats().n_failed_steps, 1);
}

// drop_blocks frees blocks from the middle: the pool's usage falls, the
// sequence goes on with its remaining slots at their original positions, and
// what it generates is what the model computes over exactly those slots.
// Priority orders a tenant's own requests, never another tenant's: admission
// (one sequence at a time) keeps arrival order across tenants, and a tenant's
// urgent request goes ahead of its own earlier ones only.
TEST(scheduler, priority_orders_admission_within_a_tenant_only) {
  harness h(config(64, 1, 64));
  h.add(req("a1", prompt_of(4, 1), 2, "alice"));
  h.add(req("a2", prompt_of(4, 2), 2, "alice"));
  request b = req("b", prompt_of(4, 3), 2, "bob");
  b.priority = -100;
  h.add(b);
  request a3 = req("a3", prompt_of(4, 4), 2, "alice");
  a3.priority = -1;
  h.add(a3);
  std::vector<std::string> order;
  while (h.s.has_work()) {
    h.step();
    for (const std::string id : {"a1", "a2", "a3", "b"})
      if (h.s.find_sequence(id) && std::find(order.begin(), order.end(), id) == order.end()) order.push_back(id);
  }
  // Alice's requests keep the places they arrived at (1st, 2nd, 4th) and
  // fill them by priority; bob's urgent request keeps its 3rd place.
  EXPECT_EQ(order, (std::vector<std::string>{"a3", "a1", "b", "a2"}));
}

// Preemption picks the tenant by recency, not by priority: bob's urgent
// sequence, started last, is the one that makes room, not alice's older one.
TEST(scheduler, priority_does_not_shield_a_tenant_from_preemption) {
  harness h(config(10, 4, 64));
  h.add(req("a", prompt_of(12, 1), 20, "alice"));  // 3 blocks, grows to 8
  h.step();
  request b = req("b", prompt_of(12, 2), 20, "bob");
  b.priority = -100;
  h.add(b);
  h.step();
  ASSERT_TRUE(h.s.find_sequence("a") && h.s.find_sequence("b"));
  bool a_preempted = false, b_preempted = false;
  while (h.s.has_work()) {
    h.step();
    if (!h.s.find_sequence("a") && h.results["a"].finish.empty()) a_preempted = true;
    if (!h.s.find_sequence("b") && h.results["b"].finish.empty()) b_preempted = true;
  }
  EXPECT_TRUE(b_preempted) << "the pool never ran short: the test no longer preempts";
  EXPECT_FALSE(a_preempted) << "alice's older sequence paid for bob's priority";
  EXPECT_EQ(h.results["a"].tokens, alone(req("a", prompt_of(12, 1), 20, "alice")));
  EXPECT_EQ(h.results["b"].tokens.size(), 20u);
}

// Latency histograms read the injected clock: a request that waited 2 s
// before its first step has a TTFT of 2 s, tokens 0.25 s apart an
// inter-token latency of 0.25 s, whatever the real time was.
TEST(scheduler, latencies_come_from_the_injected_clock) {
  manual_clock clock;
  scheduler_config c = config(64);
  c.clock = &clock;
  harness h(c);
  h.add(req("a", prompt_of(6), 3));
  clock.advance_seconds(2.0);
  h.step();  // the prompt and the first token
  clock.advance_seconds(0.25);
  h.step();
  clock.advance_seconds(0.25);
  h.step();
  EXPECT_TRUE(h.results["a"].finish == "length");
  const engine_stats& st = h.s.stats();
  EXPECT_EQ(st.ttft_seconds.snapshot().count, 1u);
  EXPECT_DOUBLE_EQ(st.ttft_seconds.snapshot().sum, 2.0);
  EXPECT_EQ(st.itl_seconds.snapshot().count, 2u);
  EXPECT_DOUBLE_EQ(st.itl_seconds.snapshot().sum, 0.5);
  EXPECT_DOUBLE_EQ(st.e2e_seconds.snapshot().sum, 2.5);
}

TEST(scheduler, drop_frees_blocks_and_keeps_positions) {
  harness h(config(64, 8, 64));
  h.add(req("a", prompt_of(17, 4), 6));
  h.step();  // the prompt: 4 full blocks + 1 slot, and the first token
  const seq_id a = *h.s.find_sequence("a");
  const std::int32_t used = h.s.kv().metrics().n_blocks_used;
  const std::int32_t drop[] = {1, 2};
  ASSERT_TRUE(h.s.drop_blocks(a, drop).ok());
  EXPECT_EQ(h.s.kv().metrics().n_blocks_used, used - 2);
  EXPECT_EQ(h.s.kv().n_stored_tokens(a), 17 - 8);
  const step_plan& next = h.step();
  ASSERT_EQ(next.seqs.size(), 1u);
  EXPECT_EQ(next.seqs[0].n_stored, 9);
  EXPECT_EQ(next.seqs[0].positions[0], 17) << "the new token keeps its logical position";
  // The model saw slots of positions 0..3, 12..16 and the new token.
  std::vector<std::pair<token_id, std::int32_t>> visible;
  std::vector<token_id> all = prompt_of(17, 4);
  all.push_back(h.results["a"].tokens[0]);
  for (int p = 0; p <= 17; ++p)
    if (p < 4 || p >= 12) visible.push_back({all[static_cast<std::size_t>(p)], p});
  EXPECT_EQ(h.results["a"].tokens[1], test::fake_next(visible, vocab().n_vocab()));
  EXPECT_FALSE(h.s.drop_blocks(a, std::vector<std::int32_t>{9}).ok());
  h.run();
  EXPECT_EQ(h.results["a"].tokens.size(), 6u);
  // Blocks completed after the drop hold K/V computed without the dropped
  // tokens: none of them may be shared. Only the prompt's 4 blocks are indexed.
  EXPECT_EQ(h.s.kv().index().size(), 4u);
}

// truncate rolls back the tail (speculation): generating again from there
// gives exactly the tokens an uninterrupted run gives.
TEST(scheduler, truncate_rolls_back_and_regenerates_the_same_tokens) {
  const request r = req("a", prompt_of(10, 6), 12);
  const std::vector<token_id> want = alone(r);
  harness h(config(64, 8, 64));
  h.add(r);
  for (int i = 0; i < 7; ++i) h.step();  // prompt + 7 tokens
  const seq_id a = *h.s.find_sequence("a");
  ASSERT_EQ(h.results["a"].tokens.size(), 7u);
  // Keep the prompt and 3 generated tokens; the rest is forgotten.
  ASSERT_TRUE(h.s.truncate(a, 13).ok());
  EXPECT_EQ(h.s.kv().n_stored_tokens(a), 12);
  h.results["a"].tokens.resize(3);
  h.run();
  EXPECT_EQ(h.results["a"].tokens, want);
  EXPECT_FALSE(h.s.truncate(a, 5).ok()) << "finished";
}

// The load path: a prompt whose blocks the pool lacks but an external source
// holds is LOADING for a step (no forward pass), then runs with them cached.
TEST(scheduler, a_prompt_found_in_the_kv_source_is_loaded_not_computed) {
  const std::vector<token_id> p = prompt_of(14, 8);
  const std::vector<token_id> want = alone(req("a", p, 5));
  // Fill the source: run once, evict everything, keep what the hook saw.
  harness first(config(64, 8, 64));
  first.add(req("a", p, 5));
  first.run();
  // 14 prompt + 5 generated tokens: 4 full blocks cached, 3 of them the prompt's.
  EXPECT_EQ(first.s.kv().evict_cached_blocks(), 4);
  first.step();  // the eviction ops reach the runner
  ASSERT_EQ(first.runner.evicted.size(), 4u);
  EXPECT_TRUE(first.runner.bytes_intact);

  harness h(config(64, 8, 64));
  h.runner.source = first.runner.evicted;
  fake_source source(h.runner);
  h.s.set_kv_source(&source);
  h.add(req("a", p, 5));
  const step_plan& load = h.step();
  EXPECT_EQ(load.loads.size(), 3u);
  EXPECT_TRUE(load.seqs.empty()) << "a loading sequence computes nothing";
  const step_plan& run = h.step();
  ASSERT_EQ(run.seqs.size(), 1u);
  EXPECT_EQ(run.seqs[0].n_stored, 12);
  EXPECT_EQ(run.seqs[0].tokens.size(), 2u);
  h.run();
  EXPECT_EQ(h.results["a"].tokens, want);
  EXPECT_EQ(h.results["a"].usage.cached_tokens, 12);
  EXPECT_EQ(h.s.stats().n_loaded_tokens, 12);
  // Blocks the source announces but cannot deliver (the second of three) are
  // computed instead: the first is kept, the rest recomputed, same tokens.
  harness partial(config(64, 8, 64));
  fake_source src2(partial.runner);
  for (const auto& [key, slots] : first.runner.evicted) src2.claimed.insert(key);
  const auto keys = partial.s.kv().prompt_keys(p);
  partial.runner.source[keys[0]] = first.runner.evicted.at(keys[0]);
  partial.runner.source[keys[2]] = first.runner.evicted.at(keys[2]);
  partial.s.set_kv_source(&src2);
  partial.add(req("b", p, 5));
  const step_plan& l2 = partial.step();
  ASSERT_EQ(l2.loads.size(), 3u);
  partial.run();
  EXPECT_EQ(partial.results["b"].tokens, want);
  EXPECT_EQ(partial.results["b"].usage.cached_tokens, 4);
  EXPECT_EQ(partial.s.stats().n_loaded_tokens, 4);
}

TEST(scheduler, attention_totals_accumulate_and_follow_drops) {
  scheduler_config c = config(64, 8, 64);
  c.attention_stats_window = 0;
  harness h(c);
  h.runner.stats_layers = 2;
  h.runner.stats_heads = 3;
  h.add(req("a", prompt_of(12, 9), 4));
  h.step();  // prompt: the last row sees 12 slots (the fake reports the last row only)
  h.step();  // one decode token sees 13
  const seq_id a = *h.s.find_sequence("a");
  const std::vector<float>* totals = h.s.attention_totals(a);
  ASSERT_NE(totals, nullptr);
  ASSERT_EQ(totals->size(), 13u * 6);
  EXPECT_EQ((*totals)[0], 2.0f);       // slot 0, layer 0, head 0: seen twice
  EXPECT_EQ((*totals)[12 * 6 + 5], 1.0f);  // slot 12 only by its own row
  const std::int32_t drop[] = {0};
  ASSERT_TRUE(h.s.drop_blocks(a, drop).ok());
  ASSERT_EQ(h.s.attention_totals(a)->size(), 9u * 6);
  EXPECT_EQ((*h.s.attention_totals(a))[8 * 6], 1.0f);  // what was slot 12
}

TEST(scheduler, rejects_what_could_never_run) {
  harness h(config(8, 4, 64));
  EXPECT_EQ(h.s.add_request(req("n", prompt_of(4), 4)).code(), errc::ok);
  request many = req("many", prompt_of(4), 4);
  many.n = 5;  // above --max-num-seqs 4: it would wait forever
  const status st = h.s.add_request(many);
  EXPECT_EQ(st.code(), errc::invalid_argument);
  EXPECT_NE(st.message().find("max-num-seqs"), std::string::npos) << st.message();
  EXPECT_EQ(h.s.add_request(req("big", prompt_of(30), 10)).code(), errc::resource_exhausted);
  EXPECT_EQ(h.s.add_request(req("n", prompt_of(4), 4)).code(), errc::invalid_argument);  // duplicate
  h.run();
}

TEST(scheduler, prompt_logits_score_every_position) {
  harness h(config(64, 4, 8));
  request r = req("s", prompt_of(19, 3), 0);
  r.prompt_logits = true;
  h.add(r);
  int rows = 0, next_first = 0;
  while (h.s.has_work()) {
    step_plan plan = h.s.schedule();
    step_output out;
    h.runner.execute(plan, out);
    std::vector<engine_event> events;
    h.s.update(plan, out, events);
    for (const engine_event& e : events) {
      if (e.prompt_logits.empty()) continue;
      EXPECT_EQ(e.first_prompt_position, next_first);
      const int n = static_cast<int>(e.prompt_logits.size()) / vocab().n_vocab();
      next_first += n;
      rows += n;
    }
  }
  EXPECT_EQ(rows, 19);
}

// A finished request's id can be used again at once (its state is forgotten
// lazily, and must not take the new request with it).
TEST(scheduler, an_id_is_free_again_once_its_request_finished) {
  harness h(config(64, 4, 64));
  h.add(req("a", prompt_of(6, 1), 2));
  while (h.results["a"].finish.empty()) h.step();
  h.add(req("a", prompt_of(7, 2), 3));
  h.results["a"] = {};
  h.run();
  EXPECT_EQ(h.results["a"].tokens, alone(req("a", prompt_of(7, 2), 3)));
}

// The blocks a run of prompt p leaves when every cached block is evicted:
// what the eviction hook would have stored in an external source.
std::map<block_key, std::vector<std::pair<token_id, std::int32_t>>> evicted_blocks_of(const std::vector<token_id>& p) {
  harness first(config(64, 8, 64));
  first.add(req("a", p, 5));
  first.run();
  first.s.kv().evict_cached_blocks();
  first.step();
  return first.runner.evicted;
}

// A slow source: the loading sequence waits (holding its blocks, computing
// nothing) while others run, and runs once its blocks arrived.
// A harness whose external source holds the blocks of a run of prompt p.
struct loading_harness : harness {
  fake_source source;
  explicit loading_harness(const std::vector<token_id>& p) : harness(config(64, 8, 64)), source(runner) {
    runner.source = evicted_blocks_of(p);
    s.set_kv_source(&source);
  }
};

TEST(scheduler, a_loading_sequence_waits_for_a_slow_source_while_others_run) {
  const std::vector<token_id> p = prompt_of(14, 8);
  loading_harness h(p);
  fake_source& source = h.source;
  source.settle_after = 3;
  h.add(req("other", prompt_of(9, 1), 6));
  h.add(req("a", p, 5));
  int waited = 0;
  for (int i = 0; i < 10; ++i) {
    const step_plan& plan = h.step();
    if (!plan.loads.empty()) break;
    const auto a = h.s.find_sequence("a");
    ASSERT_TRUE(a.has_value());
    EXPECT_FALSE(harness::planned(plan, *a)) << "a loading sequence computed";
    ++waited;
  }
  EXPECT_EQ(waited, 3);
  EXPECT_EQ(source.n_prefetches, 1);
  EXPECT_GE(h.results["other"].tokens.size(), 2u) << "the other request was held up";
  h.run();
  EXPECT_EQ(h.results["a"].tokens, alone(req("a", p, 5)));
  EXPECT_EQ(h.results["a"].usage.cached_tokens, 12);
  EXPECT_EQ(source.n_held, 0) << "prefetched blocks never released";
}

// A source that does not know yet (a remote lookup in flight) answers
// k_source_pending: the request stays waiting, takes nothing from the pool,
// lets the request behind it run, and is asked again at each step until the
// answer comes; then it loads. A loading sequence that is aborted releases
// what it prefetched.
TEST(scheduler, a_pending_lookup_keeps_the_request_waiting_without_holding_back_others) {
  const std::vector<token_id> p = prompt_of(14, 8);
  loading_harness h(p);
  fake_source& source = h.source;
  source.pending_lookups = 3;
  h.add(req("a", p, 5));
  h.add(req("other", prompt_of(3, 1), 6));  // no full block to look up
  for (int i = 0; i < 3; ++i) {
    const step_plan& plan = h.step();
    EXPECT_TRUE(plan.loads.empty());
    EXPECT_FALSE(h.s.find_sequence("a").has_value()) << "a request waiting on a lookup took KV";
  }
  EXPECT_EQ(source.n_lookups, 3) << "asked once a step";
  EXPECT_GE(h.results["other"].tokens.size(), 2u) << "the request behind it was held up";
  const step_plan& load = h.step();
  EXPECT_EQ(load.loads.size(), 3u);
  h.run();
  EXPECT_EQ(h.results["a"].tokens, alone(req("a", p, 5)));
  EXPECT_EQ(h.results["a"].usage.cached_tokens, 12);
  EXPECT_EQ(source.n_held, 0);

  // Aborted while loading: its prefetch is released.
  loading_harness g(p);
  fake_source& slow = g.source;
  slow.settle_after = 100;
  g.add(req("b", p, 5));
  g.step();
  EXPECT_EQ(slow.n_held, 3);
  EXPECT_TRUE(g.s.abort_request("b"));
  g.step();
  EXPECT_EQ(slow.n_held, 0) << "an aborted loading sequence kept its prefetched blocks";
}

}  // namespace
}  // namespace pagoda

// --- KV policies through the scheduler ------------------------------------------

namespace pagoda {
namespace {

// A policy for tests: "keep:sinks=S,recent=R,slack=K[,rows=1][,cache=1]"
// keeps the first S and the last R live slots of every row once a row holds K
// more; rows=1 makes odd rows keep one recent slot less (rows differ);
// cache=1 renumbers the kept slots (positions within the cache).
class keep_policy final : public kv_policy {
 public:
  explicit keep_policy(kv_policy_spec spec) : spec_(std::move(spec)) {
    auto get = [&](const char* k, int def) { const std::string* v = spec_.find(k); return v ? std::stoi(*v) : def; };
    sinks_ = get("sinks", 2);
    recent_ = get("recent", 4);
    slack_ = get("slack", 4);
    rows_ = get("rows", 0) != 0;
    cache_ = get("cache", 0) != 0;
  }
  const kv_policy_spec& spec() const override { return spec_; }
  bool lossy() const override { return true; }
  eviction_decision evict(const eviction_input& in) override {
    std::vector<std::vector<std::int32_t>> keep(static_cast<std::size_t>(in.n_rows()));
    int widest_live = 0;
    for (int r = 0; r < in.n_rows(); ++r) {
      std::vector<std::int32_t> live;
      for (int s = 0; s < in.n_slots; ++s)
        if (!in.is_dead(r, s)) live.push_back(s);
      widest_live = std::max(widest_live, static_cast<int>(live.size()));
      const int recent = recent_ - (rows_ && r % 2 ? 1 : 0);
      for (std::size_t i = 0; i < live.size(); ++i)
        if (static_cast<int>(i) < sinks_ || static_cast<int>(live.size() - i) <= recent) keep[static_cast<std::size_t>(r)].push_back(live[i]);
    }
    if (widest_live < sinks_ + recent_ + slack_) return {};
    eviction_decision d;
    d.n_rows = in.n_rows();
    for (const auto& k : keep) d.width = std::max(d.width, static_cast<int>(k.size()));
    d.keep.assign(static_cast<std::size_t>(d.n_rows) * d.width, 0);
    for (int r = 0; r < d.n_rows; ++r) {
      const auto& k = keep[static_cast<std::size_t>(r)];
      d.count.push_back(static_cast<std::int32_t>(k.size()));
      std::copy(k.begin(), k.end(), d.keep.begin() + static_cast<std::ptrdiff_t>(r) * d.width);
    }
    d.reposition = cache_;
    ++n_evictions;
    return d;
  }
  static std::int64_t n_evictions_of(const std::string&) { return n_evictions; }
  static inline std::int64_t n_evictions = 0;

 private:
  kv_policy_spec spec_;
  int sinks_, recent_, slack_;
  bool rows_, cache_;
};

scheduler_config policy_config(std::int64_t n_blocks, int rows = 1) {
  scheduler_config c = config(n_blocks);
  c.policy_shape = {rows, 1, 8, c.block_size};
  c.policy_factory = [](const kv_policy_spec& spec) -> result<std::unique_ptr<kv_policy>> {
    if (spec.name == "keep") return std::unique_ptr<kv_policy>(new keep_policy(spec));
    return make_kv_policy(spec);
  };
  return c;
}

// What the fake runner's KV holds for a sequence matches the KV manager's
// bookkeeping slot for slot: every gather moved the right tokens. Block ops
// reach the tensors with the next plan, so this runs between a step's
// execution and its update (harness::after_execute).
void expect_kv_matches(harness& h, seq_id a) {
  const auto table = h.s.kv().block_table(a);
  const auto tokens = h.s.kv().tokens(a);
  const auto positions = h.s.kv().positions(a);
  for (std::int32_t i = 0; i < h.s.kv().n_stored_tokens(a); ++i) {
    const auto& got = h.runner.slot(table[static_cast<std::size_t>(i / 4)], i % 4);
    ASSERT_EQ(got.first, tokens[static_cast<std::size_t>(i)]) << "slot " << i;
    ASSERT_EQ(got.second, positions[static_cast<std::size_t>(i)]) << "slot " << i;
  }
}

// Eviction frees memory for real: the sequence keeps its sinks and its recent
// tokens, compacted to the front, and its blocks go back to the pool.
TEST(scheduler_policy, eviction_compacts_and_frees_blocks) {
  keep_policy::n_evictions = 0;
  harness h(policy_config(64));
  request r = req("a", prompt_of(10), 40);
  r.kv_policy = "keep:sinks=2,recent=6,slack=4";
  h.add(std::move(r));
  h.after_execute = [&] {
    if (const auto a = h.s.find_sequence("a")) expect_kv_matches(h, *a);
  };
  int max_stored = 0;
  for (int i = 0; i < 200 && h.s.has_work(); ++i) {
    h.step();
    const auto a = h.s.find_sequence("a");
    if (!a) break;
    max_stored = std::max(max_stored, h.s.kv().n_stored_tokens(*a));
    const auto pos = h.s.kv().positions(*a);
    if (pos.size() > 2) {
      EXPECT_EQ(pos[0], 0);
      EXPECT_EQ(pos[1], 1);
    }
  }
  EXPECT_EQ(h.results["a"].tokens.size(), 40u);
  EXPECT_LE(max_stored, 2 + 6 + 4 + 1);  // the budget, the slack and the step's own token
  EXPECT_GT(h.runner.n_gathers, 3);
  EXPECT_EQ(h.s.stats().n_policy_compactions, keep_policy::n_evictions_of("a"));
  EXPECT_GE(h.s.stats().n_policy_evicted_slots, 4 * h.s.stats().n_policy_compactions);  // each frees the slack at least
  EXPECT_EQ(h.s.kv().metrics().n_blocks_used, 0);
}

// Rows that keep different slots: dead slots lead the narrower rows (negative
// positions), every row keeps its own, and the table holds the widest row.
TEST(scheduler_policy, rows_keep_their_own_slots) {
  harness h(policy_config(64, 2));
  request r = req("a", prompt_of(9), 20);
  r.kv_policy = "keep:sinks=1,recent=5,slack=4,rows=1";
  h.add(std::move(r));
  bool saw_rows = false;
  for (int i = 0; i < 200 && h.s.has_work(); ++i) {
    h.step();
    const auto a = h.s.find_sequence("a");
    if (!a) break;
    const seq_policy* p = h.s.policy_of(*a);
    ASSERT_NE(p, nullptr);
    if (!p->per_row()) continue;
    saw_rows = true;
    const int n = h.s.kv().n_stored_tokens(*a);
    ASSERT_EQ(p->n_slots(), n);
    const std::int32_t* row0 = p->row_positions();
    const std::int32_t* row1 = p->row_positions() + p->row_stride();
    // Row 1 keeps one slot less: its first slot is dead.
    EXPECT_LT(row1[0], 0);
    EXPECT_GE(row0[0], 0);
    for (int s = 1; s < n; ++s) {
      EXPECT_GT(row0[s], row0[s - 1]);
      EXPECT_GT(row1[s], row1[s - 1]);
    }
    EXPECT_EQ(row0[0], 0);  // the sink
    EXPECT_EQ(row1[1], 0);  // its sink, after the dead slot
    EXPECT_EQ(row0[n - 1], row1[n - 1]);  // the newest token is everyone's
    EXPECT_NEAR(p->mean_live_slots(), n - 0.5, 1e-9);
  }
  EXPECT_TRUE(saw_rows);
  EXPECT_EQ(h.results["a"].tokens.size(), 20u);
}

// StreamingLLM's positions within the cache: kept slots are renumbered 0..n-1
// (keys rotated), and the next token continues right after them.
TEST(scheduler_policy, positions_within_the_cache_continue_after_the_kept_slots) {
  harness h(policy_config(64));
  request r = req("a", prompt_of(6), 30);
  r.kv_policy = "keep:sinks=2,recent=4,slack=4,cache=1";
  h.add(std::move(r));
  h.after_execute = [&] {
    if (const auto a = h.s.find_sequence("a")) expect_kv_matches(h, *a);
  };
  for (int i = 0; i < 200 && h.s.has_work(); ++i) {
    const step_plan& plan = h.step();
    ASSERT_FALSE(plan.seqs.empty());
    EXPECT_EQ(plan.seqs[0].positions[0], plan.seqs[0].n_stored) << "step " << i;
    const auto a = h.s.find_sequence("a");
    if (!a) break;
    const auto pos = h.s.kv().positions(*a);
    for (std::size_t s = 0; s < pos.size(); ++s) ASSERT_EQ(pos[s], static_cast<std::int32_t>(s));
  }
  EXPECT_GT(h.runner.n_gathers, 3);
  EXPECT_EQ(h.results["a"].tokens.size(), 30u);
}

// No lossy block is ever served under a plain prefix key: a request that
// reuses the prompt and output of one whose policy evicted gets only blocks
// computed before the first eviction, and generates what it generates alone.
TEST(scheduler_policy, lossy_blocks_never_enter_the_prefix_cache) {
  harness h(policy_config(128));
  request a = req("a", prompt_of(12), 24);
  a.kv_policy = "keep:sinks=2,recent=4,slack=4";
  h.add(std::move(a));
  h.run();
  ASSERT_EQ(h.results["a"].tokens.size(), 24u);
  std::vector<token_id> prompt = prompt_of(12);
  prompt.insert(prompt.end(), h.results["a"].tokens.begin(), h.results["a"].tokens.end());
  h.add(req("b", prompt, 8));
  h.run();
  harness alone(policy_config(128));
  alone.add(req("b", prompt, 8));
  alone.run();
  EXPECT_EQ(h.results["b"].tokens, alone.results["b"].tokens);
  // The prompt's 12 tokens were computed whole before the first eviction: 3
  // blocks of 4 at most come from the cache.
  EXPECT_LE(h.results["b"].usage.cached_tokens, 12);
}

// n > 1: forked sequences share blocks; a compaction copies what it may not
// write, and each completion keeps its own.
TEST(scheduler_policy, forked_sequences_compact_their_own_blocks) {
  harness h(policy_config(128));
  request r = req("a", prompt_of(11), 30);
  r.n = 3;
  r.sampling.temperature = 1.0f;
  r.sampling.top_k = 0;
  r.sampling.top_p = 1.0f;
  r.sampling.min_p = 0.0f;
  r.kv_policy = "keep:sinks=2,recent=5,slack=4";
  h.add(std::move(r));
  h.after_execute = [&] {
    for (int c = 0; c < 3; ++c)
      if (const auto s = h.s.find_sequence("a", c)) expect_kv_matches(h, *s);
  };
  h.run();
  EXPECT_EQ(h.results["a"].tokens.size(), 90u);
  EXPECT_EQ(h.s.kv().metrics().n_blocks_used, 0);
}

// A first admission that takes a cached prefix and then cannot get the
// blocks of its first chunk leaves nothing behind: the policy does not count
// the cached slots once per attempt (which aborted the engine when its
// statistics met the sequence's slots), and the request's cached tokens are
// those of the admission that ran. A (12 tokens) leaves 3 cached blocks; C
// keeps the pool short while B (A's prompt + 8, h2o) is refused again and
// again, and C's growth evicts two of A's blocks before B gets in.
TEST(scheduler_policy, a_failed_first_admission_leaves_the_policy_and_usage_untouched) {
  harness h(policy_config(12));
  const std::vector<token_id> pa = prompt_of(12, 5);
  h.add(req("A", pa, 1));
  h.run();
  ASSERT_EQ(h.s.kv().metrics().n_blocks_cached, 3);
  h.add(req("C", prompt_of(30, 6), 14));
  h.step();
  std::vector<token_id> pb = pa;
  for (int i = 0; i < 8; ++i) pb.push_back(static_cast<token_id>(100 + i));
  request b = req("B", pb, 6);
  b.kv_policy = "h2o:budget=0.5";
  h.add(b);
  int refused = 0;
  while (h.s.has_work()) {
    h.step();
    if (!h.s.find_sequence("B") && h.results["B"].finish.empty()) ++refused;
  }
  h.step();
  EXPECT_GT(refused, 3) << "B was never refused: the test no longer reaches the failed admission";
  EXPECT_EQ(h.results["B"].finish, "length");
  EXPECT_EQ(h.results["B"].tokens.size(), 6u);
  EXPECT_EQ(h.results["B"].usage.cached_tokens, 4) << "cached tokens of a refused attempt, not of the admission";
}

// --- Eviction that lowers the peak: long prompts in chunks, exact budgets ---

// One sequence with a prompt four times its budget, alone in a pool for its
// whole prompt, and a step budget that would compute the prompt at once.
scheduler_config long_prompt_config() {
  scheduler_config c = policy_config(1024);
  c.max_model_len = 1024;
  c.max_num_batched_tokens = 1024;
  return c;
}

struct long_prompt_run {
  int peak_blocks = 0;                // the most blocks its table held during a step
  std::vector<int> prompt_steps;      // tokens of each step that computed prompt tokens
  std::vector<std::pair<int, int>> after;  // (tokens computed, slots stored) after each step
  request_usage usage;
};

long_prompt_run run_long_prompt(const std::string& policy, int n_prompt, int max_tokens = 8) {
  harness h(long_prompt_config());
  request r = req("a", prompt_of(n_prompt), max_tokens);
  r.kv_policy = policy;
  h.add(std::move(r));
  long_prompt_run out;
  h.after_execute = [&] {
    if (const auto a = h.s.find_sequence("a"))
      out.peak_blocks = std::max(out.peak_blocks, static_cast<int>(h.s.kv().block_table(*a).size()));
  };
  int computed = 0;
  for (int i = 0; i < 10000 && h.s.has_work(); ++i) {
    const step_plan& plan = h.step();
    for (const scheduled_seq& q : plan.seqs) {
      if (computed < n_prompt) out.prompt_steps.push_back(static_cast<int>(q.tokens.size()));
      computed += static_cast<int>(q.tokens.size());
    }
    if (const auto a = h.s.find_sequence("a")) out.after.emplace_back(computed, h.s.kv().n_stored_tokens(*a));
  }
  EXPECT_EQ(h.results["a"].tokens.size(), static_cast<std::size_t>(max_tokens)) << policy;
  out.usage = h.results["a"].usage;
  return out;
}

// The peak: a prompt longer than its budget is computed in chunks with the
// policy acting between them, so the sequence holds its budget plus one chunk
// (in whole blocks), not the whole prompt. With chunk=0 (the engine before
// this) the whole prompt is held at once.
TEST(scheduler_policy, a_long_prompt_peaks_at_its_budget_plus_a_chunk) {
  const int n_prompt = 400, bs = 4;
  const int budget = 100;  // 25% of the prompt
  const int chunk = 100;   // the default: the budget in whole blocks (at most 256)
  for (const char* p : {"window:budget=0.25", "h2o:budget=0.25", "snapkv:budget=0.25", "snapkv:budget=0.25,once=1",
                        "pyramid:budget=0.25,base=h2o"}) {
    SCOPED_TRACE(p);
    const long_prompt_run chunked = run_long_prompt(p, n_prompt);
    EXPECT_LE(chunked.peak_blocks, (budget + chunk + bs - 1) / bs + 1);
    EXPECT_GE(chunked.prompt_steps.size(), 4u);
    const long_prompt_run whole = run_long_prompt(std::string(p) + ",chunk=0", n_prompt);
    EXPECT_EQ(whole.prompt_steps, (std::vector<int>{n_prompt}));
    EXPECT_GE(whole.peak_blocks, n_prompt / bs);
  }
  // An explicit chunk: the budget plus that.
  const long_prompt_run small = run_long_prompt("h2o:budget=0.25,chunk=20", n_prompt);
  EXPECT_LE(small.peak_blocks, (budget + 20 + bs - 1) / bs + 1);
  // A prompt within its budget and one chunk is computed whole, as it peaks no higher.
  EXPECT_EQ(run_long_prompt("h2o:budget=150", 250).prompt_steps, (std::vector<int>{250}));
  // No policy, or one that does not evict: whole.
  EXPECT_EQ(run_long_prompt("none", n_prompt).prompt_steps, (std::vector<int>{n_prompt}));
}

// SnapKV's final choice sees the prompt's last `window` tokens in one step:
// the chunk before the last gives way so the last one holds the window.
TEST(scheduler_policy, snapkvs_last_prompt_chunk_holds_its_observation_window) {
  int saw_short_tail = 0;
  for (int n_prompt = 200; n_prompt < 240; ++n_prompt) {
    SCOPED_TRACE(n_prompt);
    const long_prompt_run run = run_long_prompt("snapkv:budget=24,window=12,chunk=20", n_prompt, 2);
    ASSERT_GE(run.prompt_steps.size(), 2u);
    EXPECT_GE(run.prompt_steps.back(), 12);
    for (const int n : run.prompt_steps) EXPECT_LE(n, 20);
    saw_short_tail += n_prompt % 20 != 0 && n_prompt % 20 < 12;
  }
  EXPECT_GT(saw_short_tail, 0);
}

// Exact budgets by default: once over budget, after every step the sequence
// holds exactly its budget (a fraction of the tokens seen, rounded up), and
// the usage says what it keeps. With slack=K it holds up to K more.
TEST(scheduler_policy, budgets_are_exact_by_default_and_usage_reports_what_is_kept) {
  const kv_budget quarter{0.25, 0};
  for (const char* p : {"window:budget=0.25", "h2o:budget=0.25", "snapkv:budget=0.25"}) {
    SCOPED_TRACE(p);
    const long_prompt_run run = run_long_prompt(p, 300, 40);
    for (const auto& [seen, stored] : run.after) EXPECT_EQ(stored, quarter.resolve(seen)) << seen;
    // The last sampled token is never computed.
    EXPECT_EQ(run.usage.kv_tokens_seen, 300 + 40 - 1);
    EXPECT_EQ(run.usage.kv_tokens_kept, quarter.resolve(300 + 40 - 1));
  }
  const long_prompt_run fixed = run_long_prompt("h2o:budget=32", 300, 40);
  for (const auto& [seen, stored] : fixed.after) EXPECT_EQ(stored, std::min(seen, 32)) << seen;
  EXPECT_EQ(fixed.usage.kv_tokens_kept, 32);
  const long_prompt_run slack = run_long_prompt("h2o:budget=32,slack=8", 300, 40);
  bool over = false;
  for (const auto& [seen, stored] : slack.after) {
    EXPECT_LE(stored, 32 + 8) << seen;
    over |= stored > 32;
  }
  EXPECT_TRUE(over);
  EXPECT_GE(slack.usage.kv_tokens_kept, 32);
  EXPECT_LE(slack.usage.kv_tokens_kept, 32 + 8);
  // Full KV reports nothing kept apart.
  const long_prompt_run none = run_long_prompt("none", 300, 4);
  EXPECT_EQ(none.usage.kv_tokens_seen, 0);
  EXPECT_EQ(none.usage.kv_tokens_kept, 0);
}

// A bad policy is a clear error when the request is added.
TEST(scheduler_policy, unknown_policies_are_refused) {
  harness h(policy_config(64));
  request r = req("a", prompt_of(5), 4);
  r.kv_policy = "no_such_policy";
  const status st = h.s.add_request(std::move(r));
  EXPECT_EQ(st.code(), errc::invalid_argument);
  EXPECT_NE(st.message().find("no_such_policy"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace pagoda

namespace pagoda {
namespace {

// Review: KV classes in the scheduler. Class 0 of 32 blocks, class 1 ("int4") of 4.
scheduler_config class_sched_config(int budget = 64) {
  scheduler_config c = config(36, 8, budget);
  c.kv_class_blocks = {32, 4};
  c.kv_class_of = [](const std::string& t) -> result<std::uint8_t> {
    if (t == "int4") return std::uint8_t{1};
    if (t == "f16") return std::uint8_t{0};
    return error(errc::invalid_argument, "unknown type {}", t);
  };
  return c;
}

request typed(const std::string& id, std::vector<token_id> prompt, int max_tokens, std::int32_t begin, std::int32_t end) {
  request r = req(id, std::move(prompt), max_tokens);
  r.segments.push_back(prompt_segment{begin, end, "", "int4"});
  return r;
}

// A sequence blocked on class 1 only: preempting a sequence that holds no
// class-1 block frees nothing it can use. C holds 3 of the 4 int4 blocks, A
// the 4th and wants another; B (f16 only, lowest priority) holds none.
TEST(scheduler_kv_classes, a_class_blocked_sequence_preempts_only_holders_of_that_class) {
  harness h(class_sched_config());
  h.add(typed("C", prompt_of(12, 1), 30, 0, 12));  // 3 int4 blocks
  request a = typed("A", prompt_of(9, 2), 4, 0, 8);  // 2 int4 blocks, fed 4 tokens a step
  a.prompt_chunk = 4;
  h.add(a);
  request b = req("B", prompt_of(4, 3), 30);
  b.priority = 5;
  h.add(b);
  h.step();
  ASSERT_TRUE(h.s.find_sequence("C").has_value());
  ASSERT_TRUE(h.s.find_sequence("A").has_value());
  ASSERT_TRUE(h.s.find_sequence("B").has_value());
  bool b_preempted = false;
  while (h.s.has_work()) {
    h.step();
    if (!h.s.find_sequence("B").has_value() && h.results["B"].finish.empty()) b_preempted = true;
  }
  EXPECT_FALSE(b_preempted) << "B holds no int4 block, yet was preempted for A's";
  EXPECT_EQ(h.results["B"].tokens.size(), 30u);
}

// A request waiting for a block of class 1 does not hold back requests behind
// it that need only class 0 blocks, which are plenty; one behind it that needs
// class 1 waits its turn.
TEST(scheduler_kv_classes, a_request_waiting_for_class_1_does_not_block_class_0_requests) {
  harness h(class_sched_config());
  h.add(typed("C", prompt_of(16, 1), 40, 0, 16));  // all 4 int4 blocks until it ends
  h.step();
  h.add(typed("A", prompt_of(8, 2), 4, 0, 8));  // needs 2 int4 blocks: waits for C
  h.add(req("B", prompt_of(4, 3), 4));          // f16 only
  h.add(typed("D", prompt_of(4, 4), 4, 0, 4));  // needs 1 int4 block: behind A
  h.step();
  EXPECT_TRUE(h.s.find_sequence("B").has_value()) << "B waits behind A although class 0 is nearly empty";
  EXPECT_FALSE(h.s.find_sequence("A").has_value());
  EXPECT_FALSE(h.s.find_sequence("D").has_value()) << "D jumped ahead of A for class 1";
  h.run();
}

// Preempted with generated tokens, a sequence is re-added with prompt +
// generated tokens and the same runs; its outputs match a run alone.
TEST(scheduler_kv_classes, readmission_after_preemption_keeps_classes_valid) {
  std::vector<request> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(typed("r" + std::to_string(i), prompt_of(9, i), 20, 0, 9));
  harness h(class_sched_config());
  for (const request& r : reqs) h.add(r);
  h.run();
  for (const request& r : reqs) {
    harness one(class_sched_config());
    one.add(r);
    one.run();
    EXPECT_EQ(h.results[r.id].tokens, one.results[r.id].tokens) << r.id;
  }
}

}  // namespace
}  // namespace pagoda
