#include "kv/kv_storage.h"

#include <algorithm>

#include "core/assert.h"

namespace pagoda {

result<std::unique_ptr<kv_storage>> kv_storage::create(std::span<const kv_layout> class_layouts,
                                                       std::span<const kv_group_blocks> groups,
                                                       std::int64_t n_staging_slots, kv_pool_memory memory) {
  if (class_layouts.empty()) return error(errc::invalid_argument, "a KV storage needs a layout");
  if (groups.empty()) return error(errc::invalid_argument, "a KV storage needs a KV group");
  const kv_layout& base = class_layouts[0];
  PAGODA_RETURN_IF_ERROR(base.check());
  for (std::size_t c = 1; c < class_layouts.size(); ++c) {
    const kv_layout& l = class_layouts[c];
    if (status st = l.check(); !st.ok()) return error(st.code(), "KV block class {}: {}", c, st.message());
    PAGODA_RETURN_IF_ERROR(check_kv_class_shape(base, l, static_cast<int>(c)));
  }
  std::unique_ptr<kv_storage> s(new kv_storage());
  s->layout_ = base;
  s->layer_group_.assign(static_cast<std::size_t>(base.n_layers), -1);
  s->layer_index_.assign(static_cast<std::size_t>(base.n_layers), -1);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const kv_group_blocks& grp = groups[g];
    if (grp.layers.empty()) return error(errc::invalid_argument, "KV group {} holds no layer", g);
    if (grp.class_blocks.size() != class_layouts.size())
      return error(errc::invalid_argument, "KV group {}: blocks of {} classes, but {} class layouts", g,
                   grp.class_blocks.size(), class_layouts.size());
    s->foreign_.push_back(grp.own_classes.empty() ? 0 : 1);
    if (!grp.own_classes.empty()) {
      // Another model's KV: its own shape and layers, its own class layouts.
      if (grp.own_classes.size() != class_layouts.size())
        return error(errc::invalid_argument, "KV group {}: {} class layouts of its own, but {} classes", g,
                     grp.own_classes.size(), class_layouts.size());
      for (std::size_t i = 0; i < grp.layers.size(); ++i)
        if (grp.layers[i] != static_cast<int>(i))
          return error(errc::invalid_argument, "KV group {} of another model: layers must be 0 .. {}", g, grp.layers.size() - 1);
      std::vector<kv_class_spec> classes;
      for (std::size_t c = 0; c < grp.own_classes.size(); ++c) {
        if (grp.own_classes[c].n_layers != static_cast<int>(grp.layers.size()))
          return error(errc::invalid_argument, "KV group {}: a layout of {} layers for {} layers", g,
                       grp.own_classes[c].n_layers, grp.layers.size());
        classes.push_back(kv_class_spec{grp.own_classes[c], grp.class_blocks[c]});
      }
      auto arena = kv_arena::create(classes, s->n_blocks_, grp.layers, n_staging_slots, memory);
      if (!arena.ok()) return arena.error().with_context(fmt::format("KV group {}", g));
      s->n_blocks_ += (*arena)->n_blocks();
      s->arenas_.push_back(std::move(*arena));
      continue;
    }
    for (std::size_t i = 0; i < grp.layers.size(); ++i) {
      const int l = grp.layers[i];
      if (l < 0 || l >= base.n_layers || s->layer_group_[static_cast<std::size_t>(l)] >= 0)
        return error(errc::invalid_argument, "KV group {}: layer {} is not one of the model's {} or is in two groups",
                     g, l, base.n_layers);
      s->layer_group_[static_cast<std::size_t>(l)] = static_cast<int>(g);
      s->layer_index_[static_cast<std::size_t>(l)] = static_cast<int>(i);
    }
    std::vector<kv_class_spec> classes;
    for (std::size_t c = 0; c < class_layouts.size(); ++c)
      classes.push_back(kv_class_spec{class_layouts[c].select_layers(grp.layers), grp.class_blocks[c]});
    auto arena = kv_arena::create(classes, s->n_blocks_, grp.layers, n_staging_slots, memory);
    if (!arena.ok()) return groups.size() > 1 ? arena.error().with_context(fmt::format("KV group {}", g)) : arena.error();
    s->n_blocks_ += (*arena)->n_blocks();
    s->arenas_.push_back(std::move(*arena));
  }
  for (int l = 0; l < base.n_layers; ++l)
    if (s->layer_group_[static_cast<std::size_t>(l)] < 0)
      return error(errc::invalid_argument, "layer {} is in no KV group", l);
  return s;
}

result<std::unique_ptr<kv_storage>> kv_storage::create(const kv_layout& layout, std::int64_t n_blocks,
                                                       std::int64_t n_staging_slots,
                                                       std::span<const kv_class_spec> extra_classes,
                                                       kv_pool_memory memory) {
  PAGODA_RETURN_IF_ERROR(layout.check());
  if (n_blocks <= 0) return error(errc::invalid_argument, "KV pool needs at least one block (got {})", n_blocks);
  std::vector<kv_layout> layouts{layout};
  kv_group_blocks all;
  for (int l = 0; l < layout.n_layers; ++l) all.layers.push_back(l);
  all.class_blocks.push_back(n_blocks);
  for (const kv_class_spec& c : extra_classes) {
    layouts.push_back(c.layout);
    all.class_blocks.push_back(c.n_blocks);
  }
  const kv_group_blocks groups[] = {std::move(all)};
  return create(layouts, groups, n_staging_slots, memory);
}

