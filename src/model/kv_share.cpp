#include "model/kv_share.h"

#include <fmt/format.h>

#include "model/llama.h"

namespace pagoda {

status check_kv_sources(const llama_hparams& hp, const std::vector<int>& source, std::string_view what) {
  if (static_cast<int>(source.size()) != hp.n_layer)
    return error(errc::invalid_argument, "{}: {} entries for a model of {} layers", what, source.size(), hp.n_layer);
  for (int l = 0; l < hp.n_layer; ++l) {
    const int p = source[static_cast<std::size_t>(l)];
    if (p < 0 || p > l)
      return error(errc::invalid_argument, "{}: layer {} reads layer {}'s KV; a layer reads its own or an earlier layer's",
                   what, l, p);
    if (source[static_cast<std::size_t>(p)] != p)
      return error(errc::invalid_argument, "{}: layer {} reads layer {}, which reads layer {}'s KV itself", what, l, p,
                   source[static_cast<std::size_t>(p)]);
    if (hp.is_swa(l) != hp.is_swa(p) || hp.layer_rope_base(l) != hp.layer_rope_base(p) ||
        hp.layer_rope_scale(l) != hp.layer_rope_scale(p))
      return error(errc::invalid_argument,
                   "{}: layer {} reads layer {}'s KV, but they attend differently (sliding window or RoPE); share KV "
                   "only between layers of one kind",
                   what, l, p);
  }
  return {};
}

std::vector<int> cla_sources(int n_layer, int group) {
  std::vector<int> s(static_cast<std::size_t>(n_layer));
  for (int l = 0; l < n_layer; ++l) s[static_cast<std::size_t>(l)] = l - l % group;
  return s;
}

std::vector<int> yoco_sources(int n_layer) {
  std::vector<int> s(static_cast<std::size_t>(n_layer));
  const int mid = n_layer / 2;
  for (int l = 0; l < n_layer; ++l) s[static_cast<std::size_t>(l)] = l < mid ? l : mid;
  return s;
}

}  // namespace pagoda
