// Loading a Llama-family model from GGUF, with every shape and type checked
// against the architecture before anything runs.
#include <cmath>
#include <cstring>

#include "model/llama.h"

namespace pagoda {
namespace {

struct loader {
  const gguf::file& f;
  std::string arch;

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

  result<std::vector<float>> vector(const std::string& name, std::int64_t n, bool required = true) {
    PAGODA_ASSIGN_OR_RETURN(weight_view w, matrix(name, n, 1, required));
    std::vector<float> out;
    if (!w.data) return out;
    out.resize(n);
    dequantize_row(w, 0, out.data());
    return out;
  }
};

}  // namespace

double kv_bytes_per_token(const llama_hparams& hp, double bytes_per_element) {
  return 2.0 * hp.n_layer * hp.n_head_kv * hp.head_dim * bytes_per_element;
}

result<std::unique_ptr<llama_model>> llama_model::load(const std::string& path) {
  auto f = gguf::file::open(path);
  if (!f.ok()) return f.error().with_context(path);
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
  if (hp.arch != "llama" && hp.arch != "qwen2")
    return error(errc::unsupported, "architecture '{}' is not supported (llama, qwen2)", hp.arch);
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
  hp.rope_neox = hp.arch == "qwen2";

  auto tok = tokenizer::from_gguf(f);
  if (!tok.ok()) return tok.error().with_context("tokenizer");
  m->tokenizer_ = std::move(*tok);

  const gguf::tensor_info* embd = f.find_tensor("token_embd.weight");
  if (!embd) return error(errc::corrupt, "missing tensor token_embd.weight");
  hp.n_vocab = static_cast<int>(embd->ne[1]);
  if (hp.n_vocab != m->tokenizer_->n_vocab())
    return error(errc::corrupt, "token_embd.weight has {} rows but the tokenizer has {} tokens", embd->ne[1],
                 m->tokenizer_->n_vocab());

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
    PAGODA_ASSIGN_OR_RETURN(L.wq, ld.matrix(p + "attn_q.weight", n_embd, q_dim));
    PAGODA_ASSIGN_OR_RETURN(L.wk, ld.matrix(p + "attn_k.weight", n_embd, kv_dim));
    PAGODA_ASSIGN_OR_RETURN(L.wv, ld.matrix(p + "attn_v.weight", n_embd, kv_dim));
    PAGODA_ASSIGN_OR_RETURN(L.wo, ld.matrix(p + "attn_output.weight", q_dim, n_embd));
    PAGODA_ASSIGN_OR_RETURN(L.ffn_norm, ld.vector(p + "ffn_norm.weight", n_embd));
    PAGODA_ASSIGN_OR_RETURN(L.w_gate, ld.matrix(p + "ffn_gate.weight", n_embd, n_ff));
    PAGODA_ASSIGN_OR_RETURN(L.w_up, ld.matrix(p + "ffn_up.weight", n_embd, n_ff));
    PAGODA_ASSIGN_OR_RETURN(L.w_down, ld.matrix(p + "ffn_down.weight", n_ff, n_embd));
    bool need_bias = hp.arch == "qwen2";
    PAGODA_ASSIGN_OR_RETURN(L.bq, ld.vector(p + "attn_q.bias", q_dim, need_bias));
    PAGODA_ASSIGN_OR_RETURN(L.bk, ld.vector(p + "attn_k.bias", kv_dim, need_bias));
    PAGODA_ASSIGN_OR_RETURN(L.bv, ld.vector(p + "attn_v.bias", kv_dim, need_bias));
  }
  for (const gguf::tensor_info& t : f.tensors())
    if (!(hp.tied_output && t.name == "output.weight")) m->n_params_ += t.n_elements();
  return m;
}

}  // namespace pagoda
