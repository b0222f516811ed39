// Chunk reuse (CacheBlend) through the engine on stories260K: prompt parts
// marked "reuse": "chunk" are computed alone once, imported into later
// prompts at any position (keys re-rotated), and a fraction recomputed.
// References: a plain prefill of the same tokens (an engine without marks).
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/requests.h"
#include "common/synth_model.h"
#include "sched/engine_setup.h"

namespace pagoda {
namespace {

using test::greedy_ids;
using test::stories;

engine_config options(const std::string& dtype = "f32") {
  engine_config c;
  c.kv_cache_dtype = dtype;
  c.max_num_seqs = 16;
  c.max_kv_tokens = 16384;
  return c;
}

std::unique_ptr<engine_core> engine(const engine_config& c = options(), const llama_model& m = stories()) {
  auto cc = make_engine_core_config(m, c);
  EXPECT_TRUE(cc.ok()) << cc.error().message();
  if (!cc.ok()) return nullptr;
  cc->max_model_len = 1024;
  auto e = engine_core::create(m, *cc);
  EXPECT_TRUE(e.ok()) << e.error().message();
  return e.ok() ? std::move(*e) : nullptr;
}

struct result_of {
  std::vector<token_id> tokens;
  request_usage usage;
  std::string error;
};

std::map<std::string, result_of> run(engine_core& e, const std::vector<request>& reqs) {
  for (const request& r : reqs) EXPECT_TRUE(e.add_request(r).ok()) << e.add_request(r).message();
  std::map<std::string, result_of> out;
  std::vector<engine_event> ev;
  for (int guard = 0; e.has_work() && guard < 100000; ++guard) {
    ev.clear();
    e.step(ev);
    EXPECT_TRUE(e.kv().check_invariants().ok());
    for (const engine_event& x : ev) {
      result_of& r = out[x.request_id];
      r.tokens.insert(r.tokens.end(), x.tokens.begin(), x.tokens.end());
      if (!x.error.empty()) r.error = x.error;
      if (x.request_finished) r.usage = x.usage;
    }
  }
  return out;
}

std::vector<token_id> text(const std::string& s) { return stories().vocab().encode(s, false); }

// Three short stories, each at least three blocks of 16 tokens, and a question.
const std::vector<std::string> k_docs = {
    "Once upon a time there was a little girl named Lily. She loved to play in the park with her red ball. One day "
    "she saw a big dog near the tree and she was scared.",
    "Tom was a happy boy who liked to help his mom in the kitchen. He made a cake with eggs and milk. The cake was "
    "very yummy and everyone ate it at the party.",
    "A small bird lived in a nest on a tall tree. Every morning the bird sang a song to the sun. The other animals "
    "came to listen and they were glad.",
};
const std::string k_question = " What did they do next? The end. Then";

// BOS, an intro, the documents in `order`, the question. Each document a
// part marked for reuse (recompute < -1: no marks).
request rag(const std::string& id, const std::vector<int>& order, float recompute, int max_tokens = 12,
            bool mark = true, const std::string& intro = " Read these stories.") {
  std::vector<token_id> prompt = {stories().vocab().bos()};
  const std::vector<token_id> head = text(intro);
  prompt.insert(prompt.end(), head.begin(), head.end());
  std::vector<prompt_segment> segs;
  for (int d : order) {
    const std::vector<token_id> t = text(" " + k_docs[static_cast<std::size_t>(d)]);
    prompt_segment s;
    s.begin = static_cast<std::int32_t>(prompt.size());
    prompt.insert(prompt.end(), t.begin(), t.end());
    s.end = static_cast<std::int32_t>(prompt.size());
    s.reuse_chunk = true;
    s.recompute = recompute;
    segs.push_back(s);
  }
  const std::vector<token_id> q = text(k_question);
  prompt.insert(prompt.end(), q.begin(), q.end());
  request r = greedy_ids(id, prompt, max_tokens);
  if (mark) r.segments = segs;
  return r;
}

int reusable(const std::vector<int>& order) {
  int n = 0;
  for (int d : order) n += static_cast<int>(text(" " + k_docs[static_cast<std::size_t>(d)]).size()) / 16 * 16;
  return n;
}

TEST(chunk_reuse, recompute_one_is_token_identical_to_a_full_prefill) {
  auto plain = engine(), blended = engine();
  ASSERT_TRUE(plain && blended);
  const std::vector<int> order = {2, 0, 1};
  const auto want = run(*plain, {rag("r", order, 1.0f, 24, false)});
  // Twice: computing the chunks, then every chunk block a prefix-cache hit.
  for (const char* id : {"a", "b"}) {
    const auto got = run(*blended, {rag(id, order, 1.0f, 24)});
    EXPECT_EQ(got.at(id).tokens, want.at("r").tokens) << id;
    EXPECT_EQ(got.at(id).usage.reused_chunk_tokens, 0) << "recompute 1 reuses nothing";
  }
  EXPECT_EQ(blended->kv_stats().n_blocks_used, 0) << "blocks leaked";
}

// A chunk at the very start of the prompt (BOS included) computed alone is
// exactly what the prompt computes there: with recompute 0 the imported K/V
// stand as they are and the rest of the prompt, computed in place against
// them, gives the plain outputs. This pins the import (gather, rotation by
// 0) and the in-place recompute of the other tokens.
TEST(chunk_reuse, a_chunk_at_the_start_is_exact_without_recompute) {
  auto plain = engine(), blended = engine();
  ASSERT_TRUE(plain && blended);
  request r = rag("p", {0, 1}, 0.0f, 16, false);
  request marked = r;
  marked.id = "m";
  prompt_segment s;
  s.begin = 0;
  s.end = 64;  // four whole blocks from BOS
  s.reuse_chunk = true;
  s.recompute = 0.0f;
  marked.segments = {s};
  const auto want = run(*plain, {r});
  const auto got = run(*blended, {marked});
  EXPECT_EQ(got.at("m").tokens, want.at("p").tokens);
  EXPECT_EQ(got.at("m").usage.reused_chunk_tokens, 64);
  // Again: the chunk's blocks all hit; only its extra token and the rest of the prompt are computed.
  const std::int64_t before = blended->stats().n_computed_prompt_tokens;
  marked.id = "m2";
  const auto again = run(*blended, {marked});
  EXPECT_EQ(again.at("m2").tokens, want.at("p").tokens);
  EXPECT_EQ(blended->stats().n_computed_prompt_tokens - before, 1 + static_cast<std::int64_t>(r.prompt.size()) - 64);
}

// With one layer, a token's K/V depend on the token and its position only,
// not on what precedes it: a chunk computed alone and imported anywhere,
// keys rotated to their positions, holds what the prompt computes there
// (within the rounding of rotating in two steps), and with recompute 0 the
// outputs are a plain prefill's. This pins the rotation of imported keys.
TEST(chunk_reuse, imported_keys_are_rotated_to_their_positions) {
  auto model = test::load_synth(test::f32_synth_options("tiny256", 1), "chunk_reuse_1layer");
  ASSERT_TRUE(model);
  auto plain = engine(options(), *model), blended = engine(options(), *model);
  ASSERT_TRUE(plain && blended);
  const int n_vocab = model->hparams().n_vocab;
  std::vector<token_id> prompt;
  for (int i = 0; i < 150; ++i) prompt.push_back(static_cast<token_id>((i * 37 + 11) % n_vocab));
  request r = greedy_ids("p", prompt, 16);
  request marked = r;
  marked.id = "m";
  for (const auto& [b, e] : std::vector<std::pair<int, int>>{{7, 55}, {60, 101}, {101, 140}}) {
    prompt_segment s;
    s.begin = b;
    s.end = e;
    s.reuse_chunk = true;
    s.recompute = 0.0f;
    marked.segments.push_back(s);
  }
  const auto want = run(*plain, {r});
  const auto got = run(*blended, {marked});
  EXPECT_EQ(got.at("m").usage.reused_chunk_tokens, 48 + 32 + 32);
  EXPECT_EQ(got.at("m").tokens, want.at("p").tokens);
}

TEST(chunk_reuse, chunks_are_reused_at_any_position_and_order) {
  auto e = engine();
  ASSERT_TRUE(e);
  const auto first = run(*e, {rag("a", {0, 1, 2}, 0.0f)});
  ASSERT_TRUE(first.at("a").error.empty()) << first.at("a").error;
  EXPECT_EQ(first.at("a").tokens.size(), 12u);
  EXPECT_EQ(first.at("a").usage.reused_chunk_tokens, reusable({0, 1, 2}));
  // Shuffled, after another intro: every chunk is found; the chunks compute one token each.
  const std::int64_t before = e->stats().n_computed_prompt_tokens;
  const request b = rag("b", {2, 0, 1}, 0.0f, 12, true, " Here are three tales for you to read now.");
  const auto second = run(*e, {b});
  EXPECT_EQ(second.at("b").tokens.size(), 12u);
  EXPECT_EQ(second.at("b").usage.reused_chunk_tokens, reusable({2, 0, 1}));
  EXPECT_EQ(e->stats().n_computed_prompt_tokens - before,
            3 + static_cast<std::int64_t>(b.prompt.size()) - reusable({2, 0, 1}));
  EXPECT_EQ(e->kv_stats().n_blocks_used, 0) << "blocks leaked";
}

TEST(chunk_reuse, a_fraction_of_the_chunk_is_recomputed) {
  auto e = engine();
  ASSERT_TRUE(e);
  const int n = reusable({1, 0});
  const auto got = run(*e, {rag("h", {1, 0}, 0.5f)});
  const int reused = got.at("h").usage.reused_chunk_tokens;
  // ceil(half) of the imported tokens recomputed (the step's last token is not one of them).
  EXPECT_EQ(reused, n - (n + 1) / 2);
}

TEST(chunk_reuse, chunks_are_never_shared_across_tenants_or_salts) {
  auto e = engine();
  ASSERT_TRUE(e);
  request a = rag("a", {0}, 0.0f);
  a.tenant = "acme";
  run(*e, {a});
  const int n = reusable({0});
  for (int variant = 0; variant < 2; ++variant) {
    request b = rag("b" + std::to_string(variant), {0}, 0.0f);
    if (variant == 0) b.tenant = "globex";
    else {
      b.tenant = "acme";
      b.cache_salt = "s1";
    }
    const std::int64_t before = e->stats().n_computed_prompt_tokens;
    run(*e, {b});
    // The chunk computed again (n + its extra token), then the rest of the prompt.
    EXPECT_EQ(e->stats().n_computed_prompt_tokens - before, n + 1 + static_cast<std::int64_t>(b.prompt.size()) - n)
        << "variant " << variant;
  }
  // The same tenant and salt: a hit.
  request c = rag("c", {0}, 0.0f);
  c.tenant = "acme";
  const std::int64_t before = e->stats().n_computed_prompt_tokens;
  run(*e, {c});
  EXPECT_EQ(e->stats().n_computed_prompt_tokens - before, 1 + static_cast<std::int64_t>(c.prompt.size()) - n);
}

TEST(chunk_reuse, quantized_kv_and_batches_complete_without_leaks) {
  for (const char* dtype : {"f16", "int8", "int4/token", "fp8"}) {
    auto e = engine(options(dtype));
    ASSERT_TRUE(e) << dtype;
    std::vector<request> reqs;
    for (int i = 0; i < 6; ++i) reqs.push_back(rag("q" + std::to_string(i), {i % 3, (i + 1) % 3}, 0.15f));
    const auto got = run(*e, reqs);
    for (const auto& [id, r] : got) {
      EXPECT_TRUE(r.error.empty()) << dtype << " " << id << ": " << r.error;
      EXPECT_EQ(r.tokens.size(), 12u) << dtype << " " << id;
      EXPECT_GT(r.usage.reused_chunk_tokens, 0) << dtype << " " << id;
    }
    EXPECT_EQ(e->kv_stats().n_blocks_used, 0) << dtype << ": blocks leaked";
  }
}

// n > 1: the prompt's last step, which forks the completions, blends too.
TEST(chunk_reuse, completions_fork_from_a_blended_prompt) {
  auto plain = engine(), blended = engine();
  ASSERT_TRUE(plain && blended);
  request r = rag("n", {1, 2}, 1.0f, 8);
  r.n = 3;
  request p = rag("n", {1, 2}, 1.0f, 8, false);
  p.n = 3;
  const auto got = run(*blended, {r});
  ASSERT_TRUE(got.at("n").error.empty()) << got.at("n").error;
  EXPECT_EQ(got.at("n").tokens, run(*plain, {p}).at("n").tokens) << "recompute 1: a plain prefill's completions";
  r.id = "n0";
  r.segments[0].recompute = r.segments[1].recompute = 0.15f;
  const auto partial = run(*blended, {r});
  ASSERT_TRUE(partial.at("n0").error.empty()) << partial.at("n0").error;
  EXPECT_EQ(partial.at("n0").tokens.size(), 24u);
  EXPECT_GT(partial.at("n0").usage.reused_chunk_tokens, 0);
  EXPECT_EQ(blended->kv_stats().n_blocks_used, 0) << "blocks leaked";
}

// Under memory pressure sequences are preempted, after their chunks were
// imported too: they import again (or compute) when they run again, finish
// with their tokens, and leave nothing behind.
TEST(chunk_reuse, preempted_requests_import_again_and_finish) {
  engine_config c = options();
  c.max_kv_tokens = 448;
  auto e = engine(c);
  ASSERT_TRUE(e);
  std::vector<request> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(rag("p" + std::to_string(i), {i % 3, (i + 2) % 3}, 0.15f, 40));
  const auto got = run(*e, reqs);
  EXPECT_GT(e->kv_stats().n_preemptions, 0) << "the pool was large enough: nothing was preempted";
  for (const auto& [id, r] : got) {
    EXPECT_TRUE(r.error.empty()) << id << ": " << r.error;
    EXPECT_EQ(r.tokens.size(), 40u) << id;
  }
  EXPECT_EQ(got.size(), 6u);
  EXPECT_EQ(e->kv_stats().n_blocks_used, 0) << "blocks leaked";
}

TEST(chunk_reuse, bad_marks_and_combinations_are_refused) {
  auto e = engine();
  ASSERT_TRUE(e);
  auto refused = [&](request r, const std::string& words) {
    const status st = e->add_request(std::move(r));
    EXPECT_FALSE(st.ok()) << words;
    EXPECT_NE(st.message().find(words), std::string::npos) << st.message();
  };
  request r = rag("x", {0, 1}, 1.5f);
  refused(r, "recompute must be in [0, 1]");
  r = rag("x", {0, 1}, 0.1f);
  r.segments[1].recompute = 0.2f;
  refused(r, "different recompute fractions");
  r = rag("x", {0}, 0.1f);
  r.segments[0].end = r.segments[0].begin;
  refused(r, "holds no prompt token");
  r = rag("x", {0, 1}, 0.1f);
  r.segments[1].begin = r.segments[0].end - 2;
  refused(r, "overlap");
  r = rag("x", {0}, 0.1f);
  r.prompt_logits = true;
  r.max_tokens = 0;
  refused(r, "prompt logits");
  r = rag("x", {0}, 0.1f);
  r.kv_policy = "h2o:budget=0.5";
  refused(r, "KV policy");
  EXPECT_FALSE(e->has_work()) << "a refused request left something behind";

  // A sealed KV format (per-channel scales, as KIVI keys) cannot have single slots rewritten.
  auto sealed = engine(options("int8/channel"));
  ASSERT_TRUE(sealed);
  const status st = sealed->add_request(rag("y", {0}, 0.1f));
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("sealed"), std::string::npos) << st.message();
}

TEST(chunk_reuse, an_aborted_request_frees_its_chunks) {
  auto e = engine();
  ASSERT_TRUE(e);
  ASSERT_TRUE(e->add_request(rag("z", {0, 1, 2}, 0.15f)).ok());
  std::vector<engine_event> ev;
  e->step(ev);  // the chunks start
  EXPECT_TRUE(e->abort_request("z"));
  for (int guard = 0; guard < 100 && (e->has_work() || e->has_pending_ops()); ++guard) e->step(ev);
  EXPECT_FALSE(e->has_work());
  EXPECT_EQ(e->kv_stats().n_blocks_used, 0) << "blocks leaked";
  EXPECT_TRUE(e->kv().check_invariants().ok());
}

}  // namespace
}  // namespace pagoda
