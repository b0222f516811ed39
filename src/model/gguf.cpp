#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>

#include "core/anon_memory.h"

namespace pagoda::gguf {

namespace {

constexpr std::uint32_t k_magic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr std::uint64_t k_default_alignment = 32;

// Smallest possible encodings, used to reject counts the remaining bytes
// cannot hold before anything is allocated for them.
constexpr std::size_t k_min_kv_bytes = 8 + 1 + 4 + 1;               // key len, 1-byte key, type, u8 value
constexpr std::size_t k_min_tensor_info_bytes = 8 + 1 + 4 + 8 + 4 + 8;  // name len, name, n_dims, ne[0], type, offset
constexpr std::size_t k_string_header_bytes = 8;
// Containers sized from a count in the file reserve at most this many entries
// up front and grow as entries actually parse, so memory follows the bytes
// present, never a corrupt count (which on a multi-GB file could still pass the
// "fits in the remaining bytes" test).
constexpr std::uint64_t k_max_reserve = 4096;

std::size_t capped_reserve(std::uint64_t count) { return static_cast<std::size_t>(std::min(count, k_max_reserve)); }

// Every type ggml defines (ggml.h numbering), so an unsupported one is named.
// Types ggml removed (4, 5, 31-33, 36-38) have no entry.
struct type_entry {
  std::uint32_t id;
  tensor_type_traits traits;
};
constexpr type_entry k_types[] = {
    {0, {"f32", 1, 4, true}},        {1, {"f16", 1, 2, true}},
    {2, {"q4_0", 32, 18, true}},     {3, {"q4_1", 32, 20, true}},
    {6, {"q5_0", 32, 22, true}},    {7, {"q5_1", 32, 24, true}},
    {8, {"q8_0", 32, 34, true}},     {9, {"q8_1", 32, 36, false}},
    {10, {"q2_K", 256, 84, true}},  {11, {"q3_K", 256, 110, true}},
    {12, {"q4_K", 256, 144, true}}, {13, {"q5_K", 256, 176, true}},
    {14, {"q6_K", 256, 210, true}}, {15, {"q8_K", 256, 292, false}},
    {16, {"iq2_xxs", 256, 66, false}}, {17, {"iq2_xs", 256, 74, false}},
    {18, {"iq3_xxs", 256, 98, false}}, {19, {"iq1_s", 256, 50, false}},
    {20, {"iq4_nl", 32, 18, true}},  {21, {"iq3_s", 256, 110, true}},
    {22, {"iq2_s", 256, 82, false}},  {23, {"iq4_xs", 256, 136, true}},
    {24, {"i8", 1, 1, false}},        {25, {"i16", 1, 2, false}},
    {26, {"i32", 1, 4, false}},       {27, {"i64", 1, 8, false}},
    {28, {"f64", 1, 8, false}},       {29, {"iq1_m", 256, 56, false}},
    {30, {"bf16", 1, 2, true}},       {34, {"tq1_0", 256, 54, false}},
    {35, {"tq2_0", 256, 66, false}},  {39, {"mxfp4", 32, 17, true}},
};

bool is_valid_value_type(std::uint32_t t) { return t <= static_cast<std::uint32_t>(value_type::f64); }

bool is_unsigned_type(value_type t) {
  return t == value_type::u8 || t == value_type::u16 || t == value_type::u32 || t == value_type::u64;
}
bool is_signed_type(value_type t) {
  return t == value_type::i8 || t == value_type::i16 || t == value_type::i32 || t == value_type::i64;
}
bool is_float_type(value_type t) { return t == value_type::f32 || t == value_type::f64; }

// Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF.
bool is_valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    auto c = static_cast<unsigned char>(s[i]);
    std::size_t n;
    std::uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      n = 1;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i <= n) return false;
    for (std::size_t k = 1; k <= n; ++k) {
      auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xc0) != 0x80) return false;
      cp = cp << 6 | (cc & 0x3f);
    }
    static constexpr std::uint32_t k_min_cp[] = {0, 0x80, 0x800, 0x10000};
    if (cp < k_min_cp[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n + 1;
  }
  return true;
}

