#include "kv/kv_layout.h"

#include <algorithm>

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

status kv_layout::check() const {
  if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0)
    return error(errc::invalid_argument, "KV layout needs positive layers, KV heads and head_dim");
  if (block_size <= 0 || block_size > 1024)
    return error(errc::invalid_argument, "block size {} out of range (1..1024)", block_size);
  if (static_cast<int>(k_formats.size()) != n_layers || static_cast<int>(v_formats.size()) != n_layers)
    return error(errc::invalid_argument, "KV layout needs one K and one V format per layer");
  if (!layer_map.empty()) {
    // Each KV layer read, first by its producer, in order.
    int next = 0;
    for (std::size_t l = 0; l < layer_map.size(); ++l) {
      const int j = layer_map[l];
      if (j < 0 || j > next || j >= n_layers)
        return error(errc::invalid_argument, "KV layer map: model layer {} reads KV layer {} of {} (next new one {})",
                     l, j, n_layers, next);
      if (j == next) ++next;
    }
    if (next != n_layers)
      return error(errc::invalid_argument, "KV layer map reads {} of the layout's {} KV layers", next, n_layers);
  }
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
  if (!merge_reader.empty() && static_cast<int>(merge_reader.size()) != n_layers)
    return error(errc::invalid_argument, "KV merging: {} readers for {} KV layers", merge_reader.size(), n_layers);
  return {};
}

std::size_t kv_layout::bytes_per_block() const { return tile_bytes_per_block() + summary_bytes_per_block(); }

std::size_t kv_layout::summary_bytes_per_block() const {
  return key_summaries ? 3 * sizeof(float) * static_cast<std::size_t>(n_layers) * n_kv_heads * head_dim : 0;
}

std::size_t kv_layout::layer_tile_bytes_per_block(int layer) const {
  const kv_tile_shape shape = tile_shape();
  return (get_kv_codec(k_formats[layer].type)->tile_bytes(k_formats[layer], shape) +
          get_kv_codec(v_formats[layer].type)->tile_bytes(v_formats[layer], shape)) *
             n_kv_heads +
         merge_bytes_per_block(layer);
}

std::size_t kv_layout::merge_bytes_per_block(int kv_layer) const {
  return merged(kv_layer) ? sizeof(float) * merge_shape().head_floats() * static_cast<std::size_t>(n_kv_heads) : 0;
}

std::size_t kv_layout::tile_bytes_per_block() const {
  std::size_t total = 0;
  for (int l = 0; l < n_layers; ++l) total += layer_tile_bytes_per_block(l);
  return total;
}

double kv_layout::bytes_per_token() const { return static_cast<double>(bytes_per_block()) / block_size; }

