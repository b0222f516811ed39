// Images through the engine (request::images, issue 37): the rows of an image
// span stand in for its positions' embeddings in whatever prompt chunks
// cover it, its blocks are prefix-cached by the image's content hash, and
// its KV takes the image type and policy (--kv-image-type, --kv-image-policy).
//
// The model and rows are the vision oracle's (tests/data/oracle/vision,
// tests/data/oracle/README.md "Vision"): text-tiny-F32 and the embeddings
// llama.cpp's mtmd made of image A, so the logits after the image are
// checked against llama.cpp's own through the whole engine.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "common/engine_configs.h"
#include "model/llama.h"
#include "pagoda/request.h"
#include "sched/engine_core.h"
#include "sched/engine_setup.h"
#include "sched/image_spans.h"
#include "sched/image_engine_util.h"
#include "store/warehouse.h"

namespace pagoda {
namespace {

using test::expect_same_logprobs;
using test::read_f32;
using test::engine_result;
using test::run_all;
using test::vision_dir;

// The oracle test's bounds (tests/vision/vision_oracle_test.cpp says why).
constexpr double k_logit_tol = 5e-4;
constexpr double k_logit_rms_tol = 5e-5;
constexpr int k_n_embd = 128;
constexpr int k_n_vocab = 512;
constexpr int k_chunk_tokens = 16;  // embeddings per image chunk (one 64x64 slice)
const std::vector<token_id> k_prompt{1, 300, 301, 302};  // the oracle's prompt (prompt.txt)

const llama_model& text_model() { return test::vision_text_model(); }

// Image `name`'s rows as mtmd encoded them: its first n_chunks chunks.
std::vector<float> image_rows(const std::string& name, int n_chunks) {
  std::vector<float> rows = read_f32(vision_dir() + "/ref-" + name + ".embd.f32");
  rows.resize(static_cast<std::size_t>(n_chunks) * k_chunk_tokens * k_n_embd);
  return rows;
}

engine_core_config config(std::int64_t n_blocks, kv_type type = kv_type::f32) {
  return test::uniform_engine(text_model().hparams(),
                             {.n_blocks = n_blocks, .type = type, .max_model_len = 256, .max_num_seqs = 8});
}

// `before` tokens, the image (rows / n_embd tokens, placeholder id 0), `after` tokens.
request image_request(const std::string& id, const std::vector<token_id>& before, std::vector<float> rows,
                      std::uint64_t hash, const std::vector<token_id>& after, int max_tokens) {
  request r;
  r.id = id;
  r.max_tokens = max_tokens;
  r.logprobs = 3;
  r.prompt = before;
  image_span im;
  im.begin = static_cast<std::int32_t>(before.size());
  im.n_tokens = static_cast<std::int32_t>(rows.size() / k_n_embd);
  im.embeddings = std::move(rows);
  im.content_hash = hash;
  r.prompt.insert(r.prompt.end(), static_cast<std::size_t>(im.n_tokens), token_id{0});
  r.prompt.insert(r.prompt.end(), after.begin(), after.end());
  r.images.push_back(std::move(im));
  return r;
}

// The logits at the image's 16 positions, through the engine, against
// llama.cpp's (its prompt, then the first chunk's rows decoded as
// llama_batch.embd, F32 KV cache), whole and in prompt chunks that split the
// image (chunks of 6: the first holds 4 text tokens and 2 of the image).
TEST(engine_images, logits_after_the_image_match_llama_cpp) {
  const std::vector<float> ref = read_f32(vision_dir() + "/ref-a-64x64.logits.f32");
  ASSERT_EQ(ref.size(), static_cast<std::size_t>(k_chunk_tokens) * k_n_vocab);
  for (const int chunk : {0, 6}) {
    SCOPED_TRACE(chunk);
    auto e = *engine_core::create(text_model(), config(16));
    request r = image_request("oracle", k_prompt, image_rows("a-64x64", 1), 0xa, {}, 0);
    r.prompt_logits = true;
    r.prompt_chunk = chunk;
    const auto got = run_all(*e, {r});
    const std::vector<float>& all = got.at("oracle").prompt_logits;
    ASSERT_EQ(all.size(), r.prompt.size() * k_n_vocab);
    const std::size_t from = k_prompt.size() * k_n_vocab;
    double max_abs = 0, sq = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      double d = std::fabs(static_cast<double>(all[from + i]) - ref[i]);
      if (std::isnan(d)) d = INFINITY;
      max_abs = std::max(max_abs, d);
      sq += d * d;
    }
    const double rms = std::sqrt(sq / static_cast<double>(ref.size()));
    EXPECT_LE(max_abs, k_logit_tol);
    EXPECT_LE(rms, k_logit_rms_tol);
    std::printf("[ images ] engine, prompt chunk %d: logits after the image max abs diff %.3g rms %.3g\n", chunk,
                max_abs, rms);
    // Not the token embeddings: the placeholder id's rows give other logits.
    request plain = r;
    plain.id = "plain";
    plain.images.clear();
    auto e2 = *engine_core::create(text_model(), config(16));
    const auto text_only = run_all(*e2, {plain});
    EXPECT_GT(std::fabs(text_only.at("plain").prompt_logits[from] - ref[0]) +
                  std::fabs(text_only.at("plain").prompt_logits[from + 1] - ref[1]),
              100 * k_logit_tol);
  }
}

// 4 text tokens, image A's 32 rows (both of its chunks), 3 text tokens: with
// blocks of 16, blocks 0 and 1 are whole and hold 28 image tokens.
TEST(engine_images, the_same_image_hits_the_prefix_cache_by_content) {
  const std::vector<token_id> tail{303, 304, 305};
  const std::vector<float> a = image_rows("a-64x64", 2), b = image_rows("b-96x80", 2);
  auto e = *engine_core::create(text_model(), config(64));
  const auto first = run_all(*e, {image_request("first", k_prompt, a, 0xa, tail, 6)});
  EXPECT_EQ(first.at("first").usage.cached_tokens, 0);
  EXPECT_EQ(first.at("first").usage.image_tokens, 32);
  ASSERT_EQ(first.at("first").tokens.size(), 6u);

  const auto again = run_all(*e, {image_request("again", k_prompt, a, 0xa, tail, 6)});
  EXPECT_EQ(again.at("again").usage.cached_tokens, 32) << "both whole blocks";
  EXPECT_EQ(again.at("again").usage.cached_image_tokens, 28);
  EXPECT_EQ(again.at("again").tokens, first.at("first").tokens);
  expect_same_logprobs(again.at("again").logprobs, first.at("first").logprobs);

  // Another image of the same size: a miss from block 0 on (it holds 12 of the image's tokens).
  const auto other = run_all(*e, {image_request("other", k_prompt, b, 0xb, tail, 6)});
  EXPECT_EQ(other.at("other").usage.cached_tokens, 0);
  // The key is the content hash, not the rows: the same rows under another hash miss.
  const auto renamed = run_all(*e, {image_request("renamed", k_prompt, a, 0xc, tail, 6)});
  EXPECT_EQ(renamed.at("renamed").usage.cached_tokens, 0);
  // Another tenant never shares an image's blocks.
  request t = image_request("tenant", k_prompt, a, 0xa, tail, 6);
  t.tenant = "bob";
  const auto tenant = run_all(*e, {t});
  EXPECT_EQ(tenant.at("tenant").usage.cached_tokens, 0);
  EXPECT_EQ(tenant.at("tenant").tokens, first.at("first").tokens) << "same rows, same answer, computed again";
  // Text only with the placeholder ids: a miss too (the image's blocks are keyed apart from any token ids).
  request text = image_request("text", k_prompt, a, 0xa, tail, 6);
  text.images.clear();
  EXPECT_EQ(run_all(*e, {text}).at("text").usage.cached_tokens, 0);

  EXPECT_EQ(e->stats().n_image_tokens, 5 * 32);
  EXPECT_EQ(e->stats().n_cached_image_tokens, 28);
  EXPECT_EQ(e->kv_stats().n_blocks_used, 0);
}

// The disk tier keys image blocks as the pool does: after a restart (a new
// engine on the same directory) the same image loads from disk, another
// image or another tenant does not.
TEST(engine_images, the_disk_tier_keys_images_by_content) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("pagoda_images_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  engine_config ec = test::vision_engine_config("text-tiny-F32.gguf", 256, 4, 4096);
  ec.kv_store_path = dir.string();
  ec.kv_store_size_gib = 0.25;
  const auto node_run = [&](std::vector<request> reqs) {
    auto cc = make_engine_core_config(text_model(), ec);
    EXPECT_TRUE(cc.ok()) << cc.error().message();
    cc->max_model_len = 256;
    auto w = make_warehouse(ec, text_model());
    EXPECT_TRUE(w.ok()) << w.error().message();
    auto core = std::move(*engine_core::create(text_model(), *cc));
    attach_warehouse(*core, **w);
    std::map<std::string, engine_result> out;
    for (request& r : reqs) {
      auto one = run_all(*core, {r});
      (*w)->flush();
      out.insert(one.begin(), one.end());
    }
    core.reset();
    (*w)->close();
    return out;
  };
  const std::vector<token_id> tail{303, 304, 305};
  const auto first = node_run({image_request("a", k_prompt, image_rows("a-64x64", 2), 0xa, tail, 4)});
  request bob = image_request("bob", k_prompt, image_rows("a-64x64", 2), 0xa, tail, 4);
  bob.tenant = "bob";
  const auto second = node_run({image_request("again", k_prompt, image_rows("a-64x64", 2), 0xa, tail, 4),
                                image_request("other", k_prompt, image_rows("b-96x80", 2), 0xb, tail, 4), bob});
  EXPECT_EQ(second.at("again").usage.cached_tokens, 32);
  EXPECT_EQ(second.at("again").usage.loaded_tokens_by_tier.empty() ? 0 : second.at("again").usage.loaded_tokens_by_tier[0], 32)
      << "from the disk tier";
  EXPECT_EQ(second.at("again").tokens, first.at("a").tokens);
  EXPECT_EQ(second.at("other").usage.cached_tokens, 0);
  EXPECT_EQ(second.at("bob").usage.cached_tokens, 0);
  fs::remove_all(dir);
}

// --kv-image-type adds a KV class of its type unless --kv-segment-dtype
// lists it (at that flag's fraction) or it is the default type.
TEST(engine_images, the_image_type_is_a_kv_class) {
  engine_config ec;
  ec.model_path = vision_dir() + "/text-tiny-F32.gguf";
  ec.kv_cache_dtype = "f32";
  ec.n_ctx = 256;
  ec.max_num_seqs = 4;
  ec.max_kv_tokens = 4096;
  const auto classes = [&](const engine_config& c) {
    auto cc = make_engine_core_config(text_model(), c);
    EXPECT_TRUE(cc.ok()) << cc.error().message();
    std::vector<std::string> names;
    if (cc.ok())
      for (const kv_segment_class& k : cc->kv_classes) names.push_back(k.name);
    return names;
  };
  engine_config img = ec;
  img.kv_image_type = "int8";
  EXPECT_EQ(classes(img), std::vector<std::string>{"int8"});
  img.kv_segment_dtypes = {"int4:0.2", "int8:0.5"};
  EXPECT_EQ(classes(img), (std::vector<std::string>{"int4", "int8"}));
  engine_config plain = ec;
  plain.kv_image_type = "f32";
  EXPECT_TRUE(classes(plain).empty());
  plain.kv_image_type = "no-such-type";
  EXPECT_FALSE(make_engine_core_config(text_model(), plain).ok());
}

TEST(engine_images, key_tokens_name_the_image_the_tenant_and_the_index) {
  EXPECT_LT(image_key_token(1, "", 0), 0);
  EXPECT_EQ(image_key_token(1, "", 0), image_key_token(1, "", 0));
  EXPECT_NE(image_key_token(1, "", 0), image_key_token(2, "", 0));
  EXPECT_NE(image_key_token(1, "", 0), image_key_token(1, "", 1));
  EXPECT_NE(image_key_token(1, "", 0), image_key_token(1, "bob", 0));
}

// A pool of about two sequences for six: preempted sequences recompute their
// images from the rows the request keeps and answer as on a large pool.
TEST(engine_images, preempted_sequences_recompute_their_images) {
  std::vector<request> reqs;
  for (int i = 0; i < 6; ++i)
    reqs.push_back(image_request("p" + std::to_string(i), k_prompt, image_rows(i % 2 ? "b-96x80" : "a-64x64", 2),
                                 0x100 + static_cast<std::uint64_t>(i), {303, static_cast<token_id>(304 + i)}, 40));
  test::expect_preemption_changes_nothing(text_model(), config(0), 256, 11, reqs, 40);
}

// 16 text tokens, then image A (32 tokens: blocks 1 and 2 hold only the
// image), then 3: with --kv-image-type int8 those two blocks are int8, the
// text's f32; a span naming the default type keeps them f32.
TEST(engine_images, image_blocks_take_the_image_kv_type) {
  std::vector<token_id> text(16);
  for (int i = 0; i < 16; ++i) text[static_cast<std::size_t>(i)] = 300 + i;
  engine_core_config c = config(48);
  c.kv_classes.push_back(kv_segment_class{"int8", kv_layout::uniform(c.kv.n_layers, c.kv.n_kv_heads, c.kv.head_dim, 16,
                                                                     kv_type::int8, kv_type::int8),
                                          16});
  c.kv_image_type = "int8";
  auto e = *engine_core::create(text_model(), c);
  const auto first = run_all(*e, {image_request("i8", text, image_rows("a-64x64", 2), 0xa, {303, 304, 305}, 2)});
  EXPECT_EQ(e->kv_stats().classes.at(1).n_cached, 2) << "the image's two whole blocks, int8";
  // The same image under its own type (the default, f32): other blocks, other keys.
  request own = image_request("f32", text, image_rows("a-64x64", 2), 0xa, {303, 304, 305}, 2);
  own.images[0].kv_type = "f32";
  const auto second = run_all(*e, {own});
  EXPECT_EQ(second.at("f32").usage.cached_tokens, 16) << "the text block only: int8 image blocks are not f32's";
  EXPECT_EQ(e->kv_stats().classes.at(1).n_cached, 2);
  // Again int8: the image's blocks hit.
  const auto third = run_all(*e, {image_request("i8b", text, image_rows("a-64x64", 2), 0xa, {303, 304, 305}, 2)});
  EXPECT_EQ(third.at("i8b").usage.cached_tokens, 48);
  EXPECT_EQ(third.at("i8b").usage.cached_image_tokens, 32);
  EXPECT_EQ(third.at("i8b").tokens, first.at("i8").tokens);

  // A type the engine keeps no class of: a clear error at the request.
  request bad = image_request("bad", text, image_rows("a-64x64", 2), 0xa, {}, 2);
  bad.images[0].kv_type = "int4";
  const status st = e->add_request(bad);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("--kv-segment-dtype int4"), std::string::npos) << st.message();
  // An engine whose image type it cannot keep does not start.
  engine_core_config no_class = config(48);
  no_class.kv_image_type = "int8";
  auto refused = engine_core::create(text_model(), no_class);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("--kv-image-type"), std::string::npos) << refused.error().message();
}

