#include "model/synth.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "core/assert.h"
#include "model/kv_share.h"
#include "core/half.h"
#include "core/thread_pool.h"
#include "model/gguf_writer.h"
#include "model/matmul.h"
#include "model/quants.h"
#include "model/synth_fill.h"

namespace pagoda {

namespace {

using gguf::tensor_type;

// Shapes of the real models (their config.json / llama.cpp's GGUF metadata).
synth_shape make_shape(const char* name, const char* arch, int n_embd, int n_head, int n_head_kv, int head_dim,
                       int n_ff, int n_layer, int n_ctx, int n_vocab, float rope_base, float rms_eps) {
  synth_shape s;
  s.name = name;
  s.arch = arch;
  s.n_embd = n_embd;
  s.n_head = n_head;
  s.n_head_kv = n_head_kv;
  s.head_dim = head_dim;
  s.n_ff = n_ff;
  s.n_layer = n_layer;
  s.n_ctx = n_ctx;
  s.n_vocab = n_vocab;
  s.rope_base = rope_base;
  s.rms_eps = rms_eps;
  const std::string_view a = arch;
  s.qkv_bias = a == "qwen2";
  s.qk_norm = a == "qwen3" || a == "gemma3";
  s.post_norms = a == "gemma2" || a == "gemma3";
  s.fused = a == "phi3";
  return s;
}

synth_shape with_window(synth_shape s, int window, int pattern = 0) {
  s.sliding_window = window;
  s.swa_pattern = pattern;
  return s;
}

synth_shape gemma2(synth_shape s, int window) {
  s = with_window(s, window);
  s.attn_softcap = 50.0f;
  s.final_softcap = 30.0f;
  return s;
}

// qwen3moe: qwen3's attention (Q/K norms) with routed experts.
synth_shape moe(synth_shape s, int n_expert, int n_expert_used, int n_ff_exp) {
  s.qk_norm = true;
  s.n_expert = n_expert;
  s.n_expert_used = n_expert_used;
  s.n_ff_exp = n_ff_exp;
  return s;
}

// gpt-oss: biased attention with sinks and a window on every other layer,
// biased experts, YaRN.
synth_shape gpt_oss(synth_shape s, int n_expert, int n_expert_used, int window, float yarn_factor, int n_ctx_orig) {
  s = moe(s, n_expert, n_expert_used, s.n_ff);
  s.qk_norm = false;
  s.qkv_bias = true;
  s.gpt_oss_parts = true;
  s.sliding_window = window;
  s.yarn_factor = yarn_factor;
  s.yarn_n_ctx_orig = n_ctx_orig;
  return s;
}

synth_shape gemma3(synth_shape s, int window) {
  s = with_window(s, window, 6);
  s.rope_base_swa = 10000.0f;
  return s;
}

const synth_shape k_presets[] = {
    // name, arch, n_embd, n_head, n_head_kv, head_dim, n_ff, n_layer, n_ctx, n_vocab, rope_base, rms_eps
    make_shape("llama3-8b", "llama", 4096, 32, 8, 128, 14336, 32, 8192, 128256, 500000.0f, 1e-5f),
    make_shape("llama3-70b", "llama", 8192, 64, 8, 128, 28672, 80, 8192, 128256, 500000.0f, 1e-5f),
    make_shape("mistral-7b", "llama", 4096, 32, 8, 128, 14336, 32, 32768, 32000, 1000000.0f, 1e-5f),
    with_window(make_shape("mistral-7b-v0.1", "llama", 4096, 32, 8, 128, 14336, 32, 32768, 32000, 10000.0f, 1e-5f),
                4096),
    make_shape("qwen2-7b", "qwen2", 3584, 28, 4, 128, 18944, 28, 32768, 152064, 1000000.0f, 1e-6f),
    make_shape("qwen3-8b", "qwen3", 4096, 32, 8, 128, 12288, 36, 40960, 151936, 1000000.0f, 1e-6f),
    gemma2(make_shape("gemma2-9b", "gemma2", 3584, 16, 8, 256, 14336, 42, 8192, 256000, 10000.0f, 1e-6f), 4096),
    gemma3(make_shape("gemma3-4b", "gemma3", 2560, 8, 4, 256, 10240, 34, 131072, 262208, 1000000.0f, 1e-6f), 1024),
    make_shape("phi3-mini", "phi3", 3072, 32, 32, 96, 8192, 32, 4096, 32064, 10000.0f, 1e-5f),
    // SmolLM2-135M, the text model of SmolVLM-256M (idefics3 images).
    make_shape("smollm2-135m", "llama", 576, 9, 3, 64, 1536, 30, 8192, 49152, 100000.0f, 1e-5f),
    moe(make_shape("qwen3-30b-a3b", "qwen3moe", 2048, 32, 4, 128, 6144, 48, 40960, 151936, 1000000.0f, 1e-6f), 128, 8,
        768),
    gpt_oss(make_shape("gpt-oss-20b", "gpt-oss", 2880, 64, 8, 64, 2880, 24, 131072, 201088, 150000.0f, 1e-5f), 32, 4,
            128, 32.0f, 4096),
    make_shape("tiny", "llama", 128, 4, 2, 32, 256, 2, 2048, 512, 10000.0f, 1e-5f),
    make_shape("tiny256", "llama", 256, 4, 2, 64, 512, 2, 2048, 512, 10000.0f, 1e-5f),
    make_shape("tiny-qwen3", "qwen3", 128, 8, 2, 32, 256, 2, 2048, 512, 1000000.0f, 1e-6f),
    gemma2(make_shape("tiny-gemma2", "gemma2", 128, 4, 2, 32, 256, 2, 2048, 512, 10000.0f, 1e-6f), 8),
    with_window(gemma3(make_shape("tiny-gemma3", "gemma3", 128, 4, 1, 32, 256, 3, 2048, 512, 1000000.0f, 1e-6f), 8),
                8, 3),
    make_shape("tiny-phi3", "phi3", 128, 4, 2, 32, 256, 2, 2048, 512, 10000.0f, 1e-5f),
    moe(make_shape("tiny-qwen3moe", "qwen3moe", 256, 4, 2, 64, 512, 2, 2048, 512, 1000000.0f, 1e-6f), 8, 2, 256),
    gpt_oss(make_shape("tiny-gpt-oss", "gpt-oss", 128, 4, 2, 64, 128, 2, 2048, 512, 150000.0f, 1e-5f), 8, 2, 8, 0.0f,
            0),
    // Mistral v0.1's kind: a sliding window on every layer.
    with_window(make_shape("tiny-swa", "llama", 128, 4, 2, 32, 256, 2, 2048, 512, 10000.0f, 1e-5f), 24),
};

// Weight types synth can write (those with an encoder in encode_row).
constexpr tensor_type k_writable_types[] = {tensor_type::f16,  tensor_type::q8_0, tensor_type::q4_0,
                                            tensor_type::q4_k, tensor_type::q5_k, tensor_type::q6_k,
                                            tensor_type::f32,  tensor_type::bf16, tensor_type::mxfp4};

constexpr int k_n_special_tokens = 3;  // <unk> <s> </s>
constexpr int k_n_byte_tokens = 256;
constexpr int k_min_vocab = k_n_special_tokens + k_n_byte_tokens + 1;

// llama.cpp token types.
constexpr std::int32_t k_token_normal = 1;
constexpr std::int32_t k_token_unknown = 2;
constexpr std::int32_t k_token_control = 3;
constexpr std::int32_t k_token_byte = 6;

// llama.cpp's general.file_type (llama_ftype) for a mix or a uniform weight type.
std::uint32_t file_type_of(tensor_type t, synth_mix mix) {
  if (mix == synth_mix::q4_k_m) return 15;  // LLAMA_FTYPE_MOSTLY_Q4_K_M
  if (mix == synth_mix::q5_k_m) return 17;  // LLAMA_FTYPE_MOSTLY_Q5_K_M
  if (mix == synth_mix::mxfp4_moe) return 38;  // LLAMA_FTYPE_MOSTLY_MXFP4_MOE
  switch (t) {
    case tensor_type::f32: return 0;
    case tensor_type::f16: return 1;
    case tensor_type::q4_0: return 2;
    case tensor_type::q8_0: return 7;
    case tensor_type::q4_k: return 14;  // LLAMA_FTYPE_MOSTLY_Q4_K_S: every matrix q4_K
    case tensor_type::q5_k: return 16;  // LLAMA_FTYPE_MOSTLY_Q5_K_S
    case tensor_type::q6_k: return 18;
    case tensor_type::bf16: return 32;
    default: return 0;
  }
}

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Fills x[0..n) with uniform values in [-amplitude, amplitude), a function of
// (seed, tensor, row) alone, so chunking never changes the weights.
void random_row(std::uint64_t seed, std::uint64_t tensor, std::int64_t row, float amplitude, float* x,
                std::int64_t n) {
  std::uint64_t state = seed ^ (tensor * 0xd1b54a32d192ed03ull);
  state = splitmix64(state) ^ static_cast<std::uint64_t>(row);
  std::uint64_t s = splitmix64(state) | 1;
  const float scale = 2.0f * amplitude / 16777216.0f;  // 24 random bits
  for (std::int64_t i = 0; i < n; ++i) {
    s ^= s << 13;  // xorshift64
    s ^= s >> 7;
    s ^= s << 17;
    x[i] = static_cast<float>(s >> 40) * scale - amplitude;
  }
}

// Encodes one row of n floats as type t into out.
void encode_row(tensor_type t, const float* x, std::int64_t n, std::byte* out) {
  switch (t) {
    case tensor_type::f32: std::memcpy(out, x, static_cast<std::size_t>(n) * sizeof(float)); return;
    case tensor_type::f16: {
      auto* h = reinterpret_cast<fp16_t*>(out);
      for (std::int64_t i = 0; i < n; ++i) h[i] = f32_to_fp16(x[i]);
      return;
    }
    case tensor_type::bf16: {
      auto* h = reinterpret_cast<bf16_t*>(out);
      for (std::int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(x[i]);
      return;
    }
    case tensor_type::q8_0: quantize_row_q8_0(x, n, out); return;
    case tensor_type::q4_0: quantize_row_q4_0(x, n, out); return;
    case tensor_type::q4_k: quantize_row_q4_k(x, n, out); return;
    case tensor_type::q5_k: quantize_row_q5_k(x, n, out); return;
    case tensor_type::q6_k: quantize_row_q6_k(x, n, out); return;
    case tensor_type::mxfp4: quantize_row_mxfp4(x, n, out); return;
    default: PAGODA_ASSERT(false, "synth: no encoder for {}", gguf::tensor_type_name(t));
  }
}

}  // namespace

namespace synth_detail {

// Rows of a chunk are generated in parallel; each depends on its index alone.
gguf::tensor_fill_fn make_fill(tensor_recipe r, std::shared_ptr<thread_pool> pool) {
  return [r, pool](std::int64_t first_row, std::int64_t n_rows, std::span<std::byte> out) -> status {
    const std::size_t row_bytes = out.size() / static_cast<std::size_t>(n_rows);
    pool->parallel_for(static_cast<std::size_t>(n_rows), [&](std::size_t begin, std::size_t end) {
      std::vector<float> x(static_cast<std::size_t>(r.n_in), r.constant);
      for (std::size_t k = begin; k < end; ++k) {
        if (r.amplitude != 0) {
          random_row(r.seed, r.id, first_row + static_cast<std::int64_t>(k), r.amplitude, x.data(), r.n_in);
          if (r.constant != 0)
            for (float& v : x) v += r.constant;
        }
        encode_row(r.type, x.data(), r.n_in, out.data() + k * row_bytes);
      }
    });
    return ok_status();
  };
}

}  // namespace synth_detail

namespace {

using synth_detail::make_fill;

// Plain pieces after the byte tokens: "▁", then for length 1, 2, ... every
// lowercase word w in order as "▁w" and "w". Scores fall with the index so
// shorter pieces rank first.
void add_vocabulary(gguf::writer& w, int n_vocab) {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<std::int32_t> types;
  tokens.reserve(n_vocab);
  auto add = [&](std::string piece, float score, std::int32_t type) {
    tokens.push_back(std::move(piece));
    scores.push_back(score);
    types.push_back(type);
  };
  add("<unk>", 0, k_token_unknown);
  add("<s>", 0, k_token_control);
  add("</s>", 0, k_token_control);
  for (int b = 0; b < k_n_byte_tokens; ++b) add(fmt::format("<0x{:02X}>", b), 0, k_token_byte);
  const std::string space = "\xe2\x96\x81";  // U+2581, SentencePiece's word boundary
  int n_pieces = 0;
  auto add_piece = [&](std::string piece) {
    if (static_cast<int>(tokens.size()) < n_vocab) add(std::move(piece), -static_cast<float>(n_pieces++), k_token_normal);
  };
  add_piece(space);
  std::string word;
  for (std::size_t len = 1; static_cast<int>(tokens.size()) < n_vocab; ++len) {
    word.assign(len, 'a');
    while (static_cast<int>(tokens.size()) < n_vocab) {
      add_piece(space + word);
      add_piece(word);
      // Next word of this length in lexicographic order; stop after "zz..z".
      std::size_t i = len;
      while (i > 0 && word[i - 1] == 'z') word[--i] = 'a';
      if (i == 0) break;
      ++word[i - 1];
    }
  }
  w.add_string("tokenizer.ggml.model", "llama");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_array("tokenizer.ggml.scores", scores);
  w.add_array("tokenizer.ggml.token_type", types);
  w.add_u32("tokenizer.ggml.unknown_token_id", 0);
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  w.add_bool("tokenizer.ggml.add_bos_token", true);
  w.add_bool("tokenizer.ggml.add_eos_token", false);
}

// Builds the writer for a resolved shape; tensor data is produced on write.
std::unique_ptr<gguf::writer> build_writer(const synth_shape& s, const synth_options& o,
                                           std::shared_ptr<thread_pool> pool) {
  auto w = std::make_unique<gguf::writer>(3);
  const std::string arch = s.arch;
  auto key = [&](const char* suffix) { return arch + "." + suffix; };
  w->add_string("general.architecture", arch);
  w->add_string("general.name", fmt::format("{} (synthetic)", s.name));
  w->set_alignment(32);
  w->add_u32("general.file_type", file_type_of(o.weight_type, o.mix));
  w->add_u32(key("vocab_size"), static_cast<std::uint32_t>(s.n_vocab));
  w->add_u32(key("context_length"), static_cast<std::uint32_t>(s.n_ctx));
  w->add_u32(key("embedding_length"), static_cast<std::uint32_t>(s.n_embd));
  w->add_u32(key("block_count"), static_cast<std::uint32_t>(s.n_layer));
  w->add_u32(key("feed_forward_length"), static_cast<std::uint32_t>(s.n_ff));
  w->add_u32(key("rope.dimension_count"), static_cast<std::uint32_t>(s.head_dim));
  w->add_u32(key("attention.head_count"), static_cast<std::uint32_t>(s.n_head));
  w->add_u32(key("attention.head_count_kv"), static_cast<std::uint32_t>(s.n_head_kv));
  if (s.head_dim * s.n_head != s.n_embd) {
    w->add_u32(key("attention.key_length"), static_cast<std::uint32_t>(s.head_dim));
    w->add_u32(key("attention.value_length"), static_cast<std::uint32_t>(s.head_dim));
  }
  w->add_f32(key("attention.layer_norm_rms_epsilon"), s.rms_eps);
  w->add_f32(key("rope.freq_base"), s.rope_base);
  if (s.sliding_window > 0) w->add_u32(key("attention.sliding_window"), static_cast<std::uint32_t>(s.sliding_window));
  if (s.swa_pattern > 0) w->add_u32(key("attention.sliding_window_pattern"), static_cast<std::uint32_t>(s.swa_pattern));
  if (s.attn_softcap > 0) w->add_f32(key("attn_logit_softcapping"), s.attn_softcap);
  if (s.final_softcap > 0) w->add_f32(key("final_logit_softcapping"), s.final_softcap);
  if (s.rope_base_swa > 0) w->add_f32(key("rope.freq_base_swa"), s.rope_base_swa);
  if (s.yarn_factor > 0) {
    w->add_string(key("rope.scaling.type"), "yarn");
    w->add_f32(key("rope.scaling.factor"), s.yarn_factor);
    w->add_u32(key("rope.scaling.original_context_length"), static_cast<std::uint32_t>(s.yarn_n_ctx_orig));
  }
  if (s.n_expert > 0) {
    w->add_u32(key("expert_count"), static_cast<std::uint32_t>(s.n_expert));
    w->add_u32(key("expert_used_count"), static_cast<std::uint32_t>(s.n_expert_used));
    w->add_u32(key("expert_feed_forward_length"), static_cast<std::uint32_t>(s.n_ff_exp));
  }
  add_vocabulary(*w, s.n_vocab);
  std::vector<int> kv_source;  // empty: every layer its own KV
  if (o.cla > 1) kv_source = cla_sources(s.n_layer, o.cla);
  if (o.yoco) kv_source = yoco_sources(s.n_layer);
  if (!kv_source.empty()) w->add_array(k_kv_source_key, std::vector<std::int32_t>(kv_source.begin(), kv_source.end()));
  // l: the block being written, -1 before the first (embeddings, output).
  const auto shares_kv = [&](int l) { return l >= 0 && !kv_source.empty() && kv_source[static_cast<std::size_t>(l)] != l; };

  std::uint64_t id = 0;
  const std::int64_t q_dim = static_cast<std::int64_t>(s.n_head) * s.head_dim;
  const std::int64_t kv_dim = static_cast<std::int64_t>(s.n_head_kv) * s.head_dim;
  int layer = -1;  // the block being written
  // n_mat > 1: a 3-D tensor of that many matrices (experts).
  // A layer that reads another's KV has no K/V tensors; their ids are
  // skipped, so every other tensor keeps the unshared file's weights.
  auto matrix = [&](const std::string& name, std::int64_t n_in, std::int64_t n_out, float amplitude, int n_mat = 1) {
    if (shares_kv(layer) && (name.ends_with("attn_k.weight") || name.ends_with("attn_v.weight"))) {
      ++id;
      return;
    }
    const std::int64_t ne[] = {n_in, n_out, n_mat};
    const tensor_type t = synth_matrix_type(s, o, name, layer);
    w->add_tensor(name, t, std::span<const std::int64_t>(ne, n_mat > 1 ? 3 : 2),
                  make_fill({o.seed, id++, t, n_in, amplitude, 0}, pool));
  };
  auto vector = [&](const std::string& name, std::int64_t n, float amplitude, float constant) {
    if (shares_kv(layer) && (name.ends_with("attn_k_norm.weight") || name.ends_with("attn_k.bias") ||
                             name.ends_with("attn_v.bias"))) {
      ++id;
      return;
    }
    const std::int64_t ne[] = {n};
    w->add_tensor(name, tensor_type::f32, ne, make_fill({o.seed, id++, tensor_type::f32, n, amplitude, constant}, pool));
  };
  auto bias_table = [&](const std::string& name, std::int64_t n, std::int64_t rows) {
    const std::int64_t ne[] = {n, rows};
    w->add_tensor(name, tensor_type::f32, ne, make_fill({o.seed, id++, tensor_type::f32, n, 0.1f, 0}, pool));
  };
  // Uniform on [-a, a) has standard deviation a / sqrt(3).
  auto amplitude_for = [](std::int64_t n_in) { return static_cast<float>(std::sqrt(3.0 / static_cast<double>(n_in))); };

  // Gemma files tie the output to the embeddings (and scale the embeddings
  // by sqrt(n_embd) in the forward pass, so their rows are small).
  const bool gemma = s.post_norms;
  matrix("token_embd.weight", s.n_embd, s.n_vocab, gemma ? amplitude_for(s.n_embd) : std::sqrt(3.0f));
  vector("output_norm.weight", s.n_embd, 0, 1.0f);
  if (!gemma) matrix("output.weight", s.n_embd, s.n_vocab, amplitude_for(s.n_embd));
  for (int l = 0; l < s.n_layer; ++l) {
    layer = l;
    const std::string p = fmt::format("blk.{}.", l);
    vector(p + "attn_norm.weight", s.n_embd, 0, 1.0f);
    if (s.fused) {
      matrix(p + "attn_qkv.weight", s.n_embd, q_dim + 2 * kv_dim, amplitude_for(s.n_embd));
    } else {
      matrix(p + "attn_q.weight", s.n_embd, q_dim, amplitude_for(s.n_embd));
      matrix(p + "attn_k.weight", s.n_embd, kv_dim, amplitude_for(s.n_embd));
      matrix(p + "attn_v.weight", s.n_embd, kv_dim, amplitude_for(s.n_embd));
    }
    if (s.qk_norm) {
      vector(p + "attn_q_norm.weight", s.head_dim, 0, 1.0f);
      vector(p + "attn_k_norm.weight", s.head_dim, 0, 1.0f);
    }
    if (s.qkv_bias) {
      vector(p + "attn_q.bias", q_dim, 0.02f, 0);
      vector(p + "attn_k.bias", kv_dim, 0.02f, 0);
      vector(p + "attn_v.bias", kv_dim, 0.02f, 0);
    }
    matrix(p + "attn_output.weight", q_dim, s.n_embd, amplitude_for(q_dim));
    if (s.gpt_oss_parts) {
      vector(p + "attn_output.bias", s.n_embd, 0.1f, 0);
      // Sink logits of the order of the scores, so they take a real share.
      vector(p + "attn_sinks.weight", s.n_head, 2.0f, 0);
    }
    // gpt-oss's FFN input norm has gemma's post-attention norm's name.
    if (s.post_norms || s.gpt_oss_parts) vector(p + "post_attention_norm.weight", s.n_embd, 0, 1.0f);
    if (!s.gpt_oss_parts) vector(p + "ffn_norm.weight", s.n_embd, 0, 1.0f);
    if (s.n_expert > 0) {
      matrix(p + "ffn_gate_inp.weight", s.n_embd, s.n_expert, amplitude_for(s.n_embd));
      matrix(p + "ffn_gate_exps.weight", s.n_embd, s.n_ff_exp, amplitude_for(s.n_embd), s.n_expert);
      matrix(p + "ffn_up_exps.weight", s.n_embd, s.n_ff_exp, amplitude_for(s.n_embd), s.n_expert);
      matrix(p + "ffn_down_exps.weight", s.n_ff_exp, s.n_embd, amplitude_for(s.n_ff_exp), s.n_expert);
      if (s.gpt_oss_parts) {  // [n_expert] and [n_expert][width] (ggml ne = [width, n_expert])
        vector(p + "ffn_gate_inp.bias", s.n_expert, 0.5f, 0);
        bias_table(p + "ffn_gate_exps.bias", s.n_ff_exp, s.n_expert);
        bias_table(p + "ffn_up_exps.bias", s.n_ff_exp, s.n_expert);
        bias_table(p + "ffn_down_exps.bias", s.n_embd, s.n_expert);
      }
      continue;
    }
    if (s.fused) {
      matrix(p + "ffn_up.weight", s.n_embd, 2 * static_cast<std::int64_t>(s.n_ff), amplitude_for(s.n_embd));
    } else {
      matrix(p + "ffn_gate.weight", s.n_embd, s.n_ff, amplitude_for(s.n_embd));
      matrix(p + "ffn_up.weight", s.n_embd, s.n_ff, amplitude_for(s.n_embd));
    }
    matrix(p + "ffn_down.weight", s.n_ff, s.n_embd, amplitude_for(s.n_ff));
    if (s.post_norms) vector(p + "post_ffw_norm.weight", s.n_embd, 0, 1.0f);
  }
  return w;
}

}  // namespace

std::span<const synth_shape> synth_presets() { return k_presets; }

const synth_shape* find_synth_preset(std::string_view name) {
  for (const auto& p : k_presets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

namespace {

std::string writable_type_names() {
  std::string names;
  for (tensor_type t : k_writable_types) names += fmt::format("{}{}", names.empty() ? "" : ", ", gguf::tensor_type_name(t));
  return names;
}

bool same_ignoring_case(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

}  // namespace

result<tensor_type> parse_synth_weight_type(std::string_view name) {
  for (tensor_type t : k_writable_types)
    if (same_ignoring_case(name, gguf::tensor_type_name(t))) return t;
  return error(errc::invalid_argument, "unknown weight type '{}' ({})", name, writable_type_names());
}

result<synth_weights> parse_synth_weights(std::string_view name) {
  if (same_ignoring_case(name, "q4_k_m")) return synth_weights{tensor_type::q4_k, synth_mix::q4_k_m};
  if (same_ignoring_case(name, "q5_k_m")) return synth_weights{tensor_type::q5_k, synth_mix::q5_k_m};
  if (same_ignoring_case(name, "mxfp4_moe")) return synth_weights{tensor_type::mxfp4, synth_mix::mxfp4_moe};
  auto t = parse_synth_weight_type(name);
  if (!t.ok()) return error(errc::invalid_argument, "{}, or a mix: Q4_K_M, Q5_K_M, MXFP4_MOE", t.error().message());
  return synth_weights{*t, synth_mix::none};
}

tensor_type synth_matrix_type(const synth_shape& s, const synth_options& o, std::string_view name, int layer) {
  if (name.ends_with("ffn_gate_inp.weight")) return tensor_type::f32;  // the router: never quantized
  if (o.mix == synth_mix::none) return o.weight_type;
  if (o.mix == synth_mix::mxfp4_moe) return name.find("_exps.") != std::string_view::npos ? tensor_type::mxfp4 : tensor_type::q8_0;
  const bool q4 = o.mix == synth_mix::q4_k_m;
  const tensor_type base = q4 ? tensor_type::q4_k : tensor_type::q5_k;
  // llama.cpp's use_more_bits: the first and last eighth of the layers and
  // every third layer between them.
  const int n = s.n_layer;
  const bool more_bits = layer >= 0 && (layer < n / 8 || layer >= 7 * n / 8 || (layer - n / 8) % 3 == 2);
  auto is = [&](std::string_view suffix) {
    return name.size() >= suffix.size() && name.substr(name.size() - suffix.size()) == suffix;
  };
  // Gemma files tie the output to the embeddings (build_writer): the embeddings
  // then take the output's type.
  const bool tied = s.post_norms;
  if (name == "output.weight" || (tied && name == "token_embd.weight")) return tensor_type::q6_k;
  // llama-quantize's rules for 8-expert models (Mixtral) come first.
  const bool eight_experts = s.n_expert == 8;
  if (eight_experts && (is("attn_v.weight") || is("attn_k.weight"))) return tensor_type::q8_0;
  if (eight_experts && q4 && is("attn_output.weight")) return tensor_type::q5_k;
  if (is("attn_v.weight")) {
    if (more_bits) return tensor_type::q6_k;
    const bool llama_70b = std::string_view(s.arch) == "llama" && n == 80 && s.n_head != s.n_head_kv;
    return llama_70b && q4 ? tensor_type::q5_k : base;
  }
  if (is("ffn_down.weight") || is("ffn_down_exps.weight")) return more_bits ? tensor_type::q6_k : base;
  if (is("attn_qkv.weight")) return q4 ? tensor_type::q5_k : tensor_type::q6_k;
  return base;
}

result<synth_shape> resolve_synth_shape(const synth_options& o) {
  const synth_shape* preset = find_synth_preset(o.preset);
  if (!preset) {
    std::string names;
    for (const auto& p : k_presets) names += fmt::format("{}{}", names.empty() ? "" : ", ", p.name);
    return error(errc::invalid_argument, "unknown synth preset '{}' (known: {})", o.preset, names);
  }
  synth_shape s = *preset;
  if (o.n_layer) s.n_layer = *o.n_layer;
  if (o.n_ff) (s.n_expert > 0 ? s.n_ff_exp : s.n_ff) = *o.n_ff;
  if (o.n_ctx) s.n_ctx = *o.n_ctx;
  if (o.n_vocab != 0) s.n_vocab = o.n_vocab;

  if (s.n_layer < 1 || s.n_layer > 1024) return error(errc::invalid_argument, "layers {} not in 1..1024", s.n_layer);
  if (s.n_ff < 1) return error(errc::invalid_argument, "feed-forward width {} must be positive", s.n_ff);
  if (s.n_expert > 0 && (s.n_ff_exp < 1 || s.n_expert_used < 1 || s.n_expert_used > s.n_expert))
    return error(errc::invalid_argument, "expert width {} and {} of {} experts per token are not valid", s.n_ff_exp,
                 s.n_expert_used, s.n_expert);
  if (s.n_ctx < 1) return error(errc::invalid_argument, "context length {} must be positive", s.n_ctx);
  if (o.cla < 0 || o.cla == 1 || o.cla > s.n_layer || (o.cla > 1 && o.yoco))
    return error(errc::invalid_argument, "--cla {}{}: groups of 2 to {} layers, and not with --yoco", o.cla,
                 o.yoco ? " --yoco" : "", s.n_layer);
  if (o.yoco && s.n_layer < 2) return error(errc::invalid_argument, "--yoco needs at least 2 layers");
  if ((o.cla > 1 || o.yoco) && (s.fused || s.swa_pattern > 0 || s.sliding_window > 0 || s.rope_base_swa > 0))
    return error(errc::invalid_argument,
                 "--cla/--yoco: preset {} has fused Q/K/V or sliding-window layers; share KV on a llama-like preset",
                 s.name);
  if (s.n_vocab < k_min_vocab) {
    return error(errc::invalid_argument, "vocabulary size {} is below the minimum {} (3 specials, 256 bytes, 1 piece)",
                 s.n_vocab, k_min_vocab);
  }
  // A mix's every type works on super-blocks of 256, as its base does.
  const tensor_type checked = o.mix == synth_mix::none        ? o.weight_type
                              : o.mix == synth_mix::mxfp4_moe ? tensor_type::q8_0
                                                              : tensor_type::q4_k;
  const auto* traits = gguf::get_tensor_type_traits(static_cast<std::uint32_t>(checked));
  if (!traits || std::find(std::begin(k_writable_types), std::end(k_writable_types), checked) ==
                     std::end(k_writable_types)) {
    return error(errc::invalid_argument, "synth cannot write weight type {} (it writes {})",
                 gguf::tensor_type_name(checked), writable_type_names());
  }
  const std::int64_t block = traits->block_size;
  const std::int64_t q_dim = static_cast<std::int64_t>(s.n_head) * s.head_dim;
  for (auto [what, n] : {std::pair{"embedding width", static_cast<std::int64_t>(s.n_embd)},
                         std::pair{"attention width", q_dim},
                         std::pair{"feed-forward width", static_cast<std::int64_t>(s.n_expert > 0 ? s.n_ff_exp : s.n_ff)}}) {
    if (n % block != 0) {
      return error(errc::invalid_argument, "{} {} is not a multiple of the {} block size {}", what, n, traits->name,
                   block);
    }
  }
  return s;
}

result<std::uint64_t> synth_model_size_bytes(const synth_options& o) {
  PAGODA_ASSIGN_OR_RETURN(synth_shape s, resolve_synth_shape(o));
  // Laying out does not generate weights: one thread is enough.
  return static_cast<std::uint64_t>(build_writer(s, o, std::make_shared<thread_pool>(1))->layout().size_bytes);
}

status write_synth_model(const synth_options& o, const std::string& path) {
  PAGODA_ASSIGN_OR_RETURN(synth_shape s, resolve_synth_shape(o));
  return build_writer(s, o, std::make_shared<thread_pool>(o.n_threads))->write_file(path).with_context(fmt::format("synth {}", s.name));
}

}  // namespace pagoda
