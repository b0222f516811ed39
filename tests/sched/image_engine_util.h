// What the engine's image tests share (engine_image_test.cpp,
// engine_gemma3_image_test.cpp): the vision oracle's files, requests run to
// the end with their events gathered, logprobs compared bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/llama.h"
#include "pagoda/config.h"
#include "pagoda/request.h"
#include "sched/engine_core.h"

namespace pagoda::test {

inline std::string vision_dir() { return std::string(PAGODA_SOURCE_DIR) + "/tests/data/oracle/vision"; }

// text-tiny-F32, the idefics3 oracle's text model, loaded once (the server's image tests use it too).
inline const llama_model& vision_text_model() {
  static const std::unique_ptr<llama_model> m = [] {
    auto r = llama_model::load(vision_dir() + "/text-tiny-F32.gguf");
    EXPECT_TRUE(r.ok()) << r.error().message();
    return std::move(*r);
  }();
  return *m;
}

// What `run` and `serve` take (engine_config) over one of the oracle's text
// models (`model_file` in vision_dir()): f32 KV, one thread.
inline engine_config vision_engine_config(const std::string& model_file, int n_ctx, int max_num_seqs,
                                          std::int64_t max_kv_tokens) {
  engine_config ec;
  ec.model_path = vision_dir() + "/" + model_file;
  ec.kv_cache_dtype = "f32";
  ec.n_ctx = n_ctx;
  ec.n_threads = 1;
  ec.max_num_seqs = max_num_seqs;
  ec.max_kv_tokens = max_kv_tokens;
  return ec;
}

inline std::vector<float> read_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(!raw.empty() && raw.size() % sizeof(float) == 0) << path;
  std::vector<float> out(raw.size() / sizeof(float));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(float));
  return out;
}

// (Not result_of: scheduler_harness.h's result_of is another struct in the
// same test binary, and two classes of one name there broke the ODR; ASan
// caught the one's destructor run on the other.)
struct engine_result {
  std::vector<token_id> tokens;
  std::vector<token_logprob> logprobs;
  std::vector<float> prompt_logits;
  request_usage usage;
  std::string finish;
};

// Adds the requests, steps until the engine has no work (checking the KV
// manager's invariants after each step) and gathers each request's events;
// n_steps: the steps it took.
inline std::map<std::string, engine_result> run_all(engine_core& e, std::vector<request> reqs, int* n_steps = nullptr) {
  std::map<std::string, engine_result> out;
  for (request& r : reqs) {
    const std::string id = r.id;
    const status st = e.add_request(std::move(r));
    EXPECT_TRUE(st.ok()) << id << ": " << st.message();
  }
  std::vector<engine_event> events;
  int steps = 0;
  for (; e.has_work() && steps < 100000; ++steps) {
    events.clear();
    e.step(events);
    EXPECT_TRUE(e.kv().check_invariants().ok()) << e.kv().check_invariants().message();
    for (const engine_event& ev : events) {
      engine_result& o = out[ev.request_id];
      o.tokens.insert(o.tokens.end(), ev.tokens.begin(), ev.tokens.end());
      o.logprobs.insert(o.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      o.prompt_logits.insert(o.prompt_logits.end(), ev.prompt_logits.begin(), ev.prompt_logits.end());
      if (!ev.finish_reason.empty()) o.finish = ev.finish_reason;
      if (ev.request_finished) o.usage = ev.usage;
    }
  }
  std::vector<engine_event> tail;
  e.step(tail);  // the last step's ops
  if (n_steps) *n_steps = steps;
  return out;
}

inline void expect_same_logprobs(const std::vector<token_logprob>& a, const std::vector<token_logprob>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].token, b[i].token) << i;
    EXPECT_EQ(a[i].logprob, b[i].logprob) << i;
    EXPECT_EQ(a[i].top, b[i].top) << i;
  }
}

// The requests on a pool of `big` blocks, then on one of `small`: the small
// one preempts, and every request answers as on the big one with n_tokens
// tokens, no block left in use.
inline void expect_preemption_changes_nothing(const llama_model& model, engine_core_config c, std::int64_t big,
                                              std::int64_t small, const std::vector<request>& reqs,
                                              std::size_t n_tokens) {
  c.n_blocks = big;
  auto large = *engine_core::create(model, c);
  const auto expected = run_all(*large, reqs);
  c.n_blocks = small;
  auto tight = *engine_core::create(model, c);
  const auto got = run_all(*tight, reqs);
  EXPECT_GT(tight->kv_stats().n_preemptions, 0);
  for (const request& r : reqs) {
    EXPECT_EQ(got.at(r.id).tokens, expected.at(r.id).tokens) << r.id;
    EXPECT_EQ(got.at(r.id).tokens.size(), n_tokens) << r.id;
  }
  EXPECT_EQ(tight->kv_stats().n_blocks_used, 0);
}

}  // namespace pagoda::test
