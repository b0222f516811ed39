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
      {"float16", kv_type::f16},       {"half", kv_type::f16},         {"auto", kv_type::f16},
      {"bf16", kv_type::bf16},         {"bfloat16", kv_type::bf16},    {"fp8", kv_type::fp8_e4m3},
      {"fp8_e4m3", kv_type::fp8_e4m3}, {"e4m3", kv_type::fp8_e4m3},    {"fp8_e5m2", kv_type::fp8_e5m2},
      {"e5m2", kv_type::fp8_e5m2},     {"int8", kv_type::int8},        {"i8", kv_type::int8},
      {"int4", kv_type::int4},         {"i4", kv_type::int4},          {"int2", kv_type::int2},
      {"i2", kv_type::int2},           {"q8_0", kv_type::q8_0},        {"q4_0", kv_type::q4_0},
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
  return error(errc::invalid_argument, "unknown KV cache type '{}' (known: {})", name, known);
}

kv_format default_kv_format(kv_type type, kv_role role) {
  kv_format f;
  f.type = type;
  f.role = role;
  f.scale_mode = kv_scale_mode::none;
  return f;
}

}  // namespace pagoda
