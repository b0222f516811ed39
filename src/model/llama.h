// The Llama-family models: hyper-parameters and weights from GGUF, and a
// batched forward pass over a paged KV cache. One decoder block with optional
// parts covers every architecture that loads (llama.cpp's metadata keys and
// tensor names):
//   llama   (also Mistral; `llama.attention.sliding_window` puts every layer
//            under that window, which llama.cpp itself ignores)
//   qwen2   Q/K/V biases, NeoX RoPE
//   qwen3   per-head RMSNorm of Q and K before RoPE, NeoX RoPE
//   gemma2  embeddings x sqrt(n_embd), post-attention and post-FFN norms,
//           tanh-GELU, attention-logit and final-logit soft-capping,
//           alternating sliding-window and global layers
//   gemma3  as gemma2 without attention capping, with Q/K norms, a
//           sliding-window pattern and a second RoPE base for local layers
//   phi3    fused QKV and gate/up projections (read as views of the rows)
//   qwen3moe  qwen3's attention with a mixture-of-experts FFN (model/moe.h)
//   gpt-oss   Q/K/V and output biases, attention sinks (a learned logit per
//             query head), alternating sliding-window and full layers, a
//             biased router choosing by logit (softmax over the chosen),
//             biased experts with a clamped SwiGLU; the FFN's input norm is
//             the file's post_attention_norm
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attention/attention_stats.h"
#include "attention/gather_attention.h"
#include "attention/kv_selector.h"
#include "attention/paged_attention.h"
#include "core/aligned_buffer.h"
#include "core/thread_pool.h"
#include "kv/kv_backend.h"
#include "model/gguf.h"
#include "model/rope.h"
#include "model/matmul.h"
#include "model/moe.h"
#include "model/tokenizer.h"
#include "pagoda/status.h"
#include "pagoda/types.h"

namespace pagoda {

struct llama_hparams {
  std::string arch;  // llama, qwen2, qwen3, gemma2, gemma3, phi3, qwen3moe or gpt-oss
  std::string name;  // general.name, if any
  int n_vocab = 0;
  int n_embd = 0;
  int n_layer = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;
  int n_ff = 0;
  int rope_dim = 0;
  int n_ctx_train = 0;
  float rope_base = 10000.0f;
  float rms_eps = 1e-5f;
  bool rope_neox = false;  // rotate halves (qwen2) instead of adjacent pairs (llama)
  bool tied_output = false;
  bool qk_norm = false;     // qwen3, gemma3: RMSNorm over each head of Q and K
  bool post_norms = false;  // gemma: RMSNorm of the attention and FFN outputs before the residual add
  bool gelu = false;        // FFN activation: tanh-GELU (gemma) instead of SiLU
  float embd_scale = 1.0f;  // the embedding row is multiplied by this (gemma: sqrt(n_embd))
  float attn_scale = 0.0f;  // query scale before the scores (1/sqrt(head_dim) for most)
  float attn_softcap = 0.0f;   // > 0: scores s -> c tanh(s / c) (gemma2)
  float final_softcap = 0.0f;  // > 0: logits z -> c tanh(z / c)
  // RoPE scaling beyond the linear factor below (model/rope.h): YaRN and
  // Llama 3's frequency factors, the same on every layer. layer_rope_angles()
  // combines it with the layer's base and linear factor.
  rope_scaling_config rope_scaling;
  // Sliding window: a query at position p on a local layer sees keys at
  // positions p - sliding_window + 1 .. p; global layers see 0 .. p.
  int sliding_window = 0;
  std::vector<bool> swa_layer;  // [n_layer]: true for sliding-window (local) layers
  float rope_base_swa = 0.0f;   // RoPE base of local layers (gemma3); rope_base on the others
  float rope_freq_scale = 1.0f;      // linear RoPE scaling: angles of position p x this
  float rope_freq_scale_swa = 1.0f;  // the same on local layers
  // Mixture of experts (qwen3moe): every layer's FFN is routed experts;
  // moe.n_expert == 0 on the dense architectures.
  moe_config moe;
  // Cross-layer KV sharing the model declares (model/kv_share.h,
  // pagoda.kv_source_layers): [n_layer] the layer whose K/V each layer reads
  // (its own index: it computes them). Empty: every layer its own.
  std::vector<int> kv_source;
  bool reads_other_kv(int layer) const {
    return !kv_source.empty() && kv_source[static_cast<std::size_t>(layer)] != layer;
  }

