// GGUF v2/v3 reader (and, in gguf_writer.h, writer). The reader validates
// everything it reads and never reads out of bounds: a malformed file gets a
// status naming what is wrong and where, never a crash.
//
// File layout (little-endian): magic "GGUF", u32 version, u64 n_tensors,
// u64 n_kv, then n_kv metadata entries (string key, u32 value type, value),
// n_tensors tensor infos (string name, u32 n_dims, u64 ne[n_dims], u32 type,
// u64 offset), padding to general.alignment (default 32), then tensor data.
// Strings are u64 length + bytes (no terminator).
//
// Validation (parse fails with the first problem, naming the key or tensor and
// the byte offset):
//   errc::corrupt      bad magic; truncation anywhere; a string, array or count
//                      that the remaining bytes cannot hold; unknown value type;
//                      bool not 0/1; empty or non-UTF-8 key; duplicate key or
//                      tensor name; general.alignment not a power of two
//                      fitting u32; n_dims not in 1..4; a dim <= 0; element or
//                      byte count overflow; ne[0] not a multiple of the block
//                      size; offset not aligned; data past the end of the file;
//                      overlapping tensor data; a tensor type ggml does not define.
//   errc::unsupported  version other than 2 or 3 (v1, big-endian files); nested
//                      arrays; a tensor type ggml defines but Pagoda has no
//                      kernel for (named, e.g. q4_K).
// Nothing is allocated in proportion to a count before the bytes behind it have
// been read, so a corrupt count cannot cause a huge allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/anon_memory.h"
#include "pagoda/status.h"

namespace pagoda::gguf {

enum class value_type : std::uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12,
};
const char* value_type_name(value_type t);

// ggml tensor types (numbering from ggml.h). Only the ones Pagoda computes with
// are `supported`; others are recognised by name for error messages.
enum class tensor_type : std::uint32_t {
  f32 = 0, f16 = 1, q4_0 = 2, q4_1 = 3, q5_0 = 6, q5_1 = 7, q8_0 = 8, q8_1 = 9,
  q2_k = 10, q3_k = 11, q4_k = 12, q5_k = 13, q6_k = 14, q8_k = 15,
  iq4_nl = 20, iq3_s = 21, iq4_xs = 23,
  i8 = 24, i16 = 25, i32 = 26, i64 = 27, f64 = 28, bf16 = 30, mxfp4 = 39,
};

struct tensor_type_traits {
  const char* name;
  std::uint32_t block_size;  // elements per block (1 for plain types)
  std::uint32_t block_bytes; // bytes per block
  bool supported;            // Pagoda has kernels for it
};
// nullptr for a type number ggml does not define.
const tensor_type_traits* get_tensor_type_traits(std::uint32_t type);
const char* tensor_type_name(tensor_type t);

// Bytes of a tensor of `type` with dims ne[0..n) (ne[0] innermost). nullopt when
// the type is unknown, a dim is not positive, ne[0] is not a multiple of the
// type's block size, or the element count or byte size overflows int64.
std::optional<std::uint64_t> tensor_size_bytes(std::uint32_t type, std::span<const std::int64_t> ne);

// Bytes of one element of a non-array, non-string metadata value type (0 otherwise).
std::size_t value_type_size(value_type t);

// One metadata value. Scalars are decoded; arrays keep their element type and a
// view of their bytes in the file (strings in arrays are pre-split).
struct value {
  value_type type = value_type::u8;
  // scalar payloads
  std::uint64_t u = 0;  // any unsigned integer or boolean
  std::int64_t i = 0;   // any signed integer
  double f = 0;         // f32 / f64
  std::string_view str; // string
  // array payload
  value_type array_type = value_type::u8;
  std::uint64_t array_size = 0;
  const std::byte* array_data = nullptr;       // raw elements of a non-string array
  std::vector<std::string_view> array_strings; // elements of a string array
  // Nested arrays (array of arrays) are rejected as unsupported.
};

struct metadata_entry {
  std::string_view key;
  value val;
};

struct tensor_info {
  std::string_view name;
  std::uint32_t n_dims = 0;
  std::int64_t ne[4] = {1, 1, 1, 1};  // ne[0] is the contiguous (innermost) dimension
  tensor_type type = tensor_type::f32;
  std::uint64_t offset = 0;           // relative to the start of the data section
  std::uint64_t size_bytes = 0;
  const std::byte* data = nullptr;    // inside the mapping; valid while the file lives
  std::int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
};