// --kv-image-policy: the image's tokens under a window of half their number,
// the text whole; the policy's compactions are counted and the request keeps
// less than it saw.
TEST(engine_images, the_image_policy_acts_on_the_image_only) {
  engine_core_config c = config(64);
  c.kv_image_policy = "window:budget=0.5";
  auto e = *engine_core::create(text_model(), c);
  const auto got = run_all(*e, {image_request("w", k_prompt, image_rows("a-64x64", 2), 0xa, {303, 304, 305}, 8)});
  EXPECT_GT(e->stats().n_policy_evicted_slots, 0);
  const request_usage& u = got.at("w").usage;
  EXPECT_GT(u.kv_tokens_seen, 0);
  EXPECT_LT(u.kv_tokens_kept, u.kv_tokens_seen);
  // The text keeps every token; the image keeps half its 32 (an exact budget: no slack).
  EXPECT_EQ(u.kv_tokens_seen - u.kv_tokens_kept, 16);
  // A bad policy is refused when the engine is made.
  engine_core_config bad = config(64);
  bad.kv_image_policy = "no-such-policy";
  auto refused = engine_core::create(text_model(), bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("--kv-image-policy"), std::string::npos);
  // Nor a policy that cannot be a part's (sparse reads are whole-sequence).
  bad.kv_image_policy = "quest";
  auto sparse = engine_core::create(text_model(), bad);
  ASSERT_FALSE(sparse.ok());
  EXPECT_NE(sparse.error().message().find("--kv-image-policy"), std::string::npos) << sparse.error().message();
}

