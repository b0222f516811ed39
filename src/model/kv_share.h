// Cross-layer KV sharing (docs/kv-sharing.md): which model layer's K/V each
// layer reads. A model may declare it (GGUF key pagoda.kv_source_layers,
// written by `pagoda synth --cla N` and `--yoco`: layers without K/V
// projections read an earlier layer's KV), or a run may choose it for any
// model (--kv-share reuse:from=L). The engine turns the sources into the KV
// layout's layer map (share_kv_layers, kv/kv_layout.h): one KV layer per
// producer, read by every layer that names it.
#pragma once

#include <string_view>
#include <vector>

#include "pagoda/status.h"

namespace pagoda {

struct llama_hparams;

// The GGUF key of a declared sharing: one int32 per layer, the layer whose
// K/V it reads (its own index when it computes its own).
inline constexpr std::string_view k_kv_source_key = "pagoda.kv_source_layers";

// A layer's source must come before it and compute its own KV, and both must
// attend alike (sliding window or not, the same RoPE): errors name `what`.
status check_kv_sources(const llama_hparams& hp, const std::vector<int>& source, std::string_view what);

// CLA: groups of `group` adjacent layers read their first layer's KV.
std::vector<int> cla_sources(int n_layer, int group);
// YOCO: the lower half computes its own KV; the upper half reads the KV the
// middle layer (n_layer / 2) computes.
std::vector<int> yoco_sources(int n_layer);

}  // namespace pagoda
