#include "kv/kv_storage.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/assert.h"
#include "core/half.h"

namespace pagoda {
namespace {

kv_format staged_format_for(kv_role role) { return default_kv_format(kv_type::f16, role); }

std::size_t staged_tile_bytes_for(kv_tile_shape shape) {
  return get_kv_codec(kv_type::f16)->tile_bytes(staged_format_for(kv_role::key), shape);
}

// Anonymous, lazily zeroed memory, backed by huge pages where the kernel allows
// (attention reads tiles at scattered addresses: one TLB entry per 2 MiB
// instead of per 4 KiB tile). The advice is a hint; failing it changes nothing.
void* map_zeroed(std::size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
#ifdef MADV_HUGEPAGE
  if (bytes >= (std::size_t{2} << 20)) madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return p;
}

}  // namespace

// ---------------------------------------------------------------------------
// kv_layout

kv_layout kv_layout::uniform(int n_layers, int n_kv_heads, int head_dim, int block_size, kv_type k_type,
                             kv_type v_type) {
  kv_layout l;
  l.n_layers = n_layers;
  l.n_kv_heads = n_kv_heads;
  l.head_dim = head_dim;
  l.block_size = block_size;
  l.k_formats.assign(n_layers, default_kv_format(k_type, kv_role::key));
  l.v_formats.assign(n_layers, default_kv_format(v_type, kv_role::value));
  return l;
}

status kv_layout::check() const {
  if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0)
    return error(errc::invalid_argument, "KV layout needs positive layers, KV heads and head_dim");
  if (block_size <= 0 || block_size > 1024)
    return error(errc::invalid_argument, "block size {} out of range (1..1024)", block_size);
  if (static_cast<int>(k_formats.size()) != n_layers || static_cast<int>(v_formats.size()) != n_layers)
    return error(errc::invalid_argument, "KV layout needs one K and one V format per layer");
  for (int l = 0; l < n_layers; ++l)
    for (const kv_format* f : {&k_formats[l], &v_formats[l]}) {
      const char* what = f->role == kv_role::key ? "K" : "V";
      const kv_codec* c = get_kv_codec(f->type);
      if (!c) return error(errc::unsupported, "KV cache type {} has no codec", kv_type_name(f->type));
      if (status st = c->check(*f, tile_shape()); !st.ok()) return st.with_context(fmt::format("layer {} {}", l, what));
      if (f->scale_mode == kv_scale_mode::static_scales) {
        if (!c->make_static)
          return error(errc::invalid_argument, "layer {} {}: {} has no static scales", l, what, kv_type_name(f->type));
        if (!scales)
          return error(errc::invalid_argument,
                       "layer {} {}: {} needs calibrated scales (--kv-scales FILE, made by pagoda calibrate)", l, what,
                       kv_format_name(*f));
        PAGODA_RETURN_IF_ERROR(scales->check_shape(n_layers, n_kv_heads, head_dim));
      }
    }
  return {};
}

std::size_t kv_layout::bytes_per_block() const {
  const kv_tile_shape shape = tile_shape();
  std::size_t total = 0;
  for (int l = 0; l < n_layers; ++l) {
    total += get_kv_codec(k_formats[l].type)->tile_bytes(k_formats[l], shape) * n_kv_heads;
    total += get_kv_codec(v_formats[l].type)->tile_bytes(v_formats[l], shape) * n_kv_heads;
  }
  return total;
}

double kv_layout::bytes_per_token() const { return static_cast<double>(bytes_per_block()) / block_size; }

std::size_t kv_layout::staging_bytes_per_slot() const {
  std::size_t n_sealed = 0;
  for (int l = 0; l < n_layers; ++l) n_sealed += kv_format_sealed(k_formats[l]) + kv_format_sealed(v_formats[l]);
  return n_sealed * n_kv_heads * staged_tile_bytes_for(tile_shape());
}

