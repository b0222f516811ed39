#include "store/store_key.h"

#include <cstring>

#include "core/hash.h"

namespace pagoda {
namespace {

void put_be64(std::byte* p, std::uint64_t v) {
  for (int i = 7; i >= 0; --i, v >>= 8) p[i] = static_cast<std::byte>(v & 0xff);
}
std::uint64_t get_be64(const std::byte* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<std::uint64_t>(p[i]);
  return v;
}

}  // namespace

std::array<std::byte, 16> store_key::bytes() const {
  std::array<std::byte, 16> b;
  put_be64(b.data(), tenant);
  put_be64(b.data() + 8, entry);
  return b;
}

store_key store_key::from_bytes(const std::byte* p) { return {get_be64(p), get_be64(p + 8)}; }

std::string store_key::hex() const {
  static const char* k_digits = "0123456789abcdef";
  std::string s;
  for (const std::byte b : bytes()) {
    s += k_digits[static_cast<unsigned>(b) >> 4];
    s += k_digits[static_cast<unsigned>(b) & 15];
  }
  return s;
}

std::uint64_t tenant_hash(std::string_view tenant) {
  hasher h(0x7e4a47);
  static constexpr char k_tag[] = "pagoda-tenant";
  h.update(k_tag, sizeof(k_tag) - 1);
  const std::uint64_t n = tenant.size();
  h.update_pod(n);
  h.update(tenant.data(), tenant.size());
  return h.digest();
}

store_key make_store_key(const kv_space& space, std::string_view tenant, block_key chain_key) {
  hasher h(0x5707e);
  h.update_pod(k_store_key_version).update_pod(space.model).update_pod(space.layout).update_pod(chain_key);
  return {tenant_hash(tenant), h.digest()};
}

std::uint64_t layout_fingerprint(const kv_layout& l) {
  hasher h(0x1a7047);
  const std::int32_t shape[] = {l.n_layers, l.n_kv_heads, l.head_dim, l.block_size};
  h.update(shape, sizeof(shape));
  for (int i = 0; i < l.n_layers; ++i)
    for (const kv_format* f : {&l.k_formats[static_cast<std::size_t>(i)], &l.v_formats[static_cast<std::size_t>(i)]}) {
      const std::int32_t fmt[] = {static_cast<std::int32_t>(f->type), static_cast<std::int32_t>(f->role),
                                  static_cast<std::int32_t>(f->scale_mode), f->group_size};
      h.update(fmt, sizeof(fmt));
    }
  // A layout over some model layers only (a KV group's) names them; over
  // every layer in order it keeps the fingerprint it had before groups.
  bool every_layer = l.model_layers.empty();
  if (!every_layer && static_cast<int>(l.model_layers.size()) == l.n_layers) {
    every_layer = true;
    for (int i = 0; i < l.n_layers; ++i) every_layer = every_layer && l.model_layers[static_cast<std::size_t>(i)] == i;
  }
  if (!every_layer) h.update(l.model_layers.data(), sizeof(int) * l.model_layers.size());
  // Shared KV layers hold other bytes than the same formats unshared, and
  // each sharing its own (reuse and minicache share one map).
  if (!l.layer_map.empty()) {
    h.update(l.layer_map.data(), sizeof(std::int32_t) * l.layer_map.size());
    h.update(l.sharing.data(), l.sharing.size());
  }
  if (l.scales) {
    // Static scales change what codes mean: their values enter the fingerprint.
    for (kv_role role : {kv_role::key, kv_role::value})
      for (int layer = 0; layer < l.n_layers; ++layer)
        for (int head = 0; head < l.n_kv_heads; ++head) {
          h.update(l.scales->lo(role, layer, head), sizeof(float) * static_cast<std::size_t>(l.head_dim));
          h.update(l.scales->hi(role, layer, head), sizeof(float) * static_cast<std::size_t>(l.head_dim));
        }
  }
  return h.digest();
}

}  // namespace pagoda
