// The KV class rule (kv_manager.h, "KV classes"): which class a block of
// slots takes, from the class runs of its sequence. Internal to src/kv.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kv/kv_ops.h"
#include "kv/prefix_index.h"

namespace pagoda::kv_rule {

// The class whose runs hold every one of n increasing token indices t(0), ...,
// t(n - 1); 0 when one of them is outside every run or two are in runs of
// different classes. O(n + log runs).
template <typename Index>
std::int32_t class_of_tokens(std::span<const kv_class_run> runs, std::int32_t n, Index t) {
  if (runs.empty() || n <= 0) return 0;
  // The first run that ends after t(0) (runs are sorted, so their ends increase).
  auto r = std::upper_bound(runs.begin(), runs.end(), t(0),
                            [](std::int64_t p, const kv_class_run& run) { return p < run.end; });
  if (r == runs.end() || r->begin > t(0)) return 0;
  const std::uint8_t cls = r->cls;
  for (std::int32_t i = 1; i < n; ++i) {
    const std::int64_t p = t(i);
    while (r != runs.end() && r->end <= p) ++r;
    if (r == runs.end() || r->begin > p || r->cls != cls) return 0;
  }
  return cls;
}

// The class of a block whose slots hold tokens first, first + 1, ... (block_size of them).
inline std::int32_t class_of_block(std::span<const kv_class_run> runs, std::int64_t first, std::int32_t block_size) {
  return class_of_tokens(runs, block_size, [first](std::int32_t k) { return first + k; });
}

// The class of prompt block i (slot k holds token k).
inline std::int32_t prompt_block_class(std::span<const kv_class_run> runs, std::size_t i, std::int32_t block_size) {
  return class_of_block(runs, static_cast<std::int64_t>(i) * block_size, block_size);
}

// The extra keys of a block: the first block's extras (tenant, salt) for
// block 0, and the class's key for a class other than 0.
inline std::string block_extras(std::string_view first_extras, std::size_t block_index, std::int32_t cls,
                                std::span<const std::string> class_keys) {
  std::string out(block_index == 0 ? first_extras : std::string_view());
  if (cls != 0) out += extra_keys().add(extra_key_kind::kv_class, class_keys[static_cast<std::size_t>(cls)]).bytes();
  return out;
}

}  // namespace pagoda::kv_rule
