// Loading an mmproj file with every key and tensor checked against the family
// before anything runs. The keys, their defaults and the tensor names are
// llama.cpp's (tools/mtmd/clip-impl.h and clip.cpp's hyperparameter loading).
#include "vision/mmproj.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/hash.h"

namespace pagoda::vision {

namespace {

constexpr std::string_view k_implemented = "idefics3, gemma3";
// Largest encoder input and preprocessing edge accepted (real files: 384 to 2048).
constexpr int k_max_side = 8192;

}  // namespace

class mmproj::loader {
 public:
  explicit loader(const gguf::file& f) : f_(f) {}

  result<std::int64_t> u32_key(std::string_view key, std::optional<std::int64_t> fallback = std::nullopt) const {
    auto v = f_.get_int(key);
    if (!v.ok() && v.error().code() == errc::not_found) {
      if (fallback) return *fallback;
      return error(errc::corrupt, "missing required key {}", key);
    }
    if (!v.ok()) return v.error();
    if (*v < 1 || *v > (std::int64_t{1} << 20)) return error(errc::corrupt, "key {}: {} not in 1..1048576", key, *v);
    return *v;
  }

  result<bool> bool_key(std::string_view key) const {
    auto v = f_.get_bool(key);
    if (!v.ok() && v.error().code() == errc::not_found) return false;
    return v;
  }

  result<std::array<float, 3>> rgb_key(std::string_view key) const {
    auto v = f_.get_f32_array(key);
    if (!v.ok() && v.error().code() == errc::not_found) return error(errc::corrupt, "missing required key {}", key);
    if (!v.ok()) return v.error();
    if (v->size() < 3) return error(errc::corrupt, "key {}: {} values, expected 3 (R, G, B)", key, v->size());
    std::array<float, 3> out{};
    for (int c = 0; c < 3; ++c) {
      out[c] = (*v)[c];
      if (!std::isfinite(out[c])) return error(errc::corrupt, "key {}: value {} is not finite", key, out[c]);
    }
    return out;
  }

  // The tensor with exactly these dims (ggml order), any type Pagoda reads.
  result<const gguf::tensor_info*> tensor(const std::string& name, std::initializer_list<std::int64_t> ne) {
    const gguf::tensor_info* t = f_.find_tensor(name);
    if (!t) return error(errc::corrupt, "missing tensor {}", name);
    used_.insert(name);
    const std::vector<std::int64_t> want(ne);
    bool ok = t->n_dims == want.size();
    for (std::size_t d = 0; d < 4; ++d) ok = ok && t->ne[d] == (d < want.size() ? want[d] : 1);
    if (!ok) {
      return error(errc::corrupt, "tensor {} has shape [{}, {}, {}, {}], expected [{}] for this mmproj", name, t->ne[0],
                   t->ne[1], t->ne[2], t->ne[3], fmt::join(want, ", "));
    }
    return t;
  }

  result<const float*> f32(const std::string& name, std::initializer_list<std::int64_t> ne) {
    PAGODA_ASSIGN_OR_RETURN(const gguf::tensor_info* t, tensor(name, ne));
    if (t->type != gguf::tensor_type::f32)
      return error(errc::unsupported, "tensor {} is {}; Pagoda reads it as F32 only", name,
                   gguf::tensor_type_name(t->type));
    return reinterpret_cast<const float*>(t->data);
  }

  result<weight_view> matrix(const std::string& name, std::int64_t n_in, std::int64_t n_out) {
    PAGODA_ASSIGN_OR_RETURN(const gguf::tensor_info* t, tensor(name, {n_in, n_out}));
    const gguf::tensor_type_traits* tr = gguf::get_tensor_type_traits(static_cast<std::uint32_t>(t->type));
    if (n_in % tr->block_size != 0)
      return error(errc::corrupt, "tensor {}: row length {} is not a multiple of the {} block size {}", name, n_in,
                   tr->name, tr->block_size);
    return weight_view{t->type, t->data, n_in, n_out, row_size_bytes(t->type, n_in)};
  }

  // A tensor the encoder does not read is another family's or variant's part:
  // running without it would compute something else.
  status refuse_unused(projector_kind kind) const {
    for (const gguf::tensor_info& t : f_.tensors()) {
      if (used_.count(std::string(t.name)) == 0)
        return error(errc::unsupported,
                     "tensor {} is not part of the {} layout Pagoda implements (SigLIP ViT without pre-norm, fused "
                     "QKV, Q/K norms or layer scales, and {})",
                     t.name, projector_name(kind),
                     kind == projector_kind::gemma3 ? "an average pool, RMS norm and projection"
                                                    : "a pixel-shuffle projector");
    }
    return ok_status();
  }

