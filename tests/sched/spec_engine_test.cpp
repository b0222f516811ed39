// Speculative decoding end to end on stories260K (docs/speculative.md):
// greedy output token-identical to plain decoding with f32, int8, int4 and int2 KV under
// 32 concurrent requests with shared prefixes, nothing tentative ever handed
// to the store (commit hook), and the refusals.
#include <fstream>
#include <utility>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "common/engine_configs.h"
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
  engine_core_config c = test::uniform_engine(hp, {.n_blocks = 2048, .type = type, .max_num_batched_tokens = 512});
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
plain_and_spec run_both(const std::vector<request>& reqs, engine_core_config c, const std::string& speculative,
                        const llama_model& model = stories()) {
  plain_and_spec o;
  c.speculative = "none";
  const llama_model* draft = std::exchange(c.draft_model, nullptr);
  o.plain = *engine_core::create(model, c);
  c.speculative = speculative;
  c.draft_model = draft;
  auto spec = engine_core::create(model, c);
  if (!spec.ok()) {
    ADD_FAILURE() << "speculative engine: " << spec.error().message();
    return o;
  }
  o.spec = std::move(*spec);
  o.a = run(*o.plain, reqs);
  o.b = run(*o.spec, reqs);
  return o;
}

void expect_identical_to_plain(kv_type type, const std::string& speculative = "ngram:k=5,n=3") {
  const auto texts = prompts(32);
  std::vector<request> reqs;
  for (int i = 0; i < 32; ++i) reqs.push_back(greedy_request("r" + std::to_string(i), texts[i], 64));
  engine_core_config c = config(type, "none");
  // Sealed formats: a prompt chunk reads its own sealed blocks as it leaves
  // them (kv_backend.h), so a prompt must be chunked alike in both runs; a
  // verification step spends more of a step's budget than a plain one and
  // would shift later prompts' chunks. Every prompt fits the first step.
  if (c.kv.has_sealed()) c.max_num_batched_tokens = 4096;
  const auto [plain, spec, a, b] = run_both(reqs, c, speculative);
  ASSERT_TRUE(spec);
  for (const request& r : reqs) {
    ASSERT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << r.id;
    EXPECT_EQ(b.completion_tokens.at(r.id), static_cast<int>(b.tokens.at(r.id).size())) << r.id;
  }
  const spec_decode_stats& s = spec->stats().spec_decode.at(speculative.substr(0, speculative.find(':')));
  EXPECT_GT(s.n_draft_tokens, 0);
  EXPECT_GT(s.verify_seconds, 0);
  if (speculative.starts_with("ngram")) EXPECT_EQ(s.draft_seconds, 0) << "n-gram drafts need no draft pass";
  else EXPECT_GT(s.draft_seconds, 0);
  EXPECT_GT(s.n_accepted_tokens, 0) << "no draft accepted: the test checks nothing of the accept path";
  EXPECT_LT(s.n_accepted_tokens, s.n_draft_tokens) << "no draft rejected: the test checks nothing of the rollback";
  // Fewer steps, or as many when the longest request (which sets the count) drew no accepted draft.
  EXPECT_LE(spec->stats().n_steps, plain->stats().n_steps);
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

// The model drafters: the target reading a window of its own KV (prompts are
// 80-130 tokens, so a 4 + 24 view reads a fraction of it), Quest's pages, its
// first layers (stories260K has 5).
TEST(speculative_engine, greedy_self_window_equals_plain_decoding_f32) {
  expect_identical_to_plain(kv_type::f32, "self:k=4,view=window,sinks=4,window=24");
}
TEST(speculative_engine, greedy_self_window_equals_plain_decoding_int8) {
  expect_identical_to_plain(kv_type::int8, "self:k=4,view=window,sinks=4,window=24");
}
TEST(speculative_engine, greedy_self_quest_equals_plain_decoding_f32) {
  expect_identical_to_plain(kv_type::f32, "self:k=4,view=quest,budget=0.25");
}
TEST(speculative_engine, greedy_early_exit_equals_plain_decoding_f32) {
  expect_identical_to_plain(kv_type::f32, "early-exit:k=3,layers=3");
}
TEST(speculative_engine, greedy_early_exit_equals_plain_decoding_int8) {
  expect_identical_to_plain(kv_type::int8, "early-exit:k=3,layers=3");
}
// Model drafters over sealed blocks: their draft passes seal and are rewound
// inside held blocks too.
TEST(speculative_engine, greedy_self_window_equals_plain_decoding_int4) {
  expect_identical_to_plain(kv_type::int4, "self:k=4,view=window,sinks=4,window=24");
}
TEST(speculative_engine, greedy_early_exit_equals_plain_decoding_int2) {
  expect_identical_to_plain(kv_type::int2, "early-exit:k=3,layers=3");
}

// self reading its KV mirror (int4 or int2 K/V kept beside the cache, a KV
// group of its own): the drafts come from the mirror, the verified K/V is the
// target's.
TEST(speculative_engine, greedy_self_int4_mirror_equals_plain_decoding_f32) {
  expect_identical_to_plain(kv_type::f32, "self:k=4,view=int4");
}
TEST(speculative_engine, greedy_self_int4_mirror_equals_plain_decoding_int8) {
  expect_identical_to_plain(kv_type::int8, "self:k=4,view=int4");
}
TEST(speculative_engine, greedy_self_int2_mirror_equals_plain_decoding_f32) {
  expect_identical_to_plain(kv_type::f32, "self:k=4,view=int2");
}
TEST(speculative_engine, greedy_self_int2_mirror_equals_plain_decoding_int8) {
  expect_identical_to_plain(kv_type::int8, "self:k=4,view=int2,layers=4");
}
// A sealed cache (int4 KIVI) beside a sealed mirror: both roll back exactly.
TEST(speculative_engine, greedy_self_int2_mirror_equals_plain_decoding_int4) {
  expect_identical_to_plain(kv_type::int4, "self:k=4,view=int2");
}

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

// The model drafters through sampling, n > 1 and preemption: greedy
// requests give plain decoding's tokens; sampled ones draw their drafts from
// the draft's distribution and are verified by rejection sampling, which
// keeps the target's law but not plain decoding's random stream (their law
// is tested below and in tests/spec/rejection_test.cpp): they run their full
// length. Preempted sequences redraft after recomputing their KV.
TEST(speculative_engine, model_drafters_with_sampling_forks_and_preemption) {
  const auto texts = prompts(12);
  std::vector<request> reqs;
  for (int i = 0; i < 12; ++i) {
    request r = greedy_request("m" + std::to_string(i), texts[i], 80);
    if (i % 3 == 1) {
      r.sampling.temperature = 0.8f;
      r.sampling.seed = 3 + static_cast<std::uint64_t>(i);
    }
    if (i % 4 == 2) r.n = 2;
    reqs.push_back(r);
  }
  engine_core_config small = config(kv_type::f32, "none");
  small.n_blocks = 56;
  for (const char* spec : {"early-exit:k=4,layers=2", "self:k=3,view=window,sinks=4,window=16,layers=4", "self:k=3,view=int4"}) {
    const auto [plain, sp, a, b] = run_both(reqs, small, spec);
    for (const auto& [id, tokens] : a.tokens) {
      const int i = std::stoi(id.substr(1));
      if (i % 3 == 1) EXPECT_EQ(tokens.size(), b.tokens.at(id).size()) << spec << " " << id;
      else EXPECT_EQ(tokens, b.tokens.at(id)) << spec << " " << id;
    }
    EXPECT_GT(sp->kv_stats().n_preemptions, 0) << spec << ": nothing was preempted";
    const spec_decode_stats& c = sp->stats().spec_decode.at(std::string(spec).substr(0, std::string(spec).find(':')));
    EXPECT_GT(c.n_accepted_tokens, 0) << spec;
    EXPECT_LT(c.n_accepted_tokens, c.n_draft_tokens) << spec;
    EXPECT_EQ(sp->kv_stats().n_blocks_used, 0) << spec << ": blocks leaked";
  }
}

// A synth preset with f32 weights and n_layer layers (same seed: a model of
// fewer layers is the first layers of one of more), loaded under `name`.
std::unique_ptr<llama_model> f32_synth(const std::string& preset, int n_layer, const std::string& name) {
  synth_options o;
  o.preset = preset;
  o.n_layer = n_layer;
  o.weight_type = gguf::tensor_type::f32;
  o.n_threads = 1;
  return test::load_synth(o, name);
}

// A draft model (--draft-model): its KV a KV group of its own. stories260K
// drafting for itself accepts every draft (the same computation: a check of
// the plumbing, the draft group's KV kept in step, prefix hits included).
void expect_self_draft_identical(kv_type type) {
  const auto texts = prompts(32);
  std::vector<request> reqs;
  for (int i = 0; i < 32; ++i) reqs.push_back(greedy_request("d" + std::to_string(i), texts[i], 64));
  engine_core_config c = config(type, "none");
  if (c.kv.has_sealed()) c.max_num_batched_tokens = 4096;  // prompts chunked alike (expect_identical_to_plain)
  c.draft_model = &stories();
  const auto [plain, spec, a, b] = run_both(reqs, c, "draft:k=4");
  for (const request& r : reqs) ASSERT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << r.id;
  const spec_decode_stats& s = spec->stats().spec_decode.at("draft");
  EXPECT_GT(s.n_draft_tokens, 0);
  EXPECT_EQ(s.n_accepted_tokens, s.n_draft_tokens) << "the draft is the target: every draft must be accepted";
  EXPECT_GT(spec->kv_stats().n_prefix_hit_tokens, 0) << "the shared prefix must hit with the draft group";
  EXPECT_EQ(spec->kv_stats().n_blocks_used, 0) << "blocks leaked";
  ASSERT_EQ(spec->storage().n_groups(), 2);
  EXPECT_TRUE(spec->storage().foreign_group(1));
}
TEST(speculative_engine, draft_model_that_is_the_target_accepts_everything_f32) { expect_self_draft_identical(kv_type::f32); }
TEST(speculative_engine, draft_model_that_is_the_target_accepts_everything_int8) { expect_self_draft_identical(kv_type::int8); }
// Sealed blocks: a fully accepted run's last draft slot is committed (and its
// block may be handed to the commit hook at once): its draft K/V must be
// written by then, or reading the draft group's block fails.
TEST(speculative_engine, draft_model_that_is_the_target_accepts_everything_int4) { expect_self_draft_identical(kv_type::int4); }

// A smaller draft: the first 2 layers of a 4-layer synth model (same seed,
// so the same embeddings, layers and head), and a draft of another shape
// (head_dim 32 against 64) with the same synth vocabulary. Greedy outputs are
// plain decoding's, sampled ones run their length; drafts are accepted and rejected.
TEST(speculative_engine, smaller_draft_models_give_plain_decodings_tokens) {
  auto target = f32_synth("tiny256", 4, "spec_target");
  auto shallow = f32_synth("tiny256", 2, "spec_shallow");
  auto other = f32_synth("tiny", 2, "spec_other_shape");
  ASSERT_TRUE(target && shallow && other);
  const llama_hparams& hp = target->hparams();
  std::vector<request> reqs;
  for (int i = 0; i < 12; ++i) {
    std::vector<token_id> prompt;
    for (int j = 0; j < 20 + 7 * i; ++j) prompt.push_back(static_cast<token_id>(3 + (j * 37 + i * 11) % 500));
    request r = test::greedy_ids("g" + std::to_string(i), prompt, 40);
    if (i % 3 == 2) {
      r.sampling.temperature = 0.9f;
      r.sampling.seed = 17 + static_cast<std::uint64_t>(i);
    }
    reqs.push_back(r);
  }
  for (const llama_model* draft : {shallow.get(), other.get()}) {
    engine_core_config c = config(kv_type::f32, "none");
    c.kv = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, kv_type::f32, kv_type::f32);
    c.n_blocks = 40;  // small enough to preempt
    c.draft_model = draft;
    const auto [plain, spec, a, b] = run_both(reqs, c, "draft:k=4", *target);
    for (const request& r : reqs) {
      if (r.sampling.is_greedy()) EXPECT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << r.id;
      else EXPECT_EQ(a.tokens.at(r.id).size(), b.tokens.at(r.id).size()) << r.id;
    }
    const spec_decode_stats& st = spec->stats().spec_decode.at("draft");
    EXPECT_GT(st.n_draft_tokens, 0);
    EXPECT_LT(st.n_accepted_tokens, st.n_draft_tokens);
    if (draft == shallow.get()) {
      EXPECT_GT(st.n_accepted_tokens, 0) << "the shallow draft never agreed";
    }
    EXPECT_GT(spec->kv_stats().n_preemptions, 0) << "nothing was preempted";
    EXPECT_EQ(spec->kv_stats().n_blocks_used, 0) << "blocks leaked";
  }
}

