// The engine on a mixture-of-experts model (qwen3moe, synth tiny-qwen3moe):
// experts hold no state, so the KV cache is qwen3's, and batching, KV
// policies, KV classes and the prefix cache work on it unchanged.
#include <map>

#include <gtest/gtest.h>

#include "common/engine_configs.h"
#include "common/requests.h"
#include "common/synth_model.h"
#include "sched/engine_core.h"

namespace pagoda {
namespace {

using test::greedy_ids;

std::unique_ptr<llama_model> moe_model() { return test::load_synth("tiny-qwen3moe", gguf::tensor_type::q8_0); }

engine_core_config moe_engine(const llama_hparams& hp, std::int64_t n_blocks) {
  return test::uniform_engine(
      hp, {.n_blocks = n_blocks, .max_num_seqs = 16, .max_num_batched_tokens = 256, .n_threads = 2});
}

std::vector<token_id> prompt_of(int n, int salt) {
  std::vector<token_id> p;
  for (int i = 0; i < n; ++i) p.push_back(static_cast<token_id>(3 + (i * 37 + salt * 101) % 500));
  return p;
}

struct run_result {
  std::map<std::string, std::vector<token_id>> tokens;
  std::map<std::string, request_usage> usage;
};

// Runs the requests to the end, checking the KV invariants after every step.
run_result run(engine_core& e, const std::vector<request>& reqs) {
  run_result out;
  for (const request& r : reqs) {
    const status st = e.add_request(r);
    EXPECT_TRUE(st.ok()) << st.message();
  }
  std::vector<engine_event> ev;
  while (e.has_work()) {
    ev.clear();
    e.step(ev);
    for (const engine_event& x : ev) {
      EXPECT_TRUE(x.error.empty()) << x.error;
      out.tokens[x.request_id].insert(out.tokens[x.request_id].end(), x.tokens.begin(), x.tokens.end());
      if (x.request_finished) out.usage[x.request_id] = x.usage;
    }
    const status inv = e.kv().check_invariants();
    EXPECT_TRUE(inv.ok()) << inv.message();
  }
  return out;
}

// Many requests in the same steps (every step routes all of their tokens
// through the experts together) give each one's tokens as it alone does.
TEST(engine_moe, requests_together_equal_each_alone) {
  auto model = moe_model();
  ASSERT_TRUE(model);
  std::vector<request> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back(greedy_ids("r" + std::to_string(i), prompt_of(10 + 7 * i, i), 24));
  auto together = *engine_core::create(*model, moe_engine(model->hparams(), 256));
  const run_result all = run(*together, reqs);
  EXPECT_GE(together->stats().peak_running, 8);
  for (const request& r : reqs) {
    auto alone = *engine_core::create(*model, moe_engine(model->hparams(), 256));
    const run_result one = run(*alone, {r});
    ASSERT_EQ(all.tokens.at(r.id).size(), 24u);
    EXPECT_EQ(all.tokens.at(r.id), one.tokens.at(r.id)) << r.id;
  }
  EXPECT_EQ(together->kv_stats().n_blocks_used, 0);
}

// A KV policy evicts on the MoE model as on any other (a long generation
// under a 32-token budget holds a few blocks), and the prefix cache serves a
// later request's shared prompt: the same tokens as computed from scratch.
TEST(engine_moe, a_kv_policy_and_the_prefix_cache_work_unchanged) {
  auto model = moe_model();
  ASSERT_TRUE(model);
  const llama_hparams& hp = model->hparams();
  {
    auto e = *engine_core::create(*model, moe_engine(hp, 64));
    request r = greedy_ids("evicting", prompt_of(40, 1), 200);
    r.kv_policy = "h2o:budget=32";
    ASSERT_TRUE(e->add_request(r).ok());
    std::vector<engine_event> ev;
    std::int32_t peak = 0;
    std::size_t n_tokens = 0;
    while (e->has_work()) {
      ev.clear();
      e->step(ev);
      for (const engine_event& x : ev) n_tokens += x.tokens.size();
      peak = std::max(peak, e->kv_stats().n_blocks_used);
      const status inv = e->kv().check_invariants();
      ASSERT_TRUE(inv.ok()) << inv.message();
    }
    EXPECT_EQ(n_tokens, 200u);
    EXPECT_GT(e->stats().n_policy_compactions, 10);
    EXPECT_LE(peak, (40 + 15) / 16 + 2);  // the prompt's blocks, then the budget and the open block
    EXPECT_EQ(e->kv_stats().n_blocks_used, 0);
  }
  const std::vector<token_id> shared = prompt_of(96, 2);
  std::vector<token_id> longer = shared;
  for (token_id t : prompt_of(20, 3)) longer.push_back(t);
  auto e = *engine_core::create(*model, moe_engine(hp, 128));
  run(*e, {greedy_ids("first", shared, 8)});
  const run_result second = run(*e, {greedy_ids("second", longer, 16)});
  EXPECT_GE(second.usage.at("second").cached_tokens, 96);
  auto fresh = *engine_core::create(*model, moe_engine(hp, 128));
  const run_result scratch = run(*fresh, {greedy_ids("second", longer, 16)});
  EXPECT_EQ(scratch.usage.at("second").cached_tokens, 0);
  EXPECT_EQ(second.tokens.at("second"), scratch.tokens.at("second"));
}

}  // namespace
}  // namespace pagoda
