#include "vision/mmproj_synth.h"

#include <cmath>
#include <memory>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "core/thread_pool.h"
#include "model/gguf_writer.h"
#include "model/synth_fill.h"

namespace pagoda::vision {

namespace {

using gguf::tensor_type;
using synth_detail::make_fill;

// Uniform on [-a, a) has standard deviation a / sqrt(3).
float amplitude_for(std::int64_t n_in) { return static_cast<float>(std::sqrt(3.0 / static_cast<double>(n_in))); }

std::unique_ptr<gguf::writer> build_writer(const mmproj_synth_options& o, std::shared_ptr<thread_pool> pool) {
  auto w = std::make_unique<gguf::writer>(3);
  w->set_alignment(32);
  w->add_string("general.architecture", "clip");
  w->add_string("general.type", "mmproj");
  const bool gemma3 = o.projector == projector_kind::gemma3;
  w->add_string("general.name", fmt::format("{} (synthetic)", projector_name(o.projector)));
  w->add_u32("general.file_type", o.weight_type == tensor_type::f32 ? 0 : o.weight_type == tensor_type::f16 ? 1 : 7);
  w->add_string("clip.projector_type", projector_name(o.projector));
  w->add_bool("clip.has_vision_encoder", true);
  w->add_bool("clip.use_gelu", true);
  w->add_u32("clip.vision.projection_dim", static_cast<std::uint32_t>(o.projection_dim));
  w->add_u32("clip.vision.image_size", static_cast<std::uint32_t>(o.image_size));
  w->add_u32("clip.vision.patch_size", static_cast<std::uint32_t>(o.patch_size));
  w->add_u32("clip.vision.embedding_length", static_cast<std::uint32_t>(o.n_embd));
  w->add_u32("clip.vision.feed_forward_length", static_cast<std::uint32_t>(o.n_ff));
  w->add_u32("clip.vision.block_count", static_cast<std::uint32_t>(o.n_layer));
  w->add_u32("clip.vision.attention.head_count", static_cast<std::uint32_t>(o.n_head));
  w->add_f32("clip.vision.attention.layer_norm_epsilon", o.eps);
  w->add_array("clip.vision.image_mean", std::span<const float>(o.image_mean));
  w->add_array("clip.vision.image_std", std::span<const float>(o.image_std));
  if (!gemma3 || o.scale_factor != 4)
    w->add_u32("clip.vision.projector.scale_factor", static_cast<std::uint32_t>(o.scale_factor));
  if (!gemma3) w->add_u32("clip.vision.preproc_image_size", static_cast<std::uint32_t>(o.longest_edge));

  std::uint64_t id = 0;
  auto add = [&](const std::string& name, std::initializer_list<std::int64_t> ne, tensor_type t, float amplitude,
                 float constant) {
    const std::vector<std::int64_t> dims(ne);
    if (name == o.omit_tensor) {
      ++id;
      return;
    }
    w->add_tensor(name, t, dims, make_fill({o.seed, id++, t, dims[0], amplitude, constant}, pool));
  };
  auto matrix = [&](const std::string& name, std::int64_t n_in, std::int64_t n_out) {
    add(name, {n_in, n_out}, o.weight_type, amplitude_for(n_in), 0);
  };
  auto bias = [&](const std::string& name, std::int64_t n) { add(name, {n}, tensor_type::f32, 0.1f, 0); };
  auto norm = [&](const std::string& name, std::int64_t n) {
    add(name + ".weight", {n}, tensor_type::f32, 0.2f, 1.0f);
    bias(name + ".bias", n);
  };

  const std::int64_t e = o.n_embd;
  const std::int64_t p = o.patch_size;
  const std::int64_t n_side = o.image_size / o.patch_size;
  add("v.patch_embd.weight", {p, p, 3, e}, tensor_type::f32, amplitude_for(3 * p * p), 0);
  bias("v.patch_embd.bias", e);
  add("v.position_embd.weight", {e, n_side * n_side}, tensor_type::f32, 0.5f, 0);
  for (int l = 0; l < o.n_layer; ++l) {
    const std::string b = fmt::format("v.blk.{}.", l);
    norm(b + "ln1", e);
    for (const char* m : {"attn_q", "attn_k", "attn_v", "attn_out"}) {
      matrix(b + m + ".weight", e, e);
      bias(b + m + ".bias", e);
    }
    norm(b + "ln2", e);
    matrix(b + "ffn_up.weight", e, o.n_ff);
    bias(b + "ffn_up.bias", o.n_ff);
    matrix(b + "ffn_down.weight", o.n_ff, e);
    bias(b + "ffn_down.bias", e);
  }
  norm("v.post_ln", e);
  if (gemma3) {
    add("mm.soft_emb_norm.weight", {e}, tensor_type::f32, 0.2f, 1.0f);
    // ggml ne [projection_dim, n_embd]: llama.cpp multiplies by its transpose.
    add("mm.input_projection.weight", {o.projection_dim, e},
        o.weight_type == tensor_type::f32 ? tensor_type::f32 : tensor_type::f16, amplitude_for(e), 0);
  } else {
    const std::int64_t merged = e * o.scale_factor * o.scale_factor;
    matrix("mm.model.fc.weight", merged, o.projection_dim);
  }
  if (!o.extra_tensor.empty()) bias(o.extra_tensor, e);
  return w;
}

}  // namespace

status validate(const mmproj_synth_options& o) {
  for (auto [what, v] : {std::pair{"projection width", o.projection_dim}, std::pair{"image size", o.image_size},
                         std::pair{"patch size", o.patch_size}, std::pair{"embedding width", o.n_embd},
                         std::pair{"head count", o.n_head}, std::pair{"feed-forward width", o.n_ff},
                         std::pair{"block count", o.n_layer}, std::pair{"scale factor", o.scale_factor},
                         std::pair{"longest edge", o.longest_edge}}) {
    if (v < 1 || v > (1 << 16)) return error(errc::invalid_argument, "mmproj {} {} not in 1..65536", what, v);
  }
  if (o.image_size % o.patch_size != 0)
    return error(errc::invalid_argument, "mmproj image size {} is not a multiple of the patch size {}", o.image_size,
                 o.patch_size);
  if ((o.image_size / o.patch_size) % o.scale_factor != 0 || (o.projector == projector_kind::idefics3 && o.scale_factor < 2))
    return error(errc::invalid_argument, "mmproj: {} patches per side is not a multiple of the scale factor {} (idefics3: at least 2)",
                 o.image_size / o.patch_size, o.scale_factor);
  if (o.n_embd % o.n_head != 0)
    return error(errc::invalid_argument, "mmproj embedding width {} is not a multiple of the head count {}", o.n_embd,
                 o.n_head);
  if (o.n_ff == o.n_embd)
    return error(errc::invalid_argument,
                 "mmproj feed-forward width must differ from the embedding width {} (llama.cpp would read the MLP "
                 "as a legacy file with up and down swapped)",
                 o.n_embd);
  if (o.weight_type != tensor_type::f32 && o.weight_type != tensor_type::f16 && o.weight_type != tensor_type::q8_0)
    return error(errc::invalid_argument, "mmproj weight type {}: synth writes f32, f16 or q8_0",
                 gguf::tensor_type_name(o.weight_type));
  if (o.weight_type == tensor_type::q8_0 && (o.n_embd % 32 != 0 || o.n_ff % 32 != 0))
    return error(errc::invalid_argument, "mmproj q8_0 weights need widths that are multiples of 32");
  return ok_status();
}

status write_synth_mmproj(const mmproj_synth_options& o, const std::string& path) {
  PAGODA_RETURN_IF_ERROR(validate(o));
  return build_writer(o, std::make_shared<thread_pool>(o.n_threads))->write_file(path).with_context("synth mmproj");
}

}  // namespace pagoda::vision
