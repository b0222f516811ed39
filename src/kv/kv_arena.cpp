#include "kv/kv_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/assert.h"
#include "core/half.h"

namespace pagoda {
namespace {

// Anonymous, lazily zeroed memory in base pages, for the side maps
// (staging, biases, merge data, key summaries): touched only where used, and
// never in huge pages (most of a huge page would be zeroed for nothing). The
// tiles are mapped apart (map_tiles, which says why base pages are their
// default too).
void* map_zeroed(std::size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

}  // namespace

result<std::unique_ptr<kv_arena>> kv_arena::create(std::span<const kv_class_spec> classes, std::int64_t first_block,
                                                   std::vector<int> model_layers, std::int64_t n_staging_slots,
                                                   kv_pool_memory memory) {
  if (classes.empty()) return error(errc::invalid_argument, "a KV arena needs a block class");
  const kv_layout& layout = classes[0].layout;
  std::int64_t total = 0;
  for (std::size_t i = 0; i < classes.size(); ++i) {
    const kv_class_spec& c = classes[i];
    const int index = static_cast<int>(i);
    if (status st = c.layout.check(); !st.ok()) return error(st.code(), "KV block class {}: {}", index, st.message());
    if (i > 0) PAGODA_RETURN_IF_ERROR(check_kv_class_shape(layout, c.layout, index));
    if (c.n_blocks <= 0)
      return error(errc::invalid_argument, "KV block class {} needs at least one block (got {})", index, c.n_blocks);
    total += std::min<std::int64_t>(c.n_blocks, INT32_MAX);
  }
  if (first_block < 0 || first_block + total > INT32_MAX)
    return error(errc::invalid_argument, "KV pool of {} blocks from block {} is too large", total, first_block);
  if (classes.size() > 256) return error(errc::invalid_argument, "{} KV block classes; at most 256", classes.size());
  if (model_layers.size() != static_cast<std::size_t>(layout.n_layers))
    return error(errc::invalid_argument, "{} model layers named for a KV arena of {}", model_layers.size(), layout.n_layers);
  std::unique_ptr<kv_arena> s(new kv_arena());
  s->first_block_ = first_block;
  s->model_layers_ = std::move(model_layers);
  for (const kv_class_spec& c : classes) PAGODA_RETURN_IF_ERROR(s->add_class(c.layout, c.n_blocks));
  PAGODA_RETURN_IF_ERROR(s->map_tiles(memory));
  if (s->classes_.size() > 1) {
    s->block_class_.resize(static_cast<std::size_t>(total));
    for (std::size_t c = 0; c < s->classes_.size(); ++c)
      std::fill_n(s->block_class_.begin() + (s->classes_[c].first_block - first_block), s->classes_[c].n_blocks,
                  static_cast<std::uint8_t>(c));
    s->build_view_classes();
  }
  s->gather_.resize(static_cast<std::size_t>(layout.block_size) * layout.head_dim);
  if (s->slot_stride_ > 0) {
    s->staged_tile_bytes_ = kv_staged_tile_bytes(layout.tile_shape());
    s->slot_bytes_ = static_cast<std::size_t>(s->slot_stride_) * layout.n_kv_heads * s->staged_tile_bytes_;
    s->block_slot_.assign(total, -1);
    s->held_.assign(total, 0);
    s->n_slots_ = std::clamp<std::int64_t>(n_staging_slots, 1, total);
    s->staging_ = static_cast<std::byte*>(map_zeroed(s->slot_bytes_ * s->n_slots_));
    if (!s->staging_)
      return error(errc::resource_exhausted, "cannot map {} bytes of KV staging: {}", s->slot_bytes_ * s->n_slots_,
                   std::strerror(errno));
    s->slot_block_.assign(s->n_slots_, -1);
    s->slot_fill_.assign(s->n_slots_ * s->slot_stride_, 0);
    s->merge_pending_.assign(s->n_slots_ * s->slot_stride_, 0);
    for (std::int64_t i = s->n_slots_ - 1; i >= 0; --i) s->free_slots_.push_back(static_cast<std::int32_t>(i));
  }
  {
    // Per-slot biases of merged entries: mapped now, touched only where a
    // merge policy writes one (anonymous memory costs nothing until then).
    s->bias_bytes_ = sizeof(float) * static_cast<std::size_t>(layout.n_layers) * static_cast<std::size_t>(total) *
                     layout.n_kv_heads * layout.block_size;
    s->bias_ = static_cast<float*>(map_zeroed(s->bias_bytes_));
    if (!s->bias_)
      return error(errc::resource_exhausted, "cannot map {} bytes of per-slot biases: {}", s->bias_bytes_,
                   std::strerror(errno));
    s->has_bias_.assign(static_cast<std::size_t>(layout.n_layers) * static_cast<std::size_t>(total), 0);
  }
  s->merge_.assign(static_cast<std::size_t>(layout.n_layers), nullptr);
  s->merge_bytes_ = sizeof(float) * layout.merge_shape().head_floats() * layout.n_kv_heads * static_cast<std::size_t>(total);
  for (int l = 0; l < layout.n_layers; ++l) {
    if (!layout.merged(l)) continue;
    s->merge_[static_cast<std::size_t>(l)] = static_cast<float*>(map_zeroed(s->merge_bytes_));
    if (!s->merge_[static_cast<std::size_t>(l)])
      return error(errc::resource_exhausted, "cannot map {} bytes of merged-KV side data: {}", s->merge_bytes_,
                   std::strerror(errno));
  }
  s->merge_scratch_.resize(6 * static_cast<std::size_t>(layout.head_dim));
  if (layout.key_summaries) {
    s->summaries_bytes_ = layout.summary_bytes_per_block() * static_cast<std::size_t>(total);
    s->summaries_ = static_cast<float*>(map_zeroed(s->summaries_bytes_));
    if (!s->summaries_)
      return error(errc::resource_exhausted, "cannot map {} bytes of key summaries: {}", s->summaries_bytes_,
                   std::strerror(errno));
    s->summarized_.assign(static_cast<std::size_t>(total) * layout.n_layers, 0);
  }
  return s;
}

status kv_arena::add_class(const kv_layout& layout, std::int64_t n_blocks) {
  block_class_data& c = classes_.emplace_back();
  c.layout = layout;
  c.first_block = first_block_ + n_blocks_;
  c.n_blocks = n_blocks;
  n_blocks_ += n_blocks;
  c.k.resize(layout.n_layers);
  c.v.resize(layout.n_layers);
  const int cls = static_cast<int>(classes_.size()) - 1;
  for (int l = 0; l < layout.n_layers; ++l) {
    for (auto [t, fmt] : {std::pair{&c.k[l], layout.k_formats[l]}, std::pair{&c.v[l], layout.v_formats[l]}}) {
      t->cls = cls;
      PAGODA_RETURN_IF_ERROR(init_tensor(*t, fmt, l));
    }
  }
  slot_stride_ = std::max(slot_stride_, c.n_sealed);
  return {};
}

void kv_arena::build_view_classes() {
  const int n_layers = layout().n_layers;
  const std::size_t n_classes = classes_.size();
  view_classes_.resize(static_cast<std::size_t>(n_layers) * 2 * n_classes);
  for (int l = 0; l < n_layers; ++l)
    for (std::size_t c = 0; c < n_classes; ++c)
      for (int role = 0; role < 2; ++role) {
        const tensor& t = role == 0 ? classes_[c].k[l] : classes_[c].v[l];
        paged_kv_class& vc = view_classes_[(static_cast<std::size_t>(l) * 2 + role) * n_classes + c];
        vc.codec = t.codec;
        vc.format = t.format;
        vc.base = t.data;
        vc.tile_bytes = t.tile_bytes;
        vc.head_stride = t.tile_bytes * static_cast<std::size_t>(t.n_tiles);
        vc.first_block = static_cast<std::int32_t>(t.first_block);
        vc.static_params = t.params(0);
      }
}

status kv_arena::init_tensor(tensor& t, const kv_format& fmt, int layer) {
  const block_class_data& c = classes_[t.cls];
  const kv_layout& layout = c.layout;
  const kv_tile_shape shape = layout.tile_shape();
  t.codec = get_kv_codec(fmt.type);
  t.format = fmt;
  t.tile_bytes = t.codec->tile_bytes(fmt, shape);
  t.first_block = c.first_block;
  t.n_tiles = c.n_blocks;
  t.size_bytes = t.tile_bytes * layout.n_kv_heads * static_cast<std::size_t>(t.n_tiles);
  if (kv_format_sealed(fmt)) t.sealed_index = classes_[t.cls].n_sealed++;
  if (fmt.scale_mode == kv_scale_mode::static_scales) {
    const int H = layout.n_kv_heads, D = layout.head_dim;
    t.static_values.resize(2 * static_cast<std::size_t>(H) * D);
    t.static_params.resize(H);
    for (int h = 0; h < H; ++h) {
      float* scale = t.static_values.data() + static_cast<std::size_t>(h) * D;
      float* offset = scale + static_cast<std::size_t>(H) * D;
      t.codec->make_static(fmt, D, layout.scales->lo(fmt.role, layer, h), layout.scales->hi(fmt.role, layer, h),
                           scale, offset);
      t.static_params[h] = {scale, offset};
    }
  }
  return {};
}

// Tiles in base pages by default, not huge pages: the arenas are head-major,
// so the first block touches one page per (layer, K|V, KV head) (64 on a
// 4-layer 8-head model), and with MADV_HUGEPAGE each of those faults must
// find and zero a 2 MiB page. Where memory is fragmented (the page cache full
// of model files) the kernel compacts for each, synchronously (defrag =
// madvise): a fresh process's first prompt took 30-830 ms with the advice
// and 23-28 ms without (3 tokens, a 128 MiB pool), and a 512-token prompt
// 1.5x longer. With kv_pool_memory::huge_pages (--kv-huge-pages) the tiles
// are in huge pages and faulted in here, whole, so that cost moves to start
// (and the whole pool is resident from then on); decode attention then reads
// them with fewer TLB misses: on a Zen 4 VM (AVX-512 kernels) full attention
// at 32K-128K tokens 1.2-1.4x faster, Quest reading 1/8 of the tiles
// 1.05-1.35x (full
// attention 2-6% in the 2026-12-03 measurement; bench/history/2026.md, "KV
// pool pages" and "KV pool in huge pages").
status kv_arena::map_tiles(const kv_pool_memory& memory) {
  constexpr std::size_t k_page = 4096;
  const auto padded = [&](const tensor& t) { return (t.size_bytes + k_page - 1) / k_page * k_page; };
  std::size_t bytes = 0;
  for (const block_class_data& c : classes_)
    for (auto* tensors : {&c.k, &c.v})
      for (const tensor& t : *tensors) bytes += padded(t);
  auto mapped = anon_memory::map(bytes, memory.huge_pages, memory.fault_in);
  if (!mapped.ok()) return mapped.error().with_context("the KV cache");
  tiles_ = std::move(*mapped);
  std::byte* at = tiles_.data();
  for (block_class_data& c : classes_)
    for (auto* tensors : {&c.k, &c.v})
      for (tensor& t : *tensors) {
        t.data = at;
        at += padded(t);
      }
  return {};
}

kv_arena::~kv_arena() {
  if (staging_) munmap(staging_, slot_bytes_ * n_slots_);
  if (summaries_) munmap(summaries_, summaries_bytes_);
  if (bias_) munmap(bias_, bias_bytes_);
  for (float* m : merge_)
    if (m) munmap(m, merge_bytes_);
}

std::size_t kv_arena::total_bytes() const {
  std::size_t total = slot_bytes_ * static_cast<std::size_t>(n_slots_) + summaries_bytes_;
  for (const float* m : merge_) total += m ? merge_bytes_ : 0;
  for (const block_class_data& c : classes_)
    for (auto* tensors : {&c.k, &c.v})
      for (const tensor& t : *tensors) total += t.size_bytes + t.static_values.size() * sizeof(float);
  return total;
}

kv_staging_stats kv_arena::staging() const {
  kv_staging_stats s;
  s.slots_mapped = n_slots_;
  s.slots_in_use = slots_in_use_;
  s.peak_slots_in_use = peak_slots_in_use_;
  s.bytes_mapped = slot_bytes_ * static_cast<std::size_t>(n_slots_);
  return s;
}

std::byte* kv_arena::tile(const tensor& t, block_id b, int head) const {
  PAGODA_DASSERT(b.value >= t.first_block && b.value - t.first_block < t.n_tiles, "block {} is not of class {}", b.value,
                 t.cls);
  const std::int64_t index = b.value - t.first_block;
  return t.data + (static_cast<std::size_t>(head) * static_cast<std::size_t>(t.n_tiles) + static_cast<std::size_t>(index)) *
                      t.tile_bytes;
}

// --- staging slots -----------------------------------------------------------

std::byte* kv_arena::slot_data(std::int32_t slot) const {
  return staging_ + static_cast<std::size_t>(slot) * slot_bytes_;
}

std::byte* kv_arena::staged_tile(std::int32_t slot, int sealed_index, int head) const {
  return slot_data(slot) + (static_cast<std::size_t>(sealed_index) * layout().n_kv_heads + head) * staged_tile_bytes_;
}

std::int32_t kv_arena::acquire_slot(block_id b) {
  PAGODA_ASSERT(!free_slots_.empty(),
                "all {} KV staging slots are in use: more partly filled blocks of a sealed KV format than sequences "
                "the storage was sized for",
                n_slots_);
  std::int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  slot_block_[slot] = b.value;
  block_slot_[at(b)] = slot;
  std::fill_n(slot_fill_.begin() + static_cast<std::ptrdiff_t>(slot) * slot_stride_, slot_stride_, 0);
  std::fill_n(merge_pending_.begin() + static_cast<std::ptrdiff_t>(slot) * slot_stride_, slot_stride_, 0);
  peak_slots_in_use_ = std::max(peak_slots_in_use_, ++slots_in_use_);
  return slot;
}

void kv_arena::release_slot(std::int32_t slot) {
  block_slot_[at(block_id(slot_block_[slot]))] = -1;
  slot_block_[slot] = -1;
  free_slots_.push_back(slot);
  --slots_in_use_;
}

bool kv_arena::slot_sealed(std::int32_t slot, int cls) const {
  const std::size_t at = static_cast<std::size_t>(slot) * slot_stride_;
  const std::int32_t* fills = &slot_fill_[at];
  const std::uint8_t* pending = &merge_pending_[at];
  const int n = classes_[cls].n_sealed;
  return std::all_of(fills, fills + n, [&](std::int32_t f) { return f == layout().block_size; }) &&
         std::none_of(pending, pending + n, [](std::uint8_t x) { return x != 0; });
}

void kv_arena::hold_staging(block_id b) {
  PAGODA_ASSERT(owns(b), "block id {} out of range", b.value);
  if (held_.empty() || classes_[block_class(b)].n_sealed == 0 || held_[at(b)]) return;
  held_[at(b)] = 1;
  held_blocks_.push_back(b.value);
}

void kv_arena::end_holds() {
  for (const std::int32_t id : held_blocks_) {
    const block_id b(id);
    if (!held(b)) continue;  // its hold already ended (truncated, released, overwritten)
    unhold(b);
    const std::int32_t slot = slot_of(b);
    if (slot >= 0 && slot_sealed(slot, block_class(b))) release_slot(slot);  // sealed while held
  }
  held_blocks_.clear();
}

void kv_arena::stage_from_tile(tensor& t, block_id b, std::int32_t slot, int n) {
  const kv_tile_shape shape = layout().tile_shape();
  const kv_codec* f16 = get_kv_codec(kv_type::f16);
  const kv_format staged_fmt = kv_staged_format(t.format.role);
  for (int h = 0; h < layout().n_kv_heads; ++h) {
    if (n > 0) {
      t.codec->decode(t.format, shape, nullptr, tile(t, b, h), 0, n, gather_.data());
      f16->encode(staged_fmt, shape, nullptr, gather_.data(), 0, n, staged_tile(slot, t.sealed_index, h));
    }
  }
  slot_fill_[static_cast<std::size_t>(slot) * slot_stride_ + t.sealed_index] = n;
}

// --- key summaries -----------------------------------------------------------

float* kv_arena::summary(block_id b, int layer, int head) const {
  const std::size_t per_head = 3 * static_cast<std::size_t>(layout().head_dim);
  return summaries_ + ((at(b) * layout().n_layers + layer) * layout().n_kv_heads + head) * per_head;
}

void kv_arena::summarize(int layer, block_id b) {
  if (!summaries_) return;
  const tensor& t = k_of(b, layer);
  const int bs = layout().block_size, hd = layout().head_dim;
  for (int h = 0; h < layout().n_kv_heads; ++h) {
    t.codec->decode(t.format, layout().tile_shape(), t.params(h), tile(t, b, h), 0, bs, gather_.data());
    float* mn = summary(b, layer, h);
    float* mx = mn + hd;
    float* mean = mx + hd;
    for (int d = 0; d < hd; ++d) {
      float lo = gather_[d], hi = gather_[d];
      double sum = 0;
      for (int i = 0; i < bs; ++i) {
        const float x = gather_[static_cast<std::size_t>(i) * hd + d];
        lo = std::min(lo, x);
        hi = std::max(hi, x);
        sum += x;
      }
      mn[d] = lo;
      mx[d] = hi;
      mean[d] = static_cast<float>(sum / bs);
    }
  }
  summarized_[at(b) * layout().n_layers + layer] = 1;
}

void kv_arena::forget_summaries(block_id b) {
  if (!summaries_) return;
  std::fill_n(summarized_.begin() + static_cast<std::ptrdiff_t>(at(b)) * layout().n_layers, layout().n_layers, 0);
}

std::optional<key_summary> kv_arena::key_summary_of(block_id b, int layer, int head) const {
  PAGODA_ASSERT(owns(b) && layer >= 0 && layer < layout().n_layers && head >= 0 &&
                head < layout().n_kv_heads);
  if (!summaries_ || !summarized_[at(b) * layout().n_layers + layer]) return std::nullopt;
  const float* s = summary(b, layer, head);
  const int hd = layout().head_dim;
  return key_summary{s, s + hd, s + 2 * hd};
}

// --- writes and views ---------------------------------------------------------

void kv_arena::seal_from_staging(tensor& a, block_id id, std::int32_t slot) {
  const int bs = layout().block_size;
  const kv_tile_shape shape = layout().tile_shape();
  const kv_codec* f16 = get_kv_codec(kv_type::f16);
  const kv_format staged_fmt = kv_staged_format(a.format.role);
  for (int h = 0; h < layout().n_kv_heads; ++h) {
    f16->decode(staged_fmt, shape, nullptr, staged_tile(slot, a.sealed_index, h), 0, bs, gather_.data());
    a.codec->encode(a.format, shape, nullptr, gather_.data(), 0, bs, tile(a, id, h));
  }
}

void kv_arena::write_run(tensor& a, int layer, block_id id, int t0, int run, const float* x) {
  const int bs = layout().block_size;
  const int hd = layout().head_dim;
  const int n_heads = layout().n_kv_heads;
  const kv_tile_shape shape = layout().tile_shape();
  const std::size_t row = static_cast<std::size_t>(n_heads) * hd;
  const kv_codec* f16 = get_kv_codec(kv_type::f16);
  const kv_format staged_fmt = kv_staged_format(a.format.role);
  float* gather = gather_.data();
  const bool is_key = a.format.role == kv_role::key;
  // x rows are [token][head][hd]; a tile wants [token][hd] for one head.
  auto gather_head = [&](int h) {
    for (int j = 0; j < run; ++j)
      std::memcpy(gather + static_cast<std::size_t>(j) * hd, x + j * row + static_cast<std::size_t>(h) * hd,
                  sizeof(float) * hd);
  };
  if (is_key && summaries_ && t0 == 0) summarized(id, layer) = 0;
  if (is_key && has_bias(id, layer))
    for (int h = 0; h < n_heads; ++h) std::fill_n(bias_at(id, layer, h) + t0, run, 0.0f);  // new tokens stand for one each
  if (a.sealed_index < 0) {
    for (int h = 0; h < n_heads; ++h) {
      gather_head(h);
      a.codec->encode(a.format, shape, a.params(h), gather, t0, run, tile(a, id, h));
    }
  } else {
    std::int32_t slot = block_slot_[at(id)];
    if (t0 == 0 && run == bs && !held(id)) {
      // The whole block at once: encode directly, through f16 as if staged
      // (a held block goes through staging, which it keeps).
      for (int h = 0; h < n_heads; ++h) {
        gather_head(h);
        for (std::size_t j = 0; j < static_cast<std::size_t>(bs) * hd; ++j) gather[j] = fp16_to_f32(f32_to_fp16(gather[j]));
        a.codec->encode(a.format, shape, nullptr, gather, 0, bs, tile(a, id, h));
      }
      if (slot >= 0) slot_fill_[static_cast<std::size_t>(slot) * slot_stride_ + a.sealed_index] = bs;
    } else {
      if (slot < 0) {
        PAGODA_ASSERT(t0 == 0, "block {} is written at slot {} but its first slots were never staged", id.value, t0);
        slot = acquire_slot(id);
      }
      std::int32_t& fill = slot_fill_[static_cast<std::size_t>(slot) * slot_stride_ + a.sealed_index];
      PAGODA_ASSERT(t0 == 0 || fill == t0, "block {}: write at slot {} but {} tokens are staged", id.value, t0, fill);
      for (int h = 0; h < n_heads; ++h) {
        gather_head(h);
        f16->encode(staged_fmt, shape, nullptr, gather, t0, run, staged_tile(slot, a.sealed_index, h));
      }
      fill = t0 + run;
      if (fill == bs) {  // seal: encode the staged block
        seal_from_staging(a, id, slot);
        // A merged layer's reader rewrites the block next (merge_write), from
        // this staging, which stays until it seals the block again.
        if (merge_[static_cast<std::size_t>(layer)]) merge_pending_[static_cast<std::size_t>(slot) * slot_stride_ + a.sealed_index] = 1;
      }
    }
    if (slot >= 0 && !held(id) && slot_sealed(slot, a.cls)) release_slot(slot);
  }
  if (is_key && t0 + run == bs) summarize(layer, id);
}

void kv_arena::write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k, const float* v) {
  PAGODA_ASSERT(layer >= 0 && layer < layout().n_layers);
  const int bs = layout().block_size;
  const std::size_t row = static_cast<std::size_t>(layout().n_kv_heads) * layout().head_dim;
  // Block by block, K then V: a block's staging slot is released once every
  // sealed tensor of it is sealed, before the next block takes one.
  for (int i = 0; i < n;) {
    const int p = slot + i;
    const int b = p / bs, t0 = p % bs;
    const int run = std::min(n - i, bs - t0);
    PAGODA_ASSERT(b < static_cast<int>(blocks.size()), "slot {} has no block (table holds {})", p, blocks.size());
    const block_id id = blocks[b];
    PAGODA_ASSERT(owns(id), "block id {} out of range", id.value);
    write_run(k_of(id, layer), layer, id, t0, run, k + static_cast<std::size_t>(i) * row);
    write_run(v_of(id, layer), layer, id, t0, run, v + static_cast<std::size_t>(i) * row);
    i += run;
  }
}

paged_kv_view kv_arena::view(int layer, kv_role role, std::span<const block_id> blocks, int n_tokens) const {
  const tensor& a = role == kv_role::key ? classes_[0].k[layer] : classes_[0].v[layer];
  paged_kv_view view;
  view.codec = a.codec;
  view.format = a.format;
  view.shape = layout().tile_shape();
  view.base = a.data;
  view.tile_bytes = a.tile_bytes;
  view.head_stride = a.tile_bytes * static_cast<std::size_t>(a.n_tiles);
  view.blocks = blocks;
  view.first_block = static_cast<std::int32_t>(first_block_);
  view.n_tokens = n_tokens;
  view.static_params = a.params(0);
  if (!view_classes_.empty()) {
    const std::size_t at = static_cast<std::size_t>(layer) * 2 + (role == kv_role::key ? 0 : 1);
    view.classes = view_classes_.data() + at * classes_.size();
    view.block_class = block_class_.data();
  }
  const int bs = layout().block_size;
  if (any_bias_ && role == kv_role::key) {
    view.bias = bias_ + static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_blocks_) *
                            static_cast<std::size_t>(layout().n_kv_heads) * static_cast<std::size_t>(bs);
    view.has_bias = has_bias_.data() + static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_blocks_);
    view.n_kv_heads = layout().n_kv_heads;
  }
  if (slot_stride_ > 0 && n_tokens > 0 && n_tokens % bs != 0) {
    const block_id last = blocks[(n_tokens - 1) / bs];
    const int sealed_index = tensor_of(last, layer, role).sealed_index;
    const std::int32_t slot = sealed_index >= 0 ? block_slot_[at(last)] : -1;
    const std::int32_t fill = slot >= 0 ? slot_fill_[static_cast<std::size_t>(slot) * slot_stride_ + sealed_index] : bs;
    // Not staged: the block was sealed since (the view covers a prefix of it),
    // unless it is held, whose staging is whole.
    if (fill < bs || (slot >= 0 && held(last))) {
      PAGODA_ASSERT(fill >= n_tokens % bs, "view of {} tokens past the staged tokens of block {}", n_tokens, last.value);
      view.staged = staged_tile(slot, sealed_index, 0);
      view.staged_tile_bytes = staged_tile_bytes_;
      view.staged_codec = get_kv_codec(kv_type::f16);
      view.staged_format = kv_staged_format(role);
    }
  }
  return view;
}

