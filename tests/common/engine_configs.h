// The engine configuration the engine tests start from: one thread, every
// layer's K and V of one type in blocks of 16, and the sizes a test names
// (C++20 designated initializers: test::uniform_engine(hp, {.n_blocks = 64})).
// Header-only, as the rest of tests/common.
#pragma once

#include <cstdint>

#include "model/llama.h"
#include "sched/engine_core.h"

namespace pagoda::test {

struct engine_sizes {
  std::int64_t n_blocks = 256;
  kv_type type = kv_type::f32;  // K and V
  int max_model_len = 512;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  int n_threads = 1;
  int block_size = 16;
};

inline engine_core_config uniform_engine(const llama_hparams& hp, const engine_sizes& s) {
  engine_core_config c;
  c.n_threads = s.n_threads;
  c.max_model_len = s.max_model_len;
  c.max_num_seqs = s.max_num_seqs;
  c.max_num_batched_tokens = s.max_num_batched_tokens;
  c.kv = kv_layout::uniform(hp.n_layer, hp.n_head_kv, hp.head_dim, s.block_size, s.type, s.type);
  c.n_blocks = s.n_blocks;
  return c;
}

}  // namespace pagoda::test