  int n_rep() const { return n_head / n_head_kv; }
  int q_dim() const { return n_head * head_dim; }
  int kv_dim() const { return n_head_kv * head_dim; }
  bool is_swa(int layer) const { return sliding_window > 0 && swa_layer[layer]; }
  int n_swa_layers() const;
  float layer_rope_base(int layer) const { return is_swa(layer) ? rope_base_swa : rope_base; }
  float layer_rope_scale(int layer) const { return is_swa(layer) ? rope_freq_scale_swa : rope_freq_scale; }
  rope_angles layer_rope_angles(int layer) const {
    return rope_angles(rope_scaling, rope_dim, layer_rope_base(layer), layer_rope_scale(layer));
  }
};


struct llama_layer {
  std::vector<float> attn_norm;  // [n_embd]
  weight_view wq, wk, wv, wo;
  std::vector<float> bq, bk, bv;  // qwen2, gpt-oss (optional on the others, as llama.cpp); empty otherwise
  std::vector<float> bo;          // [n_embd] attention output bias, gpt-oss only
  std::vector<float> attn_sinks;  // [n_head] sink logits, gpt-oss only
  std::vector<float> q_norm, k_norm;  // [head_dim] qwen3/gemma3 only; empty otherwise
  std::vector<float> post_attn_norm;  // [n_embd] gemma only; empty otherwise
  std::vector<float> ffn_norm;    // [n_embd]
  weight_view w_gate, w_up, w_down;
  std::vector<float> post_ffn_norm;  // [n_embd] gemma only; empty otherwise
  moe_weights moe;  // qwen3moe: router and experts instead of w_gate/w_up/w_down; empty otherwise
};

class llama_model {
 public:
  // Loads and validates a GGUF model: required keys, every tensor's presence,
  // shape and type against the architecture, and the tokenizer.
  static result<std::unique_ptr<llama_model>> load(const std::string& path, gguf::open_options options = {});
  static result<std::unique_ptr<llama_model>> from_gguf(std::unique_ptr<gguf::file> file);

  const llama_hparams& hparams() const { return hp_; }
  const tokenizer& vocab() const { return *tokenizer_; }
  const gguf::file& gguf() const { return *file_; }
  std::int64_t n_params() const { return n_params_; }
  // Parameters one token computes with: all but the experts it is not routed
  // to (MoE); n_params() on dense models.
  std::int64_t n_active_params() const;

  const weight_view& token_embd() const { return token_embd_; }
  const weight_view& output() const { return output_; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  const std::vector<llama_layer>& layers() const { return layers_; }

 private:
  llama_model() = default;
  std::unique_ptr<gguf::file> file_;
  std::unique_ptr<tokenizer> tokenizer_;
  llama_hparams hp_;
  weight_view token_embd_;
  weight_view output_;
  std::vector<float> output_norm_;
  std::vector<llama_layer> layers_;
  std::int64_t n_params_ = 0;
};

// One sequence's share of a forward step.
struct forward_seq {
  std::span<const token_id> tokens;  // new tokens; their K/V go to KV slots n_stored ..
  // [tokens]: the position of each new token (its RoPE angle and what it may
  // see). Empty: n_stored, n_stored + 1, ...
  std::span<const std::int32_t> positions;
  int n_stored = 0;                  // KV slots of this sequence already stored
  // [n_stored]: the position each stored slot was computed at. Empty: its slot number.
  std::span<const std::int32_t> stored_positions;
  std::span<const block_id> blocks;  // block table covering n_stored + tokens.size() slots
  // Per KV group (kv_backend::layer_group), the table of that group's layers;
  // empty: `blocks` serves every layer (a backend of one group). A sliding
  // window's tables may start with NULL entries, which nothing reads.
  std::span<const std::span<const block_id>> tables;
  bool all_logits = false;           // logits for every new token (scoring) or only the last
  // Each new token's attention reads the cache as a one-token step at its
  // slot would (a verification step, whose rows must be plain decoding's): a
  // row before a block's last slot reads a sealed format's block staged in
  // f16 (the backend holds it, kv_backend.h "Tentative slots"), the row at
  // its last slot reads the codes. Without it a chunk's rows all read the
  // cache as the chunk leaves it. With a selector each row selects its own
  // reads; with stats each row adds only to its own window row (the
  // accumulated sums stay zero: every row the caller counts needs a window
  // row, stats_window >= tokens.size()).
  bool rows_as_steps = false;
  // Optional: the step's attention statistics of this sequence, reset to
  // [layers][kv heads][n_stored + tokens] with a window of stats_window rows.
  attention_stats* stats = nullptr;
  int stats_window = 0;
  // Optional: rows with positions of their own (a per-head KV policy): row
  // r = layer * n_kv_heads + head, row_positions[r * row_stride + slot] for
  // every slot (stored, then new). Null: stored_positions / positions for all.
  const std::int32_t* row_positions = nullptr;
  std::size_t row_stride = 0;
  // Optional: a sparse-read selector; `sparse` is set when it chose to read
  // less than everything for some (layer, head). It is asked for the layers
  // without a sliding window: a windowed layer reads its window, already bounded.
  kv_read_selector* selector = nullptr;
  bool* sparse = nullptr;
  // Optional: what the step's attention read of this sequence's KV against
  // what it could see, added here (kv_selector.h, kv_read_counts); rows that
  // rewrite slots in place are not counted.
  kv_read_counts* reads = nullptr;
  // In place (CacheBlend's recompute): [tokens] the stored slots the new
  // tokens rewrite, increasing, each < n_stored; the step adds no slot. Each
  // row reads every stored slot at or before its position (rewritten ones as
  // this step writes them), so the others are read as they are. Only for KV
  // formats that encode each token alone, without stats, selector, per-row
  // positions or rows_as_steps. Empty: the new tokens go to n_stored ...
  std::span<const std::int32_t> slots;
  // Optional: [tokens][n_embd] rows that stand in for the new tokens' embeddings
  // (an image's, vision/vision_encoder.h), taken as they are: no embedding
  // scale. The token ids then only count the rows (any id in the vocabulary).
  std::span<const float> embeddings;
  // Optional with embeddings: [tokens] 1 where its row stands in, 0 where the
  // token's own embedding does (a prompt chunk that holds part of an image);
  // empty: every row stands in.
  std::span<const std::uint8_t> embedded;
  // Optional: [tokens] the highest position each new token sees (its own for
  // causal attention; a bidirectional image span's last for its tokens,
  // llama.cpp's non-causal decode of Gemma 3 images). Every slot at a position
  // up to it must be stored or among this step's tokens. Not with slots or
  // rows_as_steps. Empty: causal (each token sees up to its own position).
  std::span<const std::int32_t> see_until;

