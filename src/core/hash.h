// Hashing for prefix-cache keys: xxHash3 (64-bit), seeded and chainable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace pagoda {

std::uint64_t hash_bytes(const void* data, std::size_t size_bytes, std::uint64_t seed = 0);

// Incremental 64-bit hasher over several pieces (parent key, token ids, extra keys).
class hasher {
 public:
  explicit hasher(std::uint64_t seed = 0);
  ~hasher();
  hasher(const hasher&) = delete;
  hasher& operator=(const hasher&) = delete;
  hasher& update(const void* data, std::size_t size_bytes);
  template <typename T>
  hasher& update_pod(const T& v) {
    return update(&v, sizeof(T));
  }
  template <typename T>
  hasher& update_span(std::span<const T> s) {
    return update(s.data(), s.size_bytes());
  }
  std::uint64_t digest() const;

 private:
  void* state_;
};

}  // namespace pagoda