// Sampled requests verified by rejection sampling follow the target's law
// through the engine: 2,000 seeded requests of 4 tokens from one prompt,
// plainly and drafted by stories260K's first 4 layers of 5 (early exit, a
// draft that is often rejected: residual draws are common), and the
// distributions of tokens 2 and 3 compared by a chi-square
// test of homogeneity over the tokens seen at least 20 times in all (the
// rest pooled): bound at the 1e-6 upper tail of chi-square with df cells - 1.
std::map<token_id, int> count_position(const run_result& r, std::size_t pos) {
  std::map<token_id, int> c;
  for (const auto& [id, t] : r.tokens)
    if (t.size() > pos) ++c[t[pos]];
  return c;
}
double homogeneity_chi2(const std::map<token_id, int>& a, const std::map<token_id, int>& b, int& df) {
  std::map<token_id, std::pair<int, int>> cells;
  std::pair<int, int> rest{0, 0};
  for (const auto& [t, n] : a) cells[t].first += n;
  for (const auto& [t, n] : b) cells[t].second += n;
  std::vector<std::pair<int, int>> kept;
  for (const auto& [t, ab] : cells) {
    if (ab.first + ab.second >= 20) kept.push_back(ab);
    else { rest.first += ab.first; rest.second += ab.second; }
  }
  if (rest.first + rest.second > 0) kept.push_back(rest);
  double na = 0, nb = 0;
  for (const auto& [x, y] : kept) { na += x; nb += y; }
  double chi2 = 0;
  for (const auto& [x, y] : kept) {
    const double total = x + y, ea = total * na / (na + nb), eb = total * nb / (na + nb);
    chi2 += (x - ea) * (x - ea) / ea + (y - eb) * (y - eb) / eb;
  }
  df = static_cast<int>(kept.size()) - 1;
  return chi2;
}
TEST(speculative_engine, rejection_sampling_keeps_the_targets_law_end_to_end) {
  std::vector<request> reqs;
  for (int i = 0; i < 2000; ++i) {
    request r = greedy_request("s" + std::to_string(i), "Once upon a time, there was a little", 4);
    r.sampling.temperature = 1.0f;
    r.sampling.top_k = 12;
    r.sampling.seed = 1000003ull * static_cast<std::uint64_t>(i + 1);
    reqs.push_back(r);
  }
  engine_core_config c = config(kv_type::f32, "none");
  c.max_num_seqs = 256;
  c.max_num_batched_tokens = 4096;
  const auto [plain, spec, a, b] = run_both(reqs, c, "early-exit:k=2,layers=4");
  const spec_decode_stats& st = spec->stats().spec_decode.at("early-exit");
  EXPECT_GT(st.n_accepted_tokens, 200) << st.n_draft_tokens << " drafts";
  EXPECT_LT(st.n_accepted_tokens, st.n_draft_tokens - 200);
  // df <= 40 here; the 1e-6 tail of chi-square: df 10: 46.9, 20: 61.8, 30: 75.3, 40: 88.0.
  for (const std::size_t pos : {1u, 2u}) {
    int df = 0;
    const double chi2 = homogeneity_chi2(count_position(a, pos), count_position(b, pos), df);
    ASSERT_GE(df, 3) << "too few tokens to test";
    ASSERT_LE(df, 40);
    const double bound = df <= 10 ? 46.9 : df <= 20 ? 61.8 : df <= 30 ? 75.3 : 88.0;
    EXPECT_LT(chi2, bound) << "token " << pos + 1 << ": chi2 " << chi2 << " at df " << df;
  }
}

