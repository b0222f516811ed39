// Gemma 3's images through the engine: an image span marked bidirectional
// (image_span::bidirectional, as vision::make_image_part makes gemma3's) is
// computed in one step, its tokens seeing each other both ways, as llama.cpp
// decodes it (mtmd_decode_use_non_causal). Checked against llama.cpp's
// logits (tests/data/oracle/vision, gemma3: text-gemma3-F32 and mtmd's
// embeddings of image A), whole, with prompt chunks smaller than the span,
// after a prefix-cache hit that ends inside the span, after preemption, and
// beside other sequences that leave the step too little room for the span.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/engine_configs.h"
#include "model/llama.h"
#include "pagoda/request.h"
#include "sched/engine_core.h"
#include "sched/engine_setup.h"
#include "sched/image_engine_util.h"
#include "sched/image_spans.h"

namespace pagoda {
namespace {

using test::expect_same_logprobs;
using test::read_f32;
using test::run_all;
using test::vision_dir;

// The gemma3 vision oracle's bounds (tests/vision/vision_gemma3_oracle_test.cpp
// says why: ggml's fp16 GELU table in the text model's FFN).
constexpr double k_logit_tol = 5e-3;
constexpr double k_logit_rms_tol = 1e-3;

struct oracle {
  std::vector<token_id> prompt, after;
  int n_tokens = 0;
  int n_vocab = 0;
  int n_embd = 0;
  std::vector<float> rows;    // mtmd's embeddings of image A, [n_tokens][n_embd]
  std::vector<float> logits;  // at the image's positions, then at `after`'s
};

const oracle& ref() {
  static const oracle o = [] {
    oracle r;
    std::ifstream in(vision_dir() + "/ref-gemma3-a-64x64.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    for (int id : j.at("prompt")) r.prompt.push_back(id);
    for (int id : j.at("after")) r.after.push_back(id);
    r.n_tokens = j.at("chunks")[0].at("n_tokens");
    r.n_vocab = j.at("n_vocab");
    r.n_embd = j.at("n_embd");
    r.rows = read_f32(vision_dir() + "/ref-gemma3-a-64x64.embd.f32");
    r.logits = read_f32(vision_dir() + "/ref-gemma3-a-64x64.logits.f32");
    return r;
  }();
  return o;
}

const llama_model& text_model() {
  static const std::unique_ptr<llama_model> m = [] {
    auto r = llama_model::load(vision_dir() + "/text-gemma3-F32.gguf");
    EXPECT_TRUE(r.ok()) << r.error().message();
    return std::move(*r);
  }();
  return *m;
}

engine_core_config config(std::int64_t n_blocks) {
  return test::uniform_engine(text_model().hparams(), {.n_blocks = n_blocks, .max_model_len = 256, .max_num_seqs = 8});
}

// The oracle's prompt, image A's rows (bidirectional), `after`.
request image_request(const std::string& id, const std::vector<token_id>& after, int max_tokens, bool bidirectional = true) {
  request r;
  r.id = id;
  r.max_tokens = max_tokens;
  r.logprobs = 3;
  r.prompt = ref().prompt;
  image_span im;
  im.begin = static_cast<std::int32_t>(r.prompt.size());
  im.n_tokens = ref().n_tokens;
  im.embeddings = ref().rows;
  im.content_hash = 0x9e3;
  im.bidirectional = bidirectional;
  r.prompt.insert(r.prompt.end(), static_cast<std::size_t>(im.n_tokens), token_id{0});
  r.prompt.insert(r.prompt.end(), after.begin(), after.end());
  r.images.push_back(std::move(im));
  return r;
}

struct diff {
  double max_abs = 0;
  double rms = 0;
};

// The prompt logits from the image's first position on against the reference.
diff against_reference(const std::vector<float>& prompt_logits) {
  const oracle& o = ref();
  const std::size_t from = o.prompt.size() * static_cast<std::size_t>(o.n_vocab);
  EXPECT_EQ(prompt_logits.size(), from + o.logits.size());
  if (prompt_logits.size() != from + o.logits.size()) return {INFINITY, INFINITY};
  diff d;
  double sq = 0;
  for (std::size_t i = 0; i < o.logits.size(); ++i) {
    double e = std::fabs(static_cast<double>(prompt_logits[from + i]) - o.logits[i]);
    if (std::isnan(e)) e = INFINITY;
    d.max_abs = std::max(d.max_abs, e);
    sq += e * e;
  }
  d.rms = std::sqrt(sq / static_cast<double>(o.logits.size()));
  return d;
}

// The logits at the image's positions and at the tokens after it match
// llama.cpp's, whole and with prompt chunks of 6 and 3 (smaller than the
// 16-token span: the span still goes in one step, the text around it in
// chunks). The same span decoded causally is far off.
TEST(engine_gemma3_images, logits_at_and_after_the_image_match_llama_cpp) {
  ASSERT_EQ(ref().n_embd, text_model().hparams().n_embd);
  for (const int chunk : {0, 6, 3}) {
    SCOPED_TRACE(chunk);
    auto e = *engine_core::create(text_model(), config(16));
    request r = image_request("oracle", ref().after, 0);
    r.prompt_logits = true;
    r.prompt_chunk = chunk;
    int n_steps = 0;
    const auto got = run_all(*e, {r}, &n_steps);
    const diff d = against_reference(got.at("oracle").prompt_logits);
    EXPECT_LE(d.max_abs, k_logit_tol);
    EXPECT_LE(d.rms, k_logit_rms_tol);
    std::printf("[ images ] gemma3 engine, prompt chunk %d (%d steps): logits at and after the image max abs diff "
                "%.3g rms %.3g\n",
                chunk, n_steps, d.max_abs, d.rms);
    if (chunk == 3) {
      // 4 text tokens in 2 chunks (3 + 1: the chunk stops before the span), the span, the 3 after: 4 steps.
      EXPECT_EQ(n_steps, 4);
    }
  }
  auto e = *engine_core::create(text_model(), config(16));
  request causal = image_request("causal", ref().after, 0, /*bidirectional=*/false);
  causal.prompt_logits = true;
  const diff d = against_reference(run_all(*e, {causal}).at("causal").prompt_logits);
  EXPECT_GT(d.max_abs, 100 * k_logit_tol) << "a causal image span is not what llama.cpp computes";
}

// 4 text tokens, the 16-token span at [4, 20), 3 after: with blocks of 16
// the cached block [0, 16) ends inside the span. The repeat computes the
// span's last 4 tokens in one step, reading the cached 12 (computed seeing
// the whole span), and answers bitwise as the first request did.
TEST(engine_gemma3_images, a_prefix_hit_inside_the_span_answers_the_same) {
  auto e = *engine_core::create(text_model(), config(64));
  const auto first = run_all(*e, {image_request("first", ref().after, 6)});
  EXPECT_EQ(first.at("first").usage.cached_tokens, 0);
  const auto again = run_all(*e, {image_request("again", ref().after, 6)});
  EXPECT_EQ(again.at("again").usage.cached_tokens, 16);
  EXPECT_EQ(again.at("again").usage.cached_image_tokens, 12);
  EXPECT_EQ(again.at("again").tokens, first.at("first").tokens);
  expect_same_logprobs(again.at("again").logprobs, first.at("first").logprobs);
  // With prompt chunks of 2 the repeat still computes the span's rest whole.
  request chunked = image_request("chunked", ref().after, 6);
  chunked.prompt_chunk = 2;
  const auto third = run_all(*e, {chunked});
  EXPECT_EQ(third.at("chunked").usage.cached_tokens, 16);
  EXPECT_EQ(third.at("chunked").tokens, first.at("first").tokens);
  expect_same_logprobs(third.at("chunked").logprobs, first.at("first").logprobs);
}

// A pool of about two sequences for six: preempted sequences recompute
// (their span again in one step, or its rest after a cached prefix) and
// answer as on a large pool.
TEST(engine_gemma3_images, preempted_sequences_recompute_their_spans) {
  std::vector<request> reqs;
  for (int i = 0; i < 6; ++i) {
    request r = image_request("p" + std::to_string(i), {303, static_cast<token_id>(304 + i)}, 40);
    r.images[0].content_hash = 0x100 + static_cast<std::uint64_t>(i % 3);
    reqs.push_back(std::move(r));
  }
  test::expect_preemption_changes_nothing(text_model(), config(0), 256, 9, reqs, 40);
}

// The engine's own layout for the model (engine_setup): the sliding-window
// layers' KV in a group of its own that lets go of blocks out of the window,
// against every layer kept whole (--swa-full): the same image requests, one
// of them a prefix hit ending inside the span, answer the same.
TEST(engine_gemma3_images, the_window_group_answers_as_full_kv) {
  const auto answers = [&](bool swa_full) {
    engine_config ec = test::vision_engine_config("text-gemma3-F32.gguf", 256, 4, 2048);
    ec.swa_full = swa_full;
    auto cc = make_engine_core_config(text_model(), ec);
    EXPECT_TRUE(cc.ok()) << cc.error().message();
    auto e = *engine_core::create(text_model(), *cc);
    EXPECT_EQ(e->kv().n_groups(), swa_full ? 1 : 2) << "a window group of the sliding layers";
    std::vector<test::engine_result> out;
    for (const char* id : {"first", "again"}) out.push_back(run_all(*e, {image_request(id, ref().after, 12)}).at(id));
    EXPECT_EQ(out[1].usage.cached_tokens, 16);
    return out;
  };
  const auto windowed = answers(false);
  const auto full = answers(true);
  for (std::size_t i = 0; i < windowed.size(); ++i) {
    EXPECT_EQ(windowed[i].tokens, full[i].tokens) << i;
    expect_same_logprobs(windowed[i].logprobs, full[i].logprobs);
  }
  EXPECT_EQ(windowed[0].tokens, windowed[1].tokens);
}

// A step budget of 17 tokens and two text requests decoding beside the
// image request: after its 4 text tokens (the first step stops before the
// span) the span's 16 tokens do not fit beside the two decode tokens, so it
// waits, unsplit, until they finish; its answer is the one it gets alone. A
// request whose prompt starts with the span waits to be admitted likewise.
TEST(engine_gemma3_images, a_span_waits_for_a_step_with_room) {
  engine_core_config c = config(64);
  auto alone = *engine_core::create(text_model(), c);
  const auto expected = run_all(*alone, {image_request("x", ref().after, 8)});
  c.max_num_batched_tokens = 17;
  auto tight = *engine_core::create(text_model(), c);
  std::vector<request> reqs;
  for (const char* id : {"t1", "t2"}) {
    request text;
    text.id = id;
    text.max_tokens = 8;
    text.prompt.assign(6, 300);
    reqs.push_back(text);
  }
  reqs.push_back(image_request("x", ref().after, 8));
  // One whose prompt starts with the span: it is not admitted until a step has room for all of it.
  request y = image_request("y", ref().after, 8);
  y.prompt.erase(y.prompt.begin(), y.prompt.begin() + static_cast<std::ptrdiff_t>(ref().prompt.size()));
  y.images[0].begin = 0;
  auto alone_y = *engine_core::create(text_model(), config(64));
  const auto expected_y = run_all(*alone_y, {y});
  reqs.push_back(y);
  int n_steps = 0;
  const auto got = run_all(*tight, reqs, &n_steps);
  EXPECT_EQ(got.at("x").tokens, expected.at("x").tokens);
  expect_same_logprobs(got.at("x").logprobs, expected.at("x").logprobs);
  EXPECT_EQ(got.at("y").tokens, expected_y.at("y").tokens);
  expect_same_logprobs(got.at("y").logprobs, expected_y.at("y").logprobs);
  EXPECT_EQ(got.at("t1").tokens.size(), 8u);
  // The texts' prompt step and 7 decode steps (the image request's span waits through them), its span, its 3 after
  // tokens with the first sample, 7 more decodes.
  EXPECT_GE(n_steps, 1 + 7 + 1 + 1 + 7);
}

// A span that no step can hold, and prompt logprobs over a span longer than
// their per-step cap, are refused with what to change.
TEST(engine_gemma3_images, spans_that_cannot_be_one_step_are_refused) {
  engine_core_config c = config(64);
  c.max_num_batched_tokens = 12;
  auto e = *engine_core::create(text_model(), c);
  status st = e->add_request(image_request("big", ref().after, 2));
  EXPECT_EQ(st.code(), errc::invalid_argument);
  EXPECT_NE(st.message().find("--max-num-batched-tokens to at least 16"), std::string::npos) << st.message();
  // The same span causal (idefics3) is split across steps as before.
  EXPECT_TRUE(e->add_request(image_request("causal", ref().after, 2, false)).ok());

  auto e2 = *engine_core::create(text_model(), config(64));
  request long_span = image_request("long", {}, 2);
  image_span& im = long_span.images[0];
  im.n_tokens = 130;
  im.embeddings.resize(static_cast<std::size_t>(im.n_tokens) * ref().n_embd, 0.5f);
  long_span.prompt.resize(ref().prompt.size() + 130, 0);
  long_span.prompt_logprobs = 0;
  st = e2->add_request(long_span);
  EXPECT_EQ(st.code(), errc::invalid_argument);
  EXPECT_NE(st.message().find("prompt_logprobs"), std::string::npos) << st.message();
}

// The scheduler's rule alone: a step never ends inside a bidirectional span.
TEST(engine_gemma3_images, step_tokens_keep_spans_whole) {
  std::vector<image_span> spans(2);
  spans[0].begin = 4;
  spans[0].n_tokens = 16;  // [4, 20)
  spans[0].bidirectional = true;
  spans[1].begin = 30;
  spans[1].n_tokens = 10;  // [30, 40), causal
  EXPECT_EQ(image_step_tokens(spans, 0, 3, 100), 3);    // before the span
  EXPECT_EQ(image_step_tokens(spans, 0, 6, 100), 4);    // would end inside: stops before it
  EXPECT_EQ(image_step_tokens(spans, 4, 6, 100), 16);   // starts at it: all of it
  EXPECT_EQ(image_step_tokens(spans, 16, 2, 100), 4);   // a cached prefix ends inside: the rest
  EXPECT_EQ(image_step_tokens(spans, 4, 6, 15), 0);     // the rest does not fit the budget: wait
  EXPECT_EQ(image_step_tokens(spans, 4, 16, 16), 16);
  EXPECT_EQ(image_step_tokens(spans, 0, 25, 100), 25);  // holds it whole
  EXPECT_EQ(image_step_tokens(spans, 32, 3, 100), 3);   // a causal span splits
  std::vector<std::int32_t> positions{16, 17, 18, 19, 20}, see;
  image_bounds_of_step(spans, 16, positions, see);
  EXPECT_EQ(see, (std::vector<std::int32_t>{19, 19, 19, 19, 20}));
  image_bounds_of_step(spans, 20, positions, see);  // no span token in the step
  EXPECT_TRUE(see.empty());
}

}  // namespace
}  // namespace pagoda
