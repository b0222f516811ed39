// The forward pass against the independent references in tests/data, and the
// batch-invariance property the scheduler relies on.
#include "kv/kv_storage.h"
#include "model/llama.h"

#include <bit>
#include <cstring>
#include <fstream>
#include <numeric>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/stories.h"

#include "model/sampler.h"

namespace pagoda {
namespace {

const std::string k_model = test::stories_path();

struct harness {
  std::unique_ptr<llama_model> model;
  std::unique_ptr<kv_storage> kv;
  std::unique_ptr<llama_context> ctx;

  explicit harness(kv_type type = kv_type::f32, int n_blocks = 256, int threads = 1) {
    auto m = llama_model::load(k_model);
    EXPECT_TRUE(m.ok()) << m.error().message();
    model = std::move(*m);
    const llama_hparams& hp = model->hparams();
    kv = *kv_storage::create(kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, type, type), n_blocks);
    ctx = std::make_unique<llama_context>(*model, *kv, threads);
  }
  // Blocks [first, first + n) as a table.
  static std::vector<block_id> table(int first, int n) {
    std::vector<block_id> t;
    for (int i = 0; i < n; ++i) t.push_back(block_id(first + i));
    return t;
  }
};

nlohmann::json load_reference() {
  std::ifstream in(std::string(PAGODA_SOURCE_DIR) + "/tests/data/reference/once_upon_a_time.greedy.json");
  return nlohmann::json::parse(in);
}

TEST(llama, loads_stories260k_hyperparameters) {
  harness h;
  const llama_hparams& hp = h.model->hparams();
  EXPECT_EQ(hp.arch, "llama");
  EXPECT_EQ(hp.n_embd, 64);
  EXPECT_EQ(hp.n_layer, 5);
  EXPECT_EQ(hp.n_head, 8);
  EXPECT_EQ(hp.n_head_kv, 4);
  EXPECT_EQ(hp.head_dim, 8);
  EXPECT_EQ(hp.n_ff, 172);
  EXPECT_EQ(hp.n_vocab, 512);
  EXPECT_TRUE(hp.tied_output);
  EXPECT_EQ(h.model->n_params(), 260032);
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(hp, 4), 1280.0);
}

// Greedy decoding reproduces the reference ids of an independent implementation.
TEST(llama, greedy_matches_reference_token_ids) {
  nlohmann::json ref = load_reference();
  harness h;
  std::vector<token_id> prompt = h.model->vocab().encode(ref["prompt"].get<std::string>(), true);
  ASSERT_EQ(prompt, ref["prompt_tokens_with_bos"].get<std::vector<token_id>>());
  std::vector<token_id> expected = ref["generated_tokens"].get<std::vector<token_id>>();
  auto blocks = harness::table(0, 32);
  std::vector<token_id> all = prompt;
  std::vector<float> logits;
  forward_seq s = forward_seq::consecutive(all, 0, blocks, false);
  ASSERT_TRUE(h.ctx->forward({&s, 1}, logits).ok());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    token_id next = argmax(logits);
    ASSERT_EQ(next, expected[i]) << "at generated token " << i;
    all.push_back(next);
    forward_seq d = forward_seq::consecutive(std::span(all).subspan(all.size() - 1), static_cast<int>(all.size()) - 1, blocks, false);
    ASSERT_TRUE(h.ctx->forward({&d, 1}, logits).ok());
  }
}

std::vector<token_id> story_tokens(const llama_model& m, int n) {
  std::ifstream in(std::string(PAGODA_SOURCE_DIR) + "/tests/data/tinystories_dev.txt");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  auto ids = m.vocab().encode(text.substr(0, 4000), true);
  ids.resize(n);
  return ids;
}

