// kv_storage's compaction (kv_backend::gather) and per-slot biases.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/assert.h"
#include "core/half.h"
#include "kv/kv_fold.h"
#include "kv/kv_arena.h"

namespace pagoda {

float* kv_arena::bias_at(block_id b, int layer, int head) const {
  const std::size_t per_block = static_cast<std::size_t>(layout().n_kv_heads) * layout().block_size;
  return bias_ + (static_cast<std::size_t>(layer) * n_blocks_ + at(b)) * per_block +
         static_cast<std::size_t>(head) * layout().block_size;
}

const float* kv_arena::bias_of(block_id b, int layer, int head) const {
  PAGODA_ASSERT(owns(b) && layer >= 0 && layer < layout().n_layers);
  return has_bias_[static_cast<std::size_t>(layer) * n_blocks_ + at(b)] ? bias_at(b, layer, head) : nullptr;
}

void kv_arena::clear_bias(block_id b) {
  for (int l = 0; l < layout().n_layers; ++l) {
    std::uint8_t& has = has_bias(b, l);
    if (!has) continue;
    std::fill_n(bias_at(b, l, 0), static_cast<std::size_t>(layout().n_kv_heads) * layout().block_size, 0.0f);
    has = 0;
  }
}

void kv_arena::decode_slots(int layer, kv_role role, std::span<const block_id> table, int head,
                              std::span<const std::int32_t> slots, float* out, std::size_t stride) {
  const int bs = layout().block_size;
  const kv_tile_shape shape = layout().tile_shape();
  const kv_codec* f16 = get_kv_codec(kv_type::f16);
  const kv_format staged_fmt = kv_staged_format(role);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    float* dst = out + i * stride;
    const std::int32_t slot = slots[i];
    if (slot < 0) {
      std::fill_n(dst, layout().head_dim, 0.0f);
      continue;
    }
    const block_id b = table[static_cast<std::size_t>(slot / bs)];
    const tensor& t = tensor_of(b, layer, role);  // each slot in its own block's class
    const int in_block = slot % bs;
    const std::int32_t ss = t.sealed_index >= 0 ? block_slot_[at(b)] : -1;
    const std::int32_t fill = ss >= 0 ? slot_fill_[static_cast<std::size_t>(ss) * slot_stride_ + t.sealed_index] : bs;
    if (ss >= 0 && fill < bs) {
      PAGODA_ASSERT(in_block < fill, "gather reads slot {} of block {}, which stages {}", in_block, b.value, fill);
      f16->decode(staged_fmt, shape, nullptr, staged_tile(ss, t.sealed_index, head), in_block, 1, dst);
    } else {
      t.codec->decode(t.format, shape, t.params(head), tile(t, b, head), in_block, 1, dst);
    }
  }
}

void kv_arena::rewrite_block(tensor& t, int layer, block_id b, int t0, int t1, const float* x) {
  const int bs = layout().block_size;
  if (t.format.role == kv_role::key && summaries_ && t1 < bs)
    summarized(b, layer) = 0;  // no longer full
  if (t.sealed_index >= 0) {
    // Sealed: the kept leading slots must be staged (from the tile when the
    // block was sealed) for the write path to append after them; it seals
    // the block again when it fills. A block without a staging slot has every
    // sealed tensor in its tile (fill = block_size) until that tensor's own
    // layer is rewritten: other layers may still read it as a source.
    std::int32_t ss = block_slot_[at(b)];
    if (ss < 0 && t0 == 0 && t1 == bs) {
      write_run(t, layer, b, 0, bs, x);  // a whole block: encoded at once, no staging
      return;
    }
    if (ss < 0 && t0 > 0 && t1 == bs) {
      // A sealed block rewritten to its end: encoded whole from its kept
      // leading tokens and the new rows, without a staging slot (a compaction
      // must not hold more slots than the sequence's two).
      const int H = layout().n_kv_heads, hd = layout().head_dim;
      const std::size_t row = static_cast<std::size_t>(H) * hd;
      std::vector<float> whole(static_cast<std::size_t>(bs) * row);
      for (int h = 0; h < H; ++h) {
        t.codec->decode(t.format, layout().tile_shape(), nullptr, tile(t, b, h), 0, t0, gather_.data());
        for (int j = 0; j < t0; ++j)
          std::memcpy(&whole[static_cast<std::size_t>(j) * row + static_cast<std::size_t>(h) * hd],
                      &gather_[static_cast<std::size_t>(j) * hd], sizeof(float) * hd);
      }
      std::memcpy(&whole[static_cast<std::size_t>(t0) * row], x, sizeof(float) * static_cast<std::size_t>(t1 - t0) * row);
      write_run(t, layer, b, 0, bs, whole.data());
      return;
    }
    if (ss < 0) {
      ss = acquire_slot(b);
      std::fill_n(slot_fill_.begin() + static_cast<std::ptrdiff_t>(ss) * slot_stride_, slot_stride_, bs);
    }
    std::int32_t& fill = slot_fill_[static_cast<std::size_t>(ss) * slot_stride_ + t.sealed_index];
    if (t0 > 0 && fill == bs) {
      stage_from_tile(t, b, ss, t0);
    } else {
      PAGODA_ASSERT(fill >= t0, "block {} stages {} tokens, {} are kept", b.value, fill, t0);
      fill = t0;
    }
  }
  // Per-token formats: the new rows simply overwrite theirs.
  write_run(t, layer, b, t0, t1 - t0, x);
}

