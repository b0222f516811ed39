// From a public engine_config (strings, as on the command line) to what the
// engine core runs with: the KV layout, the pool size, the context length.
// Shared by the library's engine (engine.h) and every CLI command.
#pragma once

#include <cstdint>
#include <string>

#include "kv/kv_layout.h"
#include "model/llama.h"
#include "pagoda/config.h"
#include "pagoda/status.h"
#include "kv/kv_storage.h"
#include "sched/engine_core.h"
#include "store/warehouse.h"

namespace pagoda {

// The context length to use: config.n_ctx, else the model's trained context.
int context_length(const engine_config& config, const llama_hparams& hp);

// Cross-layer KV sharing of a run (model/kv_share.h).
struct kv_share_plan {
  std::string name;         // kv_layout::sharing: "" when nothing is shared
  std::vector<int> source;  // [n_layer]: the layer whose KV layer l reads; empty: each its own
  // MiniCache (kv/kv_merge.h): the layers that store their KV merged into
  // the KV layer they read (merge_kv_layers), with its parameters.
  std::vector<int> merge_readers;
  float merge_t = 0.6f;
  int merge_retain = 0;
  bool shares() const { return !name.empty(); }
};
// A --kv-share spec as given, checked without a model: the name, the
// parameters (usage errors at the command line).
struct kv_share_spec {
  std::string name;  // "reuse", "minicache"; empty: none
  int from = -1;
  float t = 0.6f;                  // minicache: the slerp parameter (MiniCache's default)
  double retain = 1.0 / 16;        // minicache: the fraction of each block's tokens kept apart
};
result<kv_share_spec> parse_kv_share_spec(std::string_view text);
// The sharing of a run: the model's declared one (hparams::kv_source), or
// `spec` (--kv-share, the NAME:k=v grammar of --kv-policy): "none", or
// "reuse:from=L" (layers L, L + 2, ... compute their KV and the layer above
// each reads it; from = n_layer shares nothing), or
// "minicache:from=L[,t=T][,retain=F]" (the same pairs, each storing one
// merged KV; F of a block's block_size tokens kept apart). A spec on a model
// that declares sharing is refused.
result<kv_share_plan> plan_kv_sharing(const llama_hparams& hp, std::string_view spec, int block_size = 16);


// `layout` (one format per model layer, the same on layers that share) with
// the KV sharing the model declares, if any: what every layout for it needs.
result<kv_layout> with_declared_kv_sharing(const llama_hparams& hp, kv_layout layout);

// The KV layout the config's KV types describe for this model (shared as
// plan_kv_sharing(config.kv_share) says). Errors name the
// option at fault ("--kv-layer-types: layer range 3-9 is past the model's 5 layers").
result<kv_layout> make_kv_layout(const llama_model& model, const engine_config& config);
// The same from the hyper-parameters alone (`pagoda plan` on a synth preset,
// with no file), "auto" meaning auto_type (the model's: f32 for f32 weights, else f16).
result<kv_layout> make_kv_layout(const llama_hparams& hp, kv_type auto_type, const engine_config& config);

// Blocks in the pool: from kv_cache_size_mib or max_kv_tokens, else enough for
// default_tokens. A MiB budget also pays for n_slots staging slots (the f16
// window of sealed formats) and static scales, so the pool's real bytes stay within it.
// A pool larger than the machine's memory (machine_memory_bytes) is an error
// naming the option to lower.
result<std::int64_t> pool_blocks(const kv_layout& layout, const engine_config& config, std::int64_t default_tokens,
                                 std::int64_t n_slots = 1);
// Physical memory (sysconf), or 0 when unknown.
std::int64_t machine_memory_bytes();

// "NAME=BLOCKS" (--tenant-quota) into config.tenant_quota_blocks.
status add_tenant_quota(engine_config& config, const std::string& spec);

// What the model's KV bytes depend on: its metadata (hyper-parameters,
// tokenizer, tensor names, types and shapes) and samples of every tensor's
// data (8 spans of 4 KiB, so a 4 GB file costs milliseconds): two files that
// differ only in their weights (fine-tunes) get different fingerprints.
// The file alone gives the same value (the router fingerprints a model it
// loads only the vocabulary of; the sampled spans are the only data read).
std::uint64_t model_fingerprint(const llama_model& model);
std::uint64_t model_fingerprint(const gguf::file& f);

// The KV warehouse the config asks for (disk and/or Redis tiers), keyed for
// this model (each block brings its own layout); nullptr when it asks for
// none. Errors name the tier. REQUIRES: clock outlives the warehouse.
result<std::unique_ptr<kv_warehouse>> make_warehouse(const engine_config& config, const llama_model& model,
                                                     const clock_source& clock = system_clock_source());

// Makes the warehouse the engine's KV source and the receiver of its commits.
// REQUIRES: the warehouse outlives the engine's use of it.
void attach_warehouse(engine_core& core, kv_warehouse& warehouse);

// The store refs of prompt's full blocks as `core` would key and class them,
// in every KV group, group-major (what the engine's load path asks a KV source
// for, and what it writes):
// for HTTP handlers that ask the warehouse about a prompt.
std::vector<stored_block_ref> prompt_refs(engine_core& core, std::span<const token_id> prompt,
                                          const sequence_options& options);

// "PATH" or "PATH,size=GiB" (--kv-store) into config.kv_store_path / kv_store_size_gib.
status parse_kv_store_option(engine_config& config, const std::string& spec);

// Everything engine_core::create needs. The default pool holds max_num_seqs
// full contexts, capped at 4 GiB.
result<engine_core_config> make_engine_core_config(const llama_model& model, const engine_config& config);

// The draft model config.draft_model_path names (null when none), loaded as
// the model is (mmap); engine_core::create checks its vocabulary. Errors name --draft-model.
result<std::unique_ptr<llama_model>> load_draft_model(const engine_config& config);

}  // namespace pagoda