paged_kv_view kv_arena::k_view(int layer, std::span<const block_id> blocks, int n_slots) const {
  return view(layer, kv_role::key, blocks, n_slots);
}

paged_kv_view kv_arena::v_view(int layer, std::span<const block_id> blocks, int n_slots) const {
  return view(layer, kv_role::value, blocks, n_slots);
}

// --- block ops ------------------------------------------------------------------

void kv_arena::copy_block(block_id src, block_id dst, int n_tokens) {
  PAGODA_ASSERT(owns(src) && owns(dst) && src != dst);
  PAGODA_ASSERT(n_tokens >= 0 && n_tokens <= layout().block_size, "copy of {} tokens", n_tokens);
  PAGODA_ASSERT(block_class(src) == block_class(dst), "copy_block from block {} of class {} to block {} of class {}",
                src.value, block_class(src), dst.value, block_class(dst));
  block_class_data& c = classes_[block_class(src)];
  const int bs = layout().block_size;
  const bool sealed = c.n_sealed > 0;
  const std::int32_t from = sealed ? block_slot_[at(src)] : -1;
  std::int32_t to = sealed ? block_slot_[at(dst)] : -1;
  // A held src keeps the exact f16 of every slot written in its staging,
  // sealed or not: a prefix of it is copied from there, not from its codes.
  const bool src_held = from >= 0 && held(src);
  unhold(dst);
  // Tiles are copied whole: slots past n_tokens hold garbage until written.
  for (auto* tensors : {&c.k, &c.v})
    for (tensor& t : *tensors)
      for (int h = 0; h < layout().n_kv_heads; ++h) std::memcpy(tile(t, dst, h), tile(t, src, h), t.tile_bytes);
  if (n_tokens == bs && (from < 0 || (src_held && slot_sealed(from, block_class(src))))) {
    // A whole sealed block: dst needs no staging.
    if (to >= 0) release_slot(to);
  } else if (sealed) {
    if (to < 0) to = acquire_slot(dst);
    for (auto* tensors : {&c.k, &c.v})
      for (tensor& t : *tensors) {
        if (t.sealed_index < 0) continue;
        const std::size_t at = static_cast<std::size_t>(to) * slot_stride_ + t.sealed_index;
        if (from >= 0) {
          // Staged in src: copy the staged f16 tokens.
          const std::int32_t src_fill = slot_fill_[static_cast<std::size_t>(from) * slot_stride_ + t.sealed_index];
          for (int h = 0; h < layout().n_kv_heads; ++h)
            std::memcpy(staged_tile(to, t.sealed_index, h), staged_tile(from, t.sealed_index, h), staged_tile_bytes_);
          slot_fill_[at] = std::min(src_fill, n_tokens);
          if (src_fill == bs && n_tokens < bs && !src_held) stage_from_tile(t, dst, to, n_tokens);  // sealed in src's tile
        } else {
          stage_from_tile(t, dst, to, n_tokens);  // reopen part of a sealed block
        }
      }
  }
  for (int l = 0; l < layout().n_layers; ++l) {
    if (!merge_[static_cast<std::size_t>(l)]) continue;
    std::memcpy(merge_head(dst, l, 0).data, merge_head(src, l, 0).data, merge_bytes_per_block_head() * layout().n_kv_heads);
    for (int h = 0; h < layout().n_kv_heads; ++h) merge_head(dst, l, h).drop_from(n_tokens);
  }
  for (int l = 0; l < layout().n_layers; ++l) {
    has_bias(dst, l) = has_bias(src, l);
    if (has_bias(src, l))
      std::memcpy(bias_at(dst, l, 0), bias_at(src, l, 0), sizeof(float) * layout().n_kv_heads * bs);
  }
  if (summaries_) {
    const auto at_src = at(src) * layout().n_layers;
    const auto at_dst = at(dst) * layout().n_layers;
    for (int l = 0; l < layout().n_layers; ++l) {
      const bool keep = n_tokens == bs && summarized_[at_src + l];
      summarized_[at_dst + l] = keep;
      if (keep)
        std::memcpy(summary(dst, l, 0), summary(src, l, 0),
                    sizeof(float) * 3 * static_cast<std::size_t>(layout().head_dim) * layout().n_kv_heads);
    }
  }
}

