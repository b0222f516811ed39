#include "model/gguf_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/assert.h"

namespace pagoda::gguf {

namespace {

static_assert(std::endian::native == std::endian::little, "GGUF writer assumes a little-endian host");

constexpr std::uint32_t k_magic = 0x46554747;  // "GGUF" as a little-endian u32
// Tensor data is produced and written in chunks of about this many bytes.
constexpr std::size_t k_chunk_bytes = std::size_t{8} << 20;

template <typename T>
void append_le(std::vector<std::byte>& out, T v) {
  std::size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

void append_bytes(std::vector<std::byte>& out, const void* data, std::size_t n) {
  std::size_t at = out.size();
  out.resize(at + n);
  if (n) std::memcpy(out.data() + at, data, n);
}

void append_string(std::vector<std::byte>& out, std::string_view s) {
  append_le<std::uint64_t>(out, s.size());
  append_bytes(out, s.data(), s.size());
}

std::uint64_t align_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }

template <typename T>
constexpr value_type value_type_of() {
  if constexpr (std::is_same_v<T, std::uint8_t>) return value_type::u8;
  else if constexpr (std::is_same_v<T, std::int8_t>) return value_type::i8;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return value_type::u16;
  else if constexpr (std::is_same_v<T, std::int16_t>) return value_type::i16;
  else if constexpr (std::is_same_v<T, std::uint32_t>) return value_type::u32;
  else if constexpr (std::is_same_v<T, std::int32_t>) return value_type::i32;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return value_type::u64;
  else if constexpr (std::is_same_v<T, std::int64_t>) return value_type::i64;
  else if constexpr (std::is_same_v<T, float>) return value_type::f32;
  else if constexpr (std::is_same_v<T, double>) return value_type::f64;
  else {
    static_assert(std::is_same_v<T, bool>, "unsupported GGUF array element type");
    return value_type::boolean;
  }
}

}  // namespace

void writer::set_alignment(std::uint32_t alignment) {
  PAGODA_ASSERT(alignment != 0 && std::has_single_bit(alignment), "alignment {} is not a power of two", alignment);
  PAGODA_ASSERT(!alignment_set_, "set_alignment called twice");
  alignment_ = alignment;
  alignment_set_ = true;
  add_u32("general.alignment", alignment);
}

void writer::begin_kv(std::string_view key, value_type type) {
  kv_pos_.push_back(kv_bytes_.size());
  append_string(kv_bytes_, key);
  append_le(kv_bytes_, static_cast<std::uint32_t>(type));
}

void writer::add_u8(std::string_view key, std::uint8_t v) { begin_kv(key, value_type::u8); append_le(kv_bytes_, v); }
void writer::add_i8(std::string_view key, std::int8_t v) { begin_kv(key, value_type::i8); append_le(kv_bytes_, v); }
void writer::add_u16(std::string_view key, std::uint16_t v) { begin_kv(key, value_type::u16); append_le(kv_bytes_, v); }
void writer::add_i16(std::string_view key, std::int16_t v) { begin_kv(key, value_type::i16); append_le(kv_bytes_, v); }
void writer::add_u32(std::string_view key, std::uint32_t v) { begin_kv(key, value_type::u32); append_le(kv_bytes_, v); }
void writer::add_i32(std::string_view key, std::int32_t v) { begin_kv(key, value_type::i32); append_le(kv_bytes_, v); }
void writer::add_u64(std::string_view key, std::uint64_t v) { begin_kv(key, value_type::u64); append_le(kv_bytes_, v); }
void writer::add_i64(std::string_view key, std::int64_t v) { begin_kv(key, value_type::i64); append_le(kv_bytes_, v); }
void writer::add_f32(std::string_view key, float v) { begin_kv(key, value_type::f32); append_le(kv_bytes_, v); }
void writer::add_f64(std::string_view key, double v) { begin_kv(key, value_type::f64); append_le(kv_bytes_, v); }
void writer::add_bool(std::string_view key, bool v) {
  begin_kv(key, value_type::boolean);
  append_le<std::uint8_t>(kv_bytes_, v ? 1 : 0);
}
void writer::add_string(std::string_view key, std::string_view v) {
  begin_kv(key, value_type::string);
  append_string(kv_bytes_, v);
}

void writer::add_array_bytes(std::string_view key, value_type elem, std::uint64_t count, const void* data,
                             std::size_t size_bytes) {
  begin_kv(key, value_type::array);
  append_le(kv_bytes_, static_cast<std::uint32_t>(elem));
  append_le(kv_bytes_, count);
  append_bytes(kv_bytes_, data, size_bytes);
}

template <typename T>
void writer::add_array(std::string_view key, std::span<const T> values) {
  static_assert(sizeof(bool) == 1, "bool arrays are written as bytes");
  add_array_bytes(key, value_type_of<T>(), values.size(), values.data(), values.size_bytes());
}

template void writer::add_array(std::string_view, std::span<const std::uint8_t>);
template void writer::add_array(std::string_view, std::span<const std::int8_t>);
template void writer::add_array(std::string_view, std::span<const std::uint16_t>);
template void writer::add_array(std::string_view, std::span<const std::int16_t>);
template void writer::add_array(std::string_view, std::span<const std::uint32_t>);
template void writer::add_array(std::string_view, std::span<const std::int32_t>);
template void writer::add_array(std::string_view, std::span<const std::uint64_t>);
template void writer::add_array(std::string_view, std::span<const std::int64_t>);
template void writer::add_array(std::string_view, std::span<const float>);
template void writer::add_array(std::string_view, std::span<const double>);
template void writer::add_array(std::string_view, std::span<const bool>);

void writer::add_string_array(std::string_view key, std::span<const std::string_view> values) {
  begin_kv(key, value_type::array);
  append_le(kv_bytes_, static_cast<std::uint32_t>(value_type::string));
  append_le<std::uint64_t>(kv_bytes_, values.size());
  for (std::string_view s : values) append_string(kv_bytes_, s);
}

void writer::add_string_array(std::string_view key, std::span<const std::string> values) {
  std::vector<std::string_view> views(values.begin(), values.end());
  add_string_array(key, std::span<const std::string_view>(views));
}

void writer::add_raw(std::string_view key, std::uint32_t type, std::span<const std::byte> payload) {
  kv_pos_.push_back(kv_bytes_.size());
  append_string(kv_bytes_, key);
  append_le(kv_bytes_, type);
  append_bytes(kv_bytes_, payload.data(), payload.size());
}

void writer::add_tensor(std::string_view name, tensor_type type, std::span<const std::int64_t> ne,
                        std::span<const std::byte> data) {
  add_tensor(name, type, ne, tensor_fill_fn{});
  tensor_entry& t = tensors_.back();
  PAGODA_ASSERT(data.size() == t.size_bytes, "tensor {}: {} data bytes given, {} expected", name, data.size(),
                t.size_bytes);
  t.data.assign(data.begin(), data.end());
}

void writer::add_tensor(std::string_view name, tensor_type type, std::span<const std::int64_t> ne,
                        tensor_fill_fn fill) {
  PAGODA_ASSERT(!ne.empty() && ne.size() <= 4, "tensor {}: {} dims", name, ne.size());
  auto size = tensor_size_bytes(static_cast<std::uint32_t>(type), ne);
  PAGODA_ASSERT(size.has_value(), "tensor {}: invalid shape for type {}", name, tensor_type_name(type));
  tensor_entry t;
  t.name = std::string(name);
  t.type = type;
  t.ne.assign(ne.begin(), ne.end());
  t.size_bytes = *size;
  t.fill = std::move(fill);
  tensors_.push_back(std::move(t));
}

std::vector<std::byte> writer::header_bytes(file_layout* layout_out) const {
  std::vector<std::byte> out;
  file_layout lay;
  append_le(out, k_magic);
  append_le(out, version_);
  append_le<std::uint64_t>(out, tensors_.size());
  append_le<std::uint64_t>(out, kv_pos_.size());
  for (std::size_t p : kv_pos_) lay.kv_pos.push_back(out.size() + p);
  append_bytes(out, kv_bytes_.data(), kv_bytes_.size());

  std::uint64_t data_offset = 0;
  for (const auto& t : tensors_) {
    tensor_layout tl;
    tl.info_pos = out.size();
    append_string(out, t.name);
    tl.n_dims_pos = out.size();
    append_le(out, static_cast<std::uint32_t>(t.ne.size()));
    tl.ne_pos = out.size();
    for (std::int64_t d : t.ne) append_le(out, static_cast<std::uint64_t>(d));
    tl.type_pos = out.size();
    append_le(out, static_cast<std::uint32_t>(t.type));
    tl.offset_pos = out.size();
    data_offset = align_up(data_offset, alignment_);
    append_le(out, data_offset);
    tl.data_offset = data_offset;
    tl.size_bytes = t.size_bytes;
    data_offset += t.size_bytes;
    lay.tensors.push_back(tl);
  }
  // Files without tensors end right after the header; otherwise the data
  // section starts at the next aligned offset.
  lay.data_start = align_up(out.size(), alignment_);
  if (!tensors_.empty()) out.resize(lay.data_start, std::byte{0});
  lay.size_bytes = tensors_.empty() ? out.size() : lay.data_start + data_offset;
  if (layout_out) *layout_out = std::move(lay);
  return out;
}

file_layout writer::layout() const {
  file_layout lay;
  (void)header_bytes(&lay);
  return lay;
}

status writer::write_to(const sink_fn& sink) const {
  file_layout lay;
  PAGODA_RETURN_IF_ERROR(sink(header_bytes(&lay)));
  std::vector<std::byte> chunk;
  const std::byte zeros[64] = {};
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const tensor_entry& t = tensors_[i];
    if (i > 0) {  // pad the previous tensor's end up to this tensor's offset
      const tensor_layout& prev = lay.tensors[i - 1];
      std::uint64_t pad = lay.tensors[i].data_offset - (prev.data_offset + prev.size_bytes);
      PAGODA_ASSERT(pad < alignment_, "padding {} not below the alignment", pad);
      while (pad > 0) {
        std::size_t n = std::min<std::uint64_t>(pad, sizeof(zeros));
        PAGODA_RETURN_IF_ERROR(sink(std::span<const std::byte>(zeros, n)));
        pad -= n;
      }
    }
    if (!t.fill) {
      PAGODA_RETURN_IF_ERROR(sink(t.data));
      continue;
    }
    std::int64_t n_rows = 1;
    for (std::size_t d = 1; d < t.ne.size(); ++d) n_rows *= t.ne[d];
    const std::uint64_t row_bytes = t.size_bytes / static_cast<std::uint64_t>(n_rows);
    const std::int64_t rows_per_chunk =
        std::max<std::int64_t>(1, static_cast<std::int64_t>(k_chunk_bytes / std::max<std::uint64_t>(row_bytes, 1)));
    for (std::int64_t r = 0; r < n_rows; r += rows_per_chunk) {
      std::int64_t n = std::min(rows_per_chunk, n_rows - r);
      chunk.assign(static_cast<std::size_t>(n) * row_bytes, std::byte{0});
      status st = t.fill(r, n, chunk);
      if (!st.ok()) return st.with_context(fmt::format("tensor {}", t.name));
      PAGODA_RETURN_IF_ERROR(sink(chunk));
    }
  }
  return ok_status();
}

std::vector<std::byte> writer::to_bytes() const {
  std::vector<std::byte> out;
  status st = write_to([&](std::span<const std::byte> b) {
    out.insert(out.end(), b.begin(), b.end());
    return ok_status();
  });
  PAGODA_ASSERT(st.ok(), "to_bytes: {}", st.message());
  return out;
}

status writer::write_file(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return error(errc::io_error, "{}: cannot create: {}", tmp, std::strerror(errno));
  status st = write_to([&](std::span<const std::byte> b) {
    const std::byte* p = b.data();
    std::size_t left = b.size();
    while (left > 0) {
      ssize_t n = ::write(fd, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return error(errc::io_error, "{}: write failed: {}", tmp, std::strerror(errno));
      p += n;
      left -= static_cast<std::size_t>(n);
    }
    return ok_status();
  });
  if (::close(fd) != 0 && st.ok()) st = error(errc::io_error, "{}: close failed: {}", tmp, std::strerror(errno));
  if (st.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    st = error(errc::io_error, "{}: cannot rename to {}: {}", tmp, path, std::strerror(errno));
  }
  if (!st.ok()) ::unlink(tmp.c_str());
  return st;
}

}  // namespace pagoda::gguf
