// A GGUF metadata value's payload as the file stores it, for tests that copy
// a file's metadata into gguf::writer::add_raw (a model with one key changed).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "model/gguf.h"

namespace pagoda::test {

// A metadata value's payload as GGUF stores it (what follows the type word).
inline std::vector<std::byte> payload_of(const gguf::value& v) {
  std::vector<std::byte> out;
  auto put = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out.insert(out.end(), b, b + n);
  };
  auto put_string = [&](std::string_view s) {
    std::uint64_t n = s.size();
    put(&n, 8);
    put(s.data(), s.size());
  };
  switch (v.type) {
    case gguf::value_type::string: put_string(v.str); break;
    case gguf::value_type::array: {
      std::uint32_t t = static_cast<std::uint32_t>(v.array_type);
      put(&t, 4);
      put(&v.array_size, 8);
      if (v.array_type == gguf::value_type::string)
        for (std::string_view s : v.array_strings) put_string(s);
      else
        put(v.array_data, v.array_size * gguf::value_type_size(v.array_type));
      break;
    }
    case gguf::value_type::f32: {
      float f = static_cast<float>(v.f);
      put(&f, 4);
      break;
    }
    case gguf::value_type::f64: put(&v.f, 8); break;
    case gguf::value_type::i8: case gguf::value_type::i16: case gguf::value_type::i32: case gguf::value_type::i64:
      put(&v.i, gguf::value_type_size(v.type));  // little-endian: the low bytes
      break;
    default: put(&v.u, gguf::value_type_size(v.type)); break;
  }
  return out;
}

}  // namespace pagoda::test