void kv_arena::truncate_block(block_id b, int n_tokens) {
  PAGODA_ASSERT(owns(b));
  PAGODA_ASSERT(n_tokens >= 0 && n_tokens < layout().block_size, "truncate to {} tokens", n_tokens);
  forget_summaries(b);
  for (int l = 0; l < layout().n_layers; ++l)
    if (merge_[static_cast<std::size_t>(l)])
      for (int h = 0; h < layout().n_kv_heads; ++h) merge_head(b, l, h).drop_from(n_tokens);
  block_class_data& c = classes_[block_class(b)];
  if (c.n_sealed == 0) return;  // codes of other formats are per token: later writes just overwrite
  // A held block kept its whole staging when sealed: the kept slots' f16
  // values are exactly what was written, so the block seals again (once
  // refilled) into plain decoding's bytes. Otherwise a sealed tensor is
  // reopened from its codes.
  const bool kept = held(b);
  unhold(b);
  std::int32_t slot = block_slot_[at(b)];
  if (n_tokens == 0) {
    if (slot >= 0) release_slot(slot);
    return;
  }
  const bool sealed = slot < 0;  // no slot: every sealed tensor of b is encoded in its tile
  if (sealed) slot = acquire_slot(b);
  for (auto* tensors : {&c.k, &c.v})
    for (tensor& t : *tensors) {
      if (t.sealed_index < 0) continue;
      std::int32_t& fill = slot_fill_[static_cast<std::size_t>(slot) * slot_stride_ + t.sealed_index];
      if (sealed || (fill == layout().block_size && !kept)) stage_from_tile(t, b, slot, n_tokens);  // back to staging
      else fill = std::min(fill, n_tokens);
    }
}

