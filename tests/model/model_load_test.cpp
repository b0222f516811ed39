// The model loader's checks against the architecture: missing keys, missing
// tensors, wrong shapes and types, unsupported architectures — each a clear
// error naming what is wrong. Also qwen2 (QKV biases) end to end.
#include <cstring>
#include <functional>
#include <optional>

#include <gtest/gtest.h>

#include "model/gguf_writer.h"
#include "common/temp_files.h"
#include "kv/kv_storage.h"
#include "model/gguf_util.h"
#include "model/llama.h"
#include "model/synth.h"

namespace pagoda {
namespace {

std::string temp_path(const std::string& name) {
  return temp_file("model_load", name + ".gguf");
}

const std::string& tiny_model() {
  static std::string path = [] {
    synth_options o;
    o.preset = "tiny";
    o.weight_type = gguf::tensor_type::f32;
    o.n_threads = 1;
    std::string p = temp_path("tiny");
    status st = write_synth_model(o, p);
    EXPECT_TRUE(st.ok()) << st.message();
    return p;
  }();
  return path;
}

// Edits applied while copying a GGUF file.
struct edits {
  std::function<std::optional<std::string>(std::string_view key)> rename_key;  // nullopt: drop the key
  std::function<void(gguf::writer&)> add_metadata;
  std::function<bool(const gguf::tensor_info&)> drop_tensor;
  std::function<std::vector<std::int64_t>(const gguf::tensor_info&)> reshape;  // empty: keep
  std::function<void(gguf::writer&)> add_tensors;
};

std::string rewrite(const std::string& name, const edits& e) {
  auto f = gguf::file::open(tiny_model());
  EXPECT_TRUE(f.ok());
  gguf::writer w;
  for (const gguf::metadata_entry& m : (*f)->metadata()) {
    std::string key(m.key);
    if (key == "general.alignment") continue;
    if (e.rename_key) {
      auto k = e.rename_key(key);
      if (!k) continue;
      key = *k;
    }
    test::copy_value(w, key, m.val);
  }
  if (e.add_metadata) e.add_metadata(w);
  for (const gguf::tensor_info& t : (*f)->tensors()) {
    if (e.drop_tensor && e.drop_tensor(t)) continue;
    std::vector<std::int64_t> ne(t.ne, t.ne + t.n_dims);
    if (e.reshape) {
      auto r = e.reshape(t);
      if (!r.empty()) ne = r;
    }
    w.add_tensor(t.name, t.type, ne, std::span<const std::byte>(t.data, t.size_bytes));
  }
  if (e.add_tensors) e.add_tensors(w);
  std::string path = temp_path(name);
  EXPECT_TRUE(w.write_file(path).ok());
  return path;
}

void expect_load_error(const std::string& path, errc code, const std::string& fragment) {
  auto m = llama_model::load(path);
  std::remove(path.c_str());
  ASSERT_FALSE(m.ok()) << "loaded a broken model: " << fragment;
  EXPECT_EQ(m.error().code(), code) << m.error().message();
  EXPECT_NE(m.error().message().find(fragment), std::string::npos) << m.error().message();
}

TEST(model_load, tiny_synth_model_loads_and_runs) {
  auto m = llama_model::load(tiny_model());
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ((*m)->hparams().n_layer, 2);
  EXPECT_EQ((*m)->hparams().head_dim, 32);
}

TEST(model_load, missing_required_key) {
  expect_load_error(rewrite("nokey", {.rename_key = [](std::string_view k) -> std::optional<std::string> {
                      if (k == "llama.block_count") return std::nullopt;
                      return std::string(k);
                    }}),
                    errc::corrupt, "llama.block_count");
}

TEST(model_load, missing_tensor) {
  expect_load_error(rewrite("notensor", {.drop_tensor = [](const gguf::tensor_info& t) {
                      return t.name == "blk.1.ffn_down.weight";
                    }}),
                    errc::corrupt, "blk.1.ffn_down.weight");
}

TEST(model_load, shape_mismatch) {
  // attn_k written as if there were as many KV heads as query heads.
  expect_load_error(rewrite("shape", {.reshape = [](const gguf::tensor_info& t) -> std::vector<std::int64_t> {
                      if (t.name != "blk.0.attn_k.weight") return {};
                      return {t.ne[0] / 2, t.ne[1] * 2};
                    }}),
                    errc::corrupt, "blk.0.attn_k.weight");
}

TEST(model_load, unsupported_architecture) {
  expect_load_error(rewrite("arch", {.rename_key = [](std::string_view k) -> std::optional<std::string> {
                                       if (k == "general.architecture") return std::nullopt;
                                       return std::string(k);
                                     },
                                     .add_metadata = [](gguf::writer& w) { w.add_string("general.architecture", "gptneox"); }}),
                    errc::unsupported, "gptneox");
}

TEST(model_load, inconsistent_heads) {
  expect_load_error(rewrite("heads", {.rename_key = [](std::string_view k) -> std::optional<std::string> {
                                        if (k == "llama.attention.head_count_kv") return std::nullopt;
                                        return std::string(k);
                                      },
                                      .add_metadata = [](gguf::writer& w) { w.add_u32("llama.attention.head_count_kv", 3); }}),
                    errc::corrupt, "multiple");
}

// A tensor the model does not read is a part llama.cpp computes (llama's
// optional output bias, here) or does not know: either way the file is
// refused, naming it, rather than run without it.
TEST(model_load, unused_tensors_are_refused) {
  const std::vector<float> bias(128, 0.5f);
  for (const char* name : {"blk.0.attn_output.bias", "token_embd_norm.weight"}) {
    SCOPED_TRACE(name);
    expect_load_error(rewrite("unused", {.add_tensors = [&](gguf::writer& w) {
                        const std::int64_t ne[] = {128};
                        w.add_tensor(name, gguf::tensor_type::f32, ne, std::as_bytes(std::span<const float>(bias)));
                      }}),
                      errc::unsupported, std::string("tensor ") + name + " is not used by Pagoda's llama model");
  }
}

// qwen2: the same network with QKV biases and NeoX-style rotary; the biases are
// required and change the output.
TEST(model_load, qwen2_with_biases) {
  auto to_qwen = [](std::string_view k) -> std::optional<std::string> {
    if (k == "general.architecture") return std::nullopt;
    if (k.starts_with("llama.")) return "qwen2." + std::string(k.substr(6));
    return std::string(k);
  };
  auto add_arch = [](gguf::writer& w) { w.add_string("general.architecture", "qwen2"); };
  auto biases = [](float value) {
    return [value](gguf::writer& w) {
      for (int l = 0; l < 2; ++l)
        for (auto [name, n] : {std::pair{"attn_q", 128}, {"attn_k", 64}, {"attn_v", 64}}) {
          std::vector<float> b(n, value);
          std::vector<std::int64_t> ne{n};
          w.add_tensor("blk." + std::to_string(l) + "." + name + ".bias", gguf::tensor_type::f32, ne,
                       std::as_bytes(std::span<const float>(b)));
        }
    };
  };
  expect_load_error(rewrite("qwen_nobias", {.rename_key = to_qwen, .add_metadata = add_arch}), errc::corrupt,
                    "attn_q.bias");
  std::vector<std::vector<float>> logits;
  for (float v : {0.0f, 0.5f}) {
    std::string path = rewrite("qwen", {.rename_key = to_qwen, .add_metadata = add_arch, .add_tensors = biases(v)});
    auto m = llama_model::load(path);
    std::remove(path.c_str());
    ASSERT_TRUE(m.ok()) << m.error().message();
    EXPECT_EQ((*m)->hparams().arch, "qwen2");
    EXPECT_TRUE((*m)->hparams().rope_neox);
    const llama_hparams& hp = (*m)->hparams();
    auto kv = *kv_storage::create(kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, 16, kv_type::f32, kv_type::f32), 4);
    llama_context ctx(**m, *kv, 1);
    std::vector<token_id> ids{1, 300, 301, 302};
    std::vector<block_id> table{block_id(0)};
    forward_seq s = forward_seq::consecutive(ids, 0, table, false);
    std::vector<float> out;
    ASSERT_TRUE(ctx.forward({&s, 1}, out).ok());
    for (float x : out) ASSERT_TRUE(std::isfinite(x));
    logits.push_back(out);
  }
  EXPECT_NE(logits[0], logits[1]) << "biases had no effect";
}

}  // namespace
}  // namespace pagoda