// Sliding-window models whose window layers keep only their window (a
// window group beside the full one on gemma2; every layer a window on
// tiny-swa): verification reads the committed window, the rollback happens
// before windows are released. Greedy outputs are plain decoding's, with the
// model drafting for itself (every draft accepted) and with early exit.
TEST(speculative_engine, sliding_window_groups_keep_outputs_exact) {
  for (const char* preset : {"tiny-gemma2", "tiny-swa"}) {
    auto model = test::load_synth(preset, gguf::tensor_type::f32);
    ASSERT_TRUE(model);
    const llama_hparams& hp = model->hparams();
    std::vector<request> reqs;
    for (int i = 0; i < 8; ++i) {
      std::vector<token_id> prompt;
      for (int j = 0; j < 30 + 9 * i; ++j) prompt.push_back(static_cast<token_id>(3 + (j * 53 + i * 7) % 500));
      reqs.push_back(test::greedy_ids("w" + std::to_string(i), prompt, 48));
    }
    for (const char* spec : {"draft:k=4", "early-exit:k=3,layers=1", "self:k=3,view=int4"}) {
      engine_core_config c = config(kv_type::f32, "none");
      c.kv = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, kv_type::f32, kv_type::f32);
      c.max_model_len = 256;
      c.n_blocks = 400;
      c.draft_model = model.get();
      const auto [plain, sp, a, b] = run_both(reqs, c, spec, *model);
      ASSERT_TRUE(sp) << preset << " " << spec;
      bool windowed = false;
      for (const engine_kv_group& g : sp->config().groups) windowed = windowed || g.kind == kv_group_kind::sliding_window;
      EXPECT_TRUE(windowed) << preset << ": no sliding-window group";
      for (const request& r : reqs) EXPECT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << preset << " " << spec << " " << r.id;
      const spec_decode_stats& st = sp->stats().spec_decode.at(std::string(spec).substr(0, std::string(spec).find(':')));
      EXPECT_GT(st.n_accepted_tokens, 0) << preset << " " << spec;
      if (std::string(spec).starts_with("draft")) {
        EXPECT_EQ(st.n_accepted_tokens, st.n_draft_tokens) << preset;
      }
      EXPECT_EQ(sp->kv_stats().n_blocks_used, 0) << preset << " " << spec << ": blocks leaked";
    }
  }
}