void kv_arena::release_block(block_id b) {
  PAGODA_ASSERT(owns(b), "block id {} out of range", b.value);
  unhold(b);
  if (slot_stride_ > 0 && block_slot_[at(b)] >= 0) release_slot(block_slot_[at(b)]);
  forget_summaries(b);
  clear_bias(b);
  for (int l = 0; l < layout().n_layers; ++l)
    if (merge_[static_cast<std::size_t>(l)])
      std::memset(merge_head(b, l, 0).data, 0, merge_bytes_per_block_head() * layout().n_kv_heads);
}

void kv_arena::read_block(block_id b, std::span<std::byte> out) const {
  PAGODA_ASSERT(owns(b), "block id {} out of range", b.value);
  const block_class_data& c = classes_[block_class(b)];
  PAGODA_ASSERT(out.size() == c.layout.tile_bytes_per_block(), "read_block into {} bytes, block {} (class {}) has {}",
                out.size(), b.value, block_class(b), c.layout.tile_bytes_per_block());
  PAGODA_ASSERT(c.n_sealed == 0 || block_slot_[at(b)] < 0 || slot_sealed(block_slot_[at(b)], block_class(b)),
                "read_block of block {}, which is still staged", b.value);
  std::byte* dst = out.data();
  for (int l = 0; l < layout().n_layers; ++l)
    for (const tensor* t : {&c.k[l], &c.v[l]})
      for (int h = 0; h < layout().n_kv_heads; ++h) {
        std::memcpy(dst, tile(*t, b, h), t->tile_bytes);
        dst += t->tile_bytes;
      }
  for (int l = 0; l < layout().n_layers; ++l) {
    if (!merge_[static_cast<std::size_t>(l)]) continue;
    const std::size_t bytes = merge_bytes_per_block_head() * layout().n_kv_heads;
    std::memcpy(dst, merge_head(b, l, 0).data, bytes);
    dst += bytes;
  }
}

