#include "kv/kv_storage.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "core/assert.h"

namespace pagoda {

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

std::size_t kv_layout::bytes_per_block() const {
  kv_tile_shape shape{block_size, head_dim};
  std::size_t total = 0;
  for (int l = 0; l < n_layers; ++l) {
    total += get_kv_codec(k_formats[l].type)->tile_bytes(k_formats[l], shape) * n_kv_heads;
    total += get_kv_codec(v_formats[l].type)->tile_bytes(v_formats[l], shape) * n_kv_heads;
  }
  return total;
}

double kv_layout::bytes_per_token() const { return static_cast<double>(bytes_per_block()) / block_size; }

result<std::unique_ptr<kv_storage>> kv_storage::create(const kv_layout& layout, std::int64_t n_blocks) {
  if (layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0)
    return error(errc::invalid_argument, "KV layout needs positive layers, KV heads and head_dim");
  if (layout.block_size <= 0 || layout.block_size > 1024)
    return error(errc::invalid_argument, "block size {} out of range (1..1024)", layout.block_size);
  if (static_cast<int>(layout.k_formats.size()) != layout.n_layers ||
      static_cast<int>(layout.v_formats.size()) != layout.n_layers)
    return error(errc::invalid_argument, "KV layout needs one K and one V format per layer");
  if (n_blocks <= 0) return error(errc::invalid_argument, "KV pool needs at least one block (got {})", n_blocks);
  std::unique_ptr<kv_storage> s(new kv_storage());
  s->layout_ = layout;
  s->n_blocks_ = n_blocks;
  kv_tile_shape shape{layout.block_size, layout.head_dim};
  auto make = [&](const kv_format& fmt, arena& a) -> status {
    a.codec = get_kv_codec(fmt.type);
    if (!a.codec) return error(errc::unsupported, "KV cache type {} has no codec", kv_type_name(fmt.type));
    a.format = fmt;
    a.tile_bytes = a.codec->tile_bytes(fmt, shape);
    a.size_bytes = a.tile_bytes * layout.n_kv_heads * static_cast<std::size_t>(n_blocks);
    void* p = mmap(nullptr, a.size_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      return error(errc::resource_exhausted, "cannot map {} bytes for the KV cache: {}", a.size_bytes,
                   std::strerror(errno));
    a.data = static_cast<std::byte*>(p);
    return {};
  };
  s->k_.resize(layout.n_layers);
  s->v_.resize(layout.n_layers);
  for (int l = 0; l < layout.n_layers; ++l) {
    PAGODA_RETURN_IF_ERROR(make(layout.k_formats[l], s->k_[l]));
    PAGODA_RETURN_IF_ERROR(make(layout.v_formats[l], s->v_[l]));
  }
  return s;
}

kv_storage::~kv_storage() {
  for (auto* arenas : {&k_, &v_})
    for (arena& a : *arenas)
      if (a.data) munmap(a.data, a.size_bytes);
}

std::size_t kv_storage::total_bytes() const {
  std::size_t total = 0;
  for (const arena& a : k_) total += a.size_bytes;
  for (const arena& a : v_) total += a.size_bytes;
  return total;
}

void kv_storage::write_tensor(const arena& a, std::span<const block_id> blocks, int pos, int n, const float* x) {
  const int bs = layout_.block_size;
  const int hd = layout_.head_dim;
  const int n_heads = layout_.n_kv_heads;
  kv_tile_shape shape{bs, hd};
  const std::size_t row = static_cast<std::size_t>(n_heads) * hd;
  thread_local std::vector<float> gather;  // reused across calls: no allocation per step
  int i = 0;
  while (i < n) {
    int p = pos + i;
    int b = p / bs, t0 = p % bs;
    int run = std::min(n - i, bs - t0);
    PAGODA_ASSERT(b < static_cast<int>(blocks.size()), "position {} has no block (table holds {})", p, blocks.size());
    block_id id = blocks[b];
    PAGODA_ASSERT(id.value >= 0 && id.value < n_blocks_, "block id {} out of range", id.value);
    // x rows are [token][head][hd]; a tile wants [token][hd] for one head.
    gather.resize(static_cast<std::size_t>(run) * hd);
    for (int h = 0; h < n_heads; ++h) {
      for (int j = 0; j < run; ++j)
        std::memcpy(&gather[static_cast<std::size_t>(j) * hd], x + (i + j) * row + static_cast<std::size_t>(h) * hd,
                    sizeof(float) * hd);
      std::byte* tile = a.data + (static_cast<std::size_t>(id.value) * n_heads + h) * a.tile_bytes;
      a.codec->encode(a.format, shape, gather.data(), t0, run, tile, nullptr);
    }
    i += run;
  }
}

void kv_storage::write(int layer, std::span<const block_id> blocks, int pos, int n, const float* k, const float* v) {
  PAGODA_ASSERT(layer >= 0 && layer < layout_.n_layers);
  write_tensor(k_[layer], blocks, pos, n, k);
  write_tensor(v_[layer], blocks, pos, n, v);
}

paged_kv_view kv_storage::view(const arena& a, std::span<const block_id> blocks, int n_tokens) const {
  paged_kv_view view;
  view.codec = a.codec;
  view.format = a.format;
  view.shape = {layout_.block_size, layout_.head_dim};
  view.base = a.data;
  view.tile_bytes = a.tile_bytes;
  view.block_stride = a.tile_bytes * layout_.n_kv_heads;
  view.blocks = blocks;
  view.n_tokens = n_tokens;
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
  for (auto* arenas : {&k_, &v_})
    for (arena& a : *arenas) {
      std::size_t stride = a.tile_bytes * layout_.n_kv_heads;
      std::memcpy(a.data + stride * dst.value, a.data + stride * src.value, stride);
    }
}

}  // namespace pagoda
