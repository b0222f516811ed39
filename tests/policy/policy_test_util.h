// Hand-built eviction inputs for the policy tests: a sequence's positions,
// accumulated attention and observation window, owned in one place.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <numeric>
#include <string_view>
#include <vector>

#include "policy/kv_policy.h"

namespace pagoda::test {

struct kv_case {
  int n_layers = 1;
  int n_kv_heads = 1;
  int block_size = 1;
  int n_slots = 0;
  int n_seen = 0;
  int n_prompt = 0;
  int n_new = 1;
  bool prompt_done_now = false;
  bool per_row = false;                 // positions hold a row each
  std::vector<std::int32_t> positions;  // [n_slots], or [n_rows][n_slots] when per_row
  std::vector<float> totals;            // [n_slots][n_rows], or empty
  attention_stats window;
  bool has_window = false;

  // n tokens at positions 0 .. n - 1 in slot order, the same in every row.
  static kv_case contiguous(int n, int layers = 1, int heads = 1) {
    kv_case c;
    c.n_layers = layers;
    c.n_kv_heads = heads;
    c.n_slots = n;
    c.n_seen = n;
    c.n_prompt = n;
    c.positions.resize(static_cast<std::size_t>(n));
    std::iota(c.positions.begin(), c.positions.end(), 0);
    return c;
  }
  int n_rows() const { return n_layers * n_kv_heads; }

  // Gives every row its own copy of the positions (before per-row edits).
  void split_rows() {
    if (per_row) return;
    std::vector<std::int32_t> all;
    for (int r = 0; r < n_rows(); ++r) all.insert(all.end(), positions.begin(), positions.end());
    positions = std::move(all);
    per_row = true;
  }
  // Kills row r's first n slots (dead slots lead a row).
  void kill_front(int r, int n) {
    split_rows();
    for (int s = 0; s < n; ++s) positions[static_cast<std::size_t>(r * n_slots + s)] = -1;
  }
  float& total(int r, int slot) {
    if (totals.empty()) totals.assign(static_cast<std::size_t>(n_slots * n_rows()), 0.0f);
    return totals[static_cast<std::size_t>(slot * n_rows() + r)];
  }
  void use_window(int rows) {
    window.reset(n_layers, n_kv_heads, n_slots, rows);
    has_window = true;
  }
  float& weight(int r, int q, int slot) {
    return window.window[(static_cast<std::size_t>(r) * window.n_window + q) * window.n_kv + slot];
  }

  eviction_input input() const {
    eviction_input in;
    in.n_layers = n_layers;
    in.n_kv_heads = n_kv_heads;
    in.block_size = block_size;
    in.n_slots = n_slots;
    in.n_seen = n_seen;
    in.n_prompt = n_prompt;
    in.n_new = n_new;
    in.prompt_done_now = prompt_done_now;
    in.positions = positions;
    in.row_stride = per_row ? static_cast<std::size_t>(n_slots) : 0;
    in.totals = totals;
    in.window = has_window ? &window : nullptr;
    return in;
  }
};

inline std::unique_ptr<kv_policy> make_policy(std::string_view text) {
  result<kv_policy_spec> spec = parse_kv_policy_spec(text);
  EXPECT_TRUE(spec.ok()) << text << ": " << spec.error().message();
  if (!spec.ok()) return nullptr;
  result<std::unique_ptr<kv_policy>> p = make_kv_policy(*spec);
  EXPECT_TRUE(p.ok()) << text << ": " << p.error().message();
  return p.ok() ? std::move(p).value() : nullptr;
}

inline std::vector<std::int32_t> kept(const eviction_decision& d, int r) {
  const std::span<const std::int32_t> row = d.row(r);
  return {row.begin(), row.end()};
}

inline std::vector<std::int32_t> anchors_of(const eviction_decision& d, int r) {
  const auto first = d.anchors.begin() + static_cast<std::ptrdiff_t>(r) * d.anchors_per_row;
  return {first, first + d.anchors_per_row};
}

inline std::vector<std::int32_t> range(std::int32_t begin, std::int32_t end) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(end - begin));
  std::iota(v.begin(), v.end(), begin);
  return v;
}

inline std::vector<std::int32_t> concat(std::vector<std::int32_t> a, const std::vector<std::int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace pagoda::test