template <typename T>
T load_le(const std::byte* p) {
  static_assert(std::endian::native == std::endian::little, "GGUF reader assumes a little-endian host");
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

namespace detail {

// Reads little-endian fields from a byte span. Every read is bounds-checked and
// a failed read leaves the position unchanged.
class byte_cursor {
 public:
  explicit byte_cursor(std::span<const std::byte> bytes) : bytes_(bytes) {}

  std::size_t pos() const { return pos_; }
  std::size_t remaining() const { return bytes_.size() - pos_; }

  template <typename T>
  status read(T& out, const char* what) {
    if (remaining() < sizeof(T)) return truncated(what, sizeof(T));
    out = load_le<T>(bytes_.data() + pos_);
    pos_ += sizeof(T);
    return ok_status();
  }

  // Consumes n bytes and returns a pointer to them.
  status take(std::uint64_t n, const std::byte*& out, const char* what) {
    if (remaining() < n) return truncated(what, n);
    out = bytes_.data() + pos_;
    pos_ += n;
    return ok_status();
  }

  status read_string(std::string_view& out, const char* what) {
    std::size_t start = pos_;
    std::uint64_t len = 0;
    PAGODA_RETURN_IF_ERROR(read(len, what));
    if (len > remaining()) {
      std::size_t left = remaining();
      pos_ = start;
      return error(errc::corrupt, "{} at offset {}: length {} runs past the end of the file ({} bytes remain)", what,
                   start, len, left);
    }
    out = std::string_view(reinterpret_cast<const char*>(bytes_.data() + pos_), len);
    pos_ += len;
    return ok_status();
  }

 private:
  status truncated(const char* what, std::uint64_t n) const {
    return error(errc::corrupt, "truncated file: {} at offset {} needs {} bytes, {} remain", what, pos_, n,
                 remaining());
  }

  std::span<const std::byte> bytes_;
  std::size_t pos_ = 0;
};

}  // namespace detail

using detail::byte_cursor;

const char* value_type_name(value_type t) {
  switch (t) {
    case value_type::u8: return "uint8";
    case value_type::i8: return "int8";
    case value_type::u16: return "uint16";
    case value_type::i16: return "int16";
    case value_type::u32: return "uint32";
    case value_type::i32: return "int32";
    case value_type::f32: return "float32";
    case value_type::boolean: return "bool";
    case value_type::string: return "string";
    case value_type::array: return "array";
    case value_type::u64: return "uint64";
    case value_type::i64: return "int64";
    case value_type::f64: return "float64";
  }
  return "unknown";
}

std::size_t value_type_size(value_type t) {
  switch (t) {
    case value_type::u8:
    case value_type::i8:
    case value_type::boolean: return 1;
    case value_type::u16:
    case value_type::i16: return 2;
    case value_type::u32:
    case value_type::i32:
    case value_type::f32: return 4;
    case value_type::u64:
    case value_type::i64:
    case value_type::f64: return 8;
    case value_type::string:
    case value_type::array: return 0;
  }
  return 0;
}

const tensor_type_traits* get_tensor_type_traits(std::uint32_t type) {
  for (const auto& e : k_types) {
    if (e.id == type) return &e.traits;
  }
  return nullptr;
}

const char* tensor_type_name(tensor_type t) {
  const auto* tr = get_tensor_type_traits(static_cast<std::uint32_t>(t));
  return tr ? tr->name : "unknown";
}

std::optional<std::uint64_t> tensor_size_bytes(std::uint32_t type, std::span<const std::int64_t> ne) {
  const auto* tr = get_tensor_type_traits(type);
  if (!tr || ne.empty()) return std::nullopt;
  std::int64_t n_elements = 1;
  for (std::int64_t d : ne) {
    if (d <= 0 || __builtin_mul_overflow(n_elements, d, &n_elements)) return std::nullopt;
  }
  if (ne[0] % tr->block_size != 0) return std::nullopt;
  std::int64_t n_bytes = 0;
  if (__builtin_mul_overflow(n_elements / tr->block_size, static_cast<std::int64_t>(tr->block_bytes), &n_bytes)) {
    return std::nullopt;
  }
  return static_cast<std::uint64_t>(n_bytes);
}

// ---------------------------------------------------------------------------
// Parsing

namespace {

template <typename T, typename Out>
status read_scalar(byte_cursor& c, Out& out, const char* what) {
  T v{};
  PAGODA_RETURN_IF_ERROR(c.read(v, what));
  out = static_cast<Out>(v);
  return ok_status();
}

// Reads one value of type `type` (already read) into `out`.
status parse_value(byte_cursor& c, std::uint32_t type, value& out) {
  if (!is_valid_value_type(type)) return error(errc::corrupt, "unknown value type {}", type);
  out.type = static_cast<value_type>(type);
  switch (out.type) {
    case value_type::u8: return read_scalar<std::uint8_t>(c, out.u, "uint8 value");
    case value_type::u16: return read_scalar<std::uint16_t>(c, out.u, "uint16 value");
    case value_type::u32: return read_scalar<std::uint32_t>(c, out.u, "uint32 value");
    case value_type::u64: return read_scalar<std::uint64_t>(c, out.u, "uint64 value");
    case value_type::i8: return read_scalar<std::int8_t>(c, out.i, "int8 value");
    case value_type::i16: return read_scalar<std::int16_t>(c, out.i, "int16 value");
    case value_type::i32: return read_scalar<std::int32_t>(c, out.i, "int32 value");
    case value_type::i64: return read_scalar<std::int64_t>(c, out.i, "int64 value");
    case value_type::f32: return read_scalar<float>(c, out.f, "float32 value");
    case value_type::f64: return read_scalar<double>(c, out.f, "float64 value");
    case value_type::boolean: {
      std::uint8_t v = 0;
      std::size_t at = c.pos();
      PAGODA_RETURN_IF_ERROR(c.read(v, "bool value"));
      if (v > 1) return error(errc::corrupt, "bool value {} at offset {} is neither 0 nor 1", v, at);
      out.u = v;
      return ok_status();
    }
    case value_type::string: return c.read_string(out.str, "string value");
    case value_type::array: break;
  }

  std::uint32_t elem_type = 0;
  std::size_t at = c.pos();
  PAGODA_RETURN_IF_ERROR(c.read(elem_type, "array element type"));
  if (!is_valid_value_type(elem_type)) {
    return error(errc::corrupt, "array at offset {}: unknown element type {}", at, elem_type);
  }
  if (static_cast<value_type>(elem_type) == value_type::array) {
    return error(errc::unsupported, "array at offset {}: nested arrays are not supported", at);
  }
  out.array_type = static_cast<value_type>(elem_type);
  std::size_t count_at = c.pos();
  PAGODA_RETURN_IF_ERROR(c.read(out.array_size, "array length"));

  if (out.array_type == value_type::string) {
    if (out.array_size > c.remaining() / k_string_header_bytes) {
      return error(errc::corrupt,
                   "array length {} at offset {}: {} strings cannot fit in the {} bytes left in the file",
                   out.array_size, count_at, out.array_size, c.remaining());
    }
    out.array_strings.reserve(capped_reserve(out.array_size));
    for (std::uint64_t k = 0; k < out.array_size; ++k) {
      std::string_view s;
      PAGODA_RETURN_IF_ERROR(c.read_string(s, "string array element"));
      out.array_strings.push_back(s);
    }
    return ok_status();
  }

  std::size_t elem_size = value_type_size(out.array_type);
  if (out.array_size > c.remaining() / elem_size) {
    return error(errc::corrupt, "array length {} at offset {}: {} elements of {} cannot fit in the {} bytes left",
                 out.array_size, count_at, out.array_size, value_type_name(out.array_type), c.remaining());
  }
  std::size_t data_at = c.pos();
  PAGODA_RETURN_IF_ERROR(c.take(out.array_size * elem_size, out.array_data, "array data"));
  if (out.array_type == value_type::boolean) {
    for (std::uint64_t k = 0; k < out.array_size; ++k) {
      auto b = std::to_integer<std::uint8_t>(out.array_data[k]);
      if (b > 1) return error(errc::corrupt, "bool array element {} at offset {} is {}, neither 0 nor 1", k,
                              data_at + k, b);
    }
  }
  return ok_status();
}

std::uint64_t read_array_element_as_u64_bits(const value& v, std::uint64_t k) {
  const std::byte* p = v.array_data + k * value_type_size(v.array_type);
  switch (v.array_type) {
    case value_type::u8:
    case value_type::boolean: return load_le<std::uint8_t>(p);
    case value_type::u16: return load_le<std::uint16_t>(p);
    case value_type::u32: return load_le<std::uint32_t>(p);
    case value_type::u64: return load_le<std::uint64_t>(p);
    case value_type::i8: return static_cast<std::uint64_t>(static_cast<std::int64_t>(load_le<std::int8_t>(p)));
    case value_type::i16: return static_cast<std::uint64_t>(static_cast<std::int64_t>(load_le<std::int16_t>(p)));
    case value_type::i32: return static_cast<std::uint64_t>(static_cast<std::int64_t>(load_le<std::int32_t>(p)));
    case value_type::i64: return static_cast<std::uint64_t>(load_le<std::int64_t>(p));
    default: return 0;
  }
}

double read_array_element_as_double(const value& v, std::uint64_t k) {
  const std::byte* p = v.array_data + k * value_type_size(v.array_type);
  if (v.array_type == value_type::f32) return load_le<float>(p);
  if (v.array_type == value_type::f64) return load_le<double>(p);
  std::uint64_t bits = read_array_element_as_u64_bits(v, k);
  if (is_signed_type(v.array_type)) return static_cast<double>(static_cast<std::int64_t>(bits));
  return static_cast<double>(bits);
}

}  // namespace

status file::parse(std::span<const std::byte> bytes) {
  bytes_ = bytes;
  byte_cursor c(bytes);

  std::uint32_t magic = 0;
  PAGODA_RETURN_IF_ERROR(c.read(magic, "magic"));
  if (magic != k_magic) {
    return error(errc::corrupt, "bad magic {:02x} {:02x} {:02x} {:02x}: not a GGUF file", magic & 0xff,
                 (magic >> 8) & 0xff, (magic >> 16) & 0xff, magic >> 24);
  }
  PAGODA_RETURN_IF_ERROR(c.read(version_, "version"));
  if (version_ != 2 && version_ != 3) {
    if (version_ == 1) return error(errc::unsupported, "GGUF version 1 is not supported (only 2 and 3)");
    if ((version_ & 0xffff) == 0 && __builtin_bswap32(version_) <= 3) {
      return error(errc::unsupported, "GGUF version {} looks big-endian; only little-endian files are supported",
                   __builtin_bswap32(version_));
    }
    return error(errc::unsupported, "unsupported GGUF version {} (only 2 and 3)", version_);
  }
  std::uint64_t n_tensors = 0;
  std::uint64_t n_kv = 0;
  PAGODA_RETURN_IF_ERROR(c.read(n_tensors, "tensor count"));
  PAGODA_RETURN_IF_ERROR(c.read(n_kv, "metadata count"));

  PAGODA_RETURN_IF_ERROR(parse_metadata(c, n_kv));
  PAGODA_RETURN_IF_ERROR(parse_tensor_infos(c, n_tensors));
  return place_tensor_data(c.pos());
}

status file::parse_metadata(byte_cursor& c, std::uint64_t n_kv) {
  if (n_kv > c.remaining() / k_min_kv_bytes) {
    return error(errc::corrupt, "metadata count {} cannot fit in the {} bytes left in the file", n_kv,
                 c.remaining());
  }
  metadata_.reserve(capped_reserve(n_kv));
  key_index_.reserve(capped_reserve(n_kv));
  for (std::uint64_t i = 0; i < n_kv; ++i) {
    metadata_entry e;
    std::size_t at = c.pos();
    status st = c.read_string(e.key, "metadata key");
    if (!st.ok()) return st.with_context(fmt::format("metadata entry {}", i));
    if (e.key.empty()) return error(errc::corrupt, "metadata entry {} at offset {}: empty key", i, at);
    if (!is_valid_utf8(e.key)) {
      return error(errc::corrupt, "metadata entry {} at offset {}: key is not valid UTF-8", i, at);
    }
    std::uint32_t type = 0;
    st = c.read(type, "value type");
    if (st.ok()) st = parse_value(c, type, e.val);
    if (!st.ok()) return st.with_context(fmt::format("metadata key '{}'", e.key));
    auto [it, inserted] = key_index_.emplace(e.key, metadata_.size());
    if (!inserted) return error(errc::corrupt, "duplicate metadata key '{}' (entry {} at offset {})", e.key, i, at);
    metadata_.push_back(std::move(e));
  }

  alignment_ = k_default_alignment;
  if (const value* v = find("general.alignment")) {
    std::uint64_t a = 0;
    if (is_unsigned_type(v->type)) {
      a = v->u;
    } else if (is_signed_type(v->type) && v->i >= 0) {
      a = static_cast<std::uint64_t>(v->i);
    } else {
      return error(errc::corrupt, "general.alignment has type {}, expected uint32", value_type_name(v->type));
    }
    if (a == 0 || !std::has_single_bit(a) || a > std::numeric_limits<std::uint32_t>::max()) {
      return error(errc::corrupt, "general.alignment {} is not a non-zero power of two that fits uint32", a);
    }
    alignment_ = a;
  }
  return ok_status();
}

status file::parse_tensor_infos(byte_cursor& c, std::uint64_t n_tensors) {
  if (n_tensors > c.remaining() / k_min_tensor_info_bytes) {
    return error(errc::corrupt, "tensor count {} cannot fit in the {} bytes left in the file", n_tensors,
                 c.remaining());
  }
  tensors_.reserve(capped_reserve(n_tensors));
  tensor_index_.reserve(capped_reserve(n_tensors));
  for (std::uint64_t i = 0; i < n_tensors; ++i) {
    tensor_info t;
    std::size_t at = c.pos();
    status st = c.read_string(t.name, "tensor name");
    if (!st.ok()) return st.with_context(fmt::format("tensor info {}", i));
    if (t.name.empty()) return error(errc::corrupt, "tensor info {} at offset {}: empty name", i, at);
    auto where = [&] { return fmt::format("tensor '{}' (info {} at offset {})", t.name, i, at); };

    st = c.read(t.n_dims, "n_dims");
    if (!st.ok()) return st.with_context(where());
    if (t.n_dims == 0 || t.n_dims > 4) {
      return error(errc::corrupt, "{}: n_dims {} is not in 1..4", where(), t.n_dims);
    }
    for (std::uint32_t d = 0; d < t.n_dims; ++d) {
      std::uint64_t ne = 0;
      st = c.read(ne, "dimension");
      if (!st.ok()) return st.with_context(where());
      if (ne == 0) return error(errc::corrupt, "{}: dimension {} is zero", where(), d);
      if (ne > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        return error(errc::corrupt, "{}: dimension {} is {} (negative as int64)", where(), d, ne);
      }
      t.ne[d] = static_cast<std::int64_t>(ne);
    }
    std::int64_t n_elements = 1;
    for (std::int64_t ne : t.ne) {
      if (__builtin_mul_overflow(n_elements, ne, &n_elements)) {
        return error(errc::corrupt, "{}: element count of shape [{}, {}, {}, {}] overflows int64", where(), t.ne[0],
                     t.ne[1], t.ne[2], t.ne[3]);
      }
    }

    std::uint32_t type = 0;
    st = c.read(type, "tensor type");
    if (!st.ok()) return st.with_context(where());
    const tensor_type_traits* tr = get_tensor_type_traits(type);
    if (!tr) return error(errc::corrupt, "{}: unknown tensor type {}", where(), type);
    if (!tr->supported) {
      return error(errc::unsupported, "{}: tensor type {} is not supported (Pagoda computes with f32, f16, bf16, "
                   "q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, iq3_s and mxfp4)", where(), tr->name);
    }
    t.type = static_cast<tensor_type>(type);
    if (t.ne[0] % tr->block_size != 0) {
      return error(errc::corrupt, "{}: row length {} is not a multiple of the {} block size {}", where(), t.ne[0],
                   tr->name, tr->block_size);
    }
    auto size = tensor_size_bytes(type, std::span<const std::int64_t>(t.ne, t.n_dims));
    if (!size) return error(errc::corrupt, "{}: byte size overflows", where());
    t.size_bytes = *size;

    st = c.read(t.offset, "tensor data offset");
    if (!st.ok()) return st.with_context(where());
    if (t.offset % alignment_ != 0) {
      return error(errc::corrupt, "{}: data offset {} is not a multiple of the alignment {}", where(), t.offset,
                   alignment_);
    }
    auto [it, inserted] = tensor_index_.emplace(t.name, tensors_.size());
    if (!inserted) return error(errc::corrupt, "duplicate tensor name '{}' (info {} at offset {})", t.name, i, at);
    tensors_.push_back(t);
  }
  return ok_status();
}

status file::place_tensor_data(std::uint64_t header_end) {
  // The data section starts at the header end rounded up to the alignment.
  // A file without tensors may end before that point (no padding needed).
  std::uint64_t padded = 0;
  if (__builtin_add_overflow(header_end, alignment_ - 1, &padded)) {
    return error(errc::corrupt, "data section offset overflows");
  }
  data_offset_ = padded / alignment_ * alignment_;
  if (tensors_.empty()) return ok_status();

  if (data_offset_ > bytes_.size()) {
    return error(errc::corrupt, "truncated file: tensor data section starts at offset {} but the file has {} bytes",
                 data_offset_, bytes_.size());
  }
  const std::uint64_t data_size = bytes_.size() - data_offset_;
  for (auto& t : tensors_) {
    if (t.offset > data_size || t.size_bytes > data_size - t.offset) {
      return error(errc::corrupt,
                   "tensor '{}': data at offset {} with size {} runs past the end of the file (data section has {} "
                   "bytes)",
                   t.name, t.offset, t.size_bytes, data_size);
    }
    t.data = bytes_.data() + data_offset_ + t.offset;
  }

  std::vector<std::size_t> order(tensors_.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  for (std::size_t k = 1; k < order.size(); ++k) {
    const tensor_info& prev = tensors_[order[k - 1]];
    const tensor_info& cur = tensors_[order[k]];
    if (cur.offset < prev.offset + prev.size_bytes) {
      return error(errc::corrupt, "tensor '{}' data [{}, {}) overlaps tensor '{}' data [{}, {})", cur.name,
                   cur.offset, cur.offset + cur.size_bytes, prev.name, prev.offset, prev.offset + prev.size_bytes);
    }
  }
  return ok_status();
}

// ---------------------------------------------------------------------------
// Opening

namespace {

// Reads `size` bytes of fd into dst; a file that shrinks meanwhile is an error.
status read_all(int fd, const std::string& path, std::byte* dst, std::size_t size) {
  constexpr std::size_t k_chunk = std::size_t{64} << 20;
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, dst + done, std::min(k_chunk, size - done), static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return error(errc::io_error, "{}: read failed at offset {}: {}", path, done, std::strerror(errno));
    if (n == 0) return error(errc::io_error, "{}: file ended at {} bytes while reading {}", path, done, size);
    done += static_cast<std::size_t>(n);
  }
  return ok_status();
}

}  // namespace

result<std::unique_ptr<file>> file::open(const std::string& path, open_options options) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return error(e == ENOENT ? errc::not_found : errc::io_error, "{}: cannot open: {}", path, std::strerror(e));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return error(errc::io_error, "{}: cannot stat: {}", path, std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return error(errc::invalid_argument, "{}: not a regular file", path);
  }
  std::unique_ptr<file> f(new file());
  f->path_ = path;
  f->storage_ = options.use_mmap ? storage::mapped : storage::read_into_memory;
  auto size = static_cast<std::size_t>(st.st_size);
  if (size > 0 && options.use_mmap) {
    void* m = map_file_huge_aligned(fd, size);
    if (!m) {
      int e = errno;
      ::close(fd);
      return error(errc::io_error, "{}: cannot map {} bytes: {}", path, size, std::strerror(e));
    }
    f->map_ = m;
    f->map_size_ = size;
  } else if (size > 0) {
    // Rounded up to whole huge pages and advised to be backed by them (the
    // kernel may give base pages instead); faulted in by the read.
    auto m = anon_memory::map(size, /*huge_pages=*/true, /*fault_in=*/false);
    status rs = m.ok() ? read_all(fd, path, m->data(), size)
                       : error(errc::resource_exhausted, "{}: cannot allocate {} bytes to read the file into (--no-mmap): {}",
                               path, size, m.error().message());
    if (!rs.ok()) {
      ::close(fd);
      return rs;
    }
    f->copy_ = std::move(*m);
  }
  ::close(fd);
  std::span<const std::byte> bytes(f->map_ ? static_cast<const std::byte*>(f->map_) : f->copy_.data(), size);
  status s = f->parse(bytes);
  if (!s.ok()) return s.with_context(path);
  return f;
}

