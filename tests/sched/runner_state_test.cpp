// The runner's per-sequence state (runner_state.h): what plans' deltas do to
// it, the samples it draws, and the errors for plans that do not fit it. And
// the block hooks as model_runner virtuals, through a wrapper.
#include "sched/runner_state.h"

#include <gtest/gtest.h>

#include "common/engine_configs.h"
#include "common/requests.h"
#include "sched/engine_core.h"

namespace pagoda {
namespace {

using test::greedy_request;
using test::stories;

constexpr int k_vocab = 32;

std::vector<block_id> ids(std::initializer_list<int> v) {
  std::vector<block_id> out;
  for (int b : v) out.push_back(block_id(b));
  return out;
}

// A sequence's first run: its setup, and its KV state in full.
scheduled_seq first_run(seq_id id, std::vector<token_id> prompt, std::vector<block_id> table) {
  scheduled_seq q;
  q.seq = id;
  q.tokens = prompt;
  for (std::size_t i = 0; i < prompt.size(); ++i) q.positions.push_back(static_cast<std::int32_t>(i));
  q.n_tokens = static_cast<std::int32_t>(prompt.size());
  q.sample = true;
  seq_setup u;
  u.sampling = sampling_params::greedy();
  u.tokens = prompt;
  u.n_prompt = static_cast<std::int32_t>(prompt.size());
  q.setup = u;
  q.fresh_kv = true;
  q.tables.push_back({0, 0, 0, std::move(table)});
  return q;
}

// A later step of one token at `position`: n_stored slots, n_tokens tokens
// so far, the first keep positions as the runner has them and `stored` after.
scheduled_seq next_step(seq_id id, token_id token, std::int32_t position, std::int32_t n_stored, std::int32_t n_tokens,
                        std::int32_t keep, std::vector<std::int32_t> stored, std::vector<table_update> tables = {}) {
  scheduled_seq q;
  q.seq = id;
  q.tokens = {token};
  q.positions = {position};
  q.n_stored = n_stored;
  q.n_tokens = n_tokens;
  q.keep_positions = keep;
  q.stored_positions = std::move(stored);
  q.tables = std::move(tables);
  return q;
}

// Logits for `rows` rows whose argmax is `best`.
std::vector<float> rows_for(int rows, token_id best) {
  std::vector<float> l(static_cast<std::size_t>(rows) * k_vocab, 0.0f);
  for (int r = 0; r < rows; ++r) l[static_cast<std::size_t>(r) * k_vocab + best] = 5.0f;
  return l;
}

runner_state make_state() { return runner_state(runner_shape{1, 1, 8, 4}, {}); }

TEST(runner_state, deltas_append_replace_and_null_table_entries) {
  runner_state st = make_state();
  step_plan p;
  p.seqs.push_back(first_run(seq_id(1), {5, 6, 7, 8, 9}, ids({10, 11})));
  ASSERT_TRUE(st.apply(p).ok());
  runner_state::sequence* s = st.find(seq_id(1));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->tables[0], ids({10, 11}));
  EXPECT_EQ(s->positions, (std::vector<std::int32_t>{0, 1, 2, 3, 4}));

  // A decode step: one appended block, a window that let the first go, a
  // compaction that rewrote slots from 3 on (stored positions from there).
  scheduled_seq q = next_step(seq_id(1), 20, 9, 5, 5, 3, {5, 7}, {{0, 1, 2, ids({12})}});
  step_plan d;
  d.seqs.push_back(q);
  ASSERT_TRUE(st.apply(d).ok());
  EXPECT_EQ(s->tables[0], (std::vector<block_id>{block_id(), block_id(11), block_id(12)}));
  EXPECT_EQ(s->positions, (std::vector<std::int32_t>{0, 1, 2, 5, 7, 9}));

