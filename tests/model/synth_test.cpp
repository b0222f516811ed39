// Synthetic models: presets carry the real models' shapes, and generated files
// read back through the GGUF reader with the right keys, shapes, types,
// vocabulary and weight statistics.
#include "model/synth.h"

#include <gmock/gmock.h>
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

#include "core/ggml_blocks.h"
#include "core/half.h"
#include "model/gguf.h"
#include "model/quants.h"

namespace pagoda {
namespace {

using gguf::tensor_type;
using ::testing::HasSubstr;

std::string temp_path(const std::string& name) { return ::testing::TempDir() + "/" + name; }

std::unique_ptr<gguf::file> write_and_open(const synth_options& o, const std::string& name) {
  const std::string path = temp_path(name);
  status st = write_synth_model(o, path);
  EXPECT_TRUE(st.ok()) << st.message();
  auto f = gguf::file::open(path);
  EXPECT_TRUE(f.ok()) << f.error().message();
  std::remove(path.c_str());  // the mapping stays valid after unlink
  return f.ok() ? std::move(*f) : nullptr;
}

void expect_shape(const gguf::file& f, const std::string& name, tensor_type type, std::vector<std::int64_t> ne) {
  const gguf::tensor_info* t = f.find_tensor(name);
  ASSERT_NE(t, nullptr) << name;
  EXPECT_EQ(t->type, type) << name;
  ASSERT_EQ(t->n_dims, ne.size()) << name;
  for (std::size_t d = 0; d < ne.size(); ++d) EXPECT_EQ(t->ne[d], ne[d]) << name << " dim " << d;
}

// Row r of a tensor as floats, decoded straight from the ggml block layouts.
std::vector<float> decode_row(const gguf::tensor_info& t, std::int64_t r) {
  const std::int64_t n = t.ne[0];
  const std::size_t row_bytes = t.size_bytes / static_cast<std::size_t>(t.n_elements() / n);
  const std::byte* p = t.data + static_cast<std::size_t>(r) * row_bytes;
  std::vector<float> x(static_cast<std::size_t>(n));
  switch (t.type) {
    case tensor_type::f32: std::memcpy(x.data(), p, x.size() * 4); break;
    case tensor_type::f16:
      for (std::int64_t i = 0; i < n; ++i) {
        fp16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        x[i] = fp16_to_f32(h);
      }
      break;
    case tensor_type::q8_0:
      for (std::int64_t b = 0; b < n / 32; ++b) {
        block_q8_0 blk;
        std::memcpy(&blk, p + b * sizeof(block_q8_0), sizeof blk);
        for (int i = 0; i < 32; ++i) x[b * 32 + i] = fp16_to_f32(blk.d) * blk.qs[i];
      }
      break;
    case tensor_type::q4_0:
      for (std::int64_t b = 0; b < n / 32; ++b) {
        block_q4_0 blk;
        std::memcpy(&blk, p + b * sizeof(block_q4_0), sizeof blk);
        for (int i = 0; i < 16; ++i) {
          x[b * 32 + i] = fp16_to_f32(blk.d) * ((blk.qs[i] & 15) - 8);
          x[b * 32 + i + 16] = fp16_to_f32(blk.d) * ((blk.qs[i] >> 4) - 8);
        }
      }
      break;
    case tensor_type::mxfp4: dequantize_quantized_row(t.type, p, n, x.data()); break;  // ggml-checked (mxfp4_test)
    default: ADD_FAILURE() << "unexpected type";
  }
  return x;
}

bool all_distinct(std::span<const std::string_view> tokens) {
  std::vector<std::string_view> sorted(tokens.begin(), tokens.end());
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
}

TEST(synth_presets, real_model_shapes) {
  struct expect {
    const char* name;
    const char* arch;
    int n_embd, n_head, n_head_kv, head_dim, n_ff, n_layer, n_vocab;
    float rope_base;
    bool qkv_bias;
  };
  const expect cases[] = {
      {"llama3-8b", "llama", 4096, 32, 8, 128, 14336, 32, 128256, 500000.0f, false},
      {"llama3-70b", "llama", 8192, 64, 8, 128, 28672, 80, 128256, 500000.0f, false},
      {"mistral-7b", "llama", 4096, 32, 8, 128, 14336, 32, 32000, 1e6f, false},
      {"qwen2-7b", "qwen2", 3584, 28, 4, 128, 18944, 28, 152064, 1e6f, true},
  };
  for (const auto& c : cases) {
    const synth_shape* p = find_synth_preset(c.name);
    ASSERT_NE(p, nullptr) << c.name;
    EXPECT_STREQ(p->arch, c.arch);
    EXPECT_EQ(p->n_embd, c.n_embd) << c.name;
    EXPECT_EQ(p->n_head, c.n_head) << c.name;
    EXPECT_EQ(p->n_head_kv, c.n_head_kv) << c.name;
    EXPECT_EQ(p->head_dim, c.head_dim) << c.name;
    EXPECT_EQ(p->n_ff, c.n_ff) << c.name;
    EXPECT_EQ(p->n_layer, c.n_layer) << c.name;
    EXPECT_EQ(p->n_vocab, c.n_vocab) << c.name;
    EXPECT_EQ(p->rope_base, c.rope_base) << c.name;
    EXPECT_EQ(p->qkv_bias, c.qkv_bias) << c.name;
  }
  EXPECT_EQ(find_synth_preset("llama3-8b")->n_ctx, 8192);
  EXPECT_EQ(find_synth_preset("mistral-7b")->n_ctx, 32768);
  EXPECT_EQ(find_synth_preset("gpt-5"), nullptr);
  EXPECT_GE(synth_presets().size(), 4u);
}

TEST(synth_file, tiny_preset_round_trips) {
  synth_options o;
  o.preset = "tiny";
  o.weight_type = tensor_type::q8_0;
  auto size = synth_model_size_bytes(o);
  ASSERT_TRUE(size.ok());
  auto f = write_and_open(o, "synth_tiny.gguf");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->size_bytes(), *size);
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(*f->get_string("general.architecture"), "llama");
  EXPECT_EQ(*f->get_string("general.name"), "tiny (synthetic)");
  EXPECT_EQ(*f->get_uint("general.alignment"), 32u);
  EXPECT_EQ(*f->get_uint("general.file_type"), 7u);  // LLAMA_FTYPE_MOSTLY_Q8_0
  EXPECT_EQ(*f->get_uint("llama.embedding_length"), 128u);
  EXPECT_EQ(*f->get_uint("llama.block_count"), 2u);
  EXPECT_EQ(*f->get_uint("llama.feed_forward_length"), 256u);
  EXPECT_EQ(*f->get_uint("llama.attention.head_count"), 4u);
  EXPECT_EQ(*f->get_uint("llama.attention.head_count_kv"), 2u);
  EXPECT_EQ(*f->get_uint("llama.rope.dimension_count"), 32u);
  EXPECT_EQ(*f->get_uint("llama.context_length"), 2048u);
  EXPECT_EQ(*f->get_uint("llama.vocab_size"), 512u);
  EXPECT_NEAR(*f->get_float("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-12);
  EXPECT_EQ(*f->get_float("llama.rope.freq_base"), 10000.0);
  EXPECT_EQ(f->find("llama.attention.key_length"), nullptr);  // head_dim * n_head == n_embd

  // 3 global tensors and 9 per layer.
  EXPECT_EQ(f->tensors().size(), 3u + 2u * 9u);
  expect_shape(*f, "token_embd.weight", tensor_type::q8_0, {128, 512});
  expect_shape(*f, "output_norm.weight", tensor_type::f32, {128});
  expect_shape(*f, "output.weight", tensor_type::q8_0, {128, 512});
  for (int l = 0; l < 2; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    expect_shape(*f, p + "attn_norm.weight", tensor_type::f32, {128});
    expect_shape(*f, p + "attn_q.weight", tensor_type::q8_0, {128, 128});
    expect_shape(*f, p + "attn_k.weight", tensor_type::q8_0, {128, 64});
    expect_shape(*f, p + "attn_v.weight", tensor_type::q8_0, {128, 64});
    expect_shape(*f, p + "attn_output.weight", tensor_type::q8_0, {128, 128});
    expect_shape(*f, p + "ffn_norm.weight", tensor_type::f32, {128});
    expect_shape(*f, p + "ffn_gate.weight", tensor_type::q8_0, {128, 256});
    expect_shape(*f, p + "ffn_up.weight", tensor_type::q8_0, {128, 256});
    expect_shape(*f, p + "ffn_down.weight", tensor_type::q8_0, {256, 128});
    EXPECT_EQ(f->find_tensor(p + "attn_q.bias"), nullptr);
  }
  EXPECT_EQ(f->find_tensor("blk.2.attn_q.weight"), nullptr);

  // Norms are exactly 1.
  for (float v : decode_row(*f->find_tensor("blk.1.ffn_norm.weight"), 0)) EXPECT_EQ(v, 1.0f);
}

TEST(synth_file, vocabulary_is_sentencepiece_style) {
  synth_options o;
  o.preset = "tiny";
  o.n_vocab = 300;
  o.n_layer = 1;
  auto f = write_and_open(o, "synth_vocab.gguf");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(*f->get_string("tokenizer.ggml.model"), "llama");
  auto tokens = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ(tokens->size(), 300u);
  EXPECT_EQ((*tokens)[0], "<unk>");
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ((*tokens)[2], "</s>");
  EXPECT_EQ((*tokens)[3], "<0x00>");
  EXPECT_EQ((*tokens)[3 + 0x41], "<0x41>");
  EXPECT_EQ((*tokens)[258], "<0xFF>");
  EXPECT_EQ((*tokens)[259], "\xe2\x96\x81");
  EXPECT_EQ((*tokens)[260], "\xe2\x96\x81" "a");
  EXPECT_EQ((*tokens)[261], "a");
  EXPECT_EQ((*tokens)[262], "\xe2\x96\x81" "b");
  EXPECT_TRUE(all_distinct(*tokens));

  auto types = f->get_i32_array("tokenizer.ggml.token_type");
  ASSERT_TRUE(types.ok());
  ASSERT_EQ(types->size(), 300u);
  EXPECT_EQ((*types)[0], 2);
  EXPECT_EQ((*types)[1], 3);
  EXPECT_EQ((*types)[2], 3);
  for (int k = 3; k < 259; ++k) EXPECT_EQ((*types)[k], 6) << k;
  for (int k = 259; k < 300; ++k) EXPECT_EQ((*types)[k], 1) << k;
  auto scores = f->get_f32_array("tokenizer.ggml.scores");
  ASSERT_TRUE(scores.ok());
  ASSERT_EQ(scores->size(), 300u);
  for (int k = 260; k < 300; ++k) EXPECT_LT((*scores)[k], (*scores)[k - 1]) << k;
  EXPECT_EQ(*f->get_uint("tokenizer.ggml.bos_token_id"), 1u);
  EXPECT_EQ(*f->get_uint("tokenizer.ggml.eos_token_id"), 2u);
  EXPECT_EQ(*f->get_uint("tokenizer.ggml.unknown_token_id"), 0u);
  expect_shape(*f, "token_embd.weight", tensor_type::q8_0, {128, 300});
}

TEST(synth_file, large_vocabulary_stays_unique) {
  // Llama 3's 128256 tokens need pieces of up to four letters.
  synth_options o;
  o.preset = "tiny";
  o.n_layer = 1;
  o.n_vocab = 128256;
  auto f = write_and_open(o, "synth_big_vocab.gguf");
  ASSERT_NE(f, nullptr);
  auto tokens = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ(tokens->size(), 128256u);
  EXPECT_TRUE(all_distinct(*tokens));
  EXPECT_EQ(tokens->back().size(), 4u);  // "▁" is 3 bytes: a 4-byte token is a bare 4-letter word
  expect_shape(*f, "output.weight", tensor_type::q8_0, {128, 128256});
  o.n_vocab = 0;  // the preset's own size
  EXPECT_EQ(resolve_synth_shape(o)->n_vocab, 512);
}

TEST(synth_file, qwen2_has_biases_and_its_keys) {
  synth_options o;
  o.preset = "qwen2-7b";
  o.n_layer = 1;
  o.n_ff = 64;
  o.n_vocab = 300;
  o.n_ctx = 4096;
  o.weight_type = tensor_type::q4_0;
  auto f = write_and_open(o, "synth_qwen2.gguf");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(*f->get_string("general.architecture"), "qwen2");
  EXPECT_EQ(*f->get_uint("general.file_type"), 2u);
  EXPECT_EQ(*f->get_uint("qwen2.embedding_length"), 3584u);
  EXPECT_EQ(*f->get_uint("qwen2.attention.head_count"), 28u);
  EXPECT_EQ(*f->get_uint("qwen2.attention.head_count_kv"), 4u);
  EXPECT_EQ(*f->get_uint("qwen2.feed_forward_length"), 64u);
  EXPECT_EQ(*f->get_uint("qwen2.context_length"), 4096u);
  EXPECT_EQ(*f->get_float("qwen2.rope.freq_base"), 1e6);
  EXPECT_EQ(f->find("llama.embedding_length"), nullptr);
  expect_shape(*f, "blk.0.attn_q.weight", tensor_type::q4_0, {3584, 3584});
  expect_shape(*f, "blk.0.attn_k.weight", tensor_type::q4_0, {3584, 512});
  expect_shape(*f, "blk.0.attn_q.bias", tensor_type::f32, {3584});
  expect_shape(*f, "blk.0.attn_k.bias", tensor_type::f32, {512});
  expect_shape(*f, "blk.0.attn_v.bias", tensor_type::f32, {512});
  expect_shape(*f, "blk.0.ffn_down.weight", tensor_type::q4_0, {64, 3584});
  EXPECT_EQ(f->tensors().size(), 3u + 12u);
  for (float b : decode_row(*f->find_tensor("blk.0.attn_k.bias"), 0)) EXPECT_LE(std::fabs(b), 0.02f);
}

TEST(synth_file, llama3_8b_weights_have_the_intended_scale) {
  synth_options o;
  o.preset = "llama3-8b";
  o.n_layer = 1;
  o.n_ff = 256;
  o.weight_type = tensor_type::f16;
  auto f = write_and_open(o, "synth_l3.gguf");
  ASSERT_NE(f, nullptr);
  expect_shape(*f, "blk.0.attn_q.weight", tensor_type::f16, {4096, 4096});
  expect_shape(*f, "blk.0.attn_k.weight", tensor_type::f16, {4096, 1024});  // 8 KV heads of 128
  expect_shape(*f, "blk.0.attn_output.weight", tensor_type::f16, {4096, 4096});
  expect_shape(*f, "blk.0.ffn_down.weight", tensor_type::f16, {256, 4096});
  EXPECT_EQ(*f->get_float("llama.rope.freq_base"), 500000.0);
  // Uniform weights with standard deviation 1/sqrt(n_in), mean 0.
  struct check {
    const char* name;
    double n_in;
  };
  for (const check& c : {check{"blk.0.attn_q.weight", 4096}, check{"blk.0.ffn_down.weight", 256}}) {
    const gguf::tensor_info* t = f->find_tensor(c.name);
    double sum = 0, sum2 = 0, amax = 0;
    std::int64_t n = 0;
    for (std::int64_t r : {0, 1, 100, 255}) {
      for (float v : decode_row(*t, r)) {
        ASSERT_TRUE(std::isfinite(v));
        sum += v;
        sum2 += static_cast<double>(v) * v;
        amax = std::max(amax, std::fabs(static_cast<double>(v)));
        ++n;
      }
    }
    const double sd = std::sqrt(sum2 / n - (sum / n) * (sum / n));
    EXPECT_NEAR(sd * std::sqrt(c.n_in), 1.0, 0.05) << c.name;
    EXPECT_NEAR(sum / n * std::sqrt(c.n_in), 0.0, 0.1) << c.name;
    EXPECT_LE(amax, std::sqrt(3.0 / c.n_in) * 1.001) << c.name;
  }
}

TEST(synth_file, quantized_weights_match_the_f32_weights) {
  // Same seed and shape: the q8_0 and q4_0 files hold the f32 file's weights
  // to within their quantization error (half a step of d = amax/127 or amax/8);
  // mxfp4 (the smallest exponent covering the block, the nearest code) within
  // one E2M1 unit 2^(e - 127), which is below amax / 3.
  synth_options o;
  o.preset = "tiny";
  o.n_layer = 1;
  o.weight_type = tensor_type::f32;
  auto ref = write_and_open(o, "synth_ref.gguf");
  o.weight_type = tensor_type::q8_0;
  auto q8 = write_and_open(o, "synth_q8.gguf");
  o.weight_type = tensor_type::q4_0;
  auto q4 = write_and_open(o, "synth_q4.gguf");
  o.weight_type = tensor_type::mxfp4;
  auto mx = write_and_open(o, "synth_mxfp4.gguf");
  ASSERT_TRUE(ref && q8 && q4 && mx);
  for (const char* name : {"token_embd.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight"}) {
    const gguf::tensor_info* tr = ref->find_tensor(name);
    for (std::int64_t r : {0, 7, 63}) {
      auto x = decode_row(*tr, r);
      auto x8 = decode_row(*q8->find_tensor(name), r);
      auto x4 = decode_row(*q4->find_tensor(name), r);
      auto xm = decode_row(*mx->find_tensor(name), r);
      for (std::size_t b = 0; b < x.size(); b += 32) {
        float amax = 0;
        for (std::size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
        for (std::size_t i = b; i < b + 32; ++i) {
          EXPECT_NEAR(x8[i], x[i], amax / 127 * 0.51f + 1e-3f * amax) << name << " row " << r << " i " << i;
          EXPECT_NEAR(x4[i], x[i], amax / 8 * 1.01f + 1e-3f * amax) << name << " row " << r << " i " << i;
          EXPECT_LT(std::fabs(xm[i] - x[i]), amax / 3) << name << " row " << r << " i " << i;
        }
      }
    }
  }
}

TEST(synth_file, k_quant_weights_match_the_f32_weights) {
  // q4_K: per sub-block of 32 with range [lo, hi] (lo <= 0), step s = (hi - lo) / 15
  // and 6-bit scales and mins under d and dmin: a value is off by at most s / 2
  // plus the scale's and min's rounding (s - d * ls <= d / 2 over 15 steps,
  // dmin / 2), so |x - x'| <= s / 2 + 8 d + dmin / 2. q6_K: per group of 16,
  // step s = max |x| / 31 under d, |x - x'| <= s / 2 + 16 d. A wrong nibble,
  // scale or min moves values by whole steps of the largest sub-block.
  synth_options o;
  o.preset = "tiny256";
  o.n_layer = 1;
  o.weight_type = tensor_type::f32;
  auto ref = write_and_open(o, "synth_k_ref.gguf");
  o.weight_type = tensor_type::q4_k;
  auto q4 = write_and_open(o, "synth_q4k.gguf");
  o.weight_type = tensor_type::q6_k;
  auto q6 = write_and_open(o, "synth_q6k.gguf");
  ASSERT_TRUE(ref && q4 && q6);
  EXPECT_EQ(*q4->get_uint("general.file_type"), 14u);
  EXPECT_EQ(*q6->get_uint("general.file_type"), 18u);
  for (const char* name : {"token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"}) {
    const gguf::tensor_info* tr = ref->find_tensor(name);
    const gguf::tensor_info* t4 = q4->find_tensor(name);
    const gguf::tensor_info* t6 = q6->find_tensor(name);
    ASSERT_TRUE(tr && t4 && t6) << name;
    ASSERT_EQ(t4->type, tensor_type::q4_k);
    ASSERT_EQ(t6->type, tensor_type::q6_k);
    const std::int64_t n = tr->ne[0];
    for (std::int64_t r : {0, 5, 63}) {
      const std::vector<float> x = decode_row(*tr, r);
      std::vector<float> x4(x.size()), x6(x.size());
      const std::size_t rb4 = t4->size_bytes / static_cast<std::size_t>(tr->ne[1]);
      const std::size_t rb6 = t6->size_bytes / static_cast<std::size_t>(tr->ne[1]);
      dequantize_quantized_row(tensor_type::q4_k, t4->data + rb4 * r, n, x4.data());
      dequantize_quantized_row(tensor_type::q6_k, t6->data + rb6 * r, n, x6.data());
      for (std::int64_t b = 0; b < n / 256; ++b) {
        const auto& blk4 = reinterpret_cast<const block_q4_k*>(t4->data + rb4 * r)[b];
        const auto& blk6 = reinterpret_cast<const block_q6_k*>(t6->data + rb6 * r)[b];
        const float d4 = fp16_to_f32(blk4.d), dmin4 = fp16_to_f32(blk4.dmin), d6 = fp16_to_f32(blk6.d);
        for (std::int64_t i = 256 * b; i < 256 * (b + 1); i += 32) {
          float lo = 0, hi = x[i];
          for (std::int64_t k = i; k < i + 32; ++k) lo = std::min(lo, x[k]), hi = std::max(hi, x[k]);
          const float bound = (hi - lo) / 15 / 2 + 8 * d4 + dmin4 / 2 + 1e-6f;
          for (std::int64_t k = i; k < i + 32; ++k) EXPECT_NEAR(x4[k], x[k], bound) << name << " row " << r << " i " << k;
        }
        for (std::int64_t i = 256 * b; i < 256 * (b + 1); i += 16) {
          float amax = 0;
          for (std::int64_t k = i; k < i + 16; ++k) amax = std::max(amax, std::fabs(x[k]));
          const float bound = amax / 31 / 2 + 16 * d6 + 1e-6f;
          for (std::int64_t k = i; k < i + 16; ++k) EXPECT_NEAR(x6[k], x[k], bound) << name << " row " << r << " i " << k;
        }
      }
    }
  }
}

// The oracle's synth-llama files (tests/data/oracle, made by llama-quantize of
// llama.cpp d32676d) have tiny256's shape: 2 layers of 256 wide, 4/2 heads of
// 64, ffn 512, vocabulary 512. llama-quantize's Q4_K_M and Q5_K_M of it and
// synth's mixes of tiny256 hold the same tensors in the same types.
TEST(synth_mix, types_are_llama_quantize_s_on_the_oracle_shape) {
  struct mix_case {
    const char* name;
    synth_mix mix;
    std::uint64_t file_type;
  };
  for (const mix_case& c : {mix_case{"Q4_K_M", synth_mix::q4_k_m, 15}, mix_case{"Q5_K_M", synth_mix::q5_k_m, 17}}) {
    auto oracle = gguf::file::open(std::string(PAGODA_SOURCE_DIR) + "/tests/data/oracle/gguf/synth-llama-" + c.name + ".gguf");
    ASSERT_TRUE(oracle.ok()) << oracle.error().message();
    synth_options o;
    o.preset = "tiny256";
    o.mix = c.mix;
    auto f = write_and_open(o, std::string("synth_mix_") + c.name + ".gguf");
    ASSERT_NE(f, nullptr);
    EXPECT_EQ(*f->get_uint("general.file_type"), c.file_type) << c.name;
    EXPECT_EQ(*(*oracle)->get_uint("general.file_type"), c.file_type) << c.name;
    ASSERT_EQ(f->tensors().size(), (*oracle)->tensors().size()) << c.name;
    int n_q6 = 0;
    for (const gguf::tensor_info& want : (*oracle)->tensors()) {
      const gguf::tensor_info* got = f->find_tensor(want.name);
      ASSERT_NE(got, nullptr) << c.name << " " << want.name;
      EXPECT_EQ(got->type, want.type) << c.name << " " << want.name << ": " << gguf::tensor_type_name(got->type)
                                      << " against llama-quantize's " << gguf::tensor_type_name(want.type);
      EXPECT_EQ(got->ne[0], want.ne[0]) << want.name;
      EXPECT_EQ(got->ne[1], want.ne[1]) << want.name;
      n_q6 += want.type == tensor_type::q6_k;
    }
    EXPECT_EQ(n_q6, 3) << c.name;  // output, and layer 1's attn_v and ffn_down
  }
}

// With more layers llama-quantize's rule (i < n/8, i >= 7n/8, (i - n/8) % 3 ==
// 2) picks these layers for q6_K attn_v and ffn_down; written out by hand.
TEST(synth_mix, q6_k_layers_follow_the_rule_at_4_and_32_layers) {
  struct layers_case {
    int n_layer;
    std::vector<int> q6;
  };
  for (const layers_case& c : {layers_case{4, {2, 3}},
                               layers_case{32, {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}}}) {
    synth_options o;
    o.preset = "tiny256";
    o.n_layer = c.n_layer;
    o.n_vocab = 300;
    o.mix = synth_mix::q4_k_m;
    auto f = write_and_open(o, "synth_mix_layers.gguf");
    ASSERT_NE(f, nullptr);
    EXPECT_EQ(f->find_tensor("output.weight")->type, tensor_type::q6_k);
    EXPECT_EQ(f->find_tensor("token_embd.weight")->type, tensor_type::q4_k);
    for (int l = 0; l < c.n_layer; ++l) {
      const bool q6 = std::find(c.q6.begin(), c.q6.end(), l) != c.q6.end();
      const std::string p = "blk." + std::to_string(l) + ".";
      const tensor_type more = q6 ? tensor_type::q6_k : tensor_type::q4_k;
      EXPECT_EQ(f->find_tensor(p + "attn_v.weight")->type, more) << c.n_layer << " layers, " << p;
      EXPECT_EQ(f->find_tensor(p + "ffn_down.weight")->type, more) << c.n_layer << " layers, " << p;
      for (const char* m : {"attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"})
        EXPECT_EQ(f->find_tensor(p + m + ".weight")->type, tensor_type::q4_k) << p << m;
      EXPECT_EQ(f->find_tensor(p + "attn_norm.weight")->type, tensor_type::f32);
    }
  }
}

// The architecture cases of the same rules, by name: tied outputs (gemma) put
// the embeddings in q6_K, a fused attn_qkv (phi3) is q5_K / q6_K, and a 70B
// llama's attn_v outside the q6_K layers is q5_K under Q4_K_M.
TEST(synth_mix, tied_fused_and_70b_cases) {
  synth_options o;
  o.mix = synth_mix::q4_k_m;
  const synth_shape gemma = *find_synth_preset("gemma2-9b");
  EXPECT_EQ(synth_matrix_type(gemma, o, "token_embd.weight", -1), tensor_type::q6_k);
  const synth_shape llama = *find_synth_preset("llama3-8b");
  EXPECT_EQ(synth_matrix_type(llama, o, "token_embd.weight", -1), tensor_type::q4_k);
  const synth_shape phi3 = *find_synth_preset("phi3-mini");
  EXPECT_EQ(synth_matrix_type(phi3, o, "blk.5.attn_qkv.weight", 5), tensor_type::q5_k);
  EXPECT_EQ(synth_matrix_type(phi3, o, "blk.5.ffn_up.weight", 5), tensor_type::q4_k);
  const synth_shape l70 = *find_synth_preset("llama3-70b");  // 80 layers: q6_K at 0-9, 70-79, 12, 15, ...
  EXPECT_EQ(synth_matrix_type(l70, o, "blk.11.attn_v.weight", 11), tensor_type::q5_k);
  EXPECT_EQ(synth_matrix_type(l70, o, "blk.12.attn_v.weight", 12), tensor_type::q6_k);
  EXPECT_EQ(synth_matrix_type(l70, o, "blk.11.ffn_down.weight", 11), tensor_type::q4_k);
  o.mix = synth_mix::q5_k_m;
  EXPECT_EQ(synth_matrix_type(phi3, o, "blk.5.attn_qkv.weight", 5), tensor_type::q6_k);
  EXPECT_EQ(synth_matrix_type(l70, o, "blk.11.attn_v.weight", 11), tensor_type::q5_k);
  EXPECT_EQ(synth_matrix_type(l70, o, "blk.12.ffn_down.weight", 12), tensor_type::q6_k);
  o.mix = synth_mix::none;
  o.weight_type = tensor_type::q8_0;
  EXPECT_EQ(synth_matrix_type(l70, o, "output.weight", -1), tensor_type::q8_0);
}

// Bound on |x - x'| for one value of a K-quant min/max quantizer: half a step
// of a sub-block's range over its levels, plus each level's share of the
// 6-bit scale's rounding and half a min step (q4_K 15 and q5_K 31 levels over
// sub-blocks of 32); q6_K symmetric, 31 steps a side over groups of 16.
float k_bound(tensor_type t, const float* x, std::int64_t i, const std::byte* block) {
  if (t == tensor_type::q6_k) {
    const std::int64_t g = i / 16 * 16;
    float amax = 0;
    for (std::int64_t k = g; k < g + 16; ++k) amax = std::max(amax, std::fabs(x[k]));
    return amax / 31 / 2 + 16 * fp16_to_f32(reinterpret_cast<const block_q6_k*>(block)->d) + 1e-6f;
  }
  const std::int64_t s = i / 32 * 32;
  float lo = 0, hi = x[s];
  for (std::int64_t k = s; k < s + 32; ++k) lo = std::min(lo, x[k]), hi = std::max(hi, x[k]);
  const float levels = t == tensor_type::q4_k ? 15 : 31;
  const auto* b = reinterpret_cast<const block_q4_k*>(block);  // q5_K starts with the same d, dmin
  return (hi - lo) / levels / 2 + (levels + 1) / 2 * fp16_to_f32(b->d) + fp16_to_f32(b->dmin) / 2 + 1e-6f;
}

// Values: every matrix of a Q5_K_M and a Q4_K_M file holds the f32 file's
// weights (same seed and shape) within its own type's quantization error.
TEST(synth_mix, values_round_trip_within_each_type_s_error) {
  synth_options o;
  o.preset = "tiny256";
  o.weight_type = tensor_type::f32;
  auto ref = write_and_open(o, "synth_mix_ref.gguf");
  ASSERT_NE(ref, nullptr);
  for (synth_mix mix : {synth_mix::q4_k_m, synth_mix::q5_k_m}) {
    o.mix = mix;
    auto f = write_and_open(o, "synth_mix_values.gguf");
    ASSERT_NE(f, nullptr);
    int n_checked = 0;
    for (const gguf::tensor_info& tr : ref->tensors()) {
      if (tr.n_dims != 2) continue;
      const gguf::tensor_info* t = f->find_tensor(tr.name);
      ASSERT_NE(t, nullptr);
      const std::int64_t n = tr.ne[0];
      const std::size_t row_bytes = t->size_bytes / static_cast<std::size_t>(tr.ne[1]);
      const std::size_t block_bytes = row_bytes / static_cast<std::size_t>(n / 256);
      for (std::int64_t r : {std::int64_t{0}, tr.ne[1] / 2, tr.ne[1] - 1}) {
        const std::vector<float> x = decode_row(tr, r);
        std::vector<float> y(x.size());
        const std::byte* row = t->data + row_bytes * static_cast<std::size_t>(r);
        dequantize_quantized_row(t->type, row, n, y.data());
        for (std::int64_t i = 0; i < n; ++i)
          ASSERT_NEAR(y[i], x[i], k_bound(t->type, x.data(), i, row + block_bytes * static_cast<std::size_t>(i / 256)))
              << tr.name << " (" << gguf::tensor_type_name(t->type) << ") row " << r << " i " << i;
      }
      ++n_checked;
    }
    EXPECT_EQ(n_checked, 16);
  }
}

std::vector<char> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(synth_file, deterministic_in_the_seed) {
  // Same seed: the same bytes whatever the thread count.
  synth_options o;
  o.preset = "tiny";
  o.n_layer = 1;
  const std::string a = temp_path("synth_a.gguf"), b = temp_path("synth_b.gguf"), c = temp_path("synth_c.gguf");
  o.n_threads = 1;
  ASSERT_TRUE(write_synth_model(o, a).ok());
  o.n_threads = 3;
  ASSERT_TRUE(write_synth_model(o, b).ok());
  o.seed = 43;
  ASSERT_TRUE(write_synth_model(o, c).ok());
  auto ba = read_all(a), bb = read_all(b), bc = read_all(c);
  EXPECT_FALSE(ba.empty());
  EXPECT_EQ(ba, bb);
  ASSERT_EQ(ba.size(), bc.size());
  EXPECT_NE(ba, bc);
  for (const auto& p : {a, b, c}) std::remove(p.c_str());
}

TEST(synth_options_errors, are_values_with_clear_messages) {
  synth_options o;
  o.preset = "gpt-9";
  auto s = resolve_synth_shape(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code(), errc::invalid_argument);
  EXPECT_THAT(s.error().message(), HasSubstr("unknown synth preset 'gpt-9'"));
  EXPECT_THAT(s.error().message(), HasSubstr("llama3-8b"));

  o = synth_options{};
  o.n_vocab = 100;
  EXPECT_THAT(resolve_synth_shape(o).error().message(), HasSubstr("vocabulary size 100 is below the minimum 260"));

  o = synth_options{};
  o.n_ff = 100;  // not a multiple of 32
  EXPECT_THAT(resolve_synth_shape(o).error().message(),
              HasSubstr("feed-forward width 100 is not a multiple of the q8_0 block size 32"));
  o.weight_type = tensor_type::f16;
  EXPECT_TRUE(resolve_synth_shape(o).ok());

  o = synth_options{};
  o.n_layer = 0;
  EXPECT_EQ(resolve_synth_shape(o).error().code(), errc::invalid_argument);
  o = synth_options{};
  o.weight_type = tensor_type::iq3_s;  // computed with, but synth has no encoder for it
  EXPECT_THAT(resolve_synth_shape(o).error().message(), HasSubstr("synth cannot write weight type iq3_s"));
  o.weight_type = tensor_type::q4_k;
  EXPECT_TRUE(resolve_synth_shape(o).ok());
  o.preset = "tiny";  // n_embd 128: no whole super-block of 256
  EXPECT_THAT(resolve_synth_shape(o).error().message(),
              HasSubstr("embedding width 128 is not a multiple of the q4_K block size 256"));

  EXPECT_EQ(*parse_synth_weight_type("f16"), tensor_type::f16);
  EXPECT_EQ(*parse_synth_weight_type("q8_0"), tensor_type::q8_0);
  EXPECT_EQ(*parse_synth_weight_type("q4_0"), tensor_type::q4_0);
  EXPECT_EQ(*parse_synth_weight_type("q4_k"), tensor_type::q4_k);
  EXPECT_EQ(*parse_synth_weight_type("Q6_K"), tensor_type::q6_k);
  EXPECT_EQ(*parse_synth_weight_type("q5_K"), tensor_type::q5_k);
  EXPECT_EQ(*parse_synth_weight_type("MXFP4"), tensor_type::mxfp4);
  EXPECT_THAT(parse_synth_weight_type("q5_1").error().message(), HasSubstr("unknown weight type 'q5_1'"));
  EXPECT_EQ(parse_synth_weights("q4_k_m")->mix, synth_mix::q4_k_m);
  EXPECT_EQ(parse_synth_weights("Q5_K_M")->type, tensor_type::q5_k);
  EXPECT_EQ(parse_synth_weights("q8_0")->mix, synth_mix::none);
  EXPECT_THAT(parse_synth_weights("Q3_K_M").error().message(), HasSubstr("or a mix: Q4_K_M, Q5_K_M, MXFP4_MOE"));
  EXPECT_EQ(parse_synth_weights("mxfp4_moe")->mix, synth_mix::mxfp4_moe);
  o = synth_options{};
  o.preset = "tiny";  // rows of 128 cannot hold a mix's super-blocks
  o.mix = synth_mix::q4_k_m;
  EXPECT_THAT(resolve_synth_shape(o).error().message(), HasSubstr("not a multiple of the q4_K block size 256"));

  o = synth_options{};
  o.preset = "tiny";
  status st = write_synth_model(o, "/nonexistent-dir/x.gguf");
  EXPECT_EQ(st.code(), errc::io_error);
  EXPECT_THAT(st.message(), HasSubstr("/nonexistent-dir/x.gguf"));
}

// MXFP4_MOE as llama-quantize writes it (gpt-oss files): experts mxfp4,
// every other matrix q8_0, the router and the vectors F32, file type 38.
// The counts are llama-quantize's own on the same model (the gpt-oss MXFP4
// oracle file, tests/data/oracle/README.md): F32 25, MXFP4 6, Q8_0 10.
TEST(synth_mix, mxfp4_moe_matches_llama_quantize) {
  synth_options o;
  o.preset = "tiny-gpt-oss";
  o.mix = synth_mix::mxfp4_moe;
  o.n_threads = 1;
  const std::string path = ::testing::TempDir() + "/synth_mxfp4_moe.gguf";
  ASSERT_TRUE(write_synth_model(o, path).ok());
  auto f = gguf::file::open(path);
  std::remove(path.c_str());
  ASSERT_TRUE(f.ok());
  std::map<tensor_type, int> n;
  for (const gguf::tensor_info& t : (*f)->tensors()) {
    ++n[t.type];
    if (t.name.find("_exps.weight") != std::string::npos) {
      EXPECT_EQ(t.type, tensor_type::mxfp4) << t.name;
    }
    if (t.name.find("ffn_gate_inp") != std::string::npos) {
      EXPECT_EQ(t.type, tensor_type::f32) << t.name;
    }
  }
  EXPECT_EQ(n[tensor_type::f32], 25);
  EXPECT_EQ(n[tensor_type::mxfp4], 6);
  EXPECT_EQ(n[tensor_type::q8_0], 10);
  EXPECT_EQ(*(*f)->get_int("general.file_type"), 38);
}

}  // namespace
}  // namespace pagoda
