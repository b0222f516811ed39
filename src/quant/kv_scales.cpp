#include "quant/kv_scales.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/assert.h"

namespace pagoda {

status kv_scales::check_shape(int layers, int heads, int dim) const {
  if (layers != n_layers || heads != n_kv_heads || dim != head_dim)
    return error(errc::invalid_argument,
                 "KV scales were calibrated for {} layers x {} KV heads x head_dim {}, but the model has {} x {} x {}",
                 n_layers, n_kv_heads, head_dim, layers, heads, dim);
  return {};
}

result<kv_scales> load_kv_scales(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return error(errc::not_found, "cannot open KV scales file {}", path);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  auto bad = [&](std::string_view why) { return error(errc::corrupt, "KV scales file {}: {}", path, why); };
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  if (j.value("format", "") != "pagoda-kv-scales") return bad("\"format\" is not \"pagoda-kv-scales\"");
  if (j.value("version", 0) != 1) return bad("unsupported \"version\" (expected 1)");
  kv_scales s;
  auto get_int = [&](const char* key, int& out) {
    if (!j.contains(key) || !j[key].is_number_integer()) return false;
    out = j[key].get<int>();
    return true;
  };
  if (!get_int("n_layers", s.n_layers) || !get_int("n_kv_heads", s.n_kv_heads) || !get_int("head_dim", s.head_dim))
    return bad("n_layers, n_kv_heads and head_dim must be integers");
  if (s.n_layers <= 0 || s.n_kv_heads <= 0 || s.head_dim <= 0 || s.n_layers > 4096 || s.n_kv_heads > 4096 ||
      s.head_dim > 65536)
    return bad("n_layers, n_kv_heads or head_dim out of range");
  if (j.contains("model") && j["model"].is_string()) s.model = j["model"].get<std::string>();
  if (j.contains("clip") && j["clip"].is_string()) s.clip = j["clip"].get<std::string>();
  if (j.contains("tokens") && j["tokens"].is_number_integer()) s.n_tokens = j["tokens"].get<std::int64_t>();
  const nlohmann::json& layers = j["layers"];
  if (!layers.is_array() || static_cast<int>(layers.size()) != s.n_layers)
    return bad(fmt::format("\"layers\" must be an array of {} entries", s.n_layers));
  std::size_t n = static_cast<std::size_t>(s.n_layers) * s.n_kv_heads * s.head_dim;
  s.k_lo.resize(n);
  s.k_hi.resize(n);
  s.v_lo.resize(n);
  s.v_hi.resize(n);
  for (int l = 0; l < s.n_layers; ++l)
    for (const char* kind : {"k", "v"})
      for (const char* side : {"lo", "hi"}) {
        const nlohmann::json* a = nullptr;
        if (layers[l].is_object() && layers[l].contains(kind) && layers[l][kind].is_object() &&
            layers[l][kind].contains(side))
          a = &layers[l][kind][side];
        if (!a || !a->is_array() || static_cast<int>(a->size()) != s.n_kv_heads)
          return bad(fmt::format("layer {} {}.{} must hold {} heads", l, kind, side, s.n_kv_heads));
        std::vector<float>& dst = kind[0] == 'k' ? (side[0] == 'l' ? s.k_lo : s.k_hi) : (side[0] == 'l' ? s.v_lo : s.v_hi);
        for (int h = 0; h < s.n_kv_heads; ++h) {
          const nlohmann::json& row = (*a)[h];
          if (!row.is_array() || static_cast<int>(row.size()) != s.head_dim)
            return bad(fmt::format("layer {} {}.{} head {} must hold {} numbers", l, kind, side, h, s.head_dim));
          for (int d = 0; d < s.head_dim; ++d) {
            if (!row[d].is_number()) return bad(fmt::format("layer {} {}.{} head {}: not a number", l, kind, side, h));
            float v = row[d].get<float>();
            if (!std::isfinite(v)) return bad(fmt::format("layer {} {}.{} head {}: not finite", l, kind, side, h));
            dst[s.index(l, h) + d] = v;
          }
        }
      }
  for (std::size_t i = 0; i < n; ++i)
    if (s.k_lo[i] > s.k_hi[i] || s.v_lo[i] > s.v_hi[i]) return bad("a range has lo > hi");
  return s;
}

status save_kv_scales(const kv_scales& s, const std::string& path) {
  nlohmann::json j;
  j["format"] = "pagoda-kv-scales";
  j["version"] = 1;
  j["model"] = s.model;
  j["clip"] = s.clip;
  j["tokens"] = s.n_tokens;
  j["n_layers"] = s.n_layers;
  j["n_kv_heads"] = s.n_kv_heads;
  j["head_dim"] = s.head_dim;
  nlohmann::json layers = nlohmann::json::array();
  for (int l = 0; l < s.n_layers; ++l) {
    nlohmann::json layer;
    for (kv_role role : {kv_role::key, kv_role::value}) {
      nlohmann::json lo = nlohmann::json::array(), hi = nlohmann::json::array();
      for (int h = 0; h < s.n_kv_heads; ++h) {
        lo.push_back(std::vector<float>(s.lo(role, l, h), s.lo(role, l, h) + s.head_dim));
        hi.push_back(std::vector<float>(s.hi(role, l, h), s.hi(role, l, h) + s.head_dim));
      }
      layer[role == kv_role::key ? "k" : "v"] = {{"lo", lo}, {"hi", hi}};
    }
    layers.push_back(layer);
  }
  j["layers"] = layers;
  std::ofstream out(path, std::ios::binary);
  if (!out) return error(errc::io_error, "cannot write KV scales file {}", path);
  out << j.dump(1) << "\n";
  if (!out) return error(errc::io_error, "writing KV scales file {} failed", path);
  return {};
}

kv_range_calibrator::kv_range_calibrator(int n_layers, int n_kv_heads, int head_dim, double percentile,
                                         std::int64_t max_tokens)
    : n_layers_(n_layers), n_kv_heads_(n_kv_heads), head_dim_(head_dim), percentile_(percentile) {
  PAGODA_ASSERT(percentile > 0 && percentile <= 100, "percentile {} out of (0, 100]", percentile);
  keep_ = static_cast<std::size_t>(std::floor((1.0 - percentile / 100.0) * std::max<std::int64_t>(max_tokens, 1))) + 1;
  channels_.resize(2 * static_cast<std::size_t>(n_layers) * n_kv_heads * head_dim);
}

kv_range_calibrator::channel& kv_range_calibrator::at(int layer, kv_role role, int head, int d) {
  std::size_t r = role == kv_role::key ? 0 : 1;
  return channels_[((r * n_layers_ + layer) * n_kv_heads_ + head) * head_dim_ + d];
}

void kv_range_calibrator::add(int layer, kv_role role, const float* x, int n) {
  PAGODA_ASSERT(layer >= 0 && layer < n_layers_);
  if (layer == 0) n_tokens_[role == kv_role::key ? 0 : 1] += n;
  for (int h = 0; h < n_kv_heads_; ++h)
    for (int d = 0; d < head_dim_; ++d) {
      channel& c = at(layer, role, h, d);
      for (int t = 0; t < n; ++t) {
        float v = x[(static_cast<std::size_t>(t) * n_kv_heads_ + h) * head_dim_ + d];
        if (!std::isfinite(v)) continue;
        if (c.top.size() < keep_) {
          c.top.push_back(v);
          std::push_heap(c.top.begin(), c.top.end(), std::greater<>());
        } else if (v > c.top.front()) {
          std::pop_heap(c.top.begin(), c.top.end(), std::greater<>());
          c.top.back() = v;
          std::push_heap(c.top.begin(), c.top.end(), std::greater<>());
        }
        if (c.bottom.size() < keep_) {
          c.bottom.push_back(v);
          std::push_heap(c.bottom.begin(), c.bottom.end());
        } else if (v < c.bottom.front()) {
          std::pop_heap(c.bottom.begin(), c.bottom.end());
          c.bottom.back() = v;
          std::push_heap(c.bottom.begin(), c.bottom.end());
        }
      }
    }
}

kv_scales kv_range_calibrator::finish() const {
  kv_scales s;
  s.n_layers = n_layers_;
  s.n_kv_heads = n_kv_heads_;
  s.head_dim = head_dim_;
  s.n_tokens = n_tokens_[0];
  s.clip = percentile_ >= 100 ? "max" : fmt::format("p{}", percentile_);
  std::size_t n = static_cast<std::size_t>(n_layers_) * n_kv_heads_ * head_dim_;
  s.k_lo.assign(n, 0);
  s.k_hi.assign(n, 0);
  s.v_lo.assign(n, 0);
  s.v_hi.assign(n, 0);
  for (int r = 0; r < 2; ++r) {
    // The value of rank j from each end, j = floor((1 - p) * tokens seen).
    const std::int64_t seen = n_tokens_[r];
    const std::size_t rank = std::min<std::size_t>(
        keep_ - 1, static_cast<std::size_t>(std::floor((1.0 - percentile_ / 100.0) * static_cast<double>(seen))));
    for (int l = 0; l < n_layers_; ++l)
      for (int h = 0; h < n_kv_heads_; ++h)
        for (int d = 0; d < head_dim_; ++d) {
          const channel& c = channels_[((static_cast<std::size_t>(r) * n_layers_ + l) * n_kv_heads_ + h) * head_dim_ + d];
          if (c.top.empty()) continue;
          std::vector<float> top = c.top, bottom = c.bottom;
          std::sort(top.begin(), top.end(), std::greater<>());
          std::sort(bottom.begin(), bottom.end());
          std::size_t i = s.index(l, h) + d;
          (r == 0 ? s.k_hi : s.v_hi)[i] = top[std::min(rank, top.size() - 1)];
          (r == 0 ? s.k_lo : s.v_lo)[i] = bottom[std::min(rank, bottom.size() - 1)];
        }
  }
  return s;
}

}  // namespace pagoda
