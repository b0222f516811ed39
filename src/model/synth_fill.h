// Deterministic random tensors for synthetic GGUF files (model/synth.h and
// vision/mmproj_synth.h): the same bytes for a (seed, tensor id, row) whatever
// the thread count or the chunking.
#pragma once

#include <cstdint>
#include <memory>

#include "core/thread_pool.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"

namespace pagoda::synth_detail {

// A tensor of rows of n_in values: constant + uniform in [-amplitude,
// amplitude) (all `constant` when amplitude is 0), encoded as `type`.
struct tensor_recipe {
  std::uint64_t seed;
  std::uint64_t id;
  gguf::tensor_type type;
  std::int64_t n_in;
  float amplitude;
  float constant;
};

// The writer's fill function for a recipe; rows are generated on `pool`.
gguf::tensor_fill_fn make_fill(tensor_recipe r, std::shared_ptr<thread_pool> pool);

}  // namespace pagoda::synth_detail