// An engine with a draft model serves requests that do not speculate too,
// KV policies included: a compaction gathers the draft's group as well, a
// renumbering one (positions=cache) rotates the draft's keys with the
// draft's own RoPE and head size (here 32 against the target's 64), and a
// per-head one (pyramid) keeps its first row's slots there (the draft has
// 2 layers x 2 KV heads, the target's rows would number others). No crash
// and no leak is what this checks (the draft group's content only drafts).
TEST(speculative_engine, draft_group_follows_a_renumbering_policy) {
  auto target = f32_synth("tiny256", 2, "spec_policy_target");
  auto draft = f32_synth("tiny", 2, "spec_policy_draft");
  ASSERT_TRUE(target && draft);
  const llama_hparams& hp = target->hparams();
  engine_core_config c = config(kv_type::f32, "none");
  c.kv = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, kv_type::f32, kv_type::f32);
  c.draft_model = draft.get();
  auto e = *engine_core::create(*target, c);
  std::vector<request> reqs;
  for (int i = 0; i < 4; ++i) {
    std::vector<token_id> prompt;
    for (int j = 0; j < 90; ++j) prompt.push_back(static_cast<token_id>(3 + (j * 29 + i) % 500));
    request r = test::greedy_ids("p" + std::to_string(i), prompt, 40);
    // A renumbering window, and per-head budgets (a gather of one row per target layer and head).
    r.kv_policy = i % 2 == 0 ? "window:budget=32,positions=cache" : "pyramid:budget=32";
    reqs.push_back(r);
  }
  const run_result out = run(*e, reqs);
  for (const request& r : reqs) EXPECT_EQ(out.tokens.at(r.id).size(), 40u) << r.id;
  EXPECT_GT(e->stats().n_policy_compactions, 0) << "no compaction: the test checks nothing";
  EXPECT_EQ(e->kv_stats().n_blocks_used, 0);
}