  // A copy-on-write replaces the last entry; a second group appears.
  d.seqs = {next_step(seq_id(1), 21, 10, 6, 5, 6, {}, {{0, 1, 2, ids({13})}, {1, 0, 0, ids({40, 41})}})};
  ASSERT_TRUE(st.apply(d).ok());
  EXPECT_EQ(s->tables[0], (std::vector<block_id>{block_id(), block_id(11), block_id(13)}));
  EXPECT_EQ(s->tables[1], ids({40, 41}));
}

TEST(runner_state, plans_that_do_not_fit_are_errors) {
  runner_state st = make_state();
  step_plan p;
  scheduled_seq unknown = first_run(seq_id(3), {1, 2}, ids({0}));
  unknown.setup.reset();
  p.seqs.push_back(unknown);
  EXPECT_EQ(st.apply(p).code(), errc::internal);

  p.seqs = {first_run(seq_id(3), {1, 2, 3, 4, 5}, ids({0}))};  // 5 slots, one block of 4
  EXPECT_EQ(st.apply(p).code(), errc::internal);

  p.seqs = {first_run(seq_id(3), {1, 2}, ids({0}))};
  p.seqs[0].keep_positions = 1;  // positions it never had
  EXPECT_EQ(st.apply(p).code(), errc::internal);

  p.seqs = {first_run(seq_id(3), {1, 2}, ids({0}))};
  p.seqs[0].n_tokens = 9;  // more tokens than its history
  EXPECT_EQ(st.apply(p).code(), errc::internal);
}

TEST(runner_state, forks_draw_from_the_last_row_and_keep_their_own_history) {
  runner_state st = make_state();
  step_plan p;
  scheduled_seq q = first_run(seq_id(1), {3, 4, 5}, ids({0}));
  q.setup->logprobs = 2;
  q.forks = {{seq_id(7), 11}, {seq_id(8), 12}};
  p.seqs.push_back(q);
  ASSERT_TRUE(st.apply(p).ok());
  std::vector<float> logits = rows_for(1, 9);
  step_output out;
  ASSERT_TRUE(st.sample(p, logits, k_vocab, out).ok());
  ASSERT_EQ(out.sampled.size(), 3u);
  EXPECT_EQ(out.sampled[0].seq, seq_id(7));
  EXPECT_EQ(out.sampled[1].seq, seq_id(8));
  EXPECT_EQ(out.sampled[2].seq, seq_id(1));
  const std::vector<float> row = rows_for(1, 9);
  for (const sampled_token& t : out.sampled) {
    EXPECT_EQ(t.token, 9);
    ASSERT_TRUE(t.logprob.has_value());
    EXPECT_EQ(t.logprob->logprob, sampler::log_prob(row, 9));
    EXPECT_EQ(t.logprob->top, sampler::top_log_probs(row, 2));
  }
  EXPECT_TRUE(out.prompt_logits.empty());
  for (const seq_id id : {seq_id(1), seq_id(7), seq_id(8)})
    EXPECT_EQ(st.find(id)->history, (std::vector<token_id>{3, 4, 5, 9}));
  EXPECT_EQ(st.find(seq_id(8))->params.seed, 12u);
  EXPECT_TRUE(st.find(seq_id(8))->tables.empty()) << "a fork's KV state comes with its first run";

  // A truncation cuts the history; a preemption drops the KV state and keeps
  // the history; the end frees everything.
  step_plan later;
  later.preempted = {seq_id(7)};
  later.finished = {seq_id(8)};
  later.seqs.push_back(next_step(seq_id(1), 4, 1, 1, 2, 1, {}));
  ASSERT_TRUE(st.apply(later).ok());
  EXPECT_EQ(st.find(seq_id(1))->history, (std::vector<token_id>{3, 4}));
  EXPECT_EQ(st.find(seq_id(1))->positions, (std::vector<std::int32_t>{0, 1}));
  EXPECT_TRUE(st.find(seq_id(7))->tables.empty());
  EXPECT_EQ(st.find(seq_id(7))->history.size(), 4u);
  EXPECT_EQ(st.find(seq_id(8)), nullptr);
}

TEST(runner_state, prompt_rows_are_kept_and_the_rest_dropped) {
  runner_state st = make_state();
  step_plan p;
  scheduled_seq a = first_run(seq_id(1), {3, 4}, ids({0}));
  scheduled_seq b = first_run(seq_id(2), {5, 6, 7}, ids({1}));
  b.all_logits = true;
  b.sample = false;
  p.seqs = {a, b};
  ASSERT_TRUE(st.apply(p).ok());
  std::vector<float> logits = rows_for(1, 2);
  const std::vector<float> scored = rows_for(3, 6);
  logits.insert(logits.end(), scored.begin(), scored.end());
  step_output out;
  ASSERT_TRUE(st.sample(p, logits, k_vocab, out).ok());
  EXPECT_EQ(out.prompt_logits, scored);
  ASSERT_EQ(out.sampled.size(), 1u);
  EXPECT_EQ(out.sampled[0].token, 2);
  EXPECT_FALSE(out.sampled[0].logprob.has_value());
}

// Per-row positions: sent in full when a compaction rewrote them, else cut
// to the stored slots and the step's positions appended to every row.
TEST(runner_state, rows_follow_compactions_and_steps) {
  runner_state st = make_state();
  step_plan p;
  p.seqs.push_back(first_run(seq_id(1), {3, 4, 5, 6}, ids({0})));
  ASSERT_TRUE(st.apply(p).ok());
  scheduled_seq q = next_step(seq_id(1), 8, 4, 3, 4, 0, {0, 2, 3}, {{0, 0, 0, ids({0})}});
  q.rows = {0, 2, 3, -1, 0, 3};  // two rows of 3 slots, row 1's first dead
  step_plan d;
  d.seqs = {q};
  ASSERT_TRUE(st.apply(d).ok());
  runner_state::sequence* s = st.find(seq_id(1));
  ASSERT_EQ(s->n_rows, 2);
  auto row = [&](int r) {
    return std::vector<std::int32_t>(s->rows.begin() + static_cast<std::ptrdiff_t>(r * s->row_stride),
                                     s->rows.begin() + static_cast<std::ptrdiff_t>(r * s->row_stride) + 4);
  };
  EXPECT_EQ(row(0), (std::vector<std::int32_t>{0, 2, 3, 4}));
  EXPECT_EQ(row(1), (std::vector<std::int32_t>{-1, 0, 3, 4}));
  d.seqs = {next_step(seq_id(1), 9, 5, 4, 4, 4, {}, {{0, 0, 1, ids({1})}})};
  ASSERT_TRUE(st.apply(d).ok());
  EXPECT_EQ(row(1), (std::vector<std::int32_t>{-1, 0, 3, 4}));
  EXPECT_EQ(s->rows[static_cast<std::size_t>(1 * s->row_stride + 4)], 5);
}

// Counts the blocks the commit hook sees.
class counting_runner final : public runner_wrapper {
 public:
  using runner_wrapper::runner_wrapper;
  void set_commit_hook(commit_hook hook) override {
    runner_wrapper::set_commit_hook([this, hook = std::move(hook)](const cached_block& b) {
      ++n_cached;
      if (hook) hook(b);
    });
  }
  int n_cached = 0;
};

// The block hooks are the runner's (model_runner): the engine sets them on
// whatever runner it has, and a wrapper put in front sees and forwards them.
TEST(model_runner, block_hooks_go_through_the_runner_in_front) {
  const engine_core_config c = test::uniform_engine(stories().hparams(), {.n_blocks = 64, .max_model_len = 256});
  auto e = *engine_core::create(stories(), c);
  counting_runner* counter = nullptr;
  e->wrap_runner([&](std::unique_ptr<model_runner> inner) {
    auto r = std::make_unique<counting_runner>(std::move(inner));
    counter = r.get();
    return r;
  });
  int hooked = 0;
  e->set_commit_hook([&](const cached_block& b) {
    ++hooked;
    EXPECT_EQ(b.tokens.size(), 16u);
    EXPECT_FALSE(b.bytes.empty());
  });
  ASSERT_TRUE(e->add_request(greedy_request("a", "Once upon a time there was a little girl named Lily who", 40)).ok());
  std::vector<engine_event> events;
  while (e->has_work()) e->step(events);
  e->flush(events);
  EXPECT_GE(hooked, 2);
  EXPECT_EQ(counter->n_cached, hooked);
}

}  // namespace
}  // namespace pagoda
