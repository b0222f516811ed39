// pagoda synth: a random-weight model with a real model's shapes, for speed and
// memory work at realistic sizes. Its text means nothing.
#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/common.h"
#include "model/synth.h"
#include "vision/mmproj_synth.h"

namespace pagoda::cli {
namespace {

struct synth_cli_options {
  std::string preset = "llama3-8b";
  std::string weight_type = "q8_0";
  int layers = 0;
  int ffn = 0;
  int vocab = 512;
  int ctx = 0;
  std::uint64_t seed = 42;
  int cla = 0;
  bool yoco = false;
  int threads = 0;
  std::string output;
  bool list = false;
  // --mmproj: a vision tower and projector instead of the text model.
  bool mmproj = false;
  std::string projector = "idefics3";
  vision::mmproj_synth_options vision;
};

// The mmproj pairs with the text model the same preset, layers and vocabulary
// would give: its projection width is that model's n_embd.
int synth_mmproj(const synth_cli_options& o, const synth_shape& text) {
  vision::mmproj_synth_options v = o.vision;
  v.projection_dim = text.n_embd;
  v.seed = o.seed;
  v.n_threads = o.threads;
  PAGODA_ASSIGN_OR_RETURN_CLI(v.weight_type, parse_synth_weight_type(o.weight_type));
  if (o.projector == "gemma3") v.projector = vision::projector_kind::gemma3;
  else if (o.projector != "idefics3")
    return fail(error(errc::invalid_argument, "--projector {}: synth writes idefics3 or gemma3", o.projector));
  const bool gemma3 = v.projector == vision::projector_kind::gemma3;
  std::fprintf(stderr,
               "pagoda synth: mmproj %s for %s: image %d, patch %d, %d blocks, embd %d, %d heads, ffn %d, "
               "%s %d, projection %d, %s weights\n",
               vision::projector_name(v.projector), text.name, v.image_size, v.patch_size, v.n_layer, v.n_embd,
               v.n_head, v.n_ff, gemma3 ? "average pool" : "pixel shuffle", v.scale_factor, v.projection_dim,
               o.weight_type.c_str());
  if (auto st = vision::write_synth_mmproj(v, o.output); !st.ok()) return fail(st);
  std::fprintf(stderr, "pagoda synth: wrote %s\n", o.output.c_str());
  return 0;
}

int synth(const synth_cli_options& o) {
  if (o.list) {
    std::printf("%-16s %-8s %6s %5s %5s %5s %7s %6s %7s %7s %9s\n", "preset", "arch", "embd", "heads", "kv", "hdim",
                "ffn", "layers", "vocab", "window", "experts");
    for (const synth_shape& s : synth_presets()) {
      // MoE presets: the expert width in the ffn column, "used/total" experts.
      const std::string experts = s.n_expert > 0 ? std::to_string(s.n_expert_used) + "/" + std::to_string(s.n_expert) : "-";
      std::printf("%-16s %-8s %6d %5d %5d %5d %7d %6d %7d %7d %9s\n", s.name, s.arch, s.n_embd, s.n_head,
                  s.n_head_kv, s.head_dim, s.n_expert > 0 ? s.n_ff_exp : s.n_ff, s.n_layer, s.n_vocab,
                  s.sliding_window, experts.c_str());
    }
    return 0;
  }
  if (o.output.empty()) return fail(error(errc::invalid_argument, "-o/--output is required"));
  synth_options opts;
  opts.preset = o.preset;
  if (o.layers > 0) opts.n_layer = o.layers;
  if (o.ffn > 0) opts.n_ff = o.ffn;
  if (o.ctx > 0) opts.n_ctx = o.ctx;
  opts.n_vocab = o.vocab;
  opts.seed = o.seed;
  opts.cla = o.cla;
  opts.yoco = o.yoco;
  opts.n_threads = o.threads;
  PAGODA_ASSIGN_OR_RETURN_CLI(synth_weights weights, parse_synth_weights(o.weight_type));
  opts.weight_type = weights.type;
  opts.mix = weights.mix;
  PAGODA_ASSIGN_OR_RETURN_CLI(synth_shape shape, resolve_synth_shape(opts));
  if (o.mmproj) return synth_mmproj(o, shape);
  PAGODA_ASSIGN_OR_RETURN_CLI(std::uint64_t bytes, synth_model_size_bytes(opts));
  const std::string ffn = shape.n_expert > 0 ? fmt::format("{} experts of {} ({} per token)", shape.n_expert,
                                                            shape.n_ff_exp, shape.n_expert_used)
                                             : std::to_string(shape.n_ff);
  std::fprintf(stderr, "pagoda synth: %s (%s), %d layers, embd %d, %d/%d heads of %d, ffn %s, vocab %d, %s weights: %s\n",
               shape.name, shape.arch, shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv, shape.head_dim,
               ffn.c_str(), shape.n_vocab, o.weight_type.c_str(), human_bytes(static_cast<double>(bytes)).c_str());
  if (auto st = write_synth_model(opts, o.output); !st.ok()) return fail(st);
  std::fprintf(stderr, "pagoda synth: wrote %s\n", o.output.c_str());
  return 0;
}

}  // namespace

void register_synth(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<synth_cli_options>();
  CLI::App* cmd = app.add_subcommand("synth", "write a random-weight model with a real model's shapes");
  cmd->add_option("--preset", opts->preset,
                  "llama3-8b, llama3-70b, mistral-7b, mistral-7b-v0.1, qwen2-7b, qwen3-8b, gemma2-9b, gemma3-4b, "
                  "phi3-mini, smollm2-135m, qwen3-30b-a3b, gpt-oss-20b, tiny, tiny256, tiny-qwen3, tiny-gemma2, tiny-gemma3, "
                  "tiny-phi3, tiny-qwen3moe, tiny-gpt-oss (--list shows them)");
  cmd->add_option("--layers", opts->layers, "layers (default: the preset's)")->check(CLI::Range(1, 1024));
  cmd->add_option("--ffn", opts->ffn, "feed-forward width, each expert's on MoE presets (default: the preset's)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--weight-type", opts->weight_type,
                  "f16, q8_0, q4_0, q4_K, q5_K or q6_K (also f32, bf16, mxfp4), or llama-quantize's mixes Q4_K_M, Q5_K_M, MXFP4_MOE");
  cmd->add_option("--vocab", opts->vocab, "vocabulary size (0: the real model's)")->check(CLI::Range(0, 1 << 22));
  cmd->add_option("--ctx", opts->ctx, "context length in the metadata")->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--seed", opts->seed, "weight seed");
  cmd->add_option("--cla", opts->cla,
                  "cross-layer attention: groups of N adjacent layers share the first one's KV (declared in the file)");
  cmd->add_flag("--yoco", opts->yoco, "YOCO: the upper half of the layers reads the KV of the middle layer");
  cmd->add_option("-t,--threads", opts->threads, "threads generating weights");
  cmd->add_option("-o,--output", opts->output, "output GGUF path");
  cmd->add_flag("--list", opts->list, "list the presets");
  cmd->add_flag("--mmproj", opts->mmproj,
                "write a vision mmproj (llama.cpp's idefics3: SigLIP ViT + pixel-shuffle projector, or gemma3: "
                "SigLIP ViT + average pool, RMS norm, projection; --projector) for the preset's text model instead "
                "of the model");
  cmd->add_option("--projector", opts->projector, "mmproj: idefics3 (default) or gemma3");
  cmd->add_option("--scale-factor", opts->vision.scale_factor,
                  "mmproj: patches per side merged into a token (idefics3's pixel shuffle, gemma3's pool; default 2)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--image-size", opts->vision.image_size, "mmproj: encoder input size in pixels")->check(CLI::Range(1, 1 << 14));
  cmd->add_option("--patch-size", opts->vision.patch_size, "mmproj: patch size")->check(CLI::Range(1, 1 << 10));
  cmd->add_option("--vision-layers", opts->vision.n_layer, "mmproj: ViT blocks")->check(CLI::Range(1, 256));
  cmd->add_option("--vision-embd", opts->vision.n_embd, "mmproj: ViT width")->check(CLI::Range(1, 1 << 14));
  cmd->add_option("--longest-edge", opts->vision.longest_edge, "mmproj: preprocessing's longest edge")->check(CLI::Range(1, 1 << 14));
  cmd->callback([opts, &action] { action = [opts] { return synth(*opts); }; });
}

}  // namespace pagoda::cli