void kv_arena::gather(const kv_gather& g, const kv_backend::key_rotation& rotate) {
  PAGODA_ASSERT(g.rotate.empty() || rotate, "a gather that re-rotates keys needs the model's rotation");
  for (int l = 0; l < layout().n_layers; ++l) gather_layer(g, l, rotate);
}

void kv_arena::gather_layer(const kv_gather& g, int layer, const kv_backend::key_rotation& rotate) {
  const int bs = layout().block_size, hd = layout().head_dim, H = layout().n_kv_heads;
  const std::size_t row = static_cast<std::size_t>(H) * hd;
  const int n = g.n;
  // Everything this layer's rewrite reads, before anything of it is written.
  std::vector<float> k(static_cast<std::size_t>(n) * row), v(k.size()), mass(static_cast<std::size_t>(n) * H, 1.0f);
  const int nf = g.n_folded;
  std::vector<float> fk(static_cast<std::size_t>(nf) * hd), fv(fk.size()), fmass(static_cast<std::size_t>(nf), 1.0f);
  auto slot_mass = [&](std::int32_t slot, int h) {
    if (slot < 0) return 0.0f;
    const block_id b = g.src_table[static_cast<std::size_t>(slot / bs)];
    const float* bias = bias_of(b, layer, h);
    return bias ? std::exp(bias[slot % bs]) : 1.0f;
  };
  bool any_mass = false;
  for (int h = 0; h < H; ++h) {
    // Rows are the model's: r = model layer * H + head.
    const int r = g.n_rows == 1 ? 0 : model_layers_[static_cast<std::size_t>(layer)] * H + h;
    const std::span<const std::int32_t> src(g.row_sources(r), static_cast<std::size_t>(n));
    decode_slots(layer, kv_role::key, g.src_table, h, src, k.data() + static_cast<std::size_t>(h) * hd, row);
    decode_slots(layer, kv_role::value, g.src_table, h, src, v.data() + static_cast<std::size_t>(h) * hd, row);
    for (int i = 0; i < n; ++i) {
      mass[static_cast<std::size_t>(i) * H + h] = slot_mass(src[static_cast<std::size_t>(i)], h);
      any_mass |= mass[static_cast<std::size_t>(i) * H + h] != 1.0f && src[static_cast<std::size_t>(i)] >= 0;
    }
    if (g.fold == kv_fold::drop || nf == 0) continue;
    // Fold this head's evicted entries into its kept ones.
    const std::span<const std::int32_t> folded(g.row_folded(r), static_cast<std::size_t>(nf));
    const int n_ev = static_cast<int>(std::count_if(folded.begin(), folded.end(), [](std::int32_t s) { return s >= 0; }));
    decode_slots(layer, kv_role::key, g.src_table, h, folded.first(static_cast<std::size_t>(n_ev)), fk.data(), hd);
    decode_slots(layer, kv_role::value, g.src_table, h, folded.first(static_cast<std::size_t>(n_ev)), fv.data(), hd);
    for (int e = 0; e < n_ev; ++e) fmass[static_cast<std::size_t>(e)] = slot_mass(folded[static_cast<std::size_t>(e)], h);
    // The live kept entries of this head, contiguous for the fold.
    std::vector<int> live;
    for (int i = 0; i < n; ++i)
      if (src[static_cast<std::size_t>(i)] >= 0) live.push_back(i);
    if (live.empty() || n_ev == 0) continue;
    std::vector<float> kk(live.size() * hd), vv(kk.size()), mm(live.size());
    for (std::size_t j = 0; j < live.size(); ++j) {
      std::memcpy(&kk[j * hd], &k[static_cast<std::size_t>(live[j]) * row + static_cast<std::size_t>(h) * hd], sizeof(float) * hd);
      std::memcpy(&vv[j * hd], &v[static_cast<std::size_t>(live[j]) * row + static_cast<std::size_t>(h) * hd], sizeof(float) * hd);
      mm[j] = mass[static_cast<std::size_t>(live[j]) * H + h];
    }
    kv_fold_rows fr{hd, kk.data(), vv.data(), mm.data(), static_cast<int>(live.size()), fk.data(), fv.data(), fmass.data(), n_ev};
    if (g.fold == kv_fold::nearest) {
      fold_nearest(fr);
    } else {
      std::vector<std::int32_t> anchors;  // as indices into `live`
      for (int a = 0; a < g.anchors_per_row; ++a) {
        const std::int32_t slot = g.anchors[static_cast<std::size_t>(r) * g.anchors_per_row + a] - g.first;
        const auto at = std::lower_bound(live.begin(), live.end(), slot);
        if (at != live.end() && *at == slot) anchors.push_back(static_cast<std::int32_t>(at - live.begin()));
      }
      fold_cluster(fr, anchors);
    }
    for (std::size_t j = 0; j < live.size(); ++j) {
      std::memcpy(&k[static_cast<std::size_t>(live[j]) * row + static_cast<std::size_t>(h) * hd], &kk[j * hd], sizeof(float) * hd);
      std::memcpy(&v[static_cast<std::size_t>(live[j]) * row + static_cast<std::size_t>(h) * hd], &vv[j * hd], sizeof(float) * hd);
      mass[static_cast<std::size_t>(live[j]) * H + h] = mm[j];
    }
    any_mass = true;
  }
  // A merged layer (MiniCache): each destination slot takes its source's
  // side data, read before anything is written (kv_merge.h).
  merge_moves moves;
  if (merge_[static_cast<std::size_t>(layer)]) moves = read_merge_moves(g, layer);
  if (!g.rotate.empty()) {
    rotate(model_layers_[static_cast<std::size_t>(layer)], k.data(), n, g.rotate.data());
    if (!moves.own_k.empty())  // the reader's retained keys turn with the rest (the pair shares its RoPE)
      rotate(model_layers_[static_cast<std::size_t>(layer)], moves.own_k.data(), n, g.rotate.data());
  }
  if (merge_[static_cast<std::size_t>(layer)]) write_merge_moves(g, layer, moves, k.data(), v.data());

  // Write block by block.
  for (int i = 0; i < n;) {
    const int slot = g.first + i;
    const block_id b = g.dst_table[static_cast<std::size_t>(slot / bs)];
    const int t0 = slot % bs, t1 = std::min(bs, t0 + (n - i));
    // Encoded in the destination block's class, whatever the sources' were.
    rewrite_block(k_of(b, layer), layer, b, t0, t1, k.data() + static_cast<std::size_t>(i) * row);
    rewrite_block(v_of(b, layer), layer, b, t0, t1, v.data() + static_cast<std::size_t>(i) * row);
    std::uint8_t& has = has_bias(b, layer);
    if (any_mass || has) {
      for (int h = 0; h < H; ++h) {
        float* bias = bias_at(b, layer, h);
        for (int j = t0; j < t1; ++j) {
          const float m = mass[static_cast<std::size_t>(i + j - t0) * H + h];
          bias[j] = m > 0 ? std::log(m) : 0.0f;
        }
      }
      has = 1;
      any_bias_ = true;
    }
    i += t1 - t0;
  }
}

