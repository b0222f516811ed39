// engine_stats::kv_reads: what attention read against what it could see,
// counted by the forward pass and summed by the scheduler per KV policy and
// phase, checked against sums worked out from the step shapes alone.
#include <gtest/gtest.h>

#include "common/engine_configs.h"
#include "common/requests.h"
#include "common/stories.h"
#include "policy/quest.h"
#include "sched/engine_core.h"

namespace pagoda {
namespace {

using test::stories;
using test::story_tokens;

constexpr int k_prompt = 300;
constexpr int k_new = 8;
constexpr int k_block = 16;

engine_core_config config(const std::string& policy, std::int64_t n_blocks) {
  const llama_hparams& hp = stories().hparams();
  engine_core_config c =
      test::uniform_engine(hp, {.n_blocks = n_blocks, .type = kv_type::f16, .block_size = k_block});
  c.kv_policy = policy;
  return c;
}


// Runs one greedy request of k_prompt tokens and k_new new ones (a pool of
// n_blocks: retrieval's indexes are paid for in blocks too).
engine_stats run_one(const std::string& policy, std::int64_t n_blocks = 64) {
  auto e = engine_core::create(stories(), config(policy, n_blocks));
  EXPECT_TRUE(e.ok()) << e.error().message();
  request r = test::greedy_ids("r", story_tokens(k_prompt), k_new);
  r.ignore_eos = true;
  const status added = (*e)->add_request(r);
  EXPECT_TRUE(added.ok()) << added.message();
  std::vector<engine_event> events;
  while ((*e)->has_work()) {
    events.clear();
    (*e)->step(events);
  }
  return (*e)->stats();
}

std::int64_t blocks_of(std::int64_t n) { return (n + k_block - 1) / k_block; }

// Full attention: each row reads all it sees. The prompt runs as one chunk
// (rows see 1 .. k_prompt slots); decode step j's row sees k_prompt + 1 + j.
TEST(kv_reads, full_attention_reads_every_visible_token) {
  const llama_hparams& hp = stories().hparams();
  const std::int64_t heads = static_cast<std::int64_t>(hp.n_layer) * hp.n_head_kv;
  const engine_stats st = run_one("none");
  ASSERT_EQ(st.kv_reads.size(), 1u);
  const kv_read_stats& r = st.kv_reads.at("none");
  kv_read_counts prompt, decode;
  for (std::int64_t e = 1; e <= k_prompt; ++e) prompt += kv_read_counts{1, e, e, blocks_of(e), blocks_of(e)};
  for (std::int64_t j = 0; j < k_new - 1; ++j) {
    const std::int64_t e = k_prompt + 1 + j;
    decode += kv_read_counts{1, e, e, blocks_of(e), blocks_of(e)};
  }
  auto times = [&](kv_read_counts c) {
    return kv_read_counts{c.rows * heads, c.tokens_visible * heads, c.tokens_read * heads, c.blocks_visible * heads,
                          c.blocks_read * heads};
  };
  EXPECT_EQ(r.prompt, times(prompt));
  EXPECT_EQ(r.decode, times(decode));
}

// Quest reads its budget of blocks per decode row (the sink block and the
// newest, partial one included) and the whole triangle for the prompt.
TEST(kv_reads, quest_reads_its_budget_of_blocks_per_decode_row) {
  const std::string spec = "quest:budget=0.25,min_context=64";
  const llama_hparams& hp = stories().hparams();
  const std::int64_t heads = static_cast<std::int64_t>(hp.n_layer) * hp.n_head_kv;
  const quest_params p = *parse_quest_params(*parse_kv_policy_spec(spec));
  const engine_stats st = run_one(spec);
  ASSERT_EQ(st.kv_reads.count("quest"), 1u);
  const kv_read_stats& r = st.kv_reads.at("quest");
  EXPECT_EQ(r.prompt.tokens_read, r.prompt.tokens_visible) << "a prompt chunk reads everything";
  kv_read_counts decode;
  for (std::int64_t j = 0; j < k_new - 1; ++j) {
    const std::int64_t e = k_prompt + 1 + j, n_blocks = blocks_of(e);
    const std::int64_t n_read = p.blocks_read(static_cast<int>(n_blocks));
    const std::int64_t newest = e - (n_blocks - 1) * k_block;
    decode += kv_read_counts{1, e, (n_read - 1) * k_block + newest, n_blocks, n_read};
  }
  EXPECT_EQ(r.decode.rows, decode.rows * heads);
  EXPECT_EQ(r.decode.tokens_visible, decode.tokens_visible * heads);
  EXPECT_EQ(r.decode.blocks_visible, decode.blocks_visible * heads);
  EXPECT_EQ(r.decode.blocks_read, decode.blocks_read * heads);
  EXPECT_EQ(r.decode.tokens_read, decode.tokens_read * heads);
  EXPECT_LT(r.decode.tokens_read * 3, r.decode.tokens_visible) << "a quarter of the blocks, about a quarter of the tokens";
}

// Retrieval's sampled recall reaches the engine's stats by index kind: with
// recall_every=1 every search is checked; HNSW built inline finds most of the
// exact top-k of stories260K's keys. An exact top-k searches no index.
TEST(kv_reads, retrieval_recall_is_summed_by_index_kind) {
  const engine_stats st = run_one("retrieval:index=hnsw,k=8,background=0,recall_every=1", 1024);
  ASSERT_EQ(st.recall_by_index.count("hnsw"), 1u);
  const index_recall& r = st.recall_by_index.at("hnsw");
  EXPECT_GT(r.searches, 0u);
  const auto n_rep = static_cast<std::uint64_t>(stories().hparams().n_rep());
  EXPECT_EQ(r.wanted, 8u * n_rep * r.searches) << "every search checked: k slots for each query row of the group";
  EXPECT_LE(r.found, r.wanted);
  EXPECT_GT(static_cast<double>(r.found), 0.5 * static_cast<double>(r.wanted));
  EXPECT_LT(st.kv_reads.at("retrieval").decode.tokens_read, st.kv_reads.at("retrieval").decode.tokens_visible);
  EXPECT_TRUE(run_one("retrieval:index=exact,k=8", 1024).recall_by_index.empty());
}

}  // namespace
}  // namespace pagoda
