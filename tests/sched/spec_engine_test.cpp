// Speculative decoding end to end on stories260K (docs/speculative.md):
// greedy output token-identical to plain decoding with f32, int8, int4 and int2 KV under
// 32 concurrent requests with shared prefixes, nothing tentative ever handed
// to the store (commit hook), and the refusals.
#include <fstream>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "common/requests.h"
#include "common/synth_model.h"
#include "sched/engine_core.h"

namespace pagoda {
namespace {

using test::greedy_request;
using test::stories;

// Story openings after one shared instruction: prompts share their first blocks.
std::vector<std::string> prompts(int n) {
  std::ifstream in(std::string(PAGODA_SOURCE_DIR) + "/tests/data/tinystories_dev.txt");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (static_cast<int>(out.size()) < n) {
    const std::size_t end = text.find("<|endoftext|>", pos);
    std::string story = text.substr(pos, end - pos);
    story = story.substr(story.find_first_not_of("\n "));
    out.push_back("Once upon a time there was a little dog. The dog liked to play. " +
                  story.substr(0, 60 + 9 * (out.size() % 5)));
    pos = end + 13;
  }
  return out;
}

engine_core_config config(kv_type type, const std::string& speculative) {
  const llama_hparams& hp = stories().hparams();
  engine_core_config c;
  c.n_threads = 1;
  c.max_model_len = 512;
  c.max_num_seqs = 64;
  c.max_num_batched_tokens = 512;
  c.kv = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, type, type);
  c.n_blocks = 2048;
  c.speculative = speculative;
  return c;
}

struct run_result {
  std::map<std::string, std::vector<token_id>> tokens;
  std::map<std::string, int> completion_tokens;
  std::map<std::string, std::string> text, finish;
  std::vector<std::pair<block_key, std::vector<token_id>>> stored;  // what the commit hook saw
};

run_result run(engine_core& e, const std::vector<request>& reqs) {
  run_result o;
  e.set_commit_hook([&](const cached_block& b) { o.stored.emplace_back(b.key, std::vector<token_id>(b.tokens.begin(), b.tokens.end())); });
  for (const request& r : reqs) {
    status st = e.add_request(r);
    EXPECT_TRUE(st.ok()) << st.message();
  }
  std::vector<engine_event> events;
  for (int guard = 0; e.has_work() && guard < 100000; ++guard) {
    events.clear();
    e.step(events);
    EXPECT_TRUE(e.kv().check_invariants().ok()) << e.kv().check_invariants().message();
    for (const engine_event& ev : events) {
      auto& t = o.tokens[ev.index == 0 ? ev.request_id : ev.request_id + "#" + std::to_string(ev.index)];
      t.insert(t.end(), ev.tokens.begin(), ev.tokens.end());
      o.text[ev.request_id] += ev.text;
      if (!ev.finish_reason.empty()) o.finish[ev.request_id] = ev.finish_reason;
      if (ev.request_finished) o.completion_tokens[ev.request_id] = ev.usage.completion_tokens;
    }
  }
  events.clear();
  e.flush(events);
  return o;
}

// The same requests through a plain engine and a speculating one made from
// the same config (`speculative` set on the second).
struct plain_and_spec {
  std::unique_ptr<engine_core> plain, spec;
  run_result a, b;  // plain's, spec's
};
plain_and_spec run_both(const std::vector<request>& reqs, engine_core_config c, const std::string& speculative) {
  plain_and_spec o;
  c.speculative = "none";
  o.plain = *engine_core::create(stories(), c);
  c.speculative = speculative;
  auto spec = engine_core::create(stories(), c);
  if (!spec.ok()) {
    ADD_FAILURE() << "speculative engine: " << spec.error().message();
    return o;
  }
  o.spec = std::move(*spec);
  o.a = run(*o.plain, reqs);
  o.b = run(*o.spec, reqs);
  return o;
}

void expect_identical_to_plain(kv_type type) {
  const auto texts = prompts(32);
  std::vector<request> reqs;
  for (int i = 0; i < 32; ++i) reqs.push_back(greedy_request("r" + std::to_string(i), texts[i], 64));
  engine_core_config c = config(type, "none");
  // Sealed formats: a prompt chunk reads its own sealed blocks as it leaves
  // them (kv_backend.h), so a prompt must be chunked alike in both runs; a
  // verification step spends more of a step's budget than a plain one and
  // would shift later prompts' chunks. Every prompt fits the first step.
  if (c.kv.has_sealed()) c.max_num_batched_tokens = 4096;
  const auto [plain, spec, a, b] = run_both(reqs, c, "ngram:k=5,n=3");
  ASSERT_TRUE(spec);
  for (const request& r : reqs) {
    ASSERT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << r.id;
    EXPECT_EQ(b.completion_tokens.at(r.id), static_cast<int>(b.tokens.at(r.id).size())) << r.id;
  }
  const spec_decode_stats& s = spec->stats().spec_decode.at("ngram");
  EXPECT_GT(s.n_draft_tokens, 0);
  EXPECT_GT(s.n_accepted_tokens, 0) << "no draft accepted: the test checks nothing of the accept path";
  EXPECT_LT(s.n_accepted_tokens, s.n_draft_tokens) << "no draft rejected: the test checks nothing of the rollback";
  EXPECT_LT(spec->stats().n_steps, plain->stats().n_steps);
  EXPECT_EQ(spec->kv_stats().n_blocks_used, 0) << "blocks leaked";

  // Every block handed to the store is a block of some request's verified
  // tokens (prompt + output): a rejected draft's K/V would carry a key no
  // verified sequence has.
  std::set<block_key> verified;
  for (const request& r : reqs) {
    std::vector<token_id> all = r.prompt;
    all.insert(all.end(), b.tokens.at(r.id).begin(), b.tokens.at(r.id).end());
    for (block_key k : spec->kv().prompt_keys(all)) verified.insert(k);
  }
  ASSERT_FALSE(b.stored.empty());
  for (const auto& [key, tokens] : b.stored) EXPECT_TRUE(verified.contains(key)) << "a tentative block reached the store";
  // And the same blocks as the plain run stores.
  std::set<block_key> plain_keys, spec_keys;
  for (const auto& kt : a.stored) plain_keys.insert(kt.first);
  for (const auto& kt : b.stored) spec_keys.insert(kt.first);
  EXPECT_EQ(plain_keys, spec_keys);
}

TEST(speculative_engine, greedy_ngram_equals_plain_decoding_f32) { expect_identical_to_plain(kv_type::f32); }
TEST(speculative_engine, greedy_ngram_equals_plain_decoding_int8) { expect_identical_to_plain(kv_type::int8); }
// Sealed formats (per-channel keys): drafts seal blocks and are rolled back
// inside them; the held staging keeps both the rows and the bytes exact.
TEST(speculative_engine, greedy_ngram_equals_plain_decoding_int4) { expect_identical_to_plain(kv_type::int4); }
TEST(speculative_engine, greedy_ngram_equals_plain_decoding_int2) { expect_identical_to_plain(kv_type::int2); }

TEST(speculative_engine, sampled_requests_equal_plain_decoding_with_the_same_seed) {
  // A point-mass draft verified by drawing from the target row consumes the
  // sampler exactly as plain decoding does: same seed, same tokens.
  const auto texts = prompts(4);
  std::vector<request> reqs;
  for (int i = 0; i < 4; ++i) {
    request r = greedy_request("s" + std::to_string(i), texts[i], 48);
    r.sampling.temperature = 0.7f;
    r.sampling.seed = 11 + static_cast<std::uint64_t>(i);
    reqs.push_back(r);
  }
  const auto [plain, spec, a, b] = run_both(reqs, config(kv_type::f32, "none"), "ngram:k=4");
  for (const request& r : reqs) EXPECT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << r.id;
  EXPECT_GT(spec->stats().spec_decode.at("ngram").n_accepted_tokens, 0);
}

// n > 1: the completions fork at their first sample, before any draft; each
// then speculates on its own and gives plain decoding's tokens (same seed).
TEST(speculative_engine, n_completions_each_equal_plain_decoding) {
  const auto texts = prompts(3);
  std::vector<request> reqs;
  for (int i = 0; i < 3; ++i) {
    request r = greedy_request("n" + std::to_string(i), texts[i], 48);
    r.n = 3;
    r.sampling.temperature = 0.8f;
    r.sampling.seed = 5 + static_cast<std::uint64_t>(i);
    reqs.push_back(r);
  }
  const auto [plain, spec, a, b] = run_both(reqs, config(kv_type::f32, "none"), "ngram:k=4,n=2");
  ASSERT_EQ(a.tokens.size(), 9u);
  for (const auto& [id, tokens] : a.tokens) EXPECT_EQ(tokens, b.tokens.at(id)) << id;
  EXPECT_GT(spec->stats().spec_decode.at("ngram").n_accepted_tokens, 0);
  EXPECT_EQ(spec->kv_stats().n_blocks_used, 0) << "blocks leaked";
}

// A pool too small for every request at once: sequences are preempted while
// they speculate (their drafts dropped, their KV recomputed later), and the
// greedy outputs are still plain decoding's.
TEST(speculative_engine, preemption_mid_speculation_keeps_outputs_exact) {
  const auto texts = prompts(16);
  std::vector<request> reqs;
  for (int i = 0; i < 16; ++i) reqs.push_back(greedy_request("p" + std::to_string(i), texts[i], 96));
  engine_core_config small = config(kv_type::f32, "none");
  small.n_blocks = 48;
  const auto [plain, spec, a, b] = run_both(reqs, small, "ngram:k=5,n=2");
  for (const request& r : reqs) EXPECT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << r.id;
  EXPECT_GT(spec->kv_stats().n_preemptions, 0) << "the pool was large enough: nothing was preempted";
  EXPECT_GT(spec->stats().spec_decode.at("ngram").n_accepted_tokens, 0);
  EXPECT_EQ(spec->kv_stats().n_blocks_used, 0) << "blocks leaked";
}

// A stop string completed inside an accepted run cuts the chunk there: the
// text, the tokens and the usage are plain decoding's.
TEST(speculative_engine, stop_strings_inside_an_accepted_run) {
  const auto texts = prompts(8);
  std::vector<request> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back(greedy_request("t" + std::to_string(i), texts[i], 96));
  auto probe = *engine_core::create(stories(), config(kv_type::f32, "none"));
  const run_result free_run = run(*probe, reqs);
  for (request& r : reqs) {  // a stop string from the middle of each plain output
    const std::string& t = free_run.text.at(r.id);
    ASSERT_GT(t.size(), 80u);
    r.stop = {t.substr(t.size() / 2, 6)};
  }
  const auto [plain, spec, a, b] = run_both(reqs, config(kv_type::f32, "none"), "ngram:k=5,n=2");
  for (const request& r : reqs) {
    EXPECT_EQ(a.text.at(r.id), b.text.at(r.id)) << r.id;
    EXPECT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << r.id;
    EXPECT_EQ(a.completion_tokens.at(r.id), b.completion_tokens.at(r.id)) << r.id;
    EXPECT_EQ(b.finish.at(r.id), "stop") << r.id;
  }
  EXPECT_GT(spec->stats().spec_decode.at("ngram").n_accepted_tokens, 0);
  EXPECT_EQ(spec->stats().n_generated_tokens, plain->stats().n_generated_tokens);
}

TEST(speculative_engine, refuses_what_it_cannot_verify_exactly) {
  auto bad = engine_core::create(stories(), config(kv_type::f32, "ngram:k=99"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("k=99"), std::string::npos) << bad.error().message();
  auto e = *engine_core::create(stories(), config(kv_type::f32, "none"));
  request r = greedy_request("x", "Once upon a time", 8);
  r.speculative = "ngram:q=1";
  EXPECT_NE(e->add_request(r).message().find("unknown parameter 'q'"), std::string::npos);
  r.speculative = "";
  EXPECT_TRUE(e->add_request(r).ok());
}

}  // namespace
}  // namespace pagoda