std::size_t kv_layout::static_bytes() const {
  std::size_t n = 0;
  for (int l = 0; l < n_layers; ++l)
    n += (k_formats[l].scale_mode == kv_scale_mode::static_scales) + (v_formats[l].scale_mode == kv_scale_mode::static_scales);
  return n * 2 * sizeof(float) * n_kv_heads * head_dim;
}

double kv_layout::bytes_per_token_at(std::int64_t n_tokens) const {
  if (n_tokens <= 0) return 0;
  std::int64_t blocks = (n_tokens + block_size - 1) / block_size;
  return (static_cast<double>(blocks) * bytes_per_block() + staging_bytes_per_slot()) / static_cast<double>(n_tokens);
}

double kv_layout::bits_per_element() const {
  return 8.0 * bytes_per_token() / (2.0 * n_layers * n_kv_heads * head_dim);
}

std::string kv_layout::describe() const {
  auto pair = [&](int l) { return kv_format_name(k_formats[l]) + "+" + kv_format_name(v_formats[l]); };
  std::string out;
  int start = 0;
  for (int l = 1; l <= n_layers; ++l) {
    if (l < n_layers && pair(l) == pair(start)) continue;
    if (start == 0 && l == n_layers) return pair(0);
    if (!out.empty()) out += ",";
    out += l - 1 == start ? fmt::format("{}:{}", start, pair(start)) : fmt::format("{}-{}:{}", start, l - 1, pair(start));
    start = l;
  }
  return out;
}

// ---------------------------------------------------------------------------
// kv_storage

result<std::unique_ptr<kv_storage>> kv_storage::create(const kv_layout& layout, std::int64_t n_blocks,
                                                       std::int64_t n_staging_slots) {
  PAGODA_RETURN_IF_ERROR(layout.check());
  if (n_blocks <= 0) return error(errc::invalid_argument, "KV pool needs at least one block (got {})", n_blocks);
  if (n_blocks > INT32_MAX) return error(errc::invalid_argument, "KV pool of {} blocks is too large", n_blocks);
  std::unique_ptr<kv_storage> s(new kv_storage());
  s->layout_ = layout;
  s->n_blocks_ = n_blocks;
  s->k_.resize(layout.n_layers);
  s->v_.resize(layout.n_layers);
  for (int l = 0; l < layout.n_layers; ++l) {
    PAGODA_RETURN_IF_ERROR(s->init_tensor(s->k_[l], layout.k_formats[l], l));
    PAGODA_RETURN_IF_ERROR(s->init_tensor(s->v_[l], layout.v_formats[l], l));
  }
  s->gather_.resize(static_cast<std::size_t>(layout.block_size) * layout.head_dim);
  if (s->n_sealed_ > 0) {
    s->staged_tile_bytes_ = staged_tile_bytes_for(layout.tile_shape());
    s->slot_bytes_ = static_cast<std::size_t>(s->n_sealed_) * layout.n_kv_heads * s->staged_tile_bytes_;
    s->block_slot_.assign(n_blocks, -1);
    s->slots_per_chunk_ = std::clamp<std::int64_t>(n_staging_slots, 1, n_blocks);
    if (!s->map_staging_chunk())
      return error(errc::resource_exhausted, "cannot map {} bytes of KV staging: {}",
                   s->slot_bytes_ * s->slots_per_chunk_, std::strerror(errno));
  }
  return s;
}