  // Tokens at consecutive positions right after n_stored stored slots (whose
  // positions are their slot numbers): a sequence nothing was dropped from.
  static forward_seq consecutive(std::span<const token_id> tokens, int n_stored, std::span<const block_id> blocks,
                                 bool all_logits) {
    forward_seq f;
    f.tokens = tokens;
    f.n_stored = n_stored;
    f.blocks = blocks;
    f.all_logits = all_logits;
    return f;
  }
};

// Scratch and threads for forward passes of one model over one KV backend.
class llama_context {
 public:
  llama_context(const llama_model& model, kv_backend& kv, int n_threads);

  // Runs one step for all seqs at once (weights read once per step). Writes K/V
  // of every new token, then fills logits: for each seq in order, one row per
  // new token if all_logits, else one row for its last token; [rows][n_vocab].
  // n_layers > 0: only the first n_layers layers run (and write K/V), then the
  // final norm and the output head (an early-exit draft); 0: every layer.
  // kv_only: the last layer run stops once its K/V are written (no attention,
  // FFN or output head; logits come back empty): what chunk reuse's selection
  // pass needs of the layer it compares (cpu_runner_blend.cpp).
  status forward(std::span<const forward_seq> seqs, std::vector<float>& logits, int n_layers = 0,
                 bool kv_only = false);

  const llama_model& model() const { return model_; }
  kv_backend& kv() { return kv_; }
  const kv_backend& kv() const { return kv_; }
  thread_pool& pool() { return pool_; }
  // Expert FFNs run so far (MoE models): one per active expert per layer and step.
  std::int64_t moe_expert_runs() const { return moe_.expert_runs; }

 private:
  void ensure_capacity(int n_tokens);
  // Asks s's selector which slots task t reads (t.ranges); whether it chose a sparse read.
  bool select_reads(const forward_seq& s, attention_task& t, int layer, attention_scratch& sc) const;

  const llama_model& model_;
  kv_backend& kv_;
  thread_pool pool_;
  matmul_scratch mm_scratch_;
  std::vector<attention_scratch> attn_scratch_;  // one per thread
  std::vector<gather_scratch> gather_scratch_;   // one per thread (sparse reads of scattered tokens)
  std::vector<std::vector<std::int32_t>> gather_slots_;  // one per thread
  int capacity_ = 0;
  aligned_buffer x_, xn_, q_, k_, v_, attn_out_, tmp_, gate_, up_;
  std::vector<std::int32_t> positions_;  // [new tokens of the step]
  std::vector<std::int32_t> see_;        // [new tokens of the step] forward_seq::see_until; empty: causal
  std::vector<std::int32_t> kv_positions_;  // per seq: [stored + new slots], concatenated
  moe_scratch moe_;  // the routed FFN's buffers (MoE models)
};

// Turns stored keys of one layer by delta[i] positions: RoPE is a rotation,
// so a key computed at p reads as if computed at p + delta (StreamingLLM's
// positions within the cache). k is [n][n_kv_heads][head_dim].
void rotate_keys(const llama_hparams& hp, int layer, float* k, int n, const std::int32_t* delta);

// KV bytes per token by the usual formula 2 x n_layers x n_kv_heads x head_dim x bytes.
double kv_bytes_per_token(const llama_hparams& hp, double bytes_per_element);

// The architectures that load, for messages and docs.
inline constexpr const char* k_supported_architectures = "llama, qwen2, qwen3, gemma2, gemma3, phi3, qwen3moe, gpt-oss";

}  // namespace pagoda
