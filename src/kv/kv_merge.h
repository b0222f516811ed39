// MiniCache (Liu et al., 2024), training-free: two adjacent layers store one
// KV. For each token and KV head, K and V alike, the lower layer's row a
// (the producer's) and the upper layer's row b (the reader's) are split into
// magnitude and direction. The KV layer stores |a| * slerp(a/|a|, b/|b|; t):
// the producer reads it as is (its own magnitude, the merged direction), the
// reader reads it times the per-slot ratio |b| / |a| (its own magnitude, the
// same direction). The tokens whose directions differ most between the two
// layers are retained: their stored row stays a, and the reader's own b is
// kept beside it, up to `retain` tokens per block and KV head, the most
// divergent ones of the block (a later token that diverges more displaces the
// least divergent retained one, which is then merged). The decision follows
// the block's tokens in slot order, so it is the same however a prompt is
// split into chunks.
//
// Plain arithmetic on rows and on one block's side data, so it tests alone;
// the KV arena (kv_arena.h) stores the side data and the attention kernels
// (paged_attention.h) read it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace pagoda {

// The reader's side data of one block and KV head, as floats:
//   ratio_k[block_size], ratio_v[block_size],
//   retain entries of {slot + 1 (0: empty), divergence, k[head_dim], v[head_dim]}.
// Zeroed memory is a block with nothing retained.
struct kv_merge_shape {
  int block_size = 0;
  int head_dim = 0;
  int retain = 0;  // retained tokens per block and KV head (0 .. block_size)

  std::size_t entry_floats() const { return 2 + 2 * static_cast<std::size_t>(head_dim); }
  std::size_t head_floats() const {
    return 2 * static_cast<std::size_t>(block_size) + static_cast<std::size_t>(retain) * entry_floats();
  }
};

// One block and KV head's side data (see kv_merge_shape).
struct kv_merge_head {
  float* data = nullptr;
  kv_merge_shape shape;

  float* ratio_k() const { return data; }
  float* ratio_v() const { return data + shape.block_size; }
  float* entry(int e) const {
    return data + 2 * static_cast<std::size_t>(shape.block_size) + static_cast<std::size_t>(e) * shape.entry_floats();
  }
  // The slot entry e retains, or -1 when it is empty.
  int slot(int e) const { return static_cast<int>(entry(e)[0]) - 1; }
  float divergence(int e) const { return entry(e)[1]; }
  float* k(int e) const { return entry(e) + 2; }
  float* v(int e) const { return entry(e) + 2 + shape.head_dim; }
  // The entry retaining `slot`, or -1.
  int find(int slot) const;
  // Every entry whose slot is >= n_tokens becomes empty (a block truncated).
  void drop_from(int n_tokens) const;
};

// Read-only twin for attention: a view's side data of one block and head.
struct kv_merge_ref {
  const float* data = nullptr;
  kv_merge_shape shape;

  const float* ratio_k() const { return data; }
  const float* ratio_v() const { return data + shape.block_size; }
  const float* entry(int e) const {
    return data + 2 * static_cast<std::size_t>(shape.block_size) + static_cast<std::size_t>(e) * shape.entry_floats();
  }
  int slot(int e) const { return static_cast<int>(entry(e)[0]) - 1; }
  const float* k(int e) const { return entry(e) + 2; }
  const float* v(int e) const { return entry(e) + 2 + shape.head_dim; }
};

// The angular distance of a and b in [0, 1] (arccos of their cosine, over pi);
// 1 when either is zero (nothing to share).
float kv_row_divergence(const float* a, const float* b, int dim);

// out = |a| * slerp(a/|a|, b/|b|; t) (t = 0: a's direction, 1: b's), computed
// in double; returns |b| / |a|, the reader's ratio. Nearly parallel rows
// interpolate linearly (then normalise); |a| = 0 gives out = 0 and ratio 0
// (kv_row_divergence retains such tokens first); |b| = 0 gives out = a and
// ratio 0. out may alias neither a nor b.
float kv_merge_rows(const float* a, const float* b, int dim, float t, float* out);

// How one token's rows of one head are stored (kv_merge_token).
struct kv_merge_rows_in {
  const float* a_k = nullptr;  // the producer's rows [head_dim]
  const float* a_v = nullptr;
  const float* b_k = nullptr;  // the reader's rows [head_dim]
  const float* b_v = nullptr;
};

// A row pair to encode at a slot of the KV layer after kv_merge_token.
struct kv_merge_write {
  int slot = -1;  // -1: none
  const float* k = nullptr;  // [head_dim]
  const float* v = nullptr;
};

// Decodes the producer's stored K and V rows of a slot of the same block and head.
using kv_merge_decode = std::function<void(int slot, float* k, float* v)>;

// Token `slot` arrives with rows `in` at a block and KV head whose side data
// is h. Updates the side data and says what to store in the KV layer:
// writes[0] the rows of `slot` (merged, or a's when retained), writes[1] the
// merged rows of a retained token it displaced (slot -1: none), whose
// producer rows kv_merge_token reads back with `decode`. The rows point into
// scratch_k / scratch_v, the caller's [3][head_dim] each. t: the slerp parameter.
void kv_merge_token(const kv_merge_head& h, int slot, const kv_merge_rows_in& in, float t, float* scratch_k,
                    float* scratch_v, kv_merge_write writes[2], const kv_merge_decode& decode);

}  // namespace pagoda