status kv_storage::init_tensor(tensor& t, const kv_format& fmt, int layer) {
  const kv_tile_shape shape = layout_.tile_shape();
  t.codec = get_kv_codec(fmt.type);
  t.format = fmt;
  t.tile_bytes = t.codec->tile_bytes(fmt, shape);
  t.size_bytes = t.tile_bytes * layout_.n_kv_heads * static_cast<std::size_t>(n_blocks_);
  t.data = static_cast<std::byte*>(map_zeroed(t.size_bytes));
  if (!t.data)
    return error(errc::resource_exhausted, "cannot map {} bytes for the KV cache: {}", t.size_bytes,
                 std::strerror(errno));
  if (kv_format_sealed(fmt)) t.sealed_index = n_sealed_++;
  if (fmt.scale_mode == kv_scale_mode::static_scales) {
    const int H = layout_.n_kv_heads, D = layout_.head_dim;
    t.static_values.resize(2 * static_cast<std::size_t>(H) * D);
    t.static_params.resize(H);
    for (int h = 0; h < H; ++h) {
      float* scale = t.static_values.data() + static_cast<std::size_t>(h) * D;
      float* offset = scale + static_cast<std::size_t>(H) * D;
      t.codec->make_static(fmt, D, layout_.scales->lo(fmt.role, layer, h), layout_.scales->hi(fmt.role, layer, h),
                           scale, offset);
      t.static_params[h] = {scale, offset};
    }
  }
  return {};
}

kv_storage::~kv_storage() {
  for (auto* tensors : {&k_, &v_})
    for (tensor& t : *tensors)
      if (t.data) munmap(t.data, t.size_bytes);
  for (std::byte* c : staging_chunks_) munmap(c, slot_bytes_ * slots_per_chunk_);
}

std::size_t kv_storage::total_bytes() const {
  std::size_t total = staging_chunks_.size() * slot_bytes_ * slots_per_chunk_;
  for (auto* tensors : {&k_, &v_})
    for (const tensor& t : *tensors) total += t.size_bytes + t.static_values.size() * sizeof(float);
  return total;
}

kv_staging_stats kv_storage::staging() const {
  kv_staging_stats s;
  s.slots_mapped = static_cast<std::int64_t>(staging_chunks_.size()) * slots_per_chunk_;
  s.slots_in_use = slots_in_use_;
  s.peak_slots_in_use = peak_slots_in_use_;
  s.bytes_mapped = staging_chunks_.size() * slot_bytes_ * slots_per_chunk_;
  return s;
}

bool kv_storage::map_staging_chunk() {
  auto* p = static_cast<std::byte*>(map_zeroed(slot_bytes_ * slots_per_chunk_));
  if (!p) return false;
  const auto first = static_cast<std::int32_t>(staging_chunks_.size() * slots_per_chunk_);
  staging_chunks_.push_back(p);
  slot_block_.resize(slot_block_.size() + slots_per_chunk_, -1);
  slot_fill_.resize(slot_fill_.size() + slots_per_chunk_ * n_sealed_, 0);
  for (std::int64_t i = slots_per_chunk_ - 1; i >= 0; --i) free_slots_.push_back(first + static_cast<std::int32_t>(i));
  return true;
}

std::byte* kv_storage::slot_data(std::int32_t slot) const {
  return staging_chunks_[slot / slots_per_chunk_] + static_cast<std::size_t>(slot % slots_per_chunk_) * slot_bytes_;
}

std::byte* kv_storage::staged_tile(std::int32_t slot, int sealed_index, int head) const {
  return slot_data(slot) + (static_cast<std::size_t>(sealed_index) * layout_.n_kv_heads + head) * staged_tile_bytes_;
}

std::int32_t kv_storage::acquire_slot(block_id b) {
  if (free_slots_.empty())
    PAGODA_ASSERT(map_staging_chunk(), "cannot map {} more bytes of KV staging: {}", slot_bytes_ * slots_per_chunk_,
                  std::strerror(errno));
  std::int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  slot_block_[slot] = b.value;
  block_slot_[b.value] = slot;
  std::fill_n(slot_fill_.begin() + static_cast<std::ptrdiff_t>(slot) * n_sealed_, n_sealed_, 0);
  peak_slots_in_use_ = std::max(peak_slots_in_use_, ++slots_in_use_);
  return slot;
}