status kv_arena::write_block(block_id b, std::span<const std::byte> in) {
  PAGODA_ASSERT(owns(b), "block id {} out of range", b.value);
  const block_class_data& c = classes_[block_class(b)];
  if (in.size() != c.layout.tile_bytes_per_block()) {
    if (classes_.size() > 1)
      return error(errc::invalid_argument, "a KV block of block class {} ({}) has {} bytes, not {}", block_class(b),
                   c.layout.describe(), c.layout.tile_bytes_per_block(), in.size());
    return error(errc::invalid_argument, "a KV block of this layout ({}) has {} bytes, not {}", c.layout.describe(),
                 c.layout.tile_bytes_per_block(), in.size());
  }
  unhold(b);
  if (slot_stride_ > 0 && block_slot_[at(b)] >= 0) release_slot(block_slot_[at(b)]);
  clear_bias(b);
  const std::byte* src = in.data();
  for (int l = 0; l < layout().n_layers; ++l)
    for (const tensor* t : {&c.k[l], &c.v[l]})
      for (int h = 0; h < layout().n_kv_heads; ++h) {
        std::memcpy(tile(*t, b, h), src, t->tile_bytes);
        src += t->tile_bytes;
      }
  for (int l = 0; l < layout().n_layers; ++l) {
    if (!merge_[static_cast<std::size_t>(l)]) continue;
    const std::size_t bytes = merge_bytes_per_block_head() * layout().n_kv_heads;
    std::memcpy(merge_head(b, l, 0).data, src, bytes);
    src += bytes;
  }
  for (int l = 0; l < layout().n_layers; ++l) summarize(l, b);
  return {};
}