 private:
  const gguf::file& f_;
  std::unordered_set<std::string> used_;
};

namespace {

result<projector_kind> check_family(const gguf::file& f) {
  if (auto arch = f.get_string("general.architecture"); arch.ok() && *arch != "clip")
    return error(errc::invalid_argument,
                 "not an mmproj file: general.architecture is '{}', expected 'clip' (a text model goes to -m, its "
                 "vision projector to --mmproj)",
                 *arch);
  auto has_vision = f.get_bool("clip.has_vision_encoder");
  if (!has_vision.ok() || !*has_vision)
    return error(errc::unsupported, "the mmproj has no vision encoder (clip.has_vision_encoder is not true)");
  auto proj = f.get_string("clip.projector_type");
  if (!proj.ok()) proj = f.get_string("clip.vision.projector_type");
  if (!proj.ok()) return error(errc::corrupt, "missing required key clip.projector_type");
  if (*proj == "idefics3") return projector_kind::idefics3;
  if (*proj == "gemma3") return projector_kind::gemma3;
  return error(errc::unsupported, "projector type '{}' is not implemented (Pagoda implements: {})", *proj,
               k_implemented);
}

// The projection as [projection_dim][n_embd] rows from the file's
// [n_embd][projection_dim] (ggml ne [projection_dim, n_embd]): llama.cpp
// multiplies by its transpose. F32 and F16 keep their type.
result<weight_view> transposed_projection(const gguf::tensor_info& t, std::int64_t n_embd, std::int64_t n_out,
                                          std::vector<std::uint8_t>& out) {
  const std::size_t size = t.type == gguf::tensor_type::f32 ? 4 : t.type == gguf::tensor_type::f16 ? 2 : 0;
  if (size == 0)
    return error(errc::unsupported, "tensor {} is {}; Pagoda reads gemma3's input projection as F32 or F16", t.name,
                 gguf::tensor_type_name(t.type));
  out.resize(static_cast<std::size_t>(n_embd * n_out) * size);
  const auto* src = reinterpret_cast<const std::uint8_t*>(t.data);
  for (std::int64_t e = 0; e < n_embd; ++e)
    for (std::int64_t o = 0; o < n_out; ++o)
      std::copy_n(src + static_cast<std::size_t>(e * n_out + o) * size, size,
                  out.data() + static_cast<std::size_t>(o * n_embd + e) * size);
  return weight_view{t.type, out.data(), n_embd, n_out, static_cast<std::size_t>(n_embd) * size};
}

}  // namespace

result<std::unique_ptr<mmproj>> mmproj::open(const std::string& path) {
  auto f = gguf::file::open(path);
  if (!f.ok()) return f.error().with_context(fmt::format("mmproj {}", path));
  auto m = load(std::move(*f));
  if (!m.ok()) return m.error().with_context(fmt::format("mmproj {}", path));
  return m;
}

result<std::unique_ptr<mmproj>> mmproj::load(std::unique_ptr<gguf::file> file) {
  const gguf::file& f = *file;
  PAGODA_ASSIGN_OR_RETURN(const projector_kind kind, check_family(f));
  loader ld(f);
  std::unique_ptr<mmproj> m(new mmproj());
  vision_hparams& hp = m->hp_;
  hp.projector = kind;
  const bool gemma3 = kind == projector_kind::gemma3;
  PAGODA_ASSIGN_OR_RETURN(bool gelu, ld.bool_key("clip.use_gelu"));
  PAGODA_ASSIGN_OR_RETURN(bool silu, ld.bool_key("clip.use_silu"));
  if (!gelu || silu)
    return error(errc::unsupported, "the MLP activation is {}; Pagoda's {} encoder implements GELU (clip.use_gelu)",
                 silu ? "SiLU" : "quick GELU", projector_name(kind));
  auto u32 = [&](std::string_view key, int& out, std::optional<std::int64_t> fallback = std::nullopt) -> status {
    PAGODA_ASSIGN_OR_RETURN(std::int64_t v, ld.u32_key(key, fallback));
    out = static_cast<int>(v);
    return ok_status();
  };
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.image_size", hp.image_size));
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.patch_size", hp.patch_size));
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.embedding_length", hp.n_embd));
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.attention.head_count", hp.n_head));
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.feed_forward_length", hp.n_ff));
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.block_count", hp.n_layer));
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.projection_dim", hp.projection_dim));
  // gemma3: llama.cpp's default pool of 4 x 4 patches (every Gemma 3 file), the key read when present.
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.projector.scale_factor", hp.scale_factor, gemma3 ? 4 : 1));
  if (gemma3 && f.find("clip.vision.preproc_image_size") != nullptr)
    return error(errc::unsupported, "clip.vision.preproc_image_size: gemma3 resizes to image_size; the key belongs to "
                 "another family");
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.preproc_image_size", hp.longest_edge, hp.image_size));
  int n_head_kv = 0, head_dim = 0;
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.attention.head_count_kv", n_head_kv, hp.n_head));
  if (hp.n_embd % hp.n_head != 0)
    return error(errc::corrupt, "embedding width {} is not a multiple of the head count {}", hp.n_embd, hp.n_head);
  PAGODA_RETURN_IF_ERROR(u32("clip.vision.attention.head_dim", head_dim, hp.n_embd / hp.n_head));
  if (n_head_kv != hp.n_head || head_dim * hp.n_head != hp.n_embd)
    return error(errc::unsupported, "grouped or resized attention heads ({} KV heads of {} for {} heads, width {}) are not implemented",
                 n_head_kv, head_dim, hp.n_head, hp.n_embd);
  auto eps = f.get_float("clip.vision.attention.layer_norm_epsilon");
  if (!eps.ok()) return error(errc::corrupt, "missing required key clip.vision.attention.layer_norm_epsilon");
  if (!(*eps >= 0 && *eps < 1)) return error(errc::corrupt, "layer_norm_epsilon {} not in [0, 1)", *eps);
  hp.eps = static_cast<float>(*eps);
  PAGODA_ASSIGN_OR_RETURN(hp.image_mean, ld.rgb_key("clip.vision.image_mean"));
  PAGODA_ASSIGN_OR_RETURN(hp.image_std, ld.rgb_key("clip.vision.image_std"));
  for (float s : hp.image_std)
    if (!(s > 0)) return error(errc::corrupt, "clip.vision.image_std has {}; every value must be positive", s);
  if (hp.image_size > k_max_side || hp.longest_edge > k_max_side)
    return error(errc::unsupported, "image size {} or longest edge {} above {} pixels", hp.image_size, hp.longest_edge,
                 k_max_side);
  if (hp.image_size % hp.patch_size != 0)
    return error(errc::corrupt, "image size {} is not a multiple of the patch size {}", hp.image_size, hp.patch_size);
  if (gemma3 && hp.patches_per_side() % hp.scale_factor != 0)
    return error(errc::corrupt, "average-pool kernel {} (clip.vision.projector.scale_factor) must divide the {} patches "
                 "per side", hp.scale_factor, hp.patches_per_side());
  if (!gemma3 && (hp.scale_factor < 2 || hp.patches_per_side() % hp.scale_factor != 0))
    return error(errc::corrupt, "pixel-shuffle scale factor {} must be at least 2 and divide the {} patches per side",
                 hp.scale_factor, hp.patches_per_side());
  if (f.find("clip.vision.feature_layer") != nullptr)
    return error(errc::unsupported, "clip.vision.feature_layer (features from inner layers) is not implemented");

  const std::int64_t e = hp.n_embd;
  const std::int64_t p = hp.patch_size;
  PAGODA_ASSIGN_OR_RETURN(const float* patch, ld.f32("v.patch_embd.weight", {p, p, 3, e}));
  m->patch_embd_ = weight_view{gguf::tensor_type::f32, patch, 3 * p * p, e, static_cast<std::size_t>(3 * p * p) * sizeof(float)};
  PAGODA_ASSIGN_OR_RETURN(m->patch_bias_, ld.f32("v.patch_embd.bias", {e}));
  PAGODA_ASSIGN_OR_RETURN(m->pos_, ld.f32("v.position_embd.weight", {e, hp.n_patches()}));
  m->blocks_.resize(static_cast<std::size_t>(hp.n_layer));
  for (int l = 0; l < hp.n_layer; ++l) {
    vit_block& b = m->blocks_[static_cast<std::size_t>(l)];
    const std::string n = fmt::format("v.blk.{}.", l);
    PAGODA_ASSIGN_OR_RETURN(b.ln1_w, ld.f32(n + "ln1.weight", {e}));
    PAGODA_ASSIGN_OR_RETURN(b.ln1_b, ld.f32(n + "ln1.bias", {e}));
    PAGODA_ASSIGN_OR_RETURN(b.q, ld.matrix(n + "attn_q.weight", e, e));
    PAGODA_ASSIGN_OR_RETURN(b.q_b, ld.f32(n + "attn_q.bias", {e}));
    PAGODA_ASSIGN_OR_RETURN(b.k, ld.matrix(n + "attn_k.weight", e, e));
    PAGODA_ASSIGN_OR_RETURN(b.k_b, ld.f32(n + "attn_k.bias", {e}));
    PAGODA_ASSIGN_OR_RETURN(b.v, ld.matrix(n + "attn_v.weight", e, e));
    PAGODA_ASSIGN_OR_RETURN(b.v_b, ld.f32(n + "attn_v.bias", {e}));
    PAGODA_ASSIGN_OR_RETURN(b.o, ld.matrix(n + "attn_out.weight", e, e));
    PAGODA_ASSIGN_OR_RETURN(b.o_b, ld.f32(n + "attn_out.bias", {e}));
    PAGODA_ASSIGN_OR_RETURN(b.ln2_w, ld.f32(n + "ln2.weight", {e}));
    PAGODA_ASSIGN_OR_RETURN(b.ln2_b, ld.f32(n + "ln2.bias", {e}));
    PAGODA_ASSIGN_OR_RETURN(b.up, ld.matrix(n + "ffn_up.weight", e, hp.n_ff));
    PAGODA_ASSIGN_OR_RETURN(b.up_b, ld.f32(n + "ffn_up.bias", {hp.n_ff}));
    PAGODA_ASSIGN_OR_RETURN(b.down, ld.matrix(n + "ffn_down.weight", hp.n_ff, e));
    PAGODA_ASSIGN_OR_RETURN(b.down_b, ld.f32(n + "ffn_down.bias", {e}));
  }
  PAGODA_ASSIGN_OR_RETURN(m->post_ln_w_, ld.f32("v.post_ln.weight", {e}));
  PAGODA_ASSIGN_OR_RETURN(m->post_ln_b_, ld.f32("v.post_ln.bias", {e}));
  if (gemma3) {
    PAGODA_ASSIGN_OR_RETURN(m->soft_emb_norm_, ld.f32("mm.soft_emb_norm.weight", {e}));
    PAGODA_ASSIGN_OR_RETURN(const gguf::tensor_info* proj, ld.tensor("mm.input_projection.weight", {hp.projection_dim, e}));
    PAGODA_ASSIGN_OR_RETURN(m->fc_, transposed_projection(*proj, e, hp.projection_dim, m->fc_transposed_));
  } else {
    PAGODA_ASSIGN_OR_RETURN(m->fc_,
                            ld.matrix("mm.model.fc.weight", e * hp.scale_factor * hp.scale_factor, hp.projection_dim));
  }
  PAGODA_RETURN_IF_ERROR(ld.refuse_unused(kind));
  hasher h(0x6d6d70726f6aULL);  // "mmproj"
  h.update_pod(hp.image_size).update_pod(hp.patch_size).update_pod(hp.scale_factor).update_pod(hp.longest_edge);
  h.update_pod(hp.image_mean).update_pod(hp.image_std);
  for (const gguf::tensor_info& t : f.tensors()) {
    h.update_pod(t.name.size()).update(t.name.data(), t.name.size());
    h.update_pod(t.ne).update_pod(t.type).update(t.data, t.size_bytes);
  }
  m->fingerprint_ = h.digest();
  m->file_ = std::move(file);
  return m;
}

const char* projector_name(projector_kind k) {
  switch (k) {
    case projector_kind::idefics3: return "idefics3";
    case projector_kind::gemma3: return "gemma3";
  }
  return "?";
}

status mmproj::check_text_model(int text_n_embd) const {
  if (hp_.projection_dim != text_n_embd)
    return error(errc::invalid_argument,
                 "the mmproj does not match the model: it projects images to width {}, the model's embeddings are {} "
                 "wide",
                 hp_.projection_dim, text_n_embd);
  return ok_status();
}

}  // namespace pagoda::vision