// Prompt logprobs (scoring) over a prompt with an image: every prompt token
// but the first gets an entry, the image's positions their placeholder id's
// (the runner scores the prompt's own ids, never a key token), and a second
// request with the same image takes its cached blocks and the same scores.
TEST(engine_images, prompt_logprobs_score_the_prompts_own_ids) {
  auto e = *engine_core::create(text_model(), config(64));
  const auto scored = [&](const std::string& id) {
    request r = image_request(id, k_prompt, image_rows("a-64x64", 2), 0xa, {303, 304, 305}, 1);
    r.prompt_logprobs = 0;
    std::vector<token_logprob> all;
    EXPECT_TRUE(e->add_request(r).ok());
    std::vector<engine_event> events;
    while (e->has_work()) {
      events.clear();
      e->step(events);
      for (const engine_event& ev : events) all.insert(all.end(), ev.prompt_logprobs.begin(), ev.prompt_logprobs.end());
    }
    return all;
  };
  const std::vector<token_logprob> first = scored("s1");
  ASSERT_EQ(first.size(), 4u + 32u + 3u - 1u);
  for (std::size_t i = 3; i < 3 + 32; ++i) EXPECT_EQ(first[i].token, 0) << i;  // the image's placeholders
  EXPECT_EQ(first.back().token, 305);
  const std::vector<token_logprob> second = scored("s2");
  ASSERT_EQ(second.size(), first.size());
  for (std::size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(second[i].token, first[i].token) << i;
    EXPECT_EQ(second[i].logprob, first[i].logprob) << i;
  }
}

TEST(engine_images, bad_spans_are_refused_clearly) {
  auto e = *engine_core::create(text_model(), config(64));
  const auto refused = [&](request r, const std::string& words) {
    const status st = e->add_request(std::move(r));
    EXPECT_FALSE(st.ok()) << words;
    EXPECT_NE(st.message().find(words), std::string::npos) << st.message();
  };
  request r = image_request("x", k_prompt, image_rows("a-64x64", 1), 0xa, {303}, 2);
  request past = r;
  past.images[0].begin = 10;
  refused(past, "not a non-empty range");
  request narrow = r;
  narrow.images[0].embeddings.resize(16 * 64);
  refused(narrow, "the model's are 128 wide");
  request ragged = r;
  ragged.images[0].embeddings.pop_back();
  refused(ragged, "not a row per each");
  request twice = r;
  twice.images.push_back(twice.images[0]);
  refused(twice, "overlaps or precedes image 0");
  request seg = r;
  seg.segments.push_back(prompt_segment{2, 6, "none", ""});
  refused(seg, "overlaps prompt segment");
  request spec = r;
  spec.speculative = "ngram:k=2";
  refused(spec, "speculative decoding with images");
  EXPECT_FALSE(e->has_work());
}

}  // namespace
}  // namespace pagoda