void kv_storage::release_slot(std::int32_t slot) {
  block_slot_[slot_block_[slot]] = -1;
  slot_block_[slot] = -1;
  free_slots_.push_back(slot);
  --slots_in_use_;
}

void kv_storage::release_block(block_id b) {
  PAGODA_ASSERT(b.value >= 0 && b.value < n_blocks_, "block id {} out of range", b.value);
  if (n_sealed_ > 0 && block_slot_[b.value] >= 0) release_slot(block_slot_[b.value]);
}

void kv_storage::write_tensor(tensor& a, std::span<const block_id> blocks, int pos, int n, const float* x) {
  const int bs = layout_.block_size;
  const int hd = layout_.head_dim;
  const int n_heads = layout_.n_kv_heads;
  const kv_tile_shape shape = layout_.tile_shape();
  const std::size_t row = static_cast<std::size_t>(n_heads) * hd;
  const kv_codec* f16 = get_kv_codec(kv_type::f16);
  const kv_format staged_fmt = staged_format_for(a.format.role);
  float* gather = gather_.data();
  int i = 0;
  while (i < n) {
    const int p = pos + i;
    const int b = p / bs, t0 = p % bs;
    const int run = std::min(n - i, bs - t0);
    PAGODA_ASSERT(b < static_cast<int>(blocks.size()), "position {} has no block (table holds {})", p, blocks.size());
    const block_id id = blocks[b];
    PAGODA_ASSERT(id.value >= 0 && id.value < n_blocks_, "block id {} out of range", id.value);
    // x rows are [token][head][hd]; a tile wants [token][hd] for one head.
    auto gather_head = [&](int h) {
      for (int j = 0; j < run; ++j)
        std::memcpy(gather + static_cast<std::size_t>(j) * hd, x + (i + j) * row + static_cast<std::size_t>(h) * hd,
                    sizeof(float) * hd);
    };
    auto tile_of = [&](int h) {
      return a.data + (static_cast<std::size_t>(h) * n_blocks_ + id.value) * a.tile_bytes;
    };
    if (a.sealed_index < 0) {
      for (int h = 0; h < n_heads; ++h) {
        gather_head(h);
        a.codec->encode(a.format, shape, a.static_params.empty() ? nullptr : &a.static_params[h], gather, t0, run,
                        tile_of(h));
      }
    } else {
      std::int32_t slot = block_slot_[id.value];
      if (t0 == 0 && run == bs) {
        // The whole block at once: encode directly, through f16 as if staged.
        for (int h = 0; h < n_heads; ++h) {
          gather_head(h);
          for (std::size_t j = 0; j < static_cast<std::size_t>(bs) * hd; ++j) gather[j] = fp16_to_f32(f32_to_fp16(gather[j]));
          a.codec->encode(a.format, shape, nullptr, gather, 0, bs, tile_of(h));
        }
        if (slot >= 0) slot_fill_[static_cast<std::size_t>(slot) * n_sealed_ + a.sealed_index] = bs;
      } else {
        if (slot < 0) {
          PAGODA_ASSERT(t0 == 0, "block {} is written at slot {} but its first slots were never staged", id.value, t0);
          slot = acquire_slot(id);
        }
        std::int32_t& fill = slot_fill_[static_cast<std::size_t>(slot) * n_sealed_ + a.sealed_index];
        PAGODA_ASSERT(t0 == 0 || fill == t0, "block {}: write at slot {} but {} tokens are staged", id.value, t0, fill);
        for (int h = 0; h < n_heads; ++h) {
          gather_head(h);
          f16->encode(staged_fmt, shape, nullptr, gather, t0, run, staged_tile(slot, a.sealed_index, h));
        }
        fill = t0 + run;
        if (fill == bs)  // seal: encode the staged block
          for (int h = 0; h < n_heads; ++h) {
            f16->decode(staged_fmt, shape, nullptr, staged_tile(slot, a.sealed_index, h), 0, bs, gather);
            a.codec->encode(a.format, shape, nullptr, gather, 0, bs, tile_of(h));
          }
      }
      if (slot >= 0) {
        const std::int32_t* fills = &slot_fill_[static_cast<std::size_t>(slot) * n_sealed_];
        if (std::all_of(fills, fills + n_sealed_, [&](std::int32_t f) { return f == bs; })) release_slot(slot);
      }
    }
    i += run;
  }
}