kv_storage::~kv_storage() = default;

int kv_storage::group_of(block_id b) const {
  for (std::size_t g = 0; g < arenas_.size(); ++g)
    if (arenas_[g]->owns(b)) return static_cast<int>(g);
  PAGODA_ASSERT(false, "block id {} out of range ({} blocks)", b.value, n_blocks_);
  return 0;
}

std::size_t kv_storage::total_bytes() const {
  std::size_t total = 0;
  for (const auto& a : arenas_) total += a->total_bytes();
  return total;
}

kv_staging_stats kv_storage::staging() const {
  kv_staging_stats s;
  for (const auto& a : arenas_) {
    const kv_staging_stats one = a->staging();
    s.slots_mapped += one.slots_mapped;
    s.slots_in_use += one.slots_in_use;
    s.peak_slots_in_use += one.peak_slots_in_use;
    s.bytes_mapped += one.bytes_mapped;
  }
  return s;
}

void kv_storage::write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k, const float* v) {
  PAGODA_ASSERT(layer >= 0 && layer < layout_.n_layers, "layer {}", layer);
  arena_of_layer(layer).write(local_layer(layer), blocks, slot, n, k, v);
}

void kv_storage::merge_write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k,
                             const float* v, const float* prod_k, const float* prod_v) {
  arena_of_layer(layer).merge_write(local_layer(layer), blocks, slot, n, k, v, prod_k, prod_v);
}

void kv_storage::attach_merge(int layer, paged_kv_view& k, paged_kv_view& v) const {
  arena_of_layer(layer).attach_merge(local_layer(layer), k, v);
}

void kv_backend::merge_write(int layer, std::span<const block_id>, int, int, const float*, const float*, const float*,
                             const float*) {
  PAGODA_ASSERT(false, "this KV backend merges no layer (layer {})", layer);
}

paged_kv_view kv_storage::k_view(int layer, std::span<const block_id> blocks, int n_slots) const {
  return arena_of_layer(layer).k_view(local_layer(layer), blocks, n_slots);
}

paged_kv_view kv_storage::v_view(int layer, std::span<const block_id> blocks, int n_slots) const {
  return arena_of_layer(layer).v_view(local_layer(layer), blocks, n_slots);
}

void kv_storage::copy_block(block_id src, block_id dst, int n_tokens) {
  PAGODA_ASSERT(group_of(src) == group_of(dst), "copy_block from block {} of group {} to block {} of group {}",
                src.value, group_of(src), dst.value, group_of(dst));
  arena_of(src).copy_block(src, dst, n_tokens);
}

void kv_storage::truncate_block(block_id b, int n_tokens) { arena_of(b).truncate_block(b, n_tokens); }
void kv_storage::release_block(block_id b) { arena_of(b).release_block(b); }
void kv_storage::hold_staging(block_id b) { arena_of(b).hold_staging(b); }
void kv_storage::end_holds() {
  for (const auto& a : arenas_) a->end_holds();
}
void kv_storage::read_block(block_id b, std::span<std::byte> out) const { arena_of(b).read_block(b, out); }
status kv_storage::write_block(block_id b, std::span<const std::byte> in) { return arena_of(b).write_block(b, in); }

std::optional<key_summary> kv_storage::key_summary_of(block_id b, int layer, int head) const {
  const kv_arena& a = arena_of_layer(layer);
  PAGODA_ASSERT(a.owns(b), "key summary of block {} for layer {}, which another KV group holds", b.value, layer);
  return a.key_summary_of(b, local_layer(layer), head);
}

void kv_storage::gather(const kv_gather& g, const key_rotation& rotate) {
  PAGODA_ASSERT(g.group >= 0 && g.group < n_groups(), "gather of KV group {} of {}", g.group, n_groups());
  arenas_[static_cast<std::size_t>(g.group)]->gather(g, rotate);
}

const float* kv_storage::bias_of(block_id b, int layer, int head) const {
  return arena_of_layer(layer).bias_of(b, local_layer(layer), head);
}

kv_group_backend::kv_group_backend(kv_storage& storage, int group) : storage_(storage), group_(group) {
  PAGODA_ASSERT(group >= 0 && group < storage.n_groups() && storage.foreign_group(group),
                "KV group {} is not another model's", group);
}

void kv_group_backend::write(int layer, std::span<const block_id> blocks, int slot, int n, const float* k,
                             const float* v) {
  arena().write(layer, blocks, slot, n, k, v);
}

paged_kv_view kv_group_backend::k_view(int layer, std::span<const block_id> blocks, int n_slots) const {
  return arena().k_view(layer, blocks, n_slots);
}

paged_kv_view kv_group_backend::v_view(int layer, std::span<const block_id> blocks, int n_slots) const {
  return arena().v_view(layer, blocks, n_slots);
}

std::optional<key_summary> kv_group_backend::key_summary_of(block_id b, int layer, int head) const {
  return arena().key_summary_of(b, layer, head);
}

void kv_group_backend::gather(const kv_gather& g, const key_rotation& rotate) {
  kv_gather mine = g;
  mine.group = group_;
  storage_.gather(mine, rotate);
}

}  // namespace pagoda
