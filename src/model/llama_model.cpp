// Loading a Llama-family model from GGUF, with every shape and type checked
// against the architecture before anything runs. The metadata keys, their
// defaults and the tensor names are llama.cpp's (src/llama-model.cpp,
// src/llama-arch.cpp) for each architecture.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "model/kv_share.h"
#include "model/llama.h"

namespace pagoda {
namespace {

struct loader {
  const gguf::file& f;
  std::string arch;
  std::unordered_set<std::string> used;  // the tensors the model reads

  result<std::int64_t> key_int(std::string_view suffix, std::optional<std::int64_t> fallback = std::nullopt) {
    std::string key = arch + "." + std::string(suffix);
    auto v = f.get_int(key);
    if (v.ok()) return *v;
    if (v.error().code() == errc::not_found && fallback) return *fallback;
    if (v.error().code() == errc::not_found) return error(errc::corrupt, "missing required key {}", key);
    return v.error();
  }
  result<double> key_float(std::string_view suffix, std::optional<double> fallback = std::nullopt) {
    std::string key = arch + "." + std::string(suffix);
    auto v = f.get_float(key);
    if (v.ok()) return *v;
    if (v.error().code() == errc::not_found && fallback) return *fallback;
    if (v.error().code() == errc::not_found) return error(errc::corrupt, "missing required key {}", key);
    return v.error();
  }

  result<const gguf::tensor_info*> tensor(const std::string& name, std::int64_t ne0, std::int64_t ne1,
                                          bool required = true) {
    const gguf::tensor_info* t = f.find_tensor(name);
    if (!t) {
      if (!required) return static_cast<const gguf::tensor_info*>(nullptr);
      return error(errc::corrupt, "missing tensor {}", name);
    }
    used.insert(name);
    std::int64_t want_dims = ne1 > 1 ? 2 : 1;
    bool ok = t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == 1 && t->ne[3] == 1 &&
              (t->n_dims == want_dims || (t->n_dims == 2 && ne1 == 1));
    if (!ok)
      return error(errc::corrupt, "tensor {} has shape [{}, {}, {}, {}], expected [{}, {}] for this {} model", name,
                   t->ne[0], t->ne[1], t->ne[2], t->ne[3], ne0, ne1, arch);
    return t;
  }

  result<weight_view> matrix(const std::string& name, std::int64_t n_in, std::int64_t n_out, bool required = true) {
    PAGODA_ASSIGN_OR_RETURN(const gguf::tensor_info* t, tensor(name, n_in, n_out, required));
    if (!t) return weight_view{};
    // Every type the reader accepts has kernels (it refuses the others, naming
    // the tensor and the type), so mixed files load tensor by tensor as they are.
    const gguf::tensor_type_traits* tr = gguf::get_tensor_type_traits(static_cast<std::uint32_t>(t->type));
    if (n_in % tr->block_size != 0)
      return error(errc::corrupt, "tensor {}: row length {} is not a multiple of the {} block size {}", name, n_in,
                   tr->name, tr->block_size);
    weight_view w;
    w.type = t->type;
    w.data = t->data;
    w.n_in = n_in;
    w.n_out = n_out;
    w.row_bytes = row_size_bytes(t->type, n_in);
    return w;
  }

  // Rows [row0, row0 + n_out) of a matrix, as a matrix: the parts of a fused
  // projection (phi3), read in place.
  static weight_view rows(const weight_view& w, std::int64_t row0, std::int64_t n_out) {
    weight_view r = w;
    r.data = static_cast<const std::byte*>(w.data) + static_cast<std::size_t>(row0) * w.row_bytes;
    r.n_out = n_out;
    return r;
  }

  // Q, K and V: separate matrices, or one fused attn_qkv whose rows are [Q | K | V].
  // A layer that reads another layer's KV (hparams::kv_source) has Q alone.
  status qkv(const std::string& p, const llama_hparams& hp, int layer, llama_layer& L) {
    const std::int64_t q = hp.q_dim(), kv = hp.kv_dim();
    if (hp.reads_other_kv(layer)) {
      for (const char* t : {"attn_k.weight", "attn_v.weight", "attn_qkv.weight", "attn_k.bias", "attn_v.bias", "attn_k_norm.weight"})
        if (f.find_tensor(p + t))
          return error(errc::corrupt, "{}{}: layer {} reads layer {}'s KV ({}), so it has no K/V projections of its own",
                       p, t, layer, hp.kv_source[static_cast<std::size_t>(layer)], k_kv_source_key);
      PAGODA_ASSIGN_OR_RETURN(L.wq, matrix(p + "attn_q.weight", hp.n_embd, q));
      return {};
    }
    PAGODA_ASSIGN_OR_RETURN(weight_view fused, matrix(p + "attn_qkv.weight", hp.n_embd, q + 2 * kv, false));
    if (fused.data) {
      L.wq = rows(fused, 0, q);
      L.wk = rows(fused, q, kv);
      L.wv = rows(fused, q + kv, kv);
      return {};
    }
    PAGODA_ASSIGN_OR_RETURN(L.wq, matrix(p + "attn_q.weight", hp.n_embd, q));
    PAGODA_ASSIGN_OR_RETURN(L.wk, matrix(p + "attn_k.weight", hp.n_embd, kv));
    PAGODA_ASSIGN_OR_RETURN(L.wv, matrix(p + "attn_v.weight", hp.n_embd, kv));
    return {};
  }

