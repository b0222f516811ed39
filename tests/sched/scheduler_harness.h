// The scheduler tests' harness: the scheduler, the output step and a fake
// runner (fake_runner.h) driven step by step, with no model: the tokenizer of
// stories260K gives them a vocabulary, nothing more. Every step checks the KV
// manager's invariants and that the runner's per-sequence state agrees with
// its KV; results gather each request's tokens, text and finish.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "model/gguf.h"
#include "sched/fake_runner.h"
#include "sched/output_processor.h"
#include "sched/scheduler.h"

namespace pagoda::test {

inline const tokenizer& vocab() {
  static std::unique_ptr<tokenizer> tok = [] {
    auto file = gguf::file::open(std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf");
    EXPECT_TRUE(file.ok());
    auto t = tokenizer::from_gguf(**file);
    EXPECT_TRUE(t.ok());
    return std::move(*t);
  }();
  return *tok;
}

inline scheduler_config config(std::int64_t n_blocks, int max_seqs = 16, int budget = 64, int block_size = 4) {
  scheduler_config c;
  c.max_model_len = 256;
  c.max_num_seqs = max_seqs;
  c.max_num_batched_tokens = budget;
  c.block_size = block_size;
  c.n_blocks = n_blocks;
  return c;
}

inline std::vector<token_id> prompt_of(int n, int salt = 0) {
  std::vector<token_id> p(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = 3 + (i * 7 + salt * 13) % 400;
  return p;
}

inline request req(const std::string& id, std::vector<token_id> prompt, int max_tokens, const std::string& tenant = "") {
  request r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.tenant = tenant;
  return r;
}

struct result_of {
  std::vector<token_id> tokens;
  std::string text;
  std::string finish;
  std::string error;
  request_usage usage;
};

struct harness {
  scheduler_config cfg;
  scheduler s;
  output_processor output;
  fake_runner runner;
  std::map<std::string, result_of> results;
  std::vector<step_plan> plans;  // what schedule() returned, in order
  std::vector<block_id> last_blocks;  // every block the last plan's sequences write into, copied
  std::vector<engine_event> last_events;  // what the last step handed out
  // Called between the runner's execution and update(): the block ops of the
  // plan have been applied to the fake KV, nothing of the step is committed.
  std::function<void()> after_execute;

  explicit harness(const scheduler_config& c)
      : cfg(c),
        s(c, vocab()),
        output(vocab(), s),
        runner(static_cast<std::int32_t>(c.n_blocks), c.block_size, vocab().n_vocab()) {
    EXPECT_TRUE(s.check().ok()) << s.check().message();
  }

  void add(request r) {
    const std::string id = r.id;
    std::vector<std::string> stop = r.stop;
    const status st = s.add_request(std::move(r));
    ASSERT_TRUE(st.ok()) << st.message();
    output.add_request(id, std::move(stop));
    results[id];
  }

  // One step; returns the plan.
  const step_plan& step() {
    step_plan plan = s.schedule();
    step_output out;
    if (!plan.empty()) runner.execute(plan, out);
    if (after_execute) after_execute();
    last_blocks.clear();
    for (const scheduled_seq& q : plan.seqs) {
      const std::vector<block_id> t = runner.table_of(q.seq);
      last_blocks.insert(last_blocks.end(), t.begin(), t.end());
    }
    std::vector<engine_event>& events = last_events;
    events.clear();
    s.update(plan, out, events);
    output.process(events);
    for (const engine_event& e : events) {
      result_of& r = results[e.request_id];
      r.tokens.insert(r.tokens.end(), e.tokens.begin(), e.tokens.end());
      r.text += e.text;
      if (!e.finish_reason.empty()) r.finish = e.finish_reason;
      if (!e.error.empty()) r.error = e.error;
      if (e.request_finished) r.usage = e.usage;
    }
    const status st = s.kv().check_invariants();
    EXPECT_TRUE(st.ok()) << st.message();
    EXPECT_TRUE(runner.positions_match) << "the runner's stored positions are not its KV's";
    plans.push_back(std::move(plan));
    return plans.back();
  }

  void run(int max_steps = 10000) {
    for (int i = 0; i < max_steps && s.has_work(); ++i) step();
    EXPECT_FALSE(s.has_work());
    step();  // hands out anything left (aborts)
  }

  static bool planned(const step_plan& p, seq_id id) {
    return std::any_of(p.seqs.begin(), p.seqs.end(), [&](const scheduled_seq& q) { return q.seq == id; });
  }
};

// Each request alone in a big pool: the reference tokens.
inline std::vector<token_id> alone(const request& r) {
  harness h(config(1024, 4, 512));
  h.add(r);
  h.run();
  return h.results[r.id].tokens;
}

}  // namespace pagoda::test
