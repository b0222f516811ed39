#include "quant/kv_codec_registry.h"

namespace pagoda {

const std::array<const kv_codec*, k_n_kv_types>& kv_codec_table() {
  static const std::array<const kv_codec*, k_n_kv_types> table = [] {
    std::array<const kv_codec*, k_n_kv_types> t{};
    t[static_cast<int>(kv_type::f32)] = &k_codec_f32;
    t[static_cast<int>(kv_type::f16)] = &k_codec_f16;
    return t;
  }();
  return table;
}

}  // namespace pagoda
