// Static KV scales: calibrated per-channel ranges of keys and values, written by
// `pagoda calibrate` and read by `--kv-scales`. Codecs turn a range into their
// own parameters (kv_codec::make_static); the file holds only the ranges, so one
// file serves every codec.
//
// File format (JSON):
//   {"format": "pagoda-kv-scales", "version": 1, "model": "...", "clip": "max" | "p99.9",
//    "tokens": N, "n_layers": L, "n_kv_heads": H, "head_dim": D,
//    "layers": [{"k": {"lo": [[D floats] x H], "hi": [...]}, "v": {...}}, ... L entries]}
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagoda/status.h"
#include "quant/kv_codec.h"

namespace pagoda {

struct kv_scales {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  std::string model;
  std::string clip = "max";
  std::int64_t n_tokens = 0;
  std::vector<float> k_lo, k_hi, v_lo, v_hi;  // [n_layers][n_kv_heads][head_dim]

  std::size_t index(int layer, int head) const {
    return (static_cast<std::size_t>(layer) * n_kv_heads + head) * head_dim;
  }
  const float* lo(kv_role role, int layer, int head) const {
    return (role == kv_role::key ? k_lo : v_lo).data() + index(layer, head);
  }
  const float* hi(kv_role role, int layer, int head) const {
    return (role == kv_role::key ? k_hi : v_hi).data() + index(layer, head);
  }
  // An error naming both shapes when the file was calibrated for another model.
  status check_shape(int n_layers, int n_kv_heads, int head_dim) const;
};

result<kv_scales> load_kv_scales(const std::string& path);
status save_kv_scales(const kv_scales& scales, const std::string& path);

// Collects per-channel ranges of K and V. percentile 100 keeps the exact
// minimum and maximum; below 100 each channel's range is clipped to its
// [100 - p, p] percentiles (outliers then saturate at the ends of the range).
// Exact: the (1 - p/100) * max_tokens most extreme values of each channel are
// kept in heaps, so memory is O(channels * that count), not O(tokens).
class kv_range_calibrator {
 public:
  // REQUIRES: 0 < percentile <= 100; max_tokens >= the tokens that add() will see.
  kv_range_calibrator(int n_layers, int n_kv_heads, int head_dim, double percentile, std::int64_t max_tokens);

  // x: [n][n_kv_heads][head_dim] of one layer, K or V.
  void add(int layer, kv_role role, const float* x, int n);

  kv_scales finish() const;

 private:
  struct channel {
    std::vector<float> top;     // min-heap of the largest values
    std::vector<float> bottom;  // max-heap of the smallest values
  };
  channel& at(int layer, kv_role role, int head, int d);

  int n_layers_, n_kv_heads_, head_dim_;
  double percentile_;
  std::size_t keep_;  // extremes kept per side
  std::int64_t n_tokens_[2] = {0, 0};
  std::vector<channel> channels_;  // [role][layer][head][d]
};

}  // namespace pagoda