bool bitwise_equal(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// Logits of a token do not depend on how its prompt was chunked.
TEST(llama, prefill_chunking_is_bitwise_invariant) {
  harness h;
  auto ids = story_tokens(*h.model, 100);
  auto blocks = harness::table(0, 8);
  std::vector<float> whole, logits;
  forward_seq s = forward_seq::consecutive(ids, 0, blocks, true);
  ASSERT_TRUE(h.ctx->forward({&s, 1}, whole).ok());
  const int V = h.model->hparams().n_vocab;
  for (int chunk : {1, 7, 16, 33}) {
    for (int pos = 0; pos < 100; pos += chunk) {
      int n = std::min(chunk, 100 - pos);
      forward_seq c = forward_seq::consecutive(std::span(ids).subspan(pos, n), pos, blocks, true);
      ASSERT_TRUE(h.ctx->forward({&c, 1}, logits).ok());
      ASSERT_TRUE(bitwise_equal(logits, std::span(whole).subspan(static_cast<std::size_t>(pos) * V,
                                                                 static_cast<std::size_t>(n) * V)))
          << "chunk " << chunk << " pos " << pos;
    }
  }
}

// A sequence's logits do not depend on what else shares its step, nor on the thread count.
TEST(llama, batch_composition_is_bitwise_invariant) {
  for (int threads : {1, 2, 3}) {
    harness h(kv_type::f32, 256, threads);
    auto ids = story_tokens(*h.model, 120);
    const int V = h.model->hparams().n_vocab;
    // Alone: a 40-token prompt at blocks 0..
    auto t_alone = harness::table(0, 8);
    std::vector<float> alone;
    forward_seq a = forward_seq::consecutive(std::span(ids).subspan(0, 40), 0, t_alone, true);
    ASSERT_TRUE(h.ctx->forward({&a, 1}, alone).ok());
    // Together with two other sequences (one mid-decode), in other blocks.
    auto t1 = harness::table(20, 8), t2 = harness::table(40, 8), t3 = harness::table(60, 8);
    std::vector<float> warm;
    forward_seq w = forward_seq::consecutive(std::span(ids).subspan(40, 70), 0, t3, false);
    ASSERT_TRUE(h.ctx->forward({&w, 1}, warm).ok());
    std::vector<float> mixed;
    std::vector<forward_seq> step{forward_seq::consecutive(std::span(ids).subspan(50, 17), 0, t2, true),
                                  forward_seq::consecutive(std::span(ids).subspan(0, 40), 0, t1, true),
                                  forward_seq::consecutive(std::span(ids).subspan(110, 1), 70, t3, false)};
    ASSERT_TRUE(h.ctx->forward(step, mixed).ok());
    ASSERT_TRUE(bitwise_equal(alone, std::span(mixed).subspan(17 * static_cast<std::size_t>(V), 40 * static_cast<std::size_t>(V))))
        << "threads " << threads;
  }
}

TEST(llama, rejects_bad_steps) {
  harness h;
  auto blocks = harness::table(0, 1);
  std::vector<float> logits;
  std::vector<token_id> bad{1, 9999};
  forward_seq s = forward_seq::consecutive(bad, 0, blocks, false);
  EXPECT_EQ(h.ctx->forward({&s, 1}, logits).code(), errc::invalid_argument);
  std::vector<token_id> many(17, 5);
  forward_seq too_long = forward_seq::consecutive(many, 0, blocks, false);
  EXPECT_EQ(h.ctx->forward({&too_long, 1}, logits).code(), errc::out_of_range);
  std::vector<block_id> outside{block_id(100000)};
  std::vector<token_id> one{1};
  forward_seq oob = forward_seq::consecutive(one, 0, outside, false);
  EXPECT_EQ(h.ctx->forward({&oob, 1}, logits).code(), errc::invalid_argument);
}

// f16 KV stays close to f32 KV: the logits move by far less than their spread.
TEST(llama, f16_kv_close_to_f32) {
  harness a(kv_type::f32), b(kv_type::f16);
  auto ids = story_tokens(*a.model, 200);
  auto blocks = harness::table(0, 16);
  std::vector<float> la, lb;
  forward_seq s = forward_seq::consecutive(ids, 0, blocks, true);
  ASSERT_TRUE(a.ctx->forward({&s, 1}, la).ok());
  ASSERT_TRUE(b.ctx->forward({&s, 1}, lb).ok());
  double max_diff = 0;
  for (std::size_t i = 0; i < la.size(); ++i) max_diff = std::max(max_diff, std::fabs(double(la[i]) - lb[i]));
  EXPECT_LT(max_diff, 0.05);
  EXPECT_GT(max_diff, 0.0);  // f16 really is a different storage
}

// Chunk reuse's two forward modes. In place (forward_seq::slots): rows that
// rewrite stored slots with what those slots already hold read the cache as
// a plain prefill left it, so their logits are the prefill's. kv_only: the
// last layer run writes its K/V and stops, the K/V a full pass writes there.
TEST(llama, in_place_rows_and_kv_only_layers_match_a_plain_prefill) {
  harness h;
  auto ids = story_tokens(*h.model, 80);
  auto blocks = harness::table(0, 5);
  std::vector<float> whole, logits;
  forward_seq s = forward_seq::consecutive(ids, 0, blocks, true);
  ASSERT_TRUE(h.ctx->forward({&s, 1}, whole).ok());
  const int V = h.model->hparams().n_vocab;
  const std::vector<std::int32_t> slots = {3, 17, 18, 40, 79};
  std::vector<token_id> rows;
  for (std::int32_t t : slots) rows.push_back(ids[static_cast<std::size_t>(t)]);
  forward_seq r;
  r.tokens = rows;
  r.slots = slots;
  r.n_stored = 80;
  r.blocks = blocks;
  r.all_logits = true;
  ASSERT_TRUE(h.ctx->forward({&r, 1}, logits).ok());
  ASSERT_EQ(logits.size(), slots.size() * static_cast<std::size_t>(V));
  for (std::size_t j = 0; j < slots.size(); ++j)
    for (int v = 0; v < V; ++v)
      ASSERT_NEAR(logits[j * V + v], whole[static_cast<std::size_t>(slots[j]) * V + v], 1e-4f) << "slot " << slots[j];

  // kv_only through layer 1 on another table: layer 1's K/V equal the full pass's.
  auto other = harness::table(8, 5);
  forward_seq k = forward_seq::consecutive(ids, 0, other, false);
  ASSERT_TRUE(h.ctx->forward({&k, 1}, logits, 2, /*kv_only=*/true).ok());
  EXPECT_TRUE(logits.empty());
  const kv_layout& lay = h.kv->layout();
  std::vector<float> a(static_cast<std::size_t>(lay.head_dim)), b(a.size());
  for (int role = 0; role < 2; ++role) {
    const paged_kv_view va = role ? h.kv->v_view(1, blocks, 80) : h.kv->k_view(1, blocks, 80);
    const paged_kv_view vb = role ? h.kv->v_view(1, other, 80) : h.kv->k_view(1, other, 80);
    for (int t = 0; t < 80; t += 13)
      for (int hh = 0; hh < lay.n_kv_heads; ++hh) {
        va.codec_of(t / 16)->decode(va.format_of(t / 16), va.shape, va.params_of(t / 16, hh), va.tile(t / 16, hh), t % 16, 1, a.data());
        vb.codec_of(t / 16)->decode(vb.format_of(t / 16), vb.shape, vb.params_of(t / 16, hh), vb.tile(t / 16, hh), t % 16, 1, b.data());
        for (int d = 0; d < lay.head_dim; ++d) ASSERT_FLOAT_EQ(a[d], b[d]) << "role " << role << " slot " << t;
      }
  }
  // Bad in-place steps are refused: a slot past the stored ones, slots out of order.
  const std::vector<std::int32_t> past = {80}, unordered = {5, 4};
  forward_seq bad = r;
  bad.tokens = std::span(rows).first(1);
  bad.slots = past;
  EXPECT_FALSE(h.ctx->forward({&bad, 1}, logits).ok());
  bad.tokens = std::span(rows).first(2);
  bad.slots = unordered;
  EXPECT_FALSE(h.ctx->forward({&bad, 1}, logits).ok());
}

}  // namespace
}  // namespace pagoda