  // Gate and up: separate, or (no ffn_gate, phi3) one ffn_up whose rows are [gate | up].
  status gate_up(const std::string& p, const llama_hparams& hp, llama_layer& L) {
    PAGODA_ASSIGN_OR_RETURN(L.w_gate, matrix(p + "ffn_gate.weight", hp.n_embd, hp.n_ff, hp.arch != "phi3"));
    if (L.w_gate.data) {
      PAGODA_ASSIGN_OR_RETURN(L.w_up, matrix(p + "ffn_up.weight", hp.n_embd, hp.n_ff));
      return {};
    }
    PAGODA_ASSIGN_OR_RETURN(weight_view fused, matrix(p + "ffn_up.weight", hp.n_embd, 2 * hp.n_ff));
    L.w_gate = rows(fused, 0, hp.n_ff);
    L.w_up = rows(fused, hp.n_ff, hp.n_ff);
    return {};
  }

  // A 3-D tensor of n_expert matrices [n_out][n_in] (ggml ne = [n_in, n_out,
  // n_expert]), each read in place as a slice.
  result<expert_weights> experts(const std::string& name, std::int64_t n_in, std::int64_t n_out, int n_expert) {
    const gguf::tensor_info* t = f.find_tensor(name);
    if (!t) return error(errc::corrupt, "missing tensor {}", name);
    used.insert(name);
    if (t->n_dims != 3 || t->ne[0] != n_in || t->ne[1] != n_out || t->ne[2] != n_expert)
      return error(errc::corrupt, "tensor {} has shape [{}, {}, {}, {}], expected [{}, {}, {}] for this {} model", name,
                   t->ne[0], t->ne[1], t->ne[2], t->ne[3], n_in, n_out, n_expert, arch);
    const gguf::tensor_type_traits* tr = gguf::get_tensor_type_traits(static_cast<std::uint32_t>(t->type));
    if (n_in % tr->block_size != 0)
      return error(errc::corrupt, "tensor {}: row length {} is not a multiple of the {} block size {}", name, n_in,
                   tr->name, tr->block_size);
    expert_weights w;
    w.first = weight_view{t->type, t->data, n_in, n_out, row_size_bytes(t->type, n_in)};
    w.expert_bytes = w.first.row_bytes * static_cast<std::size_t>(n_out);
    w.n_expert = n_expert;
    return w;
  }

  result<std::vector<float>> vector(const std::string& name, std::int64_t n, bool required = true) {
    return table(name, n, 1, required);
  }