namespace detail {
class byte_cursor;  // bounds-checked reader over the file bytes (gguf.cpp)
}

// How a file's bytes are held while the model uses them.
struct open_options {
  // true: map the file read-only (its pages are the page cache's, paged in as
  // used and shared with other processes), at a 2 MiB-aligned address with
  // huge pages asked for: where the page cache holds the file in huge folios
  // (what is read from disk through the mapping, on a filesystem with large
  // folios, as ext4 has on the Linux 6.18 it was measured on), they are mapped
  // whole; pages already cached in base pages stay so. false: read the whole file into
  // anonymous memory at open, with transparent huge pages asked for
  // (llama.cpp's --no-mmap): it costs the file's size in resident memory and
  // one read at load, and streaming weights from it avoids the 4 KiB page
  // walks of a file mapping (bench/RESULTS.md, "Loading a 3.9 GB file").
  bool use_mmap = true;
};

class file {
 public:
  // Opens and parses a file, mapped or read as `options` says. The bytes live as
  // long as the object.
  static result<std::unique_ptr<file>> open(const std::string& path, open_options options = {});
  // Parses bytes owned by the caller (tests, fuzzing); they must outlive the object.
  static result<std::unique_ptr<file>> from_memory(std::span<const std::byte> bytes);
  ~file();
  file(const file&) = delete;
  file& operator=(const file&) = delete;

  std::uint32_t version() const { return version_; }
  std::uint64_t alignment() const { return alignment_; }
  const std::string& path() const { return path_; }
  // Byte offset of the tensor data section from the start of the file.
  std::uint64_t data_offset() const { return data_offset_; }
  // Bytes of the whole file (or of the memory given to from_memory).
  std::size_t size_bytes() const { return bytes_.size(); }
  // How the bytes are held: a file mapping, anonymous memory the file was read
  // into (open_options::use_mmap = false), or the caller's (from_memory).
  enum class storage { mapped, read_into_memory, caller };
  storage storage_kind() const { return storage_; }
  // Of the memory the file was read into, or of its mapping, the bytes the
  // kernel backs with huge pages now (Linux /proc/self/smaps: AnonHugePages,
  // FilePmdMapped; 0 for the caller's bytes or when unknown).
  std::size_t huge_page_bytes() const;

  const std::vector<metadata_entry>& metadata() const { return metadata_; }
  const value* find(std::string_view key) const;

  // Typed getters. Integer getters accept any integer type whose value fits.
  // A missing key is errc::not_found; a wrong type is errc::invalid_argument.
  result<std::uint64_t> get_uint(std::string_view key) const;
  result<std::int64_t> get_int(std::string_view key) const;
  result<double> get_float(std::string_view key) const;  // f32/f64 (and integers)
  result<bool> get_bool(std::string_view key) const;
  result<std::string_view> get_string(std::string_view key) const;
  result<std::span<const std::string_view>> get_string_array(std::string_view key) const;
  // Numeric arrays converted to the requested element type.
  result<std::vector<float>> get_f32_array(std::string_view key) const;
  result<std::vector<std::int32_t>> get_i32_array(std::string_view key) const;

  const std::vector<tensor_info>& tensors() const { return tensors_; }
  const tensor_info* find_tensor(std::string_view name) const;

 private:
  file() = default;
  status parse(std::span<const std::byte> bytes);
  status parse_metadata(detail::byte_cursor& c, std::uint64_t n_kv);
  status parse_tensor_infos(detail::byte_cursor& c, std::uint64_t n_tensors);
  status place_tensor_data(std::uint64_t header_end);
  result<const value*> find_or_error(std::string_view key) const;

  std::string path_;
  std::span<const std::byte> bytes_;
  void* map_ = nullptr;          // the file mapping (use_mmap); munmap'ed at destruction
  std::size_t map_size_ = 0;
  anon_memory copy_;             // the file read into memory (no use_mmap)
  storage storage_ = storage::caller;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::vector<metadata_entry> metadata_;
  std::vector<tensor_info> tensors_;
  std::uint64_t data_offset_ = 0;
  // Indexes into metadata_ / tensors_; keys and names are unique (checked on parse).
  std::unordered_map<std::string_view, std::size_t> key_index_;
  std::unordered_map<std::string_view, std::size_t> tensor_index_;
};

}  // namespace pagoda::gguf
