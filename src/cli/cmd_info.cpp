// pagoda info: what a model is and what its KV cache costs per token.
#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/common.h"
#include "vision/image_prompt.h"

namespace pagoda::cli {
namespace {

struct info_options {
  engine_config config;
  std::string mmproj;     // --mmproj: the vision tower to describe beside the model
  bool kv_given = false;  // any KV type option: the configured layout gets its own row
};

// One row of the KV table: stored bytes per token (codes + in-tile scales), the
// f16 staging window one sequence holds for sealed formats, and what a single
// sequence costs per token at 1K and 32K tokens with that window included.
void print_kv_row(const std::string& name, const kv_layout& layout) {
  std::printf("  %-32s %7.2f %12.1f %12s %14.1f %14.1f\n", name.c_str(), layout.bits_per_element(),
              layout.bytes_per_token(), human_bytes(static_cast<double>(layout.staging_bytes_per_slot())).c_str(),
              layout.bytes_per_token_at(1024), layout.bytes_per_token_at(32768));
}

// Tensor types with their counts and bytes, and where the weights live: every
// matrix is used in its stored layout (no format is repacked at load), from
// the file's mapping (paged in as used, shared with the page cache) or, with
// --no-mmap, from memory the file was read into at load (resident from the
// start; the part in huge pages is shown). Only the small f32 vectors (norms,
// biases) are copied. Mixed files (Q4_K_M and the like) show each type they hold.
void print_weight_memory(const llama_model& model) {
  std::map<std::string, std::pair<int, std::uint64_t>> types;
  std::uint64_t tensor_bytes = 0;
  const gguf::file& f = model.gguf();
  for (const gguf::tensor_info& t : f.tensors()) {
    auto& [n, bytes] = types[gguf::tensor_type_name(t.type)];
    ++n;
    bytes += t.size_bytes;
    tensor_bytes += t.size_bytes;
  }
  std::printf("tensor types:   ");
  for (const auto& [name, nb] : types)
    std::printf(" %s x%d (%s)", name.c_str(), nb.first, human_bytes(static_cast<double>(nb.second)).c_str());
  std::size_t copied = model.output_norm().size();
  for (const llama_layer& l : model.layers())
    copied += l.attn_norm.size() + l.ffn_norm.size() + l.bq.size() + l.bk.size() + l.bv.size() + l.q_norm.size() +
              l.k_norm.size() + l.post_attn_norm.size() + l.post_ffn_norm.size();
  copied *= sizeof(float);
  const std::string tensors = human_bytes(static_cast<double>(tensor_bytes));
  const std::string norms = human_bytes(static_cast<double>(copied));
  if (f.storage_kind() == gguf::file::storage::read_into_memory) {
    std::printf("\nweights:         %s of tensor data, read into memory at load (--no-mmap; 0 bytes repacked)\n",
                tensors.c_str());
    std::printf("resident:        %s read into memory (the whole file, %s of it in huge pages) + %s copied at load "
                "(f32 norms and biases)\n",
                human_bytes(static_cast<double>(f.size_bytes())).c_str(),
                human_bytes(static_cast<double>(std::min(f.huge_page_bytes(), f.size_bytes()))).c_str(), norms.c_str());
    return;
  }
  std::printf("\nweights:         %s of tensor data, used in place from the file's mapping (0 bytes repacked at load)\n",
              tensors.c_str());
  std::printf("resident:        %s mapped (paged in as used; %s of the file mapped by huge pages now) + %s copied "
              "at load (f32 norms and biases)\n",
              tensors.c_str(), human_bytes(static_cast<double>(std::min(f.huge_page_bytes(), f.size_bytes()))).c_str(),
              norms.c_str());
}

// The architecture's optional parts (model/llama.h), "" for a plain llama block.
std::string block_features(const llama_model& m) {
  const llama_hparams& hp = m.hparams();
  std::vector<std::string> f;
  const llama_layer& first = m.layers().front();
  if (!first.bq.empty()) f.push_back(first.bo.empty() ? "Q/K/V biases" : "Q/K/V and output biases");
  if (!first.attn_sinks.empty()) f.push_back("attention sinks");
  if (hp.qk_norm) f.push_back("per-head Q/K RMSNorm");
  if (hp.post_norms) f.push_back("post-attention and post-FFN norms");
  if (hp.embd_scale != 1.0f) f.push_back(fmt::format("embeddings x {:g}", hp.embd_scale));
  if (hp.attn_softcap > 0) f.push_back(fmt::format("attention soft-cap {:g}", hp.attn_softcap));
  if (hp.final_softcap > 0) f.push_back(fmt::format("final soft-cap {:g}", hp.final_softcap));
  std::string out;
  for (const std::string& x : f) out += (out.empty() ? "" : ", ") + x;
  return out;
}

// The RoPE line: base, width, style and the scaling in effect (model/rope.h).
std::string rope_description(const llama_hparams& hp) {
  std::string out = fmt::format("base {:g}, {} dims, {}", hp.rope_base, hp.rope_dim, hp.rope_neox ? "neox" : "normal");
  const rope_scaling_config& rs = hp.rope_scaling;
  const rope_angles global(rs, hp.rope_dim, hp.rope_base, hp.rope_freq_scale);
  if (rs.type == rope_scaling_type::yarn)
    out += fmt::format(", YaRN x{:g} over an original context of {} (beta fast {:g}, slow {:g}; cos/sin x {:.4g})",
                       rs.factor, rs.n_ctx_orig, rs.beta_fast, rs.beta_slow, global.magnitude());
  else if (hp.rope_freq_scale != 1.0f)
    out += fmt::format(", linear scaling x{:g}", 1.0 / hp.rope_freq_scale);
  if (rs.type != rope_scaling_type::yarn && global.magnitude() != 1.0f)
    out += fmt::format(", cos/sin x {:g}", global.magnitude());
  if (!rs.freq_factors.empty()) {
    const auto [lo, hi] = std::minmax_element(rs.freq_factors.begin(), rs.freq_factors.end());
    out += fmt::format(", frequency factors {:g} to {:g} (rope_freqs)", *lo, *hi);
  }
  if (hp.n_swa_layers() > 0 && hp.rope_base_swa != hp.rope_base)
    out += fmt::format("; base {:g} on sliding-window layers", hp.rope_base_swa);
  return out;
}

// KV bytes per token of each layer type in the configured layout: global
// layers keep every position; sliding-window layers only need the last
// `window` positions (their column at 32K shows that). When every layer
// slides (Mistral v0.1) the cache frees blocks the window moved past; beside
// global layers (Gemma 2/3) the sliding ones keep their window in a KV group
// of their own, about one window per sequence (--swa-full keeps them whole, as
// llama.cpp's swa_full does).
void print_kv_by_layer_type(const llama_hparams& hp, const kv_layout& layout) {
  double bytes[2] = {0, 0};
  int n[2] = {0, 0};
  for (int j = 0; j < layout.n_layers; ++j) {  // KV layers: a shared one counts once
    const int t = hp.is_swa(layout.kv_producer(j)) ? 1 : 0;
    bytes[t] += static_cast<double>(layout.layer_tile_bytes_per_block(j)) / layout.block_size;
    ++n[t];
  }
  std::printf("\nKV per token by layer type (%s; %s):\n", layout.describe().c_str(),
              n[0] == 0 ? "a window on every layer: blocks it moved past are freed"
                        : "sliding-window layers keep their window in a KV group of their own unless --swa-full");
  std::printf("  %-26s %6s %14s %14s %22s\n", "layer type", "layers", "B/token/layer", "B/token", "needed for 32K tokens");
  constexpr std::int64_t k_ctx = 32768;
  if (n[0] > 0)
    std::printf("  %-26s %6d %14.1f %14.1f %22s\n", "global", n[0], bytes[0] / n[0], bytes[0],
                human_bytes(bytes[0] * k_ctx).c_str());
  if (n[1] > 0)
    std::printf("  %-26s %6d %14.1f %14.1f %22s\n", fmt::format("sliding (window {})", hp.sliding_window).c_str(),
                n[1], bytes[1] / n[1], bytes[1],
                human_bytes(bytes[1] * static_cast<double>(std::min<std::int64_t>(k_ctx, hp.sliding_window))).c_str());
}

// A GGUF with metadata and no tensors (llama.cpp's ggml-vocab-*.gguf): what
// it holds, the vocabulary, and what it is good for.
int info_vocabulary_only(const std::string& path, const gguf::file& f) {
  std::printf("model:           %s\n", path.c_str());
  if (auto name = f.get_string("general.name"); name.ok()) std::printf("name:            %s\n", std::string(*name).c_str());
  std::printf("gguf version:    %u, 0 tensors, %zu metadata keys\n", f.version(), f.metadata().size());
  if (auto arch = f.get_string("general.architecture"); arch.ok())
    std::printf("architecture:    %s\n", std::string(*arch).c_str());
  std::printf("contents:        a vocabulary only, no weights: `pagoda tokenize` reads it; run, serve and perplexity "
              "need a model\n");
  PAGODA_ASSIGN_OR_RETURN_CLI(auto vocab, tokenizer::from_gguf(f));
  auto token = [&](token_id t) {
    return t == k_no_token ? std::string("none") : fmt::format("{} '{}'", t, vocab->token_text(t));
  };
  std::printf("vocabulary:      %d (%s tokenizer), BOS %s%s, EOS %s\n", vocab->n_vocab(), vocab->model_name().c_str(),
              token(vocab->bos()).c_str(), vocab->add_bos_default() ? " (added)" : "", token(vocab->eos()).c_str());
  std::printf("chat template:   %s\n", f.get_string("tokenizer.chat_template").ok() ? "yes" : "none");
  return 0;
}

// --mmproj: the vision tower, the tokens an image takes in the prompt (mtmd's
// layout of the family, vision/image_prompt.h: idefics3's slices and
// overview, gemma3's one bidirectional span between its markers) and their
// KV bytes at the configured KV type and --kv-image-type.
int print_vision(const info_options& o, const llama_model& model) {
  auto proj = vision::mmproj::open(o.mmproj);
  if (!proj.ok()) return fail(proj.error().with_context("--mmproj " + o.mmproj));
  PAGODA_RETURN_IF_ERROR_CLI((*proj)->check_text_model(model.hparams().n_embd).with_context("--mmproj " + o.mmproj));
  const vision::vision_hparams& v = (*proj)->hparams();
  const bool gemma3 = v.projector == vision::projector_kind::gemma3;
  std::printf("\nvision tower:    %s (SigLIP ViT, %s x%d) from %s: image %d, patch %d "
              "(%dx%d patches), %d layers, width %d, %d heads, FFN %d, projection %d\n",
              vision::projector_name(v.projector),
              gemma3 ? "average pool, RMS norm and projection" : "pixel-shuffle projector", v.scale_factor,
              o.mmproj.c_str(), v.image_size, v.patch_size, v.patches_per_side(), v.patches_per_side(), v.n_layer,
              v.n_embd, v.n_head, v.n_ff, v.projection_dim);
  const int per_chunk = v.n_output_tokens();
  const auto markers = [](const vision::image_part& p) {
    return p.tokens.size() - static_cast<std::size_t>(p.n_image_tokens());
  };
  // idefics3: the smallest image (one slice and the overview) and the largest grid (longest edge); gemma3: one size.
  const int max_side = gemma3 ? 1 : std::max(1, v.longest_edge / v.image_size);
  const vision::image_part small = gemma3 ? vision::gemma3_layout(model.vocab(), per_chunk)
                                          : vision::idefics3_layout(model.vocab(), 1, 1, per_chunk);
  const vision::image_part large = gemma3 ? small : vision::idefics3_layout(model.vocab(), max_side, max_side, per_chunk);
  if (gemma3) {
    std::printf("image tokens:    %d per image (resized to %dx%d), +%zu marker tokens; attended both ways (one "
                "prompt step: --max-num-batched-tokens >= %d)\n",
                per_chunk, v.image_size, v.image_size, markers(small), per_chunk);
  } else {
    std::printf("image tokens:    %d per %dx%d chunk; an image is its slices (up to %dx%d at the longest edge %d) and an "
                "overview: %d image tokens (+%zu marker tokens) for one slice, %d (+%zu) for %dx%d\n",
                per_chunk, v.image_size, v.image_size, max_side, max_side, v.longest_edge, small.n_image_tokens(),
                markers(small), large.n_image_tokens(), markers(large), max_side, max_side);
  }
  auto kv_row = [&](const std::string& what, const engine_config& cfg) {
    auto layout = make_kv_layout(model, cfg);
    if (!layout.ok()) {
      std::printf("  %-36s %s\n", what.c_str(), layout.error().message().c_str());
      return;
    }
    const double per_token = layout->bytes_per_token();
    std::printf("  %-36s %10.1f %14s %14s\n", (what + " " + layout->describe()).c_str(), per_token,
                human_bytes(per_token * small.n_image_tokens()).c_str(),
                human_bytes(per_token * large.n_image_tokens()).c_str());
  };
  std::printf("KV per image:\n  %-36s %10s %14s %14s\n", "KV type", "B/token", gemma3 ? "an image" : "one slice",
              gemma3 ? "(one size)" : "largest grid");
  kv_row("configured", o.config);
  if (!o.config.kv_image_type.empty()) {
    engine_config img = o.config;
    img.kv_cache_dtype = o.config.kv_image_type;
    img.cache_type_k.clear();
    img.cache_type_v.clear();
    img.kv_layer_types.clear();
    kv_row("--kv-image-type", img);
  }
  return 0;
}

int info(const info_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(auto file, gguf::file::open(o.config.model_path, {o.config.use_mmap}));
  if (file->tensors().empty()) return info_vocabulary_only(o.config.model_path, *file);
  auto loaded = llama_model::from_gguf(std::move(file));
  if (!loaded.ok()) return fail(loaded.error().with_context(o.config.model_path));
  auto model = std::move(*loaded);
  const llama_hparams& hp = model->hparams();
  const gguf::file& f = model->gguf();
  std::printf("model:           %s\n", o.config.model_path.c_str());
  if (!hp.name.empty()) std::printf("name:            %s\n", hp.name.c_str());
  std::printf("gguf version:    %u, %zu tensors, %zu metadata keys\n", f.version(), f.tensors().size(),
              f.metadata().size());
  std::printf("architecture:    %s\n", hp.arch.c_str());
  std::printf("parameters:      %lld", static_cast<long long>(model->n_params()));
  if (hp.moe.n_expert > 0) std::printf(" (%lld active per token)", static_cast<long long>(model->n_active_params()));
  std::printf("\n");
  std::printf("layers:          %d\n", hp.n_layer);
  std::printf("embedding:       %d\n", hp.n_embd);
  std::printf("heads:           %d query, %d KV (GQA group %d), head_dim %d\n", hp.n_head, hp.n_head_kv, hp.n_rep(),
              hp.head_dim);
  if (hp.moe.n_expert > 0)  // routed experts (model/moe.h); the dense width is only a key
    std::printf("feed-forward:    %d experts of %d, %d per token (%s; %s%s)\n", hp.moe.n_expert, hp.moe.n_ff_exp,
                hp.moe.n_expert_used,
                hp.moe.activation == moe_activation::swiglu_oai ? "clamped SwiGLU, biased" : "SwiGLU",
                hp.moe.gating == moe_gating::softmax_weight
                    ? fmt::format("biased router, top-{} logits weighed by their softmax", hp.moe.n_expert_used).c_str()
                    : fmt::format("softmax router, top-{} weights {}", hp.moe.n_expert_used,
                                  hp.moe.norm_weights ? "renormalised" : "as routed").c_str(),
                hp.moe.weights_scale != 1.0f ? fmt::format(", x{:g}", hp.moe.weights_scale).c_str() : "");
  else
    std::printf("feed-forward:    %d (%s)\n", hp.n_ff, hp.gelu ? "GeGLU, tanh GELU" : "SwiGLU");
  if (const std::string f = block_features(*model); !f.empty()) std::printf("block:           %s\n", f.c_str());
  if (hp.n_swa_layers() > 0)
    std::printf("attention:       sliding window of %d on %d of %d layers (the others global)\n", hp.sliding_window,
                hp.n_swa_layers(), hp.n_layer);
  std::printf("vocabulary:      %d (%s tokenizer)\n", hp.n_vocab, model->vocab().model_name().c_str());
  std::printf("context:         %d (trained, from metadata)\n", hp.n_ctx_train);
  std::printf("rope:            %s\n", rope_description(hp).c_str());
  std::printf("rms epsilon:     %g\n", hp.rms_eps);
  std::printf("output:          %s\n", hp.tied_output ? "tied to token embeddings" : "separate");
  print_weight_memory(*model);
  auto shared = make_kv_layout(*model, o.config);
  const int n_kv_layers = shared.ok() ? shared->n_layers : hp.n_layer;
  if (shared.ok() && !shared->layer_map.empty()) {
    std::string map;
    for (int l = 0; l < hp.n_layer; ++l) map += fmt::format("{}{}", l ? " " : "", shared->kv_layer_of(l));
    std::printf("KV sharing:      %s: %d KV layers for %d layers (KV layer of each layer: %s)\n",
                shared->sharing.c_str(), shared->n_layers, hp.n_layer, map.c_str());
  }
  std::printf("\nKV cache per token (2 x %d KV layers x %d KV heads x %d values, block of %d tokens), scales and\n"
              "padding included; sealed formats (per-channel keys) keep the newest block in an f16 window per sequence:\n",
              n_kv_layers, hp.n_head_kv, hp.head_dim, o.config.block_size);
  std::printf("  %-32s %7s %12s %12s %14s %14s\n", "K+V format", "bits/el", "bytes/token", "f16 window",
              "B/token @1K", "B/token @32K");
  // One type for every layer, K and V (as --kv-cache-dtype takes it); scales
  // only when the configured ones apply (keep_scales).
  auto type_row = [&](const std::string& type, bool keep_scales) {
    engine_config opts = o.config;
    opts.kv_cache_dtype = type;
    opts.cache_type_k.clear();
    opts.cache_type_v.clear();
    opts.kv_layer_types.clear();
    if (!keep_scales) opts.kv_scales_path.clear();
    auto layout = make_kv_layout(*model, opts);
    if (layout.ok()) print_kv_row(layout->describe(), *layout);
    else std::printf("  %-32s %s\n", type.c_str(), layout.error().message().c_str());
  };
  auto row = [&](const std::string& k, const std::string& v) { type_row(k + "+" + v, false); };
  for (int i = 0; i < k_n_kv_types; ++i) {
    const char* t = kv_type_name(static_cast<kv_type>(i));
    row(t, t);
  }
  // Per-token keys (the comparison with KIVI's per-channel keys) and the K/V mixes.
  for (auto [k, v] : {std::pair{"int4/token", "int4"}, {"int2/token", "int2"}, {"int8", "int4"}, {"int4", "int2"},
                      {"int8", "int2"}})
    row(k, v);
  PAGODA_ASSIGN_OR_RETURN_CLI(kv_layout configured, make_kv_layout(*model, o.config));
  if (o.kv_given) {
    std::printf("configured:\n");
    print_kv_row(configured.describe(), configured);
  }
  if (!o.config.kv_segment_dtypes.empty()) {
    std::printf("KV classes for prompt parts that ask for their type (--kv-segment-dtype TYPE[:FRACTION of the "
                "pool's bytes, default 0.25]):\n");
    for (const std::string& t : o.config.kv_segment_dtypes) type_row(t.substr(0, t.rfind(':')), true);
  }
  print_kv_by_layer_type(hp, configured);
  if (!o.mmproj.empty()) return print_vision(o, *model);
  return 0;
}

}  // namespace

void register_info(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<info_options>();
  CLI::App* cmd = app.add_subcommand("info", "describe a model and its KV cost");
  add_model_options(cmd, opts->config);
  add_kv_options(cmd, opts->config);
  cmd->add_option("--mmproj", opts->mmproj, "FILE: llama.cpp's vision projector GGUF: its tower, tokens and KV per image")
      ->check(CLI::ExistingFile);
  cmd->callback([opts, cmd, &action] {
    for (const char* flag : {"--kv-cache-dtype", "--cache-type-k", "--cache-type-v", "--kv-layer-types", "--kv-scales"})
      opts->kv_given = opts->kv_given || cmd->count(flag) > 0;
    action = [opts] { return info(*opts); };
  });
}

}  // namespace pagoda::cli
