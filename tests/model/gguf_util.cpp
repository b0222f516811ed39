// Helpers for tests that rewrite GGUF files.
#include "model/gguf_util.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace pagoda::test {

void copy_value(gguf::writer& w, const std::string& key, const gguf::value& v) {
  using vt = gguf::value_type;
  switch (v.type) {
    case vt::u8: w.add_u8(key, static_cast<std::uint8_t>(v.u)); break;
    case vt::i8: w.add_i8(key, static_cast<std::int8_t>(v.i)); break;
    case vt::u16: w.add_u16(key, static_cast<std::uint16_t>(v.u)); break;
    case vt::i16: w.add_i16(key, static_cast<std::int16_t>(v.i)); break;
    case vt::u32: w.add_u32(key, static_cast<std::uint32_t>(v.u)); break;
    case vt::i32: w.add_i32(key, static_cast<std::int32_t>(v.i)); break;
    case vt::u64: w.add_u64(key, v.u); break;
    case vt::i64: w.add_i64(key, v.i); break;
    case vt::f32: w.add_f32(key, static_cast<float>(v.f)); break;
    case vt::f64: w.add_f64(key, v.f); break;
    case vt::boolean: w.add_bool(key, v.u != 0); break;
    case vt::string: w.add_string(key, v.str); break;
    case vt::array:
      if (v.array_type == vt::string) {
        w.add_string_array(key, std::span<const std::string_view>(v.array_strings));
      } else {
        std::size_t elem = gguf::value_type_size(v.array_type);
        std::vector<std::byte> raw(8 + 4 + 8 + elem * v.array_size);
        std::uint32_t t = static_cast<std::uint32_t>(v.array_type);
        std::uint64_t n = v.array_size;
        std::memcpy(raw.data(), &t, 4);
        std::memcpy(raw.data() + 4, &n, 8);
        std::memcpy(raw.data() + 12, v.array_data, elem * v.array_size);
        raw.resize(12 + elem * v.array_size);
        w.add_raw(key, static_cast<std::uint32_t>(vt::array), raw);
      }
      break;
  }
}

std::vector<std::byte> rewrite_gguf(const gguf::file& src, std::initializer_list<std::string_view> drop,
                                    const std::function<void(gguf::writer&)>& add) {
  gguf::writer w;
  for (const gguf::metadata_entry& e : src.metadata()) {
    bool keep = e.key != "general.alignment";
    for (std::string_view d : drop) keep = keep && e.key != d;
    if (keep) copy_value(w, std::string(e.key), e.val);
  }
  add(w);
  for (const gguf::tensor_info& t : src.tensors())
    if (std::find(drop.begin(), drop.end(), std::string_view(t.name)) == drop.end())
      w.add_tensor(t.name, t.type, std::span<const std::int64_t>(t.ne, t.n_dims),
                 std::span<const std::byte>(static_cast<const std::byte*>(t.data), t.size_bytes));
  return w.to_bytes();
}

}  // namespace pagoda::test