std::size_t file::huge_page_bytes() const {
  if (storage_ == storage::mapped && map_) return file_huge_page_bytes(map_, map_size_).value_or(0);
  if (storage_ != storage::read_into_memory || !copy_.data()) return 0;
  return anon_huge_page_bytes(copy_.data(), copy_.size_bytes()).value_or(0);
}

result<std::unique_ptr<file>> file::from_memory(std::span<const std::byte> bytes) {
  std::unique_ptr<file> f(new file());
  PAGODA_RETURN_IF_ERROR(f->parse(bytes));
  return f;
}

file::~file() {
  if (map_) ::munmap(map_, map_size_);
}

// ---------------------------------------------------------------------------
// Lookup

const value* file::find(std::string_view key) const {
  auto it = key_index_.find(key);
  return it == key_index_.end() ? nullptr : &metadata_[it->second].val;
}

const tensor_info* file::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

result<const value*> file::find_or_error(std::string_view key) const {
  const value* v = find(key);
  if (!v) return error(errc::not_found, "metadata key '{}' not found", key);
  return v;
}

namespace {
status wrong_type(std::string_view key, const value& v, const char* expected) {
  if (v.type == value_type::array) {
    return error(errc::invalid_argument, "metadata key '{}' is an array of {}, expected {}", key,
                 value_type_name(v.array_type), expected);
  }
  return error(errc::invalid_argument, "metadata key '{}' has type {}, expected {}", key, value_type_name(v.type),
               expected);
}
}  // namespace

