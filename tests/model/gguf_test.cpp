// GGUF reader tests: the bundled model and vocabulary files, writer round trips
// of every value type, and one test per malformed-file case.
#include "model/gguf.h"

#include <gtest/gtest.h>

#include <string>

namespace pagoda::gguf {
namespace {

std::string source_path(const std::string& rel) { return std::string(PAGODA_SOURCE_DIR) + "/" + rel; }

TEST(gguf_real_files, stories260k) {
  auto r = file::open(source_path("models/stories260K.gguf"));
  ASSERT_TRUE(r.ok()) << r.error().message();
  const file& f = **r;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.tensors().size(), 48u);
  EXPECT_EQ(*f.get_string("general.architecture"), "llama");
  EXPECT_EQ(*f.get_uint("llama.embedding_length"), 64u);
  EXPECT_EQ(*f.get_uint("llama.block_count"), 5u);
  EXPECT_EQ(*f.get_uint("llama.attention.head_count"), 8u);
  EXPECT_EQ(*f.get_int("llama.attention.head_count_kv"), 4);
  EXPECT_EQ(*f.get_string("tokenizer.ggml.model"), "llama");
  auto tokens = f.get_string_array("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ(tokens->size(), 512u);
  EXPECT_EQ((*tokens)[0], "<unk>");
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ((*tokens)[2], "</s>");
  EXPECT_EQ((*tokens)[3], "<0x00>");
  EXPECT_EQ(f.get_f32_array("tokenizer.ggml.scores")->size(), 512u);
  auto types = f.get_i32_array("tokenizer.ggml.token_type");
  ASSERT_TRUE(types.ok());
  EXPECT_EQ((*types)[3], 6);  // byte token
  EXPECT_NEAR(*f.get_float("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-9);

  std::uint64_t total = 0;
  for (const auto& t : f.tensors()) {
    EXPECT_EQ(t.type, tensor_type::f32) << t.name;
    EXPECT_EQ(t.size_bytes, static_cast<std::uint64_t>(t.n_elements()) * 4) << t.name;
    EXPECT_EQ(t.offset % 32, 0u) << t.name;
    EXPECT_NE(t.data, nullptr) << t.name;
    total += t.size_bytes;
  }
  const tensor_info* emb = f.find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->n_dims, 2u);
  EXPECT_EQ(emb->ne[0], 64);
  EXPECT_EQ(emb->ne[1], 512);
  const tensor_info* wk = f.find_tensor("blk.4.attn_k.weight");
  ASSERT_NE(wk, nullptr);
  EXPECT_EQ(wk->ne[0], 64);
  EXPECT_EQ(wk->ne[1], 32);  // 4 KV heads of 8
  EXPECT_EQ(f.find_tensor("blk.5.attn_k.weight"), nullptr);
  // Tensor data fills the file after the header (no gaps larger than padding).
  EXPECT_LE(f.data_offset() + total, f.size_bytes());
  EXPECT_GT(f.data_offset() + total + 32 * 48, f.size_bytes());
}

TEST(gguf_real_files, vocab_only_files_have_no_tensors) {
  struct expect {
    const char* file;
    const char* model;
    std::size_t n_vocab;
  };
  const expect cases[] = {
      {"ggml-vocab-phi-3.gguf", "llama", 32064},
      {"ggml-vocab-deepseek-coder.gguf", "gpt2", 32256},
      {"ggml-vocab-starcoder.gguf", "gpt2", 49152},
  };
  for (const auto& c : cases) {
    auto r = file::open(source_path(std::string("tests/data/tokenizer/") + c.file));
    ASSERT_TRUE(r.ok()) << c.file << ": " << r.error().message();
    const file& f = **r;
    EXPECT_EQ(f.tensors().size(), 0u) << c.file;
    EXPECT_EQ(*f.get_string("tokenizer.ggml.model"), c.model) << c.file;
    EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens")->size(), c.n_vocab) << c.file;
    EXPECT_EQ(f.get_i32_array("tokenizer.ggml.token_type")->size(), c.n_vocab) << c.file;
  }
}

TEST(gguf_real_files, missing_file_is_not_found) {
  auto r = file::open(source_path("models/does-not-exist.gguf"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), errc::not_found);
  EXPECT_NE(r.error().message().find("does-not-exist.gguf"), std::string::npos);
}

}  // namespace
}  // namespace pagoda::gguf
