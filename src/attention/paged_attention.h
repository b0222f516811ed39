// Causal attention over paged KV views, on encoded tiles (codec qk/av).
//
// Two passes per (sequence, KV head, group of query tokens): scores for every
// cached position through the key codec, an exact softmax per query row over
// its own causal range, then the weighted value sum through the value codec.
// Every KV byte is read once per group. Codecs get the whole run of a head's
// tiles at once; a staged (f16) last block of a sealed format goes through the
// f16 codec.
//
// Batch invariance: a query row's output depends only on its own q, its
// position and the cache contents up to that position, never on which other
// rows share its group (prefill chunk) or step. Positions a row must not see
// get weight exactly 0, and the codecs add 0-weighted rows exactly. This holds
// bitwise for every format that is not sealed; sealed formats (per-channel
// scales) are deterministic but a query sees its own block as f16 while the
// block is open and as codes once a later write has sealed it (kv_storage.h).
#pragma once

#include <cstddef>
#include <vector>

#include "kv/kv_storage.h"

namespace pagoda {

// Per-thread reusable buffers; grown on demand, never shrunk.
struct attention_scratch {
  std::vector<const void*> tiles;  // [blocks] tile pointers of one head
  std::vector<float> q;       // [rows][head_dim], pre-scaled
  std::vector<float> scores;  // [rows][ld]
  std::vector<float> acc;     // [rows][head_dim]
  std::vector<float> row_sum; // [rows]
};

struct attention_task {
  const paged_kv_view* k = nullptr;
  const paged_kv_view* v = nullptr;
  int kv_head = 0;
  int n_rep = 1;          // query heads per KV head (GQA)
  int head_dim = 0;
  float scale = 1.0f;     // usually 1/sqrt(head_dim)
  // Queries: n_tokens tokens at positions pos0 .. pos0 + n_tokens - 1; token i,
  // query head (kv_head * n_rep + j) is at q + i * q_stride + (kv_head * n_rep + j) * head_dim.
  const float* q = nullptr;
  std::size_t q_stride = 0;
  int n_tokens = 0;
  int pos0 = 0;
  // Output laid out like q.
  float* out = nullptr;
  std::size_t out_stride = 0;
};

// REQUIRES: k and v cover positions [0, pos0 + n_tokens).
void paged_attention(const attention_task& task, attention_scratch& scratch);

// Plain reference twin: decodes each needed key/value with the codec and
// computes attention in double precision, one query at a time.
void paged_attention_ref(const attention_task& task);

// Softmax of s[0, n) in place, returning the sum of exponentials; the entries are
// left unnormalised (exp(s - max)). Dispatches on the SIMD level.
float softmax_unnormalized(float* s, int n);
float softmax_unnormalized_ref(float* s, int n);

}  // namespace pagoda
