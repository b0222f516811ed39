#include "quant/kv_codec.h"

#include <array>
#include <cctype>
#include <string>

#include "quant/kv_codec_registry.h"

namespace pagoda {

const kv_codec* get_kv_codec(kv_type type) {
  int i = static_cast<int>(type);
  if (i < 0 || i >= k_n_kv_types) return nullptr;
  return kv_codec_table()[i];
}

status check_tile_shape(const kv_format& fmt, kv_tile_shape shape, int max_block_size) {
  if (shape.block_size < 1 || shape.block_size > max_block_size)
    return error(errc::invalid_argument, "{}: block size {} out of range (1..{})", kv_format_name(fmt), shape.block_size,
                 max_block_size);
  if (shape.head_dim < 1) return error(errc::invalid_argument, "{}: head_dim {} must be positive", kv_format_name(fmt), shape.head_dim);
  return {};
}

const char* kv_type_name(kv_type type) {
  switch (type) {
    case kv_type::f32: return "f32";
    case kv_type::f16: return "f16";
    case kv_type::bf16: return "bf16";
    case kv_type::fp8_e4m3: return "fp8_e4m3";
    case kv_type::fp8_e5m2: return "fp8_e5m2";
    case kv_type::int8: return "int8";
    case kv_type::int4: return "int4";
    case kv_type::int2: return "int2";
    case kv_type::q8_0: return "q8_0";
    case kv_type::q4_0: return "q4_0";
  }
  return "?";
}

const char* kv_scale_mode_name(kv_scale_mode mode) {
  switch (mode) {
    case kv_scale_mode::none: return "none";
    case kv_scale_mode::per_token: return "token";
    case kv_scale_mode::per_channel: return "channel";
    case kv_scale_mode::group: return "group";
    case kv_scale_mode::static_scales: return "static";
  }
  return "?";
}

std::string kv_format_name(const kv_format& fmt) {
  std::string name = kv_type_name(fmt.type);
  // Types whose only mode is implied by the name need no suffix.
  switch (fmt.type) {
    case kv_type::f32:
    case kv_type::f16:
    case kv_type::bf16:
    case kv_type::q8_0:
    case kv_type::q4_0:
      return name;
    default:
      break;
  }
  if (fmt.scale_mode == kv_scale_mode::group) return name + "/g" + std::to_string(fmt.group_size);
  return name + "/" + kv_scale_mode_name(fmt.scale_mode);
}

result<kv_type> parse_kv_type(std::string_view name) {
  std::string s(name);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  struct alias {
    const char* name;
    kv_type type;
  };
  static constexpr alias aliases[] = {
      {"f32", kv_type::f32},           {"fp32", kv_type::f32},         {"float32", kv_type::f32},
      {"float", kv_type::f32},         {"f16", kv_type::f16},          {"fp16", kv_type::f16},
      {"float16", kv_type::f16},       {"half", kv_type::f16},         {"bf16", kv_type::bf16},
      {"bfloat16", kv_type::bf16},     {"fp8", kv_type::fp8_e4m3},     {"fp8_e4m3", kv_type::fp8_e4m3},
      {"e4m3", kv_type::fp8_e4m3},     {"fp8_e5m2", kv_type::fp8_e5m2}, {"e5m2", kv_type::fp8_e5m2},
      {"int8", kv_type::int8},         {"i8", kv_type::int8},          {"int4", kv_type::int4},
      {"i4", kv_type::int4},           {"int2", kv_type::int2},        {"i2", kv_type::int2},
      {"q8_0", kv_type::q8_0},         {"q4_0", kv_type::q4_0},
  };
  for (const alias& a : aliases)
    if (s == a.name) {
      if (get_kv_codec(a.type) == nullptr)
        return error(errc::unsupported, "KV cache type '{}' is not implemented yet", name);
      return a.type;
    }
  std::string known;
  for (int i = 0; i < k_n_kv_types; ++i) {
    if (get_kv_codec(static_cast<kv_type>(i)) == nullptr) continue;
    if (!known.empty()) known += ", ";
    known += kv_type_name(static_cast<kv_type>(i));
  }
  return error(errc::invalid_argument, "unknown KV cache type '{}' (known: {}; vLLM's fp8/fp16/auto and "
               "llama.cpp's q8_0/q4_0 spellings are accepted)", name, known);
}

kv_format default_kv_format(kv_type type, kv_role role) {
  kv_format f;
  f.type = type;
  f.role = role;
  switch (type) {
    case kv_type::f32:
    case kv_type::f16:
    case kv_type::bf16:
      f.scale_mode = kv_scale_mode::none;
      break;
    case kv_type::fp8_e4m3:
    case kv_type::fp8_e5m2:
    case kv_type::int8:
      f.scale_mode = kv_scale_mode::per_token;
      break;
    case kv_type::int4:
    case kv_type::int2:
      f.scale_mode = role == kv_role::key ? kv_scale_mode::per_channel : kv_scale_mode::per_token;
      break;
    case kv_type::q8_0:
    case kv_type::q4_0:
      f.scale_mode = kv_scale_mode::group;
      f.group_size = 32;
      break;
  }
  return f;
}

bool kv_format_sealed(const kv_format& fmt) { return fmt.scale_mode == kv_scale_mode::per_channel; }

double kv_format_bits_per_element(const kv_format& fmt, kv_tile_shape shape) {
  const kv_codec* c = get_kv_codec(fmt.type);
  if (!c || shape.block_size <= 0 || shape.head_dim <= 0) return 0;
  return 8.0 * static_cast<double>(c->tile_bytes(fmt, shape)) / (static_cast<double>(shape.block_size) * shape.head_dim);
}

}  // namespace pagoda