// --- KV policies, attention statistics, prompt logits --------------------------

// Per request, after each step: the stored slots -> the accumulated attention
// and the last window rows (scheduler::attention_totals, last_attention_window).
struct stats_trace {
  std::map<std::string, std::map<int, std::pair<std::vector<float>, std::vector<float>>>> at;
};

stats_trace trace_stats(engine_core& e, const std::vector<request>& reqs) {
  stats_trace t;
  for (const request& r : reqs) EXPECT_TRUE(e.add_request(r).ok());
  std::vector<engine_event> events;
  for (int guard = 0; e.has_work() && guard < 100000; ++guard) {
    events.clear();
    e.step(events);
    for (const request& r : reqs) {
      const std::optional<seq_id> s = e.sched().find_sequence(r.id);
      if (!s) continue;
      const std::vector<float>* totals = e.sched().attention_totals(*s);
      const attention_stats* w = e.sched().last_attention_window(*s);
      if (totals && w) t.at[r.id][e.kv().n_stored_tokens(*s)] = {*totals, w->window};
    }
  }
  return t;
}

// The policy sees the rows that stood, each as a plain step would give them:
// at every stored length the speculating engine reaches, each slot's
// accumulated attention and the window rows are plain decoding's (a rejected
// draft's row would add n_rep to its (layer, KV head)'s sum, a row counted as
// a chunk would change the window).
TEST(speculative_engine, attention_statistics_count_only_the_rows_that_stood) {
  const auto texts = prompts(6);
  std::vector<request> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(greedy_request("s" + std::to_string(i), texts[i], 48));
  for (const char* speculative : {"ngram:k=5,n=3", "early-exit:k=3,layers=3"}) {
    engine_core_config c = config(kv_type::f32, "none");
    c.attention_stats_window = 4;
    auto plain = *engine_core::create(stories(), c);
    c.speculative = speculative;
    auto spec = *engine_core::create(stories(), c);
    const stats_trace a = trace_stats(*plain, reqs), b = trace_stats(*spec, reqs);
    int past_prompt = 0;
    for (const auto& [id, by_len] : b.at)
      for (const auto& [n_stored, stats] : by_len) {
        const auto it = a.at.at(id).find(n_stored);
        ASSERT_NE(it, a.at.at(id).end()) << speculative << " " << id << ": plain decoding never stored " << n_stored;
        ASSERT_EQ(stats.first.size(), it->second.first.size()) << speculative << " " << id;
        ASSERT_EQ(stats.second.size(), it->second.second.size()) << speculative << " " << id;
        for (std::size_t j = 0; j < stats.first.size(); ++j)
          ASSERT_NEAR(stats.first[j], it->second.first[j], 1e-5) << speculative << " " << id << " totals at " << n_stored;
        for (std::size_t j = 0; j < stats.second.size(); ++j)
          ASSERT_NEAR(stats.second[j], it->second.second[j], 1e-5) << speculative << " " << id << " window at " << n_stored;
        past_prompt += n_stored > static_cast<int>(reqs.front().prompt.size());
      }
    EXPECT_GT(past_prompt, 20) << speculative << ": too few decoding steps compared";
    const spec_decode_stats& st = spec->stats().spec_decode.at(std::string(speculative).substr(0, std::string(speculative).find(':')));
    EXPECT_GT(st.n_accepted_tokens, 0) << speculative;
    EXPECT_LT(st.n_accepted_tokens, st.n_draft_tokens) << speculative << ": nothing rejected, nothing checked";
    EXPECT_LT(spec->stats().n_steps, plain->stats().n_steps) << speculative;
  }
}

