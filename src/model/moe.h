// Mixture-of-experts FFN (qwen3moe, gpt-oss): a router scores every expert
// for each token, the token goes through the n_expert_used experts with the
// largest scores, and its FFN output is the weighted sum of their gated FFNs.
// Semantics are llama.cpp's build_moe_ffn as qwen3moe and gpt-oss call it
// (src/llama-graph.cpp, src/models/qwen3moe.cpp, src/models/openai-moe.cpp):
//
//   l       = router · x (+ router bias, gpt-oss)
//   softmax gating (qwen3moe):
//     p     = softmax(l)                                  over all n_expert
//     top   = the n_expert_used largest p (descending; lowest id first on ties)
//     w_j   = p_top[j] / max(sum_j p_top[j], 2^-14)       when weights are normalised
//   softmax_weight gating (gpt-oss):
//     top   = the n_expert_used largest l (as above)
//     w_j   = softmax(l_top)[j]                            (not renormalised again)
//   w_j    *= weights_scale                               when it is not 0 or 1
//   out     = sum_j w_j · (down_e(act(gate_e x + bg_e, up_e x + bu_e)) + bd_e)
//             for e = top[j], in order j; act is silu(g) * u (qwen3moe) or
//             gpt-oss's clamped swiglu_oai (model/vec_ops.h); the b are the
//             experts' biases (gpt-oss), absent elsewhere.
//
// Experts are the slices of 3-D GGUF tensors ([n_in, n_out, n_expert] in
// ggml order), read in place in their stored format.
//
// Batching: within a step the rows routed to each expert, across every
// sequence and prompt token, are gathered and go through one matrix product
// per active expert (each active expert's weights are read once per step),
// then scattered back, weighted. Matrix products keep rows independent
// (model/matmul.h), so a token's output does not depend on what shares its
// step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/thread_pool.h"
#include "model/matmul.h"

namespace pagoda {

enum class moe_gating : std::uint8_t { softmax, softmax_weight };
enum class moe_activation : std::uint8_t { silu, swiglu_oai };

// A model's mixture-of-experts hyper-parameters; n_expert 0 means a dense FFN.
struct moe_config {
  int n_expert = 0;             // <arch>.expert_count
  int n_expert_used = 0;        // <arch>.expert_used_count: experts per token
  int n_ff_exp = 0;             // <arch>.expert_feed_forward_length: each expert's FFN width
  bool norm_weights = true;     // the chosen probabilities renormalised to sum 1
  float weights_scale = 1.0f;   // the weights multiplied by this after normalising
  moe_gating gating = moe_gating::softmax;
  moe_activation activation = moe_activation::silu;
};

// One 3-D tensor of expert matrices: expert e is [n_out][n_in], starting
// expert_bytes x e bytes after expert 0 (ggml's nb[2]).
struct expert_weights {
  weight_view first;  // expert 0
  std::size_t expert_bytes = 0;
  int n_expert = 0;

  // REQUIRES: 0 <= e < n_expert.
  weight_view expert(int e) const;
};

// One layer's mixture of experts.
struct moe_weights {
  weight_view router;   // ffn_gate_inp: [n_expert][n_embd]
  expert_weights gate;  // ffn_gate_exps: [n_expert][n_ff_exp][n_embd]
  expert_weights up;    // ffn_up_exps:   [n_expert][n_ff_exp][n_embd]
  expert_weights down;  // ffn_down_exps: [n_expert][n_embd][n_ff_exp]
  // Biases (gpt-oss; empty elsewhere): router [n_expert], gate and up
  // [n_expert][n_ff_exp], down [n_expert][n_embd].
  std::vector<float> router_bias, gate_bias, up_bias, down_bias;
  bool empty() const { return router.data == nullptr; }
};

// Routes n_tok tokens from their router logits [n_tok][n_expert] (biased
// already): experts [n_tok][n_expert_used] (descending score) and their
// weights, as above.
void moe_route(const moe_config& c, const float* logits, int n_tok, std::int32_t* experts, float* weights);

// Reusable buffers of moe_ffn; they grow to the largest step and stay.
struct moe_scratch {
  std::vector<float> logits;           // [n_tok][n_expert]
  std::vector<std::int32_t> experts;   // [n_tok][n_expert_used]
  std::vector<float> weights;          // [n_tok][n_expert_used]
  std::vector<std::int32_t> offset;    // [n_expert + 1]: expert e's rows are offset[e] .. offset[e + 1]
  std::vector<std::int32_t> row_of;    // [n_tok][n_expert_used]: the gathered row of (token, j)
  std::vector<std::int32_t> cursor;    // [n_expert]: the next free row of each expert while grouping
  aligned_buffer xg;                   // [routed rows][n_embd]: inputs, then the experts' outputs
  aligned_buffer g, u;                 // [routed rows][n_ff_exp]
  std::int64_t expert_runs = 0;        // expert FFNs run so far (one per active expert per step and layer)
};

// out[n_tok][n_embd] = the layer's MoE FFN of xn[n_tok][n_embd]. Returns how
// many experts were active (each ran once, over all its rows).
// REQUIRES: c.n_expert > 0, w loaded for c; out does not overlap xn; not
// called from inside a job of `pool`.
int moe_ffn(const moe_config& c, const moe_weights& w, const float* xn, int n_tok, float* out, thread_pool& pool,
            matmul_scratch& mm, moe_scratch& s);

// Plain reference twin: token by token, every expert product through
// matmul_ref (f64 sums, the same activation quantization), sums in double.
void moe_ffn_ref(const moe_config& c, const moe_weights& w, const float* xn, int n_tok, float* out);

}  // namespace pagoda
