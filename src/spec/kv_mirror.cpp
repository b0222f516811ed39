#include "spec/kv_mirror.h"

#include <algorithm>

#include "attention/gather_attention.h"
#include "core/assert.h"

namespace pagoda {

void copy_kv_slots(const kv_backend& src, std::span<const std::span<const block_id>> src_tables, kv_backend& dst,
                   std::span<const block_id> dst_table, int from, int end, kv_copy_scratch& scratch) {
  if (from >= end) return;
  const kv_layout& l = src.layout();
  const kv_layout& d = dst.layout();
  PAGODA_ASSERT(l.n_layers == d.n_layers && l.n_kv_heads == d.n_kv_heads && l.head_dim == d.head_dim &&
                    l.block_size == d.block_size,
                "copying KV slots between backends of other shapes");
  const int bs = l.block_size, hd = l.head_dim, heads = l.n_kv_heads;
  const auto n = static_cast<std::size_t>(end - from);
  const std::size_t row = static_cast<std::size_t>(heads) * static_cast<std::size_t>(hd);
  scratch.k.resize(n * row);
  scratch.v.resize(n * row);
  scratch.row.resize(static_cast<std::size_t>(bs) * static_cast<std::size_t>(hd));
  for (int layer = 0; layer < l.n_layers; ++layer) {
    const std::span<const block_id> table = src_tables[static_cast<std::size_t>(src.layer_group(layer))];
    const paged_kv_view views[2] = {src.k_view(layer, table, end), src.v_view(layer, table, end)};
    std::vector<float>* outs[2] = {&scratch.k, &scratch.v};
    for (int kv = 0; kv < 2; ++kv)
      for (int at = from; at < end;) {
        const int run = std::min(end - at, bs - at % bs);  // one block at a time (decode_kv_rows)
        for (int h = 0; h < heads; ++h) {
          decode_kv_rows(views[kv], h, at, run, scratch.row.data());
          for (int t = 0; t < run; ++t)
            std::copy_n(scratch.row.data() + static_cast<std::size_t>(t) * hd, hd,
                        outs[kv]->data() + static_cast<std::size_t>(at - from + t) * row + static_cast<std::size_t>(h) * hd);
        }
        at += run;
      }
    dst.write(layer, dst_table, from, static_cast<int>(n), scratch.k.data(), scratch.v.data());
  }
}

}  // namespace pagoda