// Policies whose decisions a step's length cannot move keep greedy outputs
// plain decoding's with every drafter: Quest's sparse read selects pages per
// verified row (the rejected rows' keys forgotten by its selector), SnapKV
// compresses once, at the prompt's end, into per-head rows the drafts read.
TEST(speculative_engine, sparse_reads_and_one_time_compression_keep_outputs_exact) {
  const auto texts = prompts(12);
  std::vector<request> reqs;
  for (int i = 0; i < 12; ++i) reqs.push_back(greedy_request("q" + std::to_string(i), texts[i], 48));
  for (const char* policy : {"quest:pages=2,sinks=16,min_context=32", "snapkv:budget=40,once=true"}) {
    engine_core_config c = config(kv_type::f32, "none");
    c.draft_model = &stories();  // the target as its own draft model: every draft accepted
    auto unpoliced = *engine_core::create(stories(), c);
    const run_result free = run(*unpoliced, reqs);
    c.kv_policy = policy;
    for (const char* speculative : {"ngram:k=5,n=3", "early-exit:k=3,layers=3", "self:view=window,sinks=16,window=32,k=3", "draft:k=3"}) {
      const auto [plain, spec, a, b] = run_both(reqs, c, speculative);
      ASSERT_TRUE(spec) << policy << " " << speculative;
      bool policy_matters = false;
      for (const request& r : reqs) {
        EXPECT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << policy << " " << speculative << " " << r.id;
        policy_matters = policy_matters || a.tokens.at(r.id) != free.tokens.at(r.id);
      }
      EXPECT_TRUE(policy_matters) << policy << ": the policy changed no output, the test checks nothing of it";
      const std::string name = std::string(speculative).substr(0, std::string(speculative).find(':'));
      EXPECT_GT(spec->stats().spec_decode.at(name).n_accepted_tokens, 0) << policy << " " << speculative;
      EXPECT_EQ(spec->stats().n_policy_compactions, plain->stats().n_policy_compactions) << policy << " " << speculative;
      EXPECT_EQ(spec->kv_stats().n_blocks_used, 0) << policy << " " << speculative << ": blocks leaked";
    }
  }
}

