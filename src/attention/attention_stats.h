// Attention statistics of one sequence in one forward step, for eviction
// policies (H2O's accumulated attention, SnapKV's observation window): the
// softmax weight each KV slot received, summed over the query heads of each KV
// head's group, per layer.
#pragma once

#include <cstddef>
#include <vector>

#include "attention/paged_attention.h"

namespace pagoda {

struct attention_stats {
  int n_layers = 0;
  int n_kv_heads = 0;
  int n_kv = 0;      // KV slots the step's queries could see (stored + new)
  int n_window = 0;  // query tokens with a row of their own: the last n_window of the step
  std::vector<float> accumulated;  // [n_layers][n_kv_heads][n_kv]: over every query row of the step
  std::vector<float> window;       // [n_layers][n_kv_heads][n_window][n_kv]

  // Zeroed arrays for this shape.
  void reset(int layers, int kv_heads, int kv, int window_rows) {
    n_layers = layers;
    n_kv_heads = kv_heads;
    n_kv = kv;
    n_window = window_rows;
    accumulated.assign(static_cast<std::size_t>(layers) * kv_heads * kv, 0.0f);
    window.assign(static_cast<std::size_t>(layers) * kv_heads * window_rows * kv, 0.0f);
  }
  float* accumulated_at(int layer, int head) {
    return accumulated.data() + (static_cast<std::size_t>(layer) * n_kv_heads + head) * n_kv;
  }
  float* window_at(int layer, int head) {
    return window.data() + (static_cast<std::size_t>(layer) * n_kv_heads + head) * n_window * n_kv;
  }
  // Where attention of (layer, head) adds its weights.
  attention_stats_out out(int layer, int head) {
    return {accumulated_at(layer, head), n_window > 0 ? window_at(layer, head) : nullptr, n_window};
  }
};

}  // namespace pagoda