// --- merged layers (MiniCache) -----------------------------------------------------

std::size_t kv_arena::merge_bytes_per_block_head() const { return sizeof(float) * layout().merge_shape().head_floats(); }

kv_merge_head kv_arena::merge_head(block_id b, int layer, int head) const {
  float* base = merge_[static_cast<std::size_t>(layer)];
  PAGODA_DASSERT(base != nullptr, "layer {} is not merged", layer);
  const kv_merge_shape shape = layout().merge_shape();
  return {base + (at(b) * static_cast<std::size_t>(layout().n_kv_heads) + static_cast<std::size_t>(head)) *
                     shape.head_floats(),
          shape};
}

void kv_arena::attach_merge(int layer, paged_kv_view& k, paged_kv_view& v) const {
  const float* base = merge_[static_cast<std::size_t>(layer)];
  if (!base) return;
  for (paged_kv_view* view : {&k, &v}) {
    view->merge = base;
    view->merge_shape = layout().merge_shape();
    view->n_kv_heads = layout().n_kv_heads;
  }
}

void kv_arena::merge_write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k,
                           const float* v, const float* prod_k, const float* prod_v) {
  PAGODA_ASSERT(layer >= 0 && layer < layout().n_layers && merge_[static_cast<std::size_t>(layer)],
                "merge_write to layer {}, which is not merged", layer);
  const int bs = layout().block_size, hd = layout().head_dim, n_heads = layout().n_kv_heads;
  const kv_tile_shape shape = layout().tile_shape();
  const std::size_t row = static_cast<std::size_t>(n_heads) * hd;
  const std::size_t block_rows = static_cast<std::size_t>(bs) * hd;
  float* sk = merge_scratch_.data();
  float* sv = sk + 3 * static_cast<std::size_t>(hd);
  // Where one role's rows of the (block, head) being merged are read and
  // written: its tile (a per-token format), its staged f16 copy (a sealed
  // format, the block open or just sealed by its producer), or a block of
  // rows here (a sealed format, the block written whole in this step: it
  // has no staging, and is encoded once its last slot is merged).
  struct rows_at {
    const kv_codec* codec = nullptr;
    kv_format format;
    const kv_static_params* params = nullptr;
    std::byte* tile = nullptr;
    float* rows = nullptr;  // [block_size][head_dim], or null
  };
  rows_at at_k, at_v;
  const kv_codec* f16 = get_kv_codec(kv_type::f16);
  auto locate = [&](tensor& t, block_id b, int head, float* whole) {
    rows_at r;
    if (t.sealed_index < 0) {
      r = {t.codec, t.format, t.params(head), tile(t, b, head), nullptr};
    } else if (const std::int32_t st = slot_of(b); st >= 0) {
      r = {f16, kv_staged_format(t.format.role), nullptr, staged_tile(st, t.sealed_index, head), nullptr};
    } else {
      r.rows = whole + static_cast<std::size_t>(head) * block_rows;
    }
    return r;
  };
  auto read_row = [&](const rows_at& r, int s, float* out) {
    if (r.rows) std::copy_n(r.rows + static_cast<std::size_t>(s) * hd, hd, out);
    else r.codec->decode(r.format, shape, r.params, r.tile, s, 1, out);
  };
  auto write_row = [&](const rows_at& r, int s, const float* x) {
    if (!r.rows) {
      r.codec->encode(r.format, shape, r.params, x, s, 1, r.tile);
      return;
    }
    for (int d = 0; d < hd; ++d) r.rows[static_cast<std::size_t>(s) * hd + d] = fp16_to_f32(f32_to_fp16(x[d]));  // as staging holds it
  };
  // The one decode callback (made once, not per token and head) reads a displaced slot.
  const kv_merge_decode decode = [&](int s, float* ko, float* vo) {
    read_row(at_k, s, ko);
    read_row(at_v, s, vo);
  };
  for (int i = 0; i < n; ++i) {
    const int p = slot + i;
    PAGODA_ASSERT(p / bs < static_cast<int>(blocks.size()), "slot {} has no block (table holds {})", p, blocks.size());
    const block_id b = blocks[static_cast<std::size_t>(p / bs)];
    tensor& tk = k_of(b, layer);
    tensor& tv = v_of(b, layer);
    const bool whole = (tk.sealed_index >= 0 || tv.sealed_index >= 0) && slot_of(b) < 0;
    if (whole && p % bs == 0) {
      // A block written whole in this step: its rows start as the producer's,
      // rounded through f16 as its write encoded them.
      PAGODA_ASSERT(n - i >= bs, "merge_write of block {} from slot {}: a sealed block without staging is merged whole",
                    b.value, p % bs);
      merge_block_.resize(2 * static_cast<std::size_t>(n_heads) * block_rows);
      for (int h = 0; h < n_heads; ++h)
        for (int j = 0; j < bs; ++j)
          for (int d = 0; d < hd; ++d) {
            const std::size_t from = static_cast<std::size_t>(i + j) * row + static_cast<std::size_t>(h) * hd + d;
            const std::size_t to = static_cast<std::size_t>(h) * block_rows + static_cast<std::size_t>(j) * hd + d;
            merge_block_[to] = fp16_to_f32(f32_to_fp16(prod_k[from]));
            merge_block_[static_cast<std::size_t>(n_heads) * block_rows + to] = fp16_to_f32(f32_to_fp16(prod_v[from]));
          }
    }
    float* whole_k = merge_block_.data();
    float* whole_v = whole_k + static_cast<std::size_t>(n_heads) * block_rows;
    for (int head = 0; head < n_heads; ++head) {
      at_k = locate(tk, b, head, whole_k);
      at_v = locate(tv, b, head, whole_v);
      const std::size_t at_row = static_cast<std::size_t>(i) * row + static_cast<std::size_t>(head) * hd;
      kv_merge_write writes[2];
      kv_merge_token(merge_head(b, layer, head), p % bs, {prod_k + at_row, prod_v + at_row, k + at_row, v + at_row},
                     layout().merge_t, sk, sv, writes, decode);
      for (const kv_merge_write& w : writes) {
        if (w.slot < 0) continue;
        write_row(at_k, w.slot, w.k);
        write_row(at_v, w.slot, w.v);
      }
    }
    if (p % bs == bs - 1) seal_merged(layer, b, whole ? whole_k : nullptr, whole ? whole_v : nullptr);
    // A full block's key summary follows its rewritten keys.
    if (summaries_ && (p % bs == bs - 1 || i == n - 1) && summarized(b, layer)) summarize(layer, b);
  }
}

