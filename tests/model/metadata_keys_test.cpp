// Every metadata key llama.cpp reads to build a model of each architecture
// Pagoda loads, and what Pagoda does with it. Each key must be
//   used      a file that changes it loads and runs differently (its
//             hyper-parameters or its logits);
//   shapes    it sets the model's dimensions: a changed value no longer fits
//             the tensors (or the other dimensions) and is refused;
//   refused   Pagoda does not compute what it asks for: a file that sets it
//             to anything but its neutral value is refused, naming the key;
//   ignored   llama.cpp's output does not depend on it for this architecture
//             either (the reason is in the list): the logits stay the same.
// A key in none of these states would run a file at a silent wrong answer.
//
// Where the list comes from: llama.cpp (unslothai/llama.cpp at commit
// d32676d77426540327835040d5d3279728f0b4c8, the oracle's; tests/data/oracle):
//   src/llama-model.cpp, llama_model_base::load_hparams: the keys read for
//     every architecture, general.name to classifier.output_labels;
//   src/models/{llama,qwen2,qwen3,gemma2,gemma3,phi3,qwen3moe,openai-moe}.cpp, load_arch_hparams:
//     each architecture's own (Mistral files are `llama`, run here on a
//     Mistral v0.1-style model too);
//   src/llama-arch.cpp, LLM_KV_NAMES: the key strings ("%s." is the
//     architecture).
// Not listed: tokenizer.* (llama-vocab.cpp; the tokenizer's tests), the file
// format's general.alignment, general.file_type and split.* (the GGUF
// reader's), general.architecture. Listed as well: the YaRN keys llama.cpp
// reads only for other architectures (grok, mistral3, deepseek2), which a
// converted file of these could still carry.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "model/gguf_util.h"
#include "model/gguf_writer.h"
#include "model/llama.h"
#include "model/oracle_util.h"
#include "model/synth.h"

