// A stored KV block: one whole block (kv_backend::read_block's bytes: every
// layer's K and V tiles with their scales) with what makes a hit verifiable:
// its store key, its chain key and parent chain key, its tenant and token ids.
// The encoding carries a format version and a checksum over everything, so a
// torn, flipped or foreign entry decodes as an error (a miss for the caller),
// never as KV. Payloads are zstd-compressed when that saves at least 1/16.
//
// Layout (little-endian): "PGKB", u16 version, u16 flags (bit 0: zstd),
// u64 store-key entry, u64 chain key, u64 parent key, u32 tenant bytes + tenant,
// u32 n_tokens + int32 tokens, u32 raw size, u32 stored size + payload,
// u64 xxh3 of all the bytes before it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kv/prefix_index.h"
#include "pagoda/status.h"
#include "pagoda/types.h"
#include "store/store_key.h"

namespace pagoda {

inline constexpr std::uint16_t k_block_record_version = 1;
// The largest block a record may hold, uncompressed (a block of 16 tokens of
// an 80-layer model with 8 KV heads of 128 f32 values is 10 MiB): a damaged or
// crafted size never makes the decoder allocate more than this.
inline constexpr std::uint32_t k_block_record_max_bytes = 256u << 20;

struct block_record {
  store_key key;
  block_key chain = 0;
  block_key parent = 0;
  std::string tenant;
  std::vector<token_id> tokens;
  std::vector<std::byte> bytes;  // the block, uncompressed
};

// Encodes a record; compress = false stores the payload as is.
std::vector<std::byte> encode_block_record(const block_record& r, bool compress = true);
// Decodes and verifies (magic, version, sizes, checksum, and that it is the
// entry `expected` names; a payload over k_block_record_max_bytes, or a zstd
// frame that does not declare the record's size, is damage). Errors: errc::corrupt (damaged), errc::unsupported
// (another format version), errc::not_found (another key's entry).
result<block_record> decode_block_record(std::span<const std::byte> data, const store_key& expected);
// The same checks without keeping the payload (for verify walks).
status check_block_record(std::span<const std::byte> data, const store_key& expected);

}  // namespace pagoda