result<std::uint64_t> file::get_uint(std::string_view key) const {
  PAGODA_ASSIGN_OR_RETURN(const value* v, find_or_error(key));
  if (is_unsigned_type(v->type)) return v->u;
  if (is_signed_type(v->type)) {
    if (v->i < 0) return error(errc::out_of_range, "metadata key '{}' is {}, expected an unsigned value", key, v->i);
    return static_cast<std::uint64_t>(v->i);
  }
  return wrong_type(key, *v, "an unsigned integer");
}

result<std::int64_t> file::get_int(std::string_view key) const {
  PAGODA_ASSIGN_OR_RETURN(const value* v, find_or_error(key));
  if (is_signed_type(v->type)) return v->i;
  if (is_unsigned_type(v->type)) {
    if (v->u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return error(errc::out_of_range, "metadata key '{}' value {} does not fit int64", key, v->u);
    }
    return static_cast<std::int64_t>(v->u);
  }
  return wrong_type(key, *v, "an integer");
}

result<double> file::get_float(std::string_view key) const {
  PAGODA_ASSIGN_OR_RETURN(const value* v, find_or_error(key));
  if (is_float_type(v->type)) return v->f;
  if (is_unsigned_type(v->type)) return static_cast<double>(v->u);
  if (is_signed_type(v->type)) return static_cast<double>(v->i);
  return wrong_type(key, *v, "a number");
}