  // A small 2-D tensor [rows][n] (ggml ne = [n, rows]) read into floats: per-expert biases.
  result<std::vector<float>> table(const std::string& name, std::int64_t n, std::int64_t rows, bool required = true) {
    PAGODA_ASSIGN_OR_RETURN(weight_view w, matrix(name, n, rows, required));
    std::vector<float> out;
    if (!w.data) return out;
    out.resize(static_cast<std::size_t>(n * rows));
    for (std::int64_t r = 0; r < rows; ++r) dequantize_row(w, r, out.data() + r * n);
    return out;
  }
};

bool is_supported_arch(std::string_view a) {
  for (std::string_view s : {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe", "gpt-oss"})
    if (a == s) return true;
  return false;
}

// Cross-layer KV sharing the file declares (model/kv_share.h): checked in
// full, as a malformed map would run with other logits.
status read_kv_sources(const gguf::file& f, llama_hparams& hp) {
  auto src = f.get_i32_array(k_kv_source_key);
  if (!src.ok()) {
    if (src.error().code() == errc::not_found) return {};
    return error(errc::corrupt, "{}", src.error().message());
  }
  hp.kv_source.assign(src->begin(), src->end());
  if (status st = check_kv_sources(hp, hp.kv_source, k_kv_source_key); !st.ok())
    return error(errc::corrupt, "{}", st.message());
  bool shares = false;
  for (int l = 0; l < hp.n_layer; ++l) shares = shares || hp.reads_other_kv(l);
  if (!shares) hp.kv_source.clear();  // every layer its own: nothing shared
  return {};
}

// Which local/global layers: `sliding_window_pattern` is either a period n
// (layer il is local iff il % n < n - 1, llama.cpp's swa pattern; 0 makes every
// layer local) or an array with one flag per layer.
status read_swa_layers(loader& ld, llama_hparams& hp, std::int64_t default_pattern) {
  const std::string key = hp.arch + ".attention.sliding_window_pattern";
  hp.swa_layer.assign(hp.n_layer, false);
  if (auto flags = ld.f.get_i32_array(key); flags.ok()) {
    if (flags->size() != static_cast<std::size_t>(hp.n_layer))
      return error(errc::corrupt, "{} has {} entries for {} layers", key, flags->size(), hp.n_layer);
    for (int l = 0; l < hp.n_layer; ++l) hp.swa_layer[l] = (*flags)[l] != 0;
    return {};
  }
  PAGODA_ASSIGN_OR_RETURN(std::int64_t pattern, ld.key_int("attention.sliding_window_pattern", default_pattern));
  if (pattern < 0 || pattern > (1 << 16)) return error(errc::corrupt, "{} = {} out of range", key, pattern);
  for (int l = 0; l < hp.n_layer; ++l) hp.swa_layer[l] = pattern == 0 || l % pattern < pattern - 1;
  return {};
}

// RoPE scaling, read as llama.cpp reads it for every architecture
// (llama_model_base::load_hparams and llama_context's YaRN set-up):
//   rope.scaling.type     none, linear (the default) or yarn; longrope and
//                         any other value are refused, naming it;
//   rope.scaling.factor   (or the older rope.scale_linear; 0 or absent: 1):
//                         positions x 1 / factor, except under type none and on
//                         gemma3's local layers;
//   rope.scaling.attn_factor  cos and sin x this (default 1), under any type;
//   YaRN: rope.scaling.original_context_length (default: the trained
//         context), ext_factor 1, the magnitude factor 0.1 ln(factor) + 1, and
//         beta_fast / beta_slow from rope.scaling.yarn_beta_fast / _slow where
//         a file has them, else llama.cpp's 32 and 1 (llama.cpp reads those keys
//         only for other architectures; a file that states them means them);
//   rope_freqs.weight     Llama 3's per-pair frequency divisors, on llama
//                         (the only architecture here that llama.cpp reads it
//                         for); LongRoPE's rope_factors_long/short are refused.
status read_rope_scaling(loader& ld, llama_hparams& hp) {
  const std::string& a = hp.arch;
  rope_scaling_config& rs = hp.rope_scaling;
  std::string type = "linear";
  if (auto t = ld.f.get_string(a + ".rope.scaling.type"); t.ok()) type = std::string(*t);
  else if (t.error().code() != errc::not_found) return t.error();
  if (type == "longrope")
    return error(errc::unsupported, "{}.rope.scaling.type = 'longrope': LongRoPE scaling is not supported", a);
  if (type != "none" && type != "linear" && type != "yarn")
    return error(errc::unsupported, "{}.rope.scaling.type = '{}' is not supported (none, linear, yarn)", a, type);
  std::string factor_key = a + ".rope.scaling.factor";
  if (!ld.f.find(factor_key) && ld.f.find(a + ".rope.scale_linear")) factor_key = a + ".rope.scale_linear";
  double factor = 0;
  if (auto v = ld.f.get_float(factor_key); v.ok()) factor = *v;
  else if (v.error().code() != errc::not_found) return v.error();
  if (factor != 0 && !(factor > 0 && factor < 1e6)) return error(errc::corrupt, "{} = {} out of range", factor_key, factor);
  rs.factor = factor == 0 ? 1.0f : static_cast<float>(factor);
  hp.rope_freq_scale = type == "none" ? 1.0f : 1.0f / rs.factor;
  hp.rope_freq_scale_swa = a == "gemma3" ? 1.0f : hp.rope_freq_scale;
  rs.type = type == "yarn" ? rope_scaling_type::yarn
            : hp.rope_freq_scale != 1.0f ? rope_scaling_type::linear
                                         : rope_scaling_type::none;

  PAGODA_ASSIGN_OR_RETURN(double attn_factor, ld.key_float("rope.scaling.attn_factor", 1.0));
  PAGODA_ASSIGN_OR_RETURN(std::int64_t n_ctx_orig, ld.key_int("rope.scaling.original_context_length", hp.n_ctx_train));
  PAGODA_ASSIGN_OR_RETURN(double beta_fast, ld.key_float("rope.scaling.yarn_beta_fast", 32.0));
  PAGODA_ASSIGN_OR_RETURN(double beta_slow, ld.key_float("rope.scaling.yarn_beta_slow", 1.0));
  if (!(attn_factor > 0 && attn_factor < 1e3) || n_ctx_orig < 1 || n_ctx_orig > (1 << 24) ||
      !(beta_fast > 0 && beta_fast < 1e6) || !(beta_slow > 0 && beta_slow < 1e6))
    return error(errc::corrupt, "{}.rope.scaling: attn_factor {}, original_context_length {}, beta fast {} / slow {} out of range",
                 a, attn_factor, n_ctx_orig, beta_fast, beta_slow);
  rs.n_ctx_orig = static_cast<int>(n_ctx_orig);
  rs.beta_fast = static_cast<float>(beta_fast);
  rs.beta_slow = static_cast<float>(beta_slow);
  rs.ext_factor = rs.type == rope_scaling_type::yarn ? 1.0f : 0.0f;
  rs.attn_factor = static_cast<float>(attn_factor);
  if (rs.ext_factor != 0.0f) {
    // llama.cpp's YaRN attention factor before ggml's per-layer magnitude
    // factor (rope_angles): 1 for factors above 1, the inverse of that
    // magnitude factor below, so that only scaled-down layers grow.
    const float f = 1.0f / hp.rope_freq_scale;
    const float wanted = f <= 1.0f ? 1.0f : 0.1f * std::log(f) + 1.0f;
    rs.attn_factor *= wanted / (1.0f + 0.1f * std::log(f));
  }

  for (const char* name : {"rope_factors_long.weight", "rope_factors_short.weight"})
    if (ld.f.find_tensor(name))
      return error(errc::unsupported, "tensor {}: LongRoPE frequency factors are not supported", name);
  if (!ld.f.find_tensor("rope_freqs.weight")) return {};
  if (a != "llama")
    return error(errc::unsupported, "tensor rope_freqs.weight: frequency factors are read for llama models, not {}", a);
  PAGODA_ASSIGN_OR_RETURN(rs.freq_factors, ld.vector("rope_freqs.weight", hp.rope_dim / 2));
  for (float x : rs.freq_factors)
    if (!(x > 0 && std::isfinite(x))) return error(errc::corrupt, "tensor rope_freqs.weight holds {}: factors must be positive", x);
  return {};
}

// Metadata keys llama.cpp reads for these architectures that would change
// the model's output and that Pagoda does not compute: a file that sets one to
// anything but its neutral value is refused, naming the key, rather than run
// wrong. tests/model/metadata_keys_test.cpp holds the full list of keys
// llama.cpp reads and checks each is used or refused here.
status refuse_unimplemented_keys(loader& ld, const llama_hparams& hp) {
  const std::string& a = hp.arch;
  struct numeric_key {
    const char* suffix;
    double neutral;  // the value that changes nothing
    double also;     // another value that changes nothing (NaN: none)
    const char* what;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const numeric_key numeric[] = {
      {"rope.scaling.alpha", 0, nan, "NTK-aware RoPE alpha scaling"},
      // Read by llama.cpp only for other architectures (grok; the log
      // multiplier for deepseek2 and mistral3); YaRN's extrapolation share and
      // attention factor are derived here as llama.cpp derives them.
      {"rope.scaling.yarn_ext_factor", -1, hp.rope_scaling.ext_factor, "a YaRN extrapolation factor set by the file"},
      {"rope.scaling.yarn_attn_factor", 1, nan, "a YaRN attention factor set by the file"},
      {"rope.scaling.yarn_log_multiplier", 0, nan, "YaRN's log multiplier (mscale_all_dim)"},
      {"rope.dimension_count_swa", static_cast<double>(hp.rope_dim), nan, "another RoPE width on sliding-window layers"},
      {"attention.key_length_swa", static_cast<double>(hp.head_dim), nan, "another head size on sliding-window layers"},
      {"attention.value_length_swa", static_cast<double>(hp.head_dim), nan, "another head size on sliding-window layers"},
      {"attention.value_length", static_cast<double>(hp.head_dim), nan, "value heads of another size than key heads"},
      {"embedding_length_out", static_cast<double>(hp.n_embd), 0, "an output width other than the embedding width"},
      {"pooling_type", -1, 0, "pooled embeddings (an embedding model)"},
  };
  for (const numeric_key& k : numeric) {
    const std::string key = a + "." + k.suffix;
    auto v = ld.f.get_float(key);
    if (!v.ok() && v.error().code() == errc::not_found) continue;
    if (!v.ok()) return v.error();
    if (*v != k.neutral && *v != k.also)
      return error(errc::unsupported, "{} = {}: Pagoda does not compute {}", key, *v, k.what);
  }
  if (ld.f.find(a + ".attention.causal")) {
    PAGODA_ASSIGN_OR_RETURN(bool causal, ld.f.get_bool(a + ".attention.causal"));
    if (!causal) return error(errc::unsupported, "{}.attention.causal = false: non-causal attention is not supported", a);
  }
  if (ld.f.find(a + ".classifier.output_labels"))
    return error(errc::unsupported, "{}.classifier.output_labels: classifier heads are not supported", a);
  // Experts on the dense architectures (Mixtral is `llama` with expert_count
  // 8) are not computed; a mixture-of-experts architecture reads these itself.
  const bool dense = a == "llama" || a == "qwen2" || a == "qwen3" || a == "gemma2" || a == "gemma3" || a == "phi3";
  for (const char* suffix : {"expert_count", "expert_used_count", "expert_group_count", "expert_group_used_count"}) {
    if (!dense) break;
    PAGODA_ASSIGN_OR_RETURN(std::int64_t n, ld.key_int(suffix, 0));
    if (n != 0) return error(errc::unsupported, "{}.{} = {}: mixture-of-experts {} models are not supported", a, suffix, n, a);
  }
  return {};
}

// The per-architecture parts of the block (llama.h's table), after the common
// hyper-parameters are read.
status read_arch_features(loader& ld, llama_hparams& hp) {
  const std::string& a = hp.arch;
  const bool gemma = a == "gemma2" || a == "gemma3";
  hp.rope_neox = a != "llama";
  hp.qk_norm = a == "qwen3" || a == "gemma3";
  hp.post_norms = gemma;
  hp.gelu = gemma;
  hp.embd_scale = gemma ? std::sqrt(static_cast<float>(hp.n_embd)) : 1.0f;
  // Gemma's 27B models scale queries by 1/sqrt(n_embd / n_head) instead
  // (llama.cpp recognises them by their layer count).
  const bool gemma_27b = (a == "gemma2" && hp.n_layer == 46) || (a == "gemma3" && hp.n_layer == 62);
  hp.attn_scale = 1.0f / std::sqrt(static_cast<float>(gemma_27b ? hp.n_embd / hp.n_head : hp.head_dim));
  if (a == "gemma2") {
    PAGODA_ASSIGN_OR_RETURN(double c, ld.key_float("attn_logit_softcapping", 50.0));
    hp.attn_softcap = static_cast<float>(c);
  }
  if (gemma) {
    PAGODA_ASSIGN_OR_RETURN(double c, ld.key_float("final_logit_softcapping", a == "gemma2" ? 30.0 : 0.0));
    hp.final_softcap = static_cast<float>(c);
  }
  if (!(hp.attn_softcap >= 0 && hp.attn_softcap < 1e6) || !(hp.final_softcap >= 0 && hp.final_softcap < 1e6))
    return error(errc::corrupt, "soft-capping values {} / {} out of range", hp.attn_softcap, hp.final_softcap);
  // Sliding windows: required for gemma and gpt-oss, optional for llama
  // (Mistral), where it covers every layer. qwen2 and phi3 files may carry
  // the key; llama.cpp ignores it there, and so does Pagoda.
  const bool gpt_oss = a == "gpt-oss";
  if (gemma || gpt_oss || a == "llama") {
    std::optional<std::int64_t> none;
    if (a == "llama") none = 0;
    PAGODA_ASSIGN_OR_RETURN(std::int64_t w, ld.key_int("attention.sliding_window", none));
    if (w < 0 || w > (1 << 24)) return error(errc::corrupt, "sliding window {} out of range", w);
    hp.sliding_window = static_cast<int>(w);
  }
  if (hp.sliding_window > 0)
    PAGODA_RETURN_IF_ERROR(read_swa_layers(ld, hp, a == "gemma2" || gpt_oss ? 2 : a == "gemma3" ? 6 : 0));
  else hp.swa_layer.assign(hp.n_layer, false);
  hp.rope_base_swa = hp.rope_base;
  if (gemma || gpt_oss) {  // llama.cpp's defaults: one base for all layers, gemma3 10000 on local ones
    PAGODA_ASSIGN_OR_RETURN(double b, ld.key_float("rope.freq_base_swa", a == "gemma3" ? 10000.0 : hp.rope_base));
    if (!(b > 1)) return error(errc::corrupt, "rope base {} out of range", b);
    hp.rope_base_swa = static_cast<float>(b);
  }
  PAGODA_RETURN_IF_ERROR(read_rope_scaling(ld, hp));
  return {};
}

// Mixture of experts. qwen3moe and gpt-oss read llama.cpp's keys:
// expert_count and expert_used_count (required), expert_feed_forward_length
// (qwen3moe: default feed_forward_length / expert_used_count, as llama.cpp;
// gpt-oss: required). llama.cpp's qwen3moe always softmax-gates and
// renormalises the chosen weights, its gpt-oss chooses by logit and takes the
// softmax of the chosen with a clamped SwiGLU; neither reads another MoE key.
// Pagoda also honours expert_weights_norm (qwen3moe) and expert_weights_scale
// when a file sets them, and refuses, naming the key, the MoE features it does
// not compute (other gating functions, shared experts, expert groups). A
// dense architecture with experts (Mixtral is `llama` with expert_count 8) is
// refused rather than run without them.
status read_moe(loader& ld, llama_hparams& hp) {
  const std::string& a = hp.arch;
  const bool gpt_oss = a == "gpt-oss";
  PAGODA_ASSIGN_OR_RETURN(std::int64_t n_expert, ld.key_int("expert_count", 0));
  if (a != "qwen3moe" && !gpt_oss) {
    if (n_expert > 1)
      return error(errc::unsupported,
                   "{}.expert_count = {}: mixture-of-experts {} models are not supported (qwen3moe and gpt-oss are)", a,
                   n_expert, a);
    return {};
  }
  hp.qk_norm = !gpt_oss;  // qwen3's attention block
  PAGODA_ASSIGN_OR_RETURN(std::int64_t n_used, ld.key_int("expert_used_count", 0));
  if (n_expert < 1 || n_expert > 512)  // llama.cpp's LLAMA_MAX_EXPERTS
    return error(errc::corrupt, "{}.expert_count = {}: a {} model needs 1 to 512 experts", a, n_expert, a);
  if (n_used < 1 || n_used > n_expert)
    return error(errc::corrupt, "{}.expert_used_count = {} must be in 1..{} (expert_count)", a, n_used, n_expert);
  std::optional<std::int64_t> ff_default;
  if (!gpt_oss) ff_default = hp.n_ff / n_used;
  PAGODA_ASSIGN_OR_RETURN(std::int64_t n_ff_exp, ld.key_int("expert_feed_forward_length", ff_default));
  if (n_ff_exp < 1 || n_ff_exp > (1 << 20))
    return error(errc::corrupt, "{}.expert_feed_forward_length = {} out of range", a, n_ff_exp);
  hp.moe.n_expert = static_cast<int>(n_expert);
  hp.moe.n_expert_used = static_cast<int>(n_used);
  hp.moe.n_ff_exp = static_cast<int>(n_ff_exp);
  if (gpt_oss) {
    hp.moe.gating = moe_gating::softmax_weight;
    hp.moe.activation = moe_activation::swiglu_oai;
    hp.moe.norm_weights = false;
  } else if (auto norm = ld.f.get_bool(a + ".expert_weights_norm"); norm.ok()) {
    hp.moe.norm_weights = *norm;
  } else if (norm.error().code() != errc::not_found) {
    return norm.error();
  }
  PAGODA_ASSIGN_OR_RETURN(double scale, ld.key_float("expert_weights_scale", 0.0));
  if (!(scale >= 0 && scale < 1e6)) return error(errc::corrupt, "{}.expert_weights_scale = {} out of range", a, scale);
  hp.moe.weights_scale = scale == 0 ? 1.0f : static_cast<float>(scale);
  // llama.cpp's llama_expert_gating_func_type: 0 none (the architecture's
  // own, softmax here), 1 softmax, 2 sigmoid, 3 softmax over the chosen
  // weights, 4 sqrt(softplus).
  PAGODA_ASSIGN_OR_RETURN(std::int64_t gating, ld.key_int("expert_gating_func", 0));
  if (gating != 0 && gating != (gpt_oss ? 3 : 1)) {
    static constexpr const char* k_names[] = {"none", "softmax", "sigmoid", "softmax_weight", "sqrt_softplus"};
    return error(errc::unsupported, "{}.expert_gating_func = {} ({}): {} models gate with {} only", a, gating,
                 gating >= 0 && gating < 5 ? k_names[gating] : "unknown", a, gpt_oss ? "softmax_weight" : "softmax");
  }
  struct unsupported_key {
    const char* suffix;
    const char* what;
    std::int64_t allowed_max;  // values up to this mean the feature is off
  };
  for (const unsupported_key& k : {unsupported_key{"expert_shared_count", "shared experts", 0},
                                   unsupported_key{"expert_shared_feed_forward_length", "shared experts", 0},
                                   unsupported_key{"expert_group_count", "expert groups", 1},
                                   unsupported_key{"expert_group_used_count", "expert groups", 0},
                                   unsupported_key{"experts_per_group", "expert groups", 0},
                                   unsupported_key{"expert_chunk_feed_forward_length", "chunked experts", 0}}) {
    PAGODA_ASSIGN_OR_RETURN(std::int64_t v, ld.key_int(k.suffix, 0));
    if (v > k.allowed_max)
      return error(errc::unsupported, "{}.{} = {}: {} are not supported", a, k.suffix, v, k.what);
  }
  if (auto gs = ld.f.get_float(a + ".expert_group_scale"); gs.ok() && *gs != 1.0)
    return error(errc::unsupported, "{}.expert_group_scale = {}: expert groups are not supported", a, *gs);
  return {};
}

// One MoE layer's router and experts, and gpt-oss's biases of both; tensors
// of MoE features Pagoda does not compute (a selection bias, fused gate/up
// experts, per-expert scales, shared experts, and the biases on qwen3moe,
// whose llama.cpp graph has none) are refused by name.
status load_moe_layer(loader& ld, const std::string& p, const llama_hparams& hp, llama_layer& L) {
  const bool biased = hp.arch == "gpt-oss";
  for (const char* part : {"ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias",
                           "exp_probs_b.bias", "ffn_gate_up_exps.weight", "ffn_gate_exps.scale", "ffn_up_exps.scale",
                           "ffn_down_exps.scale", "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight",
                           "ffn_up_shexp.weight", "ffn_down_shexp.weight"}) {
    if (biased && std::string_view(part).ends_with(".bias") && !std::string_view(part).starts_with("exp_probs")) continue;
    if (ld.f.find_tensor(p + part))
      return error(errc::unsupported, "tensor {}{}: this mixture-of-experts feature is not supported", p, part);
  }
  const int n = hp.moe.n_expert;
  const std::int64_t ff = hp.moe.n_ff_exp;
  PAGODA_ASSIGN_OR_RETURN(L.moe.router, ld.matrix(p + "ffn_gate_inp.weight", hp.n_embd, n));
  PAGODA_ASSIGN_OR_RETURN(L.moe.gate, ld.experts(p + "ffn_gate_exps.weight", hp.n_embd, ff, n));
  PAGODA_ASSIGN_OR_RETURN(L.moe.up, ld.experts(p + "ffn_up_exps.weight", hp.n_embd, ff, n));
  PAGODA_ASSIGN_OR_RETURN(L.moe.down, ld.experts(p + "ffn_down_exps.weight", ff, hp.n_embd, n));
  if (biased) {  // [n_expert] and [n_expert][width], ggml's ne = [width, n_expert]
    PAGODA_ASSIGN_OR_RETURN(L.moe.router_bias, ld.vector(p + "ffn_gate_inp.bias", n));
    PAGODA_ASSIGN_OR_RETURN(L.moe.gate_bias, ld.table(p + "ffn_gate_exps.bias", ff, n));
    PAGODA_ASSIGN_OR_RETURN(L.moe.up_bias, ld.table(p + "ffn_up_exps.bias", ff, n));
    PAGODA_ASSIGN_OR_RETURN(L.moe.down_bias, ld.table(p + "ffn_down_exps.bias", hp.n_embd, n));
  }
  return {};
}

}  // namespace

int llama_hparams::n_swa_layers() const {
  if (sliding_window <= 0) return 0;
  return static_cast<int>(std::count(swa_layer.begin(), swa_layer.end(), true));
}

double kv_bytes_per_token(const llama_hparams& hp, double bytes_per_element) {
  return 2.0 * hp.n_layer * hp.n_head_kv * hp.head_dim * bytes_per_element;
}

std::int64_t llama_model::n_active_params() const {
  const moe_config& c = hp_.moe;
  const std::int64_t idle_experts = c.n_expert - c.n_expert_used;
  return n_params_ - idle_experts * 3 * static_cast<std::int64_t>(hp_.n_embd) * c.n_ff_exp * hp_.n_layer;
}

result<std::unique_ptr<llama_model>> llama_model::load(const std::string& path, gguf::open_options options) {
  auto f = gguf::file::open(path, options);
  if (!f.ok()) return f.error();  // its errors name the path
  auto m = from_gguf(std::move(*f));
  if (!m.ok()) return m.error().with_context(path);
  return m;
}

result<std::unique_ptr<llama_model>> llama_model::from_gguf(std::unique_ptr<gguf::file> file) {
  std::unique_ptr<llama_model> m(new llama_model());
  m->file_ = std::move(file);
  const gguf::file& f = *m->file_;
  auto arch = f.get_string("general.architecture");
  if (!arch.ok()) return error(errc::corrupt, "missing required key general.architecture");
  llama_hparams& hp = m->hp_;
  hp.arch = std::string(*arch);
  if (!is_supported_arch(hp.arch))
    return error(errc::unsupported, "architecture '{}' is not supported ({})", hp.arch, k_supported_architectures);
  if (auto name = f.get_string("general.name"); name.ok()) hp.name = std::string(*name);
  loader ld{f, hp.arch};

  PAGODA_ASSIGN_OR_RETURN(std::int64_t n_embd, ld.key_int("embedding_length"));
  PAGODA_ASSIGN_OR_RETURN(std::int64_t n_layer, ld.key_int("block_count"));
  PAGODA_ASSIGN_OR_RETURN(std::int64_t n_ff, ld.key_int("feed_forward_length"));
  PAGODA_ASSIGN_OR_RETURN(std::int64_t n_head, ld.key_int("attention.head_count"));
  PAGODA_ASSIGN_OR_RETURN(std::int64_t n_head_kv, ld.key_int("attention.head_count_kv", n_head));
  PAGODA_ASSIGN_OR_RETURN(std::int64_t n_ctx, ld.key_int("context_length"));
  PAGODA_ASSIGN_OR_RETURN(double eps, ld.key_float("attention.layer_norm_rms_epsilon"));
  PAGODA_ASSIGN_OR_RETURN(double rope_base, ld.key_float("rope.freq_base", 10000.0));
  auto in_range = [](std::int64_t v, std::int64_t lo, std::int64_t hi) { return v >= lo && v <= hi; };
  if (!in_range(n_embd, 1, 1 << 16) || !in_range(n_layer, 1, 1024) || !in_range(n_ff, 1, 1 << 20) ||
      !in_range(n_head, 1, 1024) || !in_range(n_head_kv, 1, n_head) || !in_range(n_ctx, 1, 1 << 24))
    return error(errc::corrupt,
                 "implausible hyper-parameters: embedding {} layers {} ffn {} heads {} kv heads {} context {}", n_embd,
                 n_layer, n_ff, n_head, n_head_kv, n_ctx);
  if (n_head % n_head_kv != 0)
    return error(errc::corrupt, "head count {} is not a multiple of the KV head count {}", n_head, n_head_kv);
  PAGODA_ASSIGN_OR_RETURN(std::int64_t head_dim, ld.key_int("attention.key_length", n_embd / n_head));
  if (head_dim <= 0 || head_dim % 2 != 0 || head_dim > 1024)
    return error(errc::corrupt, "head dimension {} must be even and at most 1024", head_dim);
  PAGODA_ASSIGN_OR_RETURN(std::int64_t rope_dim, ld.key_int("rope.dimension_count", head_dim));
  if (rope_dim <= 0 || rope_dim > head_dim || rope_dim % 2 != 0)
    return error(errc::corrupt, "rope dimension {} must be even and at most the head dimension {}", rope_dim, head_dim);
  if (!(eps > 0 && eps < 1)) return error(errc::corrupt, "RMS norm epsilon {} out of range", eps);
  if (!(rope_base > 1) || !std::isfinite(static_cast<float>(rope_base)))
    return error(errc::corrupt, "{}.rope.freq_base {} must be a finite number above 1", hp.arch, rope_base);

  hp.n_embd = static_cast<int>(n_embd);
  hp.n_layer = static_cast<int>(n_layer);
  hp.n_ff = static_cast<int>(n_ff);
  hp.n_head = static_cast<int>(n_head);
  hp.n_head_kv = static_cast<int>(n_head_kv);
  hp.head_dim = static_cast<int>(head_dim);
  hp.rope_dim = static_cast<int>(rope_dim);
  hp.n_ctx_train = static_cast<int>(n_ctx);
  hp.rms_eps = static_cast<float>(eps);
  hp.rope_base = static_cast<float>(rope_base);
  PAGODA_RETURN_IF_ERROR(read_arch_features(ld, hp));
  PAGODA_RETURN_IF_ERROR(read_moe(ld, hp));
  PAGODA_RETURN_IF_ERROR(read_kv_sources(f, hp));

  auto tok = tokenizer::from_gguf(f);
  if (!tok.ok()) return tok.error().with_context("tokenizer");
  m->tokenizer_ = std::move(*tok);

  const gguf::tensor_info* embd = f.find_tensor("token_embd.weight");
  if (!embd) return error(errc::corrupt, "missing tensor token_embd.weight");
  hp.n_vocab = static_cast<int>(embd->ne[1]);
  if (hp.n_vocab != m->tokenizer_->n_vocab())
    return error(errc::corrupt, "token_embd.weight has {} rows but the tokenizer has {} tokens", embd->ne[1],
                 m->tokenizer_->n_vocab());
  // Last of the metadata, once every architecture's own keys are read.
  PAGODA_RETURN_IF_ERROR(refuse_unimplemented_keys(ld, hp));

  PAGODA_ASSIGN_OR_RETURN(m->token_embd_, ld.matrix("token_embd.weight", n_embd, hp.n_vocab));
  PAGODA_ASSIGN_OR_RETURN(m->output_norm_, ld.vector("output_norm.weight", n_embd));
  PAGODA_ASSIGN_OR_RETURN(m->output_, ld.matrix("output.weight", n_embd, hp.n_vocab, /*required=*/false));
  // Converters that untie nothing still write a copy of the embeddings as
  // output.weight (stories260K does): recognise the copy so it is read from one
  // place and counted once.
  if (m->output_.data && m->output_.type == m->token_embd_.type &&
      std::memcmp(m->output_.data, m->token_embd_.data, m->output_.row_bytes * m->output_.n_out) == 0)
    m->output_ = {};
  if (!m->output_.data) {
    m->output_ = m->token_embd_;
    hp.tied_output = true;
  }
  const std::int64_t q_dim = hp.q_dim(), kv_dim = hp.kv_dim();
  m->layers_.resize(hp.n_layer);
  for (int l = 0; l < hp.n_layer; ++l) {
    llama_layer& L = m->layers_[l];
    std::string p = "blk." + std::to_string(l) + ".";
    PAGODA_ASSIGN_OR_RETURN(L.attn_norm, ld.vector(p + "attn_norm.weight", n_embd));
    PAGODA_RETURN_IF_ERROR(ld.qkv(p, hp, l, L));
    PAGODA_ASSIGN_OR_RETURN(L.wo, ld.matrix(p + "attn_output.weight", q_dim, n_embd));
    const bool gpt_oss = hp.arch == "gpt-oss";
    // gpt-oss names its FFN input norm post_attention_norm (llama.cpp's attn_post_norm).
    PAGODA_ASSIGN_OR_RETURN(L.ffn_norm, ld.vector(p + (gpt_oss ? "post_attention_norm.weight" : "ffn_norm.weight"), n_embd));
    if (gpt_oss) {
      PAGODA_ASSIGN_OR_RETURN(L.bo, ld.vector(p + "attn_output.bias", n_embd));
      PAGODA_ASSIGN_OR_RETURN(L.attn_sinks, ld.vector(p + "attn_sinks.weight", hp.n_head));
      for (float s : L.attn_sinks)
        if (!std::isfinite(s)) return error(errc::corrupt, "tensor {}attn_sinks.weight holds {}", p, s);
    }
    if (hp.moe.n_expert > 0) {
      PAGODA_RETURN_IF_ERROR(load_moe_layer(ld, p, hp, L));
    } else {
      PAGODA_RETURN_IF_ERROR(ld.gate_up(p, hp, L));
      PAGODA_ASSIGN_OR_RETURN(L.w_down, ld.matrix(p + "ffn_down.weight", n_ff, n_embd));
    }
    bool need_bias = hp.arch == "qwen2";
    const bool own_kv = !hp.reads_other_kv(l);
    PAGODA_ASSIGN_OR_RETURN(L.bq, ld.vector(p + "attn_q.bias", q_dim, need_bias));
    if (own_kv) {
      PAGODA_ASSIGN_OR_RETURN(L.bk, ld.vector(p + "attn_k.bias", kv_dim, need_bias));
      PAGODA_ASSIGN_OR_RETURN(L.bv, ld.vector(p + "attn_v.bias", kv_dim, need_bias));
      if (L.bq.empty() != L.bk.empty() || L.bq.empty() != L.bv.empty())
        return error(errc::corrupt, "{}: attn_q/k/v biases must come together", p);
    }
    if (hp.qk_norm) {
      PAGODA_ASSIGN_OR_RETURN(L.q_norm, ld.vector(p + "attn_q_norm.weight", hp.head_dim));
      if (own_kv) {
        PAGODA_ASSIGN_OR_RETURN(L.k_norm, ld.vector(p + "attn_k_norm.weight", hp.head_dim));
      }
    }
    if (hp.post_norms) {
      PAGODA_ASSIGN_OR_RETURN(L.post_attn_norm, ld.vector(p + "post_attention_norm.weight", n_embd));
      PAGODA_ASSIGN_OR_RETURN(L.post_ffn_norm, ld.vector(p + "post_ffw_norm.weight", n_embd));
    }
  }
  // A tensor the model does not read is a part llama.cpp may compute (an
  // output bias on llama, a token-embedding norm...): refused, never run
  // without it.
  for (const gguf::tensor_info& t : f.tensors())
    if (!ld.used.contains(std::string(t.name)))
      return error(errc::unsupported, "tensor {} is not used by Pagoda's {} model: the file has a part Pagoda does not compute",
                   t.name, hp.arch);
  for (const gguf::tensor_info& t : f.tensors())
    if (!(hp.tied_output && t.name == "output.weight")) m->n_params_ += t.n_elements();
  return m;
}

}  // namespace pagoda