// Policies that evict as the sequence grows decide once per step, so a
// verification step's tokens meet the next decision together and outputs may
// part from plain decoding's (docs/speculative.md); what must hold: every
// request completes, the KV's invariants hold every step (run()), drafts are
// accepted, nothing leaks.
TEST(speculative_engine, evicting_policies_run_with_every_drafter) {
  const auto texts = prompts(8);
  std::vector<request> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back(greedy_request("e" + std::to_string(i), texts[i], 64));
  for (const char* policy : {"h2o:budget=48", "pyramid:budget=48", "window:budget=40,positions=cache"}) {
    for (const char* speculative : {"ngram:k=5,n=3", "early-exit:k=3,layers=3", "draft:k=3"}) {
      engine_core_config c = config(kv_type::int8, speculative);
      c.kv_policy = policy;
      c.draft_model = &stories();
      auto e = *engine_core::create(stories(), c);
      const run_result out = run(*e, reqs);
      for (const request& r : reqs) EXPECT_EQ(out.tokens.at(r.id).size(), 64u) << policy << " " << speculative << " " << r.id;
      const std::string name = std::string(speculative).substr(0, std::string(speculative).find(':'));
      EXPECT_GT(e->stats().spec_decode.at(name).n_accepted_tokens, 0) << policy << " " << speculative;
      EXPECT_GT(e->stats().n_policy_compactions, 0) << policy << " " << speculative;
      EXPECT_EQ(e->kv_stats().n_blocks_used, 0) << policy << " " << speculative << ": blocks leaked";
    }
  }
}

// Prompt logits come from the prefill, which speculation does not touch.
TEST(speculative_engine, prompt_logits_with_speculation) {
  request r = greedy_request("p", prompts(1)[0], 32);
  r.prompt_logits = true;
  auto collect = [&](const std::string& speculative) {
    auto e = *engine_core::create(stories(), config(kv_type::f32, speculative));
    EXPECT_TRUE(e->add_request(r).ok());
    std::vector<float> logits;
    std::vector<token_id> tokens;
    std::vector<engine_event> events;
    while (e->has_work()) {
      events.clear();
      e->step(events);
      for (const engine_event& ev : events) {
        logits.insert(logits.end(), ev.prompt_logits.begin(), ev.prompt_logits.end());
        tokens.insert(tokens.end(), ev.tokens.begin(), ev.tokens.end());
      }
    }
    return std::pair{logits, tokens};
  };
  const auto plain = collect("none"), spec = collect("ngram:k=5,n=3");
  EXPECT_EQ(plain.first.size(), r.prompt.size() * static_cast<std::size_t>(stories().hparams().n_vocab));
  EXPECT_EQ(plain.first, spec.first);
  EXPECT_EQ(plain.second, spec.second);
}

// An engine with a KV mirror serves KV policies too (these requests decode
// plainly): a compaction gathers the mirror as every group, a renumbering one
// rotating its keys, a per-head one by rows (the mirror has the model's
// layers and heads). Every output is the plain engine's, the drafting
// requests' included (their drafts read a mirror that followed every step).
TEST(speculative_engine, kv_mirror_follows_compactions) {
  const auto texts = prompts(8);
  std::vector<request> reqs;
  for (int i = 0; i < 8; ++i) {
    request r = greedy_request("c" + std::to_string(i), texts[i], 48);
    if (i % 2 == 0) {
      r.kv_policy = i % 4 == 0 ? "window:budget=32,positions=cache" : "pyramid:budget=32";
      r.speculative = "none";  // evicting policies decide per step: a speculating run may keep other tokens
    }
    reqs.push_back(r);
  }
  const auto [plain, e, a, b] = run_both(reqs, config(kv_type::f32, "none"), "self:k=3,view=int4");
  ASSERT_TRUE(e);
  for (const request& r : reqs) EXPECT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << r.id;
  EXPECT_GT(e->stats().n_policy_compactions, 0) << "no compaction: the test checks nothing";
  EXPECT_GT(e->stats().spec_decode.at("self").n_accepted_tokens, 0);
  EXPECT_EQ(e->kv_stats().n_blocks_used, 0);
}

TEST(speculative_engine, draft_model_bad_input) {
  // Another vocabulary: refused naming --draft-model.
  auto synth = test::load_synth("tiny", gguf::tensor_type::f32);
  engine_core_config c = config(kv_type::f32, "draft");
  c.draft_model = synth.get();
  auto bad = engine_core::create(stories(), c);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("--draft-model"), std::string::npos) << bad.error().message();
  EXPECT_NE(bad.error().message().find("vocabulary"), std::string::npos) << bad.error().message();
  // No draft model: the default and a request asking for it are refused.
  auto none = engine_core::create(stories(), config(kv_type::f32, "draft:k=3"));
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message().find("--draft-model"), std::string::npos) << none.error().message();
  auto e = *engine_core::create(stories(), config(kv_type::f32, "none"));
  request r = greedy_request("x", "Once upon a time", 8);
  r.speculative = "draft";
  const status st = e->add_request(r);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("no draft model"), std::string::npos) << st.message();
  r.speculative = "draft:n=3";
  EXPECT_NE(e->add_request(r).message().find("unknown parameter 'n'"), std::string::npos);
}

