#include "quant/kv_codec_registry.h"

namespace pagoda {

const std::array<const kv_codec*, k_n_kv_types>& kv_codec_table() {
  static const std::array<const kv_codec*, k_n_kv_types> table = [] {
    std::array<const kv_codec*, k_n_kv_types> t{};
    for (const kv_codec* c : {&k_codec_f32, &k_codec_f16, &k_codec_bf16, &k_codec_fp8_e4m3, &k_codec_fp8_e5m2,
                              &k_codec_int8, &k_codec_int4, &k_codec_int2, &k_codec_q8_0, &k_codec_q4_0})
      t[static_cast<int>(c->type)] = c;
    return t;
  }();
  return table;
}

}  // namespace pagoda
