// pagoda info: what a model is and what its KV cache costs per token.
#include <cstdio>
#include <map>

#include "cli/commands.h"
#include "cli/common.h"

namespace pagoda::cli {
namespace {

struct info_options {
  model_options model;
  int block_size = 16;
};

int info(const info_options& o) {
  PAGODA_ASSIGN_OR_RETURN_CLI(auto model, load_model(o.model));
  const llama_hparams& hp = model->hparams();
  const gguf::file& f = model->gguf();
  std::printf("model:           %s\n", o.model.path.c_str());
  if (!hp.name.empty()) std::printf("name:            %s\n", hp.name.c_str());
  std::printf("gguf version:    %u, %zu tensors, %zu metadata keys\n", f.version(), f.tensors().size(),
              f.metadata().size());
  std::printf("architecture:    %s\n", hp.arch.c_str());
  std::printf("parameters:      %lld\n", static_cast<long long>(model->n_params()));
  std::printf("layers:          %d\n", hp.n_layer);
  std::printf("embedding:       %d\n", hp.n_embd);
  std::printf("heads:           %d query, %d KV (GQA group %d), head_dim %d\n", hp.n_head, hp.n_head_kv, hp.n_rep(),
              hp.head_dim);
  std::printf("feed-forward:    %d (SwiGLU)\n", hp.n_ff);
  std::printf("vocabulary:      %d (%s tokenizer)\n", hp.n_vocab, model->vocab().model_name().c_str());
  std::printf("context:         %d (trained, from metadata)\n", hp.n_ctx_train);
  std::printf("rope:            base %g, %d dims, %s\n", hp.rope_base, hp.rope_dim, hp.rope_neox ? "neox" : "normal");
  std::printf("rms epsilon:     %g\n", hp.rms_eps);
  std::printf("output:          %s\n", hp.tied_output ? "tied to token embeddings" : "separate");
  std::map<std::string, int> types;
  for (const gguf::tensor_info& t : f.tensors()) ++types[gguf::tensor_type_name(t.type)];
  std::printf("tensor types:   ");
  for (const auto& [name, n] : types) std::printf(" %s x%d", name.c_str(), n);
  std::printf("\n\nKV cache per token (2 x %d layers x %d KV heads x %d x bytes):\n", hp.n_layer, hp.n_head_kv,
              hp.head_dim);
  std::printf("  %-10s %14s %16s %16s\n", "type", "bytes/token", "per 1K tokens", "per 32K tokens");
  for (int i = 0; i < k_n_kv_types; ++i) {
    kv_type t = static_cast<kv_type>(i);
    if (!get_kv_codec(t)) continue;
    // Measured from the codec's real tile size: scales and padding included.
    kv_layout layout = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, o.block_size, t, t);
    double per_token = layout.bytes_per_token();
    std::printf("  %-10s %14.1f %16s %16s\n", kv_type_name(t), per_token, human_bytes(per_token * 1024).c_str(),
                human_bytes(per_token * 32768).c_str());
  }
  return 0;
}

}  // namespace

void register_info(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<info_options>();
  CLI::App* cmd = app.add_subcommand("info", "describe a model and its KV cost");
  add_model_options(cmd, opts->model);
  cmd->add_option("--block-size", opts->block_size, "KV block size for the per-token figures")->check(CLI::Range(1, 1024));
  cmd->callback([opts, &action] { action = [opts] { return info(*opts); }; });
}

}  // namespace pagoda::cli