namespace pagoda {
namespace {

using ::testing::HasSubstr;

enum class outcome { used, shapes, refused, ignored };

// Writes the key (full name) with a value other than the base model's.
using value_fn = std::function<void(gguf::writer&, const std::string& key, const llama_hparams& base)>;

value_fn u32(std::function<std::uint32_t(const llama_hparams&)> v) {
  return [v](gguf::writer& w, const std::string& k, const llama_hparams& hp) { w.add_u32(k, v(hp)); };
}
value_fn u32(std::uint32_t v) {
  return u32([v](const llama_hparams&) { return v; });
}
value_fn f32(std::function<float(const llama_hparams&)> v) {
  return [v](gguf::writer& w, const std::string& k, const llama_hparams& hp) { w.add_f32(k, v(hp)); };
}
value_fn f32(float v) {
  return f32([v](const llama_hparams&) { return v; });
}
value_fn str(const char* v) {
  return [v](gguf::writer& w, const std::string& k, const llama_hparams&) { w.add_string(k, v); };
}
value_fn boolean(bool v) {
  return [v](gguf::writer& w, const std::string& k, const llama_hparams&) { w.add_bool(k, v); };
}
// One value per layer (llama.cpp's get_key_or_arr accepts either form).
value_fn per_layer(std::function<std::int32_t(const llama_hparams&)> v) {
  return [v](gguf::writer& w, const std::string& k, const llama_hparams& hp) {
    w.add_array(k, std::vector<std::int32_t>(static_cast<std::size_t>(hp.n_layer), v(hp)));
  };
}
value_fn labels() {
  return [](gguf::writer& w, const std::string& k, const llama_hparams&) {
    const std::vector<std::string> l = {"yes", "no"};
    w.add_string_array(k, l);
  };
}

// Keys written to the baseline and the variant alike (a YaRN parameter only
// matters under YaRN).
using setup_fn = std::function<void(gguf::writer&, const std::string& arch)>;
void yarn(gguf::writer& w, const std::string& arch) {
  w.add_string(arch + ".rope.scaling.type", "yarn");
  w.add_f32(arch + ".rope.scaling.factor", 4.0f);
}
void linear_x4(gguf::writer& w, const std::string& arch) { w.add_f32(arch + ".rope.scaling.factor", 4.0f); }

struct key_case {
  std::string key;        // "general.*" as is; otherwise prefixed with "<arch>."
  std::string archs;      // empty: every architecture; else the ones (space-separated) that read it
  outcome expect;
  value_fn value;
  std::string why = {};   // for `ignored`: why llama.cpp's output does not depend on it
  setup_fn setup = {};
};

// The architectures that read expert keys as their own, and the others.
constexpr const char* k_moe = "qwen3moe gpt-oss";
constexpr const char* k_dense = "llama qwen2 qwen3 gemma2 gemma3 phi3";

const std::vector<key_case>& llama_cpp_keys() {
  const auto half = [](int v) { return static_cast<std::uint32_t>(v / 2); };
  static const std::vector<key_case> keys = {
      // llama_model_base::load_hparams, every architecture, in its order.
      {"general.name", "", outcome::used, str("another name")},
      {"context_length", "", outcome::used, u32([](const llama_hparams& h) { return 2u * h.n_ctx_train; })},
      {"embedding_length", "", outcome::shapes, u32([](const llama_hparams& h) { return 2u * h.n_embd; })},
      {"embedding_length_out", "", outcome::refused, u32([half](const llama_hparams& h) { return half(h.n_embd); })},
      {"attention.causal", "", outcome::refused, boolean(false)},
      {"pooling_type", "", outcome::refused, u32(1)},  // mean pooling
      {"block_count", "", outcome::shapes, u32([](const llama_hparams& h) { return h.n_layer + 1u; })},
      {"expert_count", k_dense, outcome::refused, u32(8)},
      {"expert_count", k_moe, outcome::shapes, u32([](const llama_hparams& h) { return 2u * h.moe.n_expert; })},
      {"expert_used_count", k_dense, outcome::refused, u32(2)},
      {"expert_used_count", k_moe, outcome::used, u32([](const llama_hparams& h) { return h.moe.n_expert_used - 1u; })},
      {"expert_group_count", "", outcome::refused, u32(2)},
      {"expert_group_used_count", "", outcome::refused, u32(1)},
      {"feed_forward_length", k_dense, outcome::shapes, u32([](const llama_hparams& h) { return 2u * h.n_ff; })},
      {"feed_forward_length", k_moe, outcome::ignored, u32([](const llama_hparams& h) { return 2u * h.n_ff; }),
       "every FFN is experts of expert_feed_forward_length (which the file has)"},
      {"feed_forward_length", "", outcome::refused, per_layer([](const llama_hparams& h) { return h.n_ff; })},
      {"attention.head_count", "", outcome::shapes, u32([](const llama_hparams& h) { return 2u * h.n_head; })},
      {"attention.head_count", "", outcome::refused, per_layer([](const llama_hparams& h) { return h.n_head; })},
      {"attention.head_count_kv", "", outcome::shapes, u32([half](const llama_hparams& h) {
         return h.n_head_kv == h.n_head ? half(h.n_head) : static_cast<std::uint32_t>(h.n_head);
       })},
      {"attention.head_count_kv", "", outcome::refused, per_layer([](const llama_hparams& h) { return h.n_head_kv; })},
      {"rope.scaling.finetuned", "", outcome::ignored, boolean(true),
       "llama.cpp only prints it for these architectures (granite reads it as a RoPE switch)"},
      {"rope.scaling.original_context_length", "", outcome::used, u32(256), {}, yarn},
      {"rope.freq_base", "", outcome::used, f32([](const llama_hparams& h) { return 2 * h.rope_base; })},
      {"rope.scaling.type", "", outcome::used, str("yarn"), {}, linear_x4},
      {"rope.scaling.type", "", outcome::used, str("none"), {}, linear_x4},
      {"rope.scaling.type", "", outcome::refused, str("longrope")},
      {"rope.scaling.type", "", outcome::refused, str("dynamic")},
      {"rope.scaling.factor", "", outcome::used, f32(4.0f)},
      {"rope.scale_linear", "", outcome::used, f32(4.0f)},
      {"rope.scaling.attn_factor", "", outcome::used, f32(1.5f)},
      {"rope.scaling.alpha", "", outcome::refused, f32(1000.0f)},
      {"attention.key_length", "", outcome::shapes, u32([](const llama_hparams& h) { return 2u * h.head_dim; })},
      {"attention.value_length", "", outcome::refused, u32([](const llama_hparams& h) { return 2u * h.head_dim; })},
      {"rope.dimension_count", "", outcome::used, u32([half](const llama_hparams& h) { return half(h.rope_dim); })},
      {"attention.key_length_swa", "", outcome::refused, u32([](const llama_hparams& h) { return 2u * h.head_dim; })},
      {"attention.value_length_swa", "", outcome::refused, u32([](const llama_hparams& h) { return 2u * h.head_dim; })},
      {"rope.dimension_count_swa", "", outcome::refused, u32([half](const llama_hparams& h) { return half(h.rope_dim); })},
      {"classifier.output_labels", "", outcome::refused, labels()},
      // load_arch_hparams of each architecture.
      {"vocab_size", "llama", outcome::ignored, u32([](const llama_hparams& h) { return 2u * h.n_vocab; }),
       "llama.cpp's llama names the model's size with it; the vocabulary is the tokenizer's"},
      {"attention.layer_norm_rms_epsilon", "", outcome::used, f32(1e-2f)},
      {"attention.sliding_window", "phi3", outcome::ignored, u32(4),
       "llama.cpp turns Phi-3's sliding window off (its window metadata was unreliable)"},
      {"attention.sliding_window", "gemma2 gemma3 gpt-oss", outcome::used, u32(4)},
      {"attention.sliding_window_pattern", "gemma2 gpt-oss", outcome::used, u32(3)},
      {"attention.sliding_window_pattern", "gemma3", outcome::used, u32(2)},
      {"rope.freq_base_swa", "gemma2 gemma3 gpt-oss", outcome::used, f32(20000.0f)},
      {"expert_feed_forward_length", k_moe, outcome::shapes,
       u32([](const llama_hparams& h) { return 2u * h.moe.n_ff_exp; })},
      {"attn_logit_softcapping", "gemma2", outcome::used, f32(5.0f)},
      {"final_logit_softcapping", "gemma2 gemma3", outcome::used, f32(5.0f)},
      // YaRN keys llama.cpp reads only for other architectures.
      {"rope.scaling.yarn_beta_fast", "", outcome::used, f32(8.0f), {}, yarn},
      {"rope.scaling.yarn_beta_slow", "", outcome::used, f32(4.0f), {}, yarn},
      {"rope.scaling.yarn_ext_factor", "", outcome::refused, f32(0.5f), {}, yarn},
      {"rope.scaling.yarn_attn_factor", "", outcome::refused, f32(2.0f)},
      {"rope.scaling.yarn_log_multiplier", "", outcome::refused, f32(0.1f), {}, yarn},
  };
  return keys;
}

bool reads(const key_case& k, const std::string& arch) {
  if (k.archs.empty()) return true;
  return (" " + k.archs + " ").find(" " + arch + " ") != std::string::npos;
}

struct model_case {
  const char* label;
  const char* preset;  // a synth preset, or an oracle file (qwen2 has no small preset)
  const char* oracle;
};

std::unique_ptr<gguf::file> base_file(const model_case& c) {
  std::string path = c.oracle ? test::oracle_dir() + "/gguf/" + c.oracle + ".gguf" : "";
  if (!c.oracle) {
    synth_options o;
    o.preset = c.preset;
    o.weight_type = gguf::tensor_type::f32;
    o.n_threads = 1;
    path = ::testing::TempDir() + "/metadata_keys_" + c.label + ".gguf";
    status st = write_synth_model(o, path);
    EXPECT_TRUE(st.ok()) << st.message();
  }
  auto f = gguf::file::open(path);
  if (!c.oracle) std::remove(path.c_str());  // the mapping outlives the file
  EXPECT_TRUE(f.ok()) << path;
  return f.ok() ? std::move(*f) : nullptr;
}

// A model from a copy of src without the key `drop` (none if empty) and with
// what `add` writes; `storage` keeps the bytes its tensors point into.
result<std::unique_ptr<llama_model>> load_copy(const gguf::file& src, std::string_view drop,
                                               const std::function<void(gguf::writer&)>& add,
                                               std::vector<std::byte>& storage) {
  storage = test::rewrite_gguf(src, {drop}, add);
  auto f = gguf::file::from_memory(storage);
  if (!f.ok()) return f.error();
  return llama_model::from_gguf(std::move(*f));
}

// 16 tokens, past the tiny gemma windows of 8, so windowed layers matter.
std::vector<float> logits_of(const llama_model& m) {
  const std::vector<token_id> tokens = {5, 90, 17, 300, 41, 7, 260, 99, 12, 480, 33, 201, 64, 3, 150, 77};
  return test::run_teacher_forced(m, tokens, static_cast<int>(tokens.size()));
}

void PrintTo(const model_case& c, std::ostream* os) { *os << c.label; }

class metadata_keys : public ::testing::TestWithParam<model_case> {};

TEST_P(metadata_keys, every_key_llama_cpp_reads_is_used_or_refused) {
  auto src = base_file(GetParam());
  ASSERT_TRUE(src);
  const std::string arch(*src->get_string("general.architecture"));
  int checked = 0;
  for (const key_case& k : llama_cpp_keys()) {
    if (!reads(k, arch)) continue;
    const std::string key = k.key.starts_with("general.") ? k.key : arch + "." + k.key;
    SCOPED_TRACE(key);
    std::vector<std::byte> base_bytes, variant_bytes;
    auto base = load_copy(*src, "", [&](gguf::writer& w) { if (k.setup) k.setup(w, arch); }, base_bytes);
    ASSERT_TRUE(base.ok()) << base.error().message();
    const llama_hparams& hp = (*base)->hparams();
    auto variant = load_copy(
        *src, key,
        [&](gguf::writer& w) {
          if (k.setup) k.setup(w, arch);
          k.value(w, key, hp);
        },
        variant_bytes);
    ++checked;
    switch (k.expect) {
      case outcome::refused:
        EXPECT_FALSE(variant.ok()) << "a file setting " << key << " loads";
        if (!variant.ok()) {
          EXPECT_THAT(variant.error().message(), HasSubstr(key));
        }
        break;
      case outcome::shapes:
        // Refused by a tensor's shape or by a dimension derived from it: a
        // key the loader did not read would load the same tensors unchanged.
        EXPECT_FALSE(variant.ok()) << "a file changing " << key << " loads with the same tensors";
        break;
      case outcome::used:
      case outcome::ignored: {
        EXPECT_TRUE(variant.ok()) << variant.error().message();
        if (!variant.ok()) break;
        const llama_hparams& v = (*variant)->hparams();
        const bool same_logits = logits_of(**base) == logits_of(**variant);
        if (k.expect == outcome::ignored) {
          EXPECT_TRUE(same_logits) << key << " changes the logits: " << k.why;
        } else {
          EXPECT_TRUE(!same_logits || v.name != hp.name || v.n_ctx_train != hp.n_ctx_train)
              << key << " changes nothing";
        }
        break;
      }
    }
  }
  EXPECT_GE(checked, 40);
  std::printf("[ keys ] %s (%s): %d keys checked\n", GetParam().label, arch.c_str(), checked);
}

INSTANTIATE_TEST_SUITE_P(architectures, metadata_keys,
                         ::testing::Values(model_case{"llama", "tiny", nullptr},
                                           model_case{"mistral", "tiny-swa", nullptr},
                                           model_case{"qwen2", nullptr, "qwen2-F32"},
                                           model_case{"qwen3", "tiny-qwen3", nullptr},
                                           model_case{"gemma2", "tiny-gemma2", nullptr},
                                           model_case{"gemma3", "tiny-gemma3", nullptr},
                                           model_case{"phi3", "tiny-phi3", nullptr},
                                           model_case{"qwen3moe", "tiny-qwen3moe", nullptr},
                                           model_case{"gpt_oss", "tiny-gpt-oss", nullptr}),
                         [](const auto& info) { return std::string(info.param.label); });

}  // namespace
}  // namespace pagoda