result<bool> file::get_bool(std::string_view key) const {
  PAGODA_ASSIGN_OR_RETURN(const value* v, find_or_error(key));
  if (v->type != value_type::boolean) return wrong_type(key, *v, "bool");
  return v->u != 0;
}

result<std::string_view> file::get_string(std::string_view key) const {
  PAGODA_ASSIGN_OR_RETURN(const value* v, find_or_error(key));
  if (v->type != value_type::string) return wrong_type(key, *v, "string");
  return v->str;
}

result<std::span<const std::string_view>> file::get_string_array(std::string_view key) const {
  PAGODA_ASSIGN_OR_RETURN(const value* v, find_or_error(key));
  if (v->type != value_type::array || v->array_type != value_type::string) {
    return wrong_type(key, *v, "an array of strings");
  }
  return std::span<const std::string_view>(v->array_strings);
}

result<std::vector<float>> file::get_f32_array(std::string_view key) const {
  PAGODA_ASSIGN_OR_RETURN(const value* v, find_or_error(key));
  if (v->type != value_type::array ||
      !(is_float_type(v->array_type) || is_signed_type(v->array_type) || is_unsigned_type(v->array_type))) {
    return wrong_type(key, *v, "a numeric array");
  }
  std::vector<float> out(v->array_size);
  for (std::uint64_t k = 0; k < v->array_size; ++k) out[k] = static_cast<float>(read_array_element_as_double(*v, k));
  return out;
}

result<std::vector<std::int32_t>> file::get_i32_array(std::string_view key) const {
  PAGODA_ASSIGN_OR_RETURN(const value* v, find_or_error(key));
  if (v->type != value_type::array || !(is_signed_type(v->array_type) || is_unsigned_type(v->array_type))) {
    return wrong_type(key, *v, "an integer array");
  }
  std::vector<std::int32_t> out(v->array_size);
  const bool is_signed = is_signed_type(v->array_type);
  for (std::uint64_t k = 0; k < v->array_size; ++k) {
    std::uint64_t bits = read_array_element_as_u64_bits(*v, k);
    bool fits = is_signed ? (static_cast<std::int64_t>(bits) >= std::numeric_limits<std::int32_t>::min() &&
                             static_cast<std::int64_t>(bits) <= std::numeric_limits<std::int32_t>::max())
                          : bits <= static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max());
    if (!fits) {
      return error(errc::out_of_range, "metadata key '{}': element {} does not fit int32", key, k);
    }
    out[k] = static_cast<std::int32_t>(static_cast<std::int64_t>(bits));
  }
  return out;
}

}  // namespace pagoda::gguf
