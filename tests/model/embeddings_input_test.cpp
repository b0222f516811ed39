// forward_seq::embeddings: rows given in place of the token embeddings (an
// image's, src/vision) enter the forward pass as they are. Fed the token
// embedding rows themselves they give the tokens' logits bit for bit; on
// gemma, whose token embeddings are scaled by sqrt(n_embd), they are not
// scaled (llama.cpp scales neither an image's embeddings); a wrong size is an error.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/stories.h"
#include "kv/kv_storage.h"
#include "model/llama.h"
#include "model/synth.h"

namespace pagoda {
namespace {

// Logits of every row of one step over `tokens` from an empty cache,
// optionally with `embeddings` standing in for the token embeddings.
std::vector<float> step_logits(const llama_model& model, const std::vector<token_id>& tokens,
                               std::span<const float> embeddings, status* st_out = nullptr) {
  const llama_hparams& hp = model.hparams();
  auto kv = kv_storage::create(kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, kv_type::f32, kv_type::f32), 4);
  EXPECT_TRUE(kv.ok());
  llama_context ctx(model, **kv, 1);
  const std::vector<block_id> table{block_id(0), block_id(1), block_id(2), block_id(3)};
  forward_seq s = forward_seq::consecutive(tokens, 0, table, true);
  s.embeddings = embeddings;
  std::vector<float> logits;
  const status st = ctx.forward({&s, 1}, logits);
  if (st_out) *st_out = st;
  else EXPECT_TRUE(st.ok()) << st.message();
  return logits;
}

std::vector<float> embedding_rows(const llama_model& model, const std::vector<token_id>& tokens, float scale) {
  const int n = model.hparams().n_embd;
  std::vector<float> rows(tokens.size() * static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    dequantize_row(model.token_embd(), tokens[i], rows.data() + i * n);
    for (int e = 0; e < n; ++e) rows[i * n + e] *= scale;
  }
  return rows;
}

TEST(embeddings_input, token_rows_give_the_tokens_logits) {
  auto m = llama_model::load(test::stories_path());
  ASSERT_TRUE(m.ok()) << m.error().message();
  const std::vector<token_id> tokens{1, 403, 407, 261, 378, 13};
  const std::vector<float> want = step_logits(**m, tokens, {});
  const std::vector<float> rows = embedding_rows(**m, tokens, 1.0f);
  const std::vector<token_id> placeholders(tokens.size(), 0);
  EXPECT_TRUE(step_logits(**m, placeholders, rows) == want);

  status st;
  step_logits(**m, placeholders, std::span(rows).first(rows.size() - 1), &st);
  EXPECT_EQ(st.code(), errc::invalid_argument);
  EXPECT_NE(st.message().find("input embedding values"), std::string::npos) << st.message();
}

TEST(embeddings_input, gemma_does_not_scale_them) {
  const std::string path = ::testing::TempDir() + "/pagoda_embeddings_input_gemma3.gguf";
  synth_options o;
  o.preset = "tiny-gemma3";
  o.weight_type = gguf::tensor_type::f32;
  o.n_threads = 1;
  ASSERT_TRUE(write_synth_model(o, path).ok());
  auto m = llama_model::load(path);
  ASSERT_TRUE(m.ok()) << m.error().message();
  const float scale = (*m)->hparams().embd_scale;
  ASSERT_NE(scale, 1.0f);
  const std::vector<token_id> tokens{1, 300, 301, 302};
  const std::vector<token_id> placeholders(tokens.size(), 0);
  const std::vector<float> want = step_logits(**m, tokens, {});
  EXPECT_TRUE(step_logits(**m, placeholders, embedding_rows(**m, tokens, scale)) == want);
  EXPECT_FALSE(step_logits(**m, placeholders, embedding_rows(**m, tokens, 1.0f)) == want);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace pagoda