void kv_storage::write(int layer, std::span<const block_id> blocks, int pos, int n, const float* k, const float* v) {
  PAGODA_ASSERT(layer >= 0 && layer < layout_.n_layers);
  write_tensor(k_[layer], blocks, pos, n, k);
  write_tensor(v_[layer], blocks, pos, n, v);
}

paged_kv_view kv_storage::view(const tensor& a, std::span<const block_id> blocks, int n_tokens) const {
  paged_kv_view view;
  view.codec = a.codec;
  view.format = a.format;
  view.shape = layout_.tile_shape();
  view.base = a.data;
  view.tile_bytes = a.tile_bytes;
  view.head_stride = a.tile_bytes * static_cast<std::size_t>(n_blocks_);
  view.blocks = blocks;
  view.n_tokens = n_tokens;
  view.static_params = a.static_params.empty() ? nullptr : a.static_params.data();
  const int bs = layout_.block_size;
  if (a.sealed_index >= 0 && n_tokens > 0 && n_tokens % bs != 0) {
    const block_id last = blocks[(n_tokens - 1) / bs];
    const std::int32_t slot = block_slot_[last.value];
    // Not staged: the block was sealed since (the view covers a prefix of it).
    if (slot >= 0 && slot_fill_[static_cast<std::size_t>(slot) * n_sealed_ + a.sealed_index] < bs) {
      PAGODA_ASSERT(slot_fill_[static_cast<std::size_t>(slot) * n_sealed_ + a.sealed_index] >= n_tokens % bs,
                    "view of {} tokens past the staged tokens of block {}", n_tokens, last.value);
      view.staged = staged_tile(slot, a.sealed_index, 0);
      view.staged_tile_bytes = staged_tile_bytes_;
      view.staged_codec = get_kv_codec(kv_type::f16);
      view.staged_format = staged_format_for(a.format.role);
    }
  }
  return view;
}

paged_kv_view kv_storage::k_view(int layer, std::span<const block_id> blocks, int n_tokens) const {
  return view(k_[layer], blocks, n_tokens);
}

paged_kv_view kv_storage::v_view(int layer, std::span<const block_id> blocks, int n_tokens) const {
  return view(v_[layer], blocks, n_tokens);
}

void kv_storage::copy_block(block_id src, block_id dst) {
  PAGODA_ASSERT(src.value >= 0 && src.value < n_blocks_ && dst.value >= 0 && dst.value < n_blocks_);
  for (auto* tensors : {&k_, &v_})
    for (tensor& t : *tensors)
      for (int h = 0; h < layout_.n_kv_heads; ++h) {
        std::byte* head = t.data + t.tile_bytes * static_cast<std::size_t>(h) * n_blocks_;
        std::memcpy(head + t.tile_bytes * dst.value, head + t.tile_bytes * src.value, t.tile_bytes);
      }
  if (n_sealed_ == 0) return;
  const std::int32_t from = block_slot_[src.value];
  if (from < 0) {
    release_block(dst);  // dst's old slot, if any, is stale
    return;
  }
  std::int32_t to = block_slot_[dst.value];
  if (to < 0) to = acquire_slot(dst);
  std::memcpy(slot_data(to), slot_data(from), slot_bytes_);
  std::copy_n(slot_fill_.begin() + static_cast<std::ptrdiff_t>(from) * n_sealed_, n_sealed_,
              slot_fill_.begin() + static_cast<std::ptrdiff_t>(to) * n_sealed_);
}

}  // namespace pagoda