std::size_t kv_layout::staging_bytes_per_slot() const {
  std::size_t n_sealed = 0;
  for (int l = 0; l < n_layers; ++l) n_sealed += kv_format_sealed(k_formats[l]) + kv_format_sealed(v_formats[l]);
  return n_sealed * n_kv_heads * kv_staged_tile_bytes(tile_shape());
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

status check_kv_class_shape(const kv_layout& base, const kv_layout& c, int index) {
  if (c.n_layers != base.n_layers || c.n_kv_heads != base.n_kv_heads || c.head_dim != base.head_dim ||
      c.block_size != base.block_size || c.key_summaries != base.key_summaries || c.merge_reader != base.merge_reader ||
      c.merge_retain != base.merge_retain)
    return error(errc::invalid_argument,
                 "KV block class {}: shape {} layers x {} KV heads x head_dim {}, block_size {}, key summaries {} "
                 "differs from the default layout's {} x {} x {}, {}, {}",
                 index, c.n_layers, c.n_kv_heads, c.head_dim, c.block_size, c.key_summaries ? "on" : "off",
                 base.n_layers, base.n_kv_heads, base.head_dim, base.block_size, base.key_summaries ? "on" : "off");
  return {};
}

kv_layout kv_layout::select_layers(std::span<const int> layers) const {
  kv_layout out = *this;
  out.n_layers = static_cast<int>(layers.size());
  out.k_formats.clear();
  out.v_formats.clear();
  out.model_layers.clear();
  out.merge_reader.clear();
  for (const int l : layers)
    if (!merge_reader.empty()) out.merge_reader.push_back(merge_reader[static_cast<std::size_t>(l)]);
  for (const int l : layers) {
    out.model_layers.push_back(model_layers.empty() ? l : model_layers[static_cast<std::size_t>(l)]);
    out.k_formats.push_back(k_formats[static_cast<std::size_t>(l)]);
    out.v_formats.push_back(v_formats[static_cast<std::size_t>(l)]);
  }
  if (scales) {
    auto sub = std::make_shared<kv_scales>(*scales);
    sub->n_layers = out.n_layers;
    for (auto* v : {&sub->k_lo, &sub->k_hi, &sub->v_lo, &sub->v_hi}) v->clear();
    for (const int l : layers)
      for (auto [dst, src] : {std::pair{&sub->k_lo, &scales->k_lo}, std::pair{&sub->k_hi, &scales->k_hi},
                              std::pair{&sub->v_lo, &scales->v_lo}, std::pair{&sub->v_hi, &scales->v_hi}}) {
        const auto at = src->begin() + static_cast<std::ptrdiff_t>(scales->index(l, 0));
        dst->insert(dst->end(), at, at + static_cast<std::ptrdiff_t>(n_kv_heads) * head_dim);
      }
    out.scales = std::move(sub);
  }
  return out;
}

bool kv_layout::writes_kv(int model_layer) const {
  if (layer_map.empty()) return true;
  const int j = layer_map[static_cast<std::size_t>(model_layer)];
  return model_layer == 0 || *std::max_element(layer_map.begin(), layer_map.begin() + model_layer) < j;
}

int kv_layout::kv_producer(int kv_layer) const {
  if (layer_map.empty()) return kv_layer;
  return static_cast<int>(std::find(layer_map.begin(), layer_map.end(), kv_layer) - layer_map.begin());
}

result<kv_layout> share_kv_layers(const kv_layout& per_model_layer, std::span<const int> source, std::string sharing) {
  const int n = per_model_layer.n_layers;
  if (static_cast<int>(source.size()) != n)
    return error(errc::invalid_argument, "KV sharing {}: {} source layers for a model of {} layers", sharing,
                 source.size(), n);
  std::vector<int> producers;
  std::vector<std::int32_t> map(static_cast<std::size_t>(n));
  for (int l = 0; l < n; ++l) {
    const int p = source[static_cast<std::size_t>(l)];
    if (p < 0 || p > l)
      return error(errc::invalid_argument, "KV sharing {}: layer {} reads layer {}'s KV (a layer reads its own or an earlier one's)",
                   sharing, l, p);
    if (source[static_cast<std::size_t>(p)] != p)
      return error(errc::invalid_argument, "KV sharing {}: layer {} reads layer {}, which reads layer {}'s KV itself",
                   sharing, l, p, source[static_cast<std::size_t>(p)]);
    if (p == l) {
      map[static_cast<std::size_t>(l)] = static_cast<std::int32_t>(producers.size());
      producers.push_back(l);
      continue;
    }
    map[static_cast<std::size_t>(l)] = map[static_cast<std::size_t>(p)];
    const auto at = [&](const std::vector<kv_format>& f, int i) { return f[static_cast<std::size_t>(i)]; };
    for (const auto* f : {&per_model_layer.k_formats, &per_model_layer.v_formats})
      if (kv_format_name(at(*f, l)) != kv_format_name(at(*f, p)))
        return error(errc::invalid_argument,
                     "KV sharing {}: layer {} reads layer {}'s KV, but their KV types differ ({} against {}); give "
                     "layers that share KV one type",
                     sharing, l, p, kv_format_name(at(*f, l)), kv_format_name(at(*f, p)));
  }
  kv_layout out = per_model_layer.select_layers(producers);
  out.model_layers.clear();  // the KV layers are the whole layout's
  if (static_cast<int>(producers.size()) < n) {
    out.layer_map = std::move(map);
    out.sharing = std::move(sharing);
  }
  return out;
}

result<kv_layout> merge_kv_layers(kv_layout shared, std::span<const int> readers, float t, int retain) {
  if (!(t >= 0.0f && t <= 1.0f))
    return error(errc::invalid_argument, "KV merging {}: t={} is outside [0, 1]", shared.sharing, t);
  if (retain < 0 || retain > shared.block_size)
    return error(errc::invalid_argument, "KV merging {}: {} retained tokens per block of {}", shared.sharing, retain,
                 shared.block_size);
  shared.merge_reader.assign(static_cast<std::size_t>(shared.n_layers), -1);
  shared.merge_t = t;
  shared.merge_retain = retain;
  for (const int r : readers) {
    if (r < 0 || r >= shared.n_model_layers())
      return error(errc::invalid_argument, "KV merging {}: no layer {}", shared.sharing, r);
    const int j = shared.kv_layer_of(r);
    int n_readers = 0;
    for (int l = 0; l < shared.n_model_layers(); ++l) n_readers += shared.kv_layer_of(l) == j;
    if (shared.writes_kv(r) || n_readers != 2)
      return error(errc::invalid_argument,
                   "KV merging {}: layer {} must be the second of exactly two layers reading one KV layer", shared.sharing, r);
    shared.merge_reader[static_cast<std::size_t>(j)] = r;
  }
  PAGODA_RETURN_IF_ERROR(shared.check());
  return shared;
}

}  // namespace pagoda
