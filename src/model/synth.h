// Synthetic models: random-weight GGUF files with the exact attention and MLP
// shapes of real models, for throughput and memory work at realistic sizes.
// Their output means nothing; their speed and memory use do.
//
// A file carries llama.cpp's tensor names and metadata keys for its
// architecture (llama, with an optional sliding window; qwen2 with QKV
// biases; qwen3 with Q/K norms; gemma2 and gemma3 with post-norms, soft-capping,
// sliding-window layers and gemma3's Q/K norms; phi3 with fused QKV and
// gate/up projections; qwen3moe with a router and 3-D expert tensors; gpt-oss
// with biases everywhere, attention sinks, alternating windows and YaRN) and a synthetic
// SentencePiece-style ("llama") vocabulary so it tokenizes and runs end to end:
// <unk> <s> </s>, the 256 byte tokens <0x00>..<0xFF>, then plain pieces.
// Weights are deterministic in (seed, tensor, row), uniform with standard
// deviation 1/sqrt(n_in) so activations stay finite; norms are 1 and stay F32.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "model/gguf.h"
#include "pagoda/status.h"

namespace pagoda {

// The shape of a model. Dimensions follow llama.cpp: n_embd is the residual
// width, each of n_head query heads and n_head_kv key/value heads is head_dim wide.
struct synth_shape {
  const char* name = "";     // preset name
  const char* arch = "llama";  // llama, qwen2, qwen3, gemma2, gemma3, phi3, qwen3moe or gpt-oss
  int n_embd = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;
  int n_ff = 0;
  int n_layer = 0;
  int n_ctx = 0;
  int n_vocab = 0;           // the real model's vocabulary size
  float rope_base = 10000.0f;
  float rms_eps = 1e-5f;
  bool qkv_bias = false;     // qwen2: attn_q/k/v biases
  // The architecture's other parts, written when set (their keys and tensors
  // are what llama.cpp reads; see model/llama.h).
  bool qk_norm = false;          // qwen3, gemma3: attn_q_norm / attn_k_norm [head_dim]
  bool post_norms = false;       // gemma: post_attention_norm, post_ffw_norm
  bool fused = false;            // phi3: attn_qkv and a [gate | up] ffn_up, no ffn_gate
  int sliding_window = 0;        // <arch>.attention.sliding_window (0: none)
  int swa_pattern = 0;           // <arch>.attention.sliding_window_pattern (0: not written)
  float attn_softcap = 0.0f;     // gemma2.attn_logit_softcapping (0: not written)
  float final_softcap = 0.0f;    // <arch>.final_logit_softcapping (0: not written)
  float rope_base_swa = 0.0f;    // <arch>.rope.freq_base_swa (0: not written)
  // Mixture of experts (qwen3moe): when n_expert > 0, every layer's FFN is a
  // router (ffn_gate_inp, F32 as llama-quantize leaves it) and experts
  // (ffn_{gate,up,down}_exps) of width n_ff_exp; n_ff is only the metadata key.
  int n_expert = 0;              // <arch>.expert_count
  int n_expert_used = 0;         // <arch>.expert_used_count
  int n_ff_exp = 0;              // <arch>.expert_feed_forward_length
  // gpt-oss: attention output bias and sinks, router and expert biases, the
  // FFN input norm named post_attention_norm (with qkv_bias and a window).
  bool gpt_oss_parts = false;
  // YaRN RoPE scaling written to the metadata (0: none).
  float yarn_factor = 0.0f;      // <arch>.rope.scaling.factor, with type yarn
  int yarn_n_ctx_orig = 0;       // <arch>.rope.scaling.original_context_length
};

// Every preset: llama3-8b, llama3-70b, mistral-7b, mistral-7b-v0.1 (with its
// 4096-token sliding window), qwen2-7b, qwen3-8b, gemma2-9b, gemma3-4b,
// phi3-mini, smollm2-135m (SmolVLM-256M's text model), qwen3-30b-a3b (128
// experts, 8 per token), gpt-oss-20b (32 experts, 4 per token, a window of
// 128 on every other layer), tiny (a small llama
// for tests and smoke runs), tiny256 (the same with rows of 256 and 512, so
// the super-block formats q4_K and q6_K fit), and tiny-qwen3, tiny-gemma2,
// tiny-gemma3, tiny-phi3, tiny-qwen3moe (small models of those architectures,
// with windows of 8 positions on the gemma ones; tiny-qwen3moe has 8 experts,
// 2 per token, and rows of 256 for the super-block formats; tiny-gpt-oss has
// 8 experts, 2 per token, a window of 8, rows of 128 and no YaRN).
std::span<const synth_shape> synth_presets();
// nullptr when no preset has that name.
const synth_shape* find_synth_preset(std::string_view name);

// llama-quantize's per-tensor mixes (llama_ftype), with the types its rules
// (llama.cpp's src/llama-quant.cpp, llama_tensor_get_type) pick for the
// tensors synth writes, on a dense model without an importance matrix:
//   Q4_K_M: q4_K, except q6_K for output.weight (token_embd.weight when the
//           output is tied) and for attn_v and ffn_down of the layers i where
//           i < n/8, i >= 7n/8 or (i - n/8) % 3 == 2 (n layers); a fused
//           attn_qkv is q5_K; on a 70B llama (80 layers, GQA) the other attn_v
//           are q5_K.
//   Q5_K_M: the same with q5_K for q4_K, and a fused attn_qkv in q6_K.
// Mixtures of experts: ffn_down_exps follows ffn_down's rule, the router
// (ffn_gate_inp) stays F32 in every file (llama-quantize never quantizes it),
// and with exactly 8 experts attn_k and attn_v are q8_0 and, in Q4_K_M,
// attn_output q5_K.
// Every row must be a multiple of 256 (llama-quantize would fall back to
// block-32 types there; synth refuses instead).
//   MXFP4_MOE: experts (3-D tensors) mxfp4, every other matrix q8_0 (the
//           router stays F32), as llama-quantize's MXFP4_MOE (gpt-oss files).
enum class synth_mix : std::uint8_t { none, q4_k_m, q5_k_m, mxfp4_moe };

struct synth_options {
  std::string preset = "llama3-8b";
  std::optional<int> n_layer;  // fewer (or more) layers than the preset
  std::optional<int> n_ff;     // a different feed-forward width (each expert's on MoE presets)
  std::optional<int> n_ctx;    // context length written to the metadata
  // Vocabulary size; 0 means the preset's real one. At least 260 (specials,
  // 256 byte tokens, one piece).
  int n_vocab = 512;
  // Matrix type: f16, q8_0, q4_0, q4_K, q5_K or q6_K (f32 and bf16 also work).
  // Norms and biases stay F32. The K types use simple min/max quantizers (valid
  // files, not llama-quantize's bytes) and need rows that are multiples of 256.
  gguf::tensor_type weight_type = gguf::tensor_type::q8_0;
  // A mix instead of one type for every matrix (weight_type is then ignored).
  synth_mix mix = synth_mix::none;
  std::uint64_t seed = 42;
  // Cross-layer KV sharing declared in the file (model/kv_share.h,
  // pagoda.kv_source_layers): cla > 1, groups of that many adjacent layers
  // read their first layer's KV (the others have no K/V projections); yoco,
  // the upper half reads the KV of the middle layer. The other weights are
  // those of the same file without sharing.
  int cla = 0;
  bool yoco = false;
  // Threads generating weights; <= 0 means every hardware thread. The file is
  // the same for any thread count.
  int n_threads = 0;
};

// "f16", "q8_0", "q4_0", "q4_K", "q5_K", "q6_K", "f32", "bf16" (any case) ->
// the tensor type; errc::invalid_argument otherwise.
result<gguf::tensor_type> parse_synth_weight_type(std::string_view name);

// What --weight-type names: one tensor type, or a mix ("Q4_K_M", "Q5_K_M", any case).
struct synth_weights {
  gguf::tensor_type type = gguf::tensor_type::q8_0;
  synth_mix mix = synth_mix::none;
};
result<synth_weights> parse_synth_weights(std::string_view name);

// The type synth writes for matrix `name` (e.g. "blk.3.attn_v.weight"; layer
// its block index, -1 outside blocks) of a resolved shape under the options.
gguf::tensor_type synth_matrix_type(const synth_shape& s, const synth_options& o, std::string_view name, int layer);

// The preset with the options' overrides applied, validated (unknown preset,
// non-positive sizes, rows that the weight type's block size does not divide,
// n_head not a multiple of n_head_kv are errc::invalid_argument).
result<synth_shape> resolve_synth_shape(const synth_options& options);

// Bytes the file will have (for progress and disk-space checks).
result<std::uint64_t> synth_model_size_bytes(const synth_options& options);

// Writes the model to `path`, streaming tensor data (never the whole model in
// memory), through a temporary file renamed into place on success.
status write_synth_model(const synth_options& options, const std::string& path);

}  // namespace pagoda
