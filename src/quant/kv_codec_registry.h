// Internal: how codec implementations register in the trait table.
#pragma once

#include <array>

#include "quant/kv_codec.h"

namespace pagoda {

// Index = kv_type. Entries are nullptr for types without a codec.
const std::array<const kv_codec*, k_n_kv_types>& kv_codec_table();

// Each codec family defines its entries in its own file.
extern const kv_codec k_codec_f32;
extern const kv_codec k_codec_f16;

}  // namespace pagoda
