// A heap buffer aligned for SIMD loads (64 bytes: one cache line, one AVX-512 vector).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace pagoda {

inline constexpr std::size_t k_simd_alignment = 64;

class aligned_buffer {
 public:
  aligned_buffer() = default;
  explicit aligned_buffer(std::size_t size_bytes, bool zero = true) { resize(size_bytes, zero); }
  ~aligned_buffer() { std::free(data_); }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  aligned_buffer(aligned_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  aligned_buffer& operator=(aligned_buffer&& o) noexcept {
    if (this != &o) {
      std::free(data_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }

  // Discards the old contents. Zero-filled when `zero`.
  void resize(std::size_t size_bytes, bool zero = true) {
    std::free(data_);
    data_ = nullptr;
    size_ = 0;
    if (size_bytes == 0) return;
    std::size_t rounded = (size_bytes + k_simd_alignment - 1) / k_simd_alignment * k_simd_alignment;
    data_ = static_cast<std::byte*>(std::aligned_alloc(k_simd_alignment, rounded));
    if (!data_) throw std::bad_alloc();
    size_ = size_bytes;
    if (zero) std::memset(data_, 0, rounded);
  }

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(data_);
  }
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(data_);
  }
  std::size_t size() const { return size_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace pagoda