kv_arena::merge_moves kv_arena::read_merge_moves(const kv_gather& g, int layer) const {
  const int bs = layout().block_size, hd = layout().head_dim, H = layout().n_kv_heads, n = g.n;
  const std::size_t row = static_cast<std::size_t>(H) * hd;
  merge_moves m;
  m.ratio_k.assign(static_cast<std::size_t>(n) * H, 0.0f);
  m.ratio_v.assign(m.ratio_k.size(), 0.0f);
  m.divergence.assign(m.ratio_k.size(), -1.0f);  // -1: not retained
  m.own_k.assign(static_cast<std::size_t>(n) * row, 0.0f);
  m.own_v.assign(m.own_k.size(), 0.0f);
  for (int h = 0; h < H; ++h) {
    const int r = g.n_rows == 1 ? 0 : model_layers_[static_cast<std::size_t>(layer)] * H + h;
    const std::int32_t* src = g.row_sources(r);
    for (int i = 0; i < n; ++i) {
      const std::int32_t s = src[i];
      if (s < 0) continue;  // a dead slot: nothing to read
      const kv_merge_head from = merge_head(g.src_table[static_cast<std::size_t>(s / bs)], layer, h);
      const std::size_t at = static_cast<std::size_t>(i) * H + h;
      m.ratio_k[at] = from.ratio_k()[s % bs];
      m.ratio_v[at] = from.ratio_v()[s % bs];
      if (const int e = from.find(s % bs); e >= 0) {
        m.divergence[at] = from.divergence(e);
        std::copy_n(from.k(e), hd, m.own_k.data() + static_cast<std::size_t>(i) * row + static_cast<std::size_t>(h) * hd);
        std::copy_n(from.v(e), hd, m.own_v.data() + static_cast<std::size_t>(i) * row + static_cast<std::size_t>(h) * hd);
      }
    }
  }
  return m;
}

