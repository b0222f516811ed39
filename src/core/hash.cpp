#include "core/hash.h"

#include <xxhash.h>

#include "core/assert.h"

namespace pagoda {

std::uint64_t hash_bytes(const void* data, std::size_t size_bytes, std::uint64_t seed) {
  return XXH3_64bits_withSeed(data, size_bytes, seed);
}

hasher::hasher(std::uint64_t seed) : state_(XXH3_createState()) {
  PAGODA_ASSERT(state_ != nullptr, "out of memory for hash state");
  XXH3_64bits_reset_withSeed(static_cast<XXH3_state_t*>(state_), seed);
}

hasher::~hasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

hasher& hasher::update(const void* data, std::size_t size_bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, size_bytes);
  return *this;
}

std::uint64_t hasher::digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

}  // namespace pagoda
