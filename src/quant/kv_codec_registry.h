// Internal: how codec implementations register in the trait table.
#pragma once

#include <array>

#include "quant/kv_codec.h"

namespace pagoda {

// Index = kv_type. Entries are nullptr for types without a codec.
const std::array<const kv_codec*, k_n_kv_types>& kv_codec_table();

// Each codec family defines its entries in its own file.
extern const kv_codec k_codec_f32;       // kv_codec_float.cpp
extern const kv_codec k_codec_f16;
extern const kv_codec k_codec_bf16;
extern const kv_codec k_codec_fp8_e4m3;
extern const kv_codec k_codec_fp8_e5m2;
extern const kv_codec k_codec_int8;      // kv_codec_int.cpp
extern const kv_codec k_codec_int4;
extern const kv_codec k_codec_int2;
extern const kv_codec k_codec_q8_0;      // kv_codec_ggml.cpp
extern const kv_codec k_codec_q4_0;

}  // namespace pagoda