TEST(speculative_engine, model_drafters_bad_input_names_the_parameter) {
  auto deep = engine_core::create(stories(), config(kv_type::f32, "early-exit:layers=9"));
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.error().message().find("layers=9"), std::string::npos) << deep.error().message();
  auto e = *engine_core::create(stories(), config(kv_type::f32, "none"));
  request r = greedy_request("x", "Once upon a time", 8);
  r.speculative = "self:view=quest";  // no key summaries kept by this engine
  status st = e->add_request(r);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("view=quest"), std::string::npos) << st.message();
  r.speculative = "early-exit";
  EXPECT_NE(e->add_request(r).message().find("layers"), std::string::npos);
  r.speculative = "self:view=sideways";
  EXPECT_NE(e->add_request(r).message().find("view=sideways"), std::string::npos);
  r.speculative = "self:k=2,layers=6";
  EXPECT_NE(e->add_request(r).message().find("layers=6"), std::string::npos);
  r.speculative = "self:k=2,layers=3";
  EXPECT_TRUE(e->add_request(r).ok());
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

TEST(speculative_engine, kv_mirror_drafts_are_accepted_and_its_blocks_are_pool_blocks) {
  // 32 requests sharing a prefix: the mirror group's blocks are cached and
  // hit with the model's, and its drafts are accepted about as often as the
  // target's own tokens would be (measured on this set: int4 0.96,
  // int2 0.73; the bounds leave a margin).
  const auto texts = prompts(32);
  std::vector<request> reqs;
  for (int i = 0; i < 32; ++i) reqs.push_back(greedy_request("m" + std::to_string(i), texts[i], 64));
  for (const auto& [spec, bound] : {std::pair<std::string, double>{"self:k=4,view=int4", 0.85},
                                    std::pair<std::string, double>{"self:k=4,view=int2", 0.55}}) {
    const auto [plain, e, a, b] = run_both(reqs, config(kv_type::f32, "none"), spec);
    ASSERT_TRUE(e);
    for (const request& r : reqs) ASSERT_EQ(a.tokens.at(r.id), b.tokens.at(r.id)) << spec << " " << r.id;
    const spec_decode_stats& s = e->stats().spec_decode.at("self");
    const double acceptance = static_cast<double>(s.n_accepted_tokens) / static_cast<double>(s.n_draft_tokens);
    std::printf("%s: %lld of %lld drafts accepted (%.3f)\n", spec.c_str(), static_cast<long long>(s.n_accepted_tokens),
                static_cast<long long>(s.n_draft_tokens), acceptance);
    EXPECT_GT(acceptance, bound) << spec;
    ASSERT_EQ(e->storage().n_groups(), 2);
    EXPECT_TRUE(e->storage().foreign_group(1));
    EXPECT_EQ(e->config().groups.back().mirror, spec.substr(spec.size() - 4));
    // Its blocks are the pool's (as many as group 0's), used and freed like them.
    EXPECT_EQ(e->kv_stats().groups.at(1).n_blocks, e->kv_stats().groups.at(0).n_blocks);
    EXPECT_GT(e->kv_stats().n_prefix_hit_tokens, 0) << "the shared prefix must hit with the mirror group";
    EXPECT_EQ(e->kv_stats().n_blocks_used, 0) << "blocks leaked";
    EXPECT_LT(e->storage().arena(1).class_layout(0).bytes_per_block(), e->storage().arena(0).class_layout(0).bytes_per_block() / 4);
  }
}

TEST(speculative_engine, kv_mirror_view_needs_an_engine_that_keeps_one) {
  auto e = *engine_core::create(stories(), config(kv_type::f32, "ngram"));
  EXPECT_EQ(e->storage().n_groups(), 1) << "no mirror without a default that reads one";
  request r = greedy_request("x", "Once upon a time", 8);
  r.speculative = "self:view=int4";
  status st = e->add_request(r);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("speculative"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("view=int4"), std::string::npos) << st.message();
  // An int2 mirror does not serve int4 drafts; it serves its own, with layers=L.
  auto m = *engine_core::create(stories(), config(kv_type::f32, "self:view=int2"));
  r.speculative = "self:k=2,view=int4";
  EXPECT_NE(m->add_request(r).message().find("view=int4"), std::string::npos);
  r.speculative = "self:k=2,view=int2,layers=3";
  EXPECT_TRUE(m->add_request(r).ok());
  r.id = "y";
  r.speculative = "self:view=int8";
  EXPECT_NE(m->add_request(r).message().find("view=int8"), std::string::npos);
}

}  // namespace
}  // namespace pagoda