void kv_arena::write_merge_moves(const kv_gather& g, int layer, const merge_moves& m, float* k, float* v) {
  const int bs = layout().block_size, hd = layout().head_dim, H = layout().n_kv_heads, n = g.n;
  const std::size_t row = static_cast<std::size_t>(H) * hd;
  const float t = layout().merge_t;
  for (int i = 0; i < n;) {
    const int slot = g.first + i;
    const block_id b = g.dst_table[static_cast<std::size_t>(slot / bs)];
    const int t0 = slot % bs, t1 = std::min(bs, t0 + (n - i));
    for (int h = 0; h < H; ++h) {
      const kv_merge_head to = merge_head(b, layer, h);
      to.drop_from(t0);  // slots below t0 keep theirs; the rewritten ones take their sources'
      int free_entries = 0;
      for (int e = 0; e < to.shape.retain; ++e) free_entries += to.slot(e) < 0;
      // The retained tokens moving here, most divergent first; those past the
      // block's room are merged now, from the row they bring and their own.
      std::vector<int> retained;
      for (int j = t0; j < t1; ++j)
        if (m.divergence[static_cast<std::size_t>(i + j - t0) * H + h] >= 0) retained.push_back(j);
      std::stable_sort(retained.begin(), retained.end(), [&](int x, int y) {
        return m.divergence[static_cast<std::size_t>(i + x - t0) * H + h] > m.divergence[static_cast<std::size_t>(i + y - t0) * H + h];
      });
      for (int j = t0; j < t1; ++j) {
        const std::size_t at = static_cast<std::size_t>(i + j - t0) * H + h;
        to.ratio_k()[j] = m.ratio_k[at];
        to.ratio_v()[j] = m.ratio_v[at];
      }
      for (std::size_t x = 0; x < retained.size(); ++x) {
        const int j = retained[x];
        const std::size_t at = static_cast<std::size_t>(i + j - t0) * H + h;
        const std::size_t off = static_cast<std::size_t>(i + j - t0) * row + static_cast<std::size_t>(h) * hd;
        if (static_cast<int>(x) < free_entries) {
          int e = 0;
          while (to.slot(e) >= 0) ++e;
          float* en = to.entry(e);
          en[0] = static_cast<float>(j + 1);
          en[1] = m.divergence[at];
          std::copy_n(m.own_k.data() + off, hd, to.k(e));
          std::copy_n(m.own_v.data() + off, hd, to.v(e));
          continue;
        }
        std::vector<float> merged(2 * static_cast<std::size_t>(hd));
        to.ratio_k()[j] = kv_merge_rows(k + off, m.own_k.data() + off, hd, t, merged.data());
        to.ratio_v()[j] = kv_merge_rows(v + off, m.own_v.data() + off, hd, t, merged.data() + hd);
        std::copy_n(merged.data(), hd, k + off);
        std::copy_n(merged.data() + hd, hd, v + off);
      }
    }
    i += t1 - t0;
  }
}

}  // namespace pagoda
