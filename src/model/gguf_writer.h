// GGUF writer: builds a v3 (or v2) file from metadata and tensors, either in
// memory (to_bytes) or streamed to disk (write_file) with tensor data produced
// a chunk of rows at a time, so a multi-GB model is never held in memory.
//
// The writer is deliberately permissive about metadata (duplicate keys, raw
// values) and exposes the byte layout of what it writes, so tests can build
// malformed files by adding raw values or patching fields at known offsets.
// Tensor shapes and types must be valid: their sizes decide the layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "model/gguf.h"
#include "pagoda/status.h"

namespace pagoda::gguf {

// Fixed header field offsets (bytes from the start of the file).
inline constexpr std::size_t k_header_magic_pos = 0;
inline constexpr std::size_t k_header_version_pos = 4;
inline constexpr std::size_t k_header_n_tensors_pos = 8;
inline constexpr std::size_t k_header_n_kv_pos = 16;
inline constexpr std::size_t k_header_bytes = 24;

// Produces rows [first_row, first_row + n_rows) of a tensor into `out`, which
// holds exactly n_rows rows of ne[0] elements in the tensor's type. A row is
// ne[0] elements; a tensor has ne[1] * ne[2] * ne[3] rows.
using tensor_fill_fn = std::function<status(std::int64_t first_row, std::int64_t n_rows, std::span<std::byte> out)>;

// Where each field of a written file lies, as absolute byte offsets.
struct tensor_layout {
  std::size_t info_pos = 0;      // the tensor info's name length
  std::size_t n_dims_pos = 0;    // u32 n_dims
  std::size_t ne_pos = 0;        // u64 ne[0]; ne[d] is at ne_pos + 8 * d
  std::size_t type_pos = 0;      // u32 type
  std::size_t offset_pos = 0;    // u64 data offset (relative to the data section)
  std::uint64_t data_offset = 0; // value written at offset_pos
  std::uint64_t size_bytes = 0;
};

struct file_layout {
  std::vector<std::size_t> kv_pos;  // each metadata entry's key length field
  std::vector<tensor_layout> tensors;
  std::size_t data_start = 0;       // absolute offset of the data section
  std::size_t size_bytes = 0;       // total file size
};

class writer {
 public:
  explicit writer(std::uint32_t version = 3) : version_(version) {}

  // Any number is written as given (v1 and others make malformed files).
  void set_version(std::uint32_t version) { version_ = version; }
  // Adds general.alignment (uint32) and pads tensor data to it.
  // REQUIRES: a non-zero power of two; called at most once.
  void set_alignment(std::uint32_t alignment);
  std::uint32_t alignment() const { return alignment_; }

  void add_u8(std::string_view key, std::uint8_t v);
  void add_i8(std::string_view key, std::int8_t v);
  void add_u16(std::string_view key, std::uint16_t v);
  void add_i16(std::string_view key, std::int16_t v);
  void add_u32(std::string_view key, std::uint32_t v);
  void add_i32(std::string_view key, std::int32_t v);
  void add_u64(std::string_view key, std::uint64_t v);
  void add_i64(std::string_view key, std::int64_t v);
  void add_f32(std::string_view key, float v);
  void add_f64(std::string_view key, double v);
  void add_bool(std::string_view key, bool v);
  void add_string(std::string_view key, std::string_view v);

  // Arrays of scalars. T is one of uint8_t, int8_t, uint16_t, int16_t,
  // uint32_t, int32_t, uint64_t, int64_t, float, double, bool.
  template <typename T>
  void add_array(std::string_view key, std::span<const T> values);
  template <typename T>
  void add_array(std::string_view key, const std::vector<T>& values) {
    static_assert(!std::is_same_v<T, bool>, "std::vector<bool> is not contiguous; pass a span of bool");
    add_array(key, std::span<const T>(values));
  }
  void add_string_array(std::string_view key, std::span<const std::string> values);
  void add_string_array(std::string_view key, std::span<const std::string_view> values);

  // Writes the key, the type word and `payload` verbatim (malformed-file tests).
  void add_raw(std::string_view key, std::uint32_t type, std::span<const std::byte> payload);

  // Tensors are laid out in the order added, each at the next aligned offset.
  // REQUIRES: 1..4 dims, tensor_size_bytes(type, ne) is defined; for the copying
  // form, data.size() equals that size.
  void add_tensor(std::string_view name, tensor_type type, std::span<const std::int64_t> ne,
                  std::span<const std::byte> data);
  void add_tensor(std::string_view name, tensor_type type, std::span<const std::int64_t> ne, tensor_fill_fn fill);

  std::size_t n_kv() const { return kv_pos_.size(); }
  std::size_t n_tensors() const { return tensors_.size(); }
  file_layout layout() const;

  // REQUIRES: every fill callback succeeds (use write_file for fallible ones).
  std::vector<std::byte> to_bytes() const;
  // Streams to `path` through a temporary file renamed into place on success.
  status write_file(const std::string& path) const;

 private:
  struct tensor_entry {
    std::string name;
    tensor_type type;
    std::vector<std::int64_t> ne;
    std::uint64_t size_bytes = 0;
    std::vector<std::byte> data;  // copied data, or empty when fill is set
    tensor_fill_fn fill;
  };
  using sink_fn = std::function<status(std::span<const std::byte>)>;

  void begin_kv(std::string_view key, value_type type);
  void add_array_bytes(std::string_view key, value_type elem, std::uint64_t count, const void* data,
                       std::size_t size_bytes);
  std::vector<std::byte> header_bytes(file_layout* layout_out) const;
  status write_to(const sink_fn& sink) const;

  std::uint32_t version_;
  std::uint32_t alignment_ = 32;
  bool alignment_set_ = false;
  std::vector<std::byte> kv_bytes_;  // serialized metadata entries
  std::vector<std::size_t> kv_pos_;  // entry starts within kv_bytes_
  std::vector<tensor_entry> tensors_;
};

}  // namespace pagoda::gguf