void kv_arena::seal_merged(int layer, block_id b, const float* whole_k, const float* whole_v) {
  const int bs = layout().block_size, hd = layout().head_dim;
  const std::size_t block_rows = static_cast<std::size_t>(bs) * hd;
  if (k_of(b, layer).sealed_index < 0 && v_of(b, layer).sealed_index < 0) return;  // encoded as written
  const std::int32_t st = slot_of(b);
  for (auto [t, whole] : {std::pair{&k_of(b, layer), whole_k}, std::pair{&v_of(b, layer), whole_v}}) {
    if (t->sealed_index < 0) continue;
    if (whole) {  // the block's rows (f16 values, as staging would hold them)
      for (int h = 0; h < layout().n_kv_heads; ++h)
        t->codec->encode(t->format, layout().tile_shape(), nullptr, whole + static_cast<std::size_t>(h) * block_rows, 0,
                         bs, tile(*t, b, h));
      continue;
    }
    PAGODA_ASSERT(st >= 0, "merged block {} of layer {} lost its staging before its reader merged it", b.value, layer);
    std::uint8_t& pending = merge_pending_[static_cast<std::size_t>(st) * slot_stride_ + t->sealed_index];
    if (!pending) continue;  // not sealed by its producer (held blocks keep staging whole and seal later)
    seal_from_staging(*t, b, st);
    pending = 0;
  }
  if (st >= 0 && !held(b) && slot_sealed(st, block_class(b))) release_slot(st);
}

}  // namespace pagoda
