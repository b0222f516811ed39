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
// [version 2 only: 32-byte HMAC-SHA256, under the server secret, of the
// 16-byte store key followed by all the record's bytes before it],
// u64 xxh3 of all the bytes before it.
//
// The checksum finds damage; only the MAC finds forgery: anyone who can write
// a tier can recompute an xxh3, nobody without the secret can compute the MAC.
// With a secret, records are written as version 2 and only a version 2 record
// whose MAC verifies is read: a version 1 record, or one whose MAC fails (a
// changed tenant, key, token, payload, or another secret), is an
// errc::unauthenticated error (counted as forged, apart from damage). Without
// a secret, records are written as version 1 (checksummed only: forgeable by
// whoever can write the tier), and a version 2 record is unauthenticated too
// (its MAC cannot be checked, so it is never trusted).
#pragma once

#include <array>
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

inline constexpr std::uint16_t k_block_record_version = 1;      // checksummed only
inline constexpr std::uint16_t k_block_record_mac_version = 2;  // checksummed and MACed
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

// The server secret that MACs stored records (--kv-store-secret-file): an
// HMAC-SHA256 key. Every replica sharing a tier must hold the same one.
class record_secret {
 public:
  static constexpr std::size_t k_min_bytes = 16;   // shorter is guessable
  static constexpr std::size_t k_max_bytes = 4096;  // longer is not a secret file
  // REQUIRES: k_min_bytes <= key.size() <= k_max_bytes.
  explicit record_secret(std::string key);
  // Reads a secret file: its bytes, without trailing CR/LF. Refused
  // (errc::invalid_argument) when it is not a regular file, is unreadable,
  // holds fewer than k_min_bytes or more than k_max_bytes, or grants any
  // permission to its group or others (like an SSH key: a secret others can
  // read protects nothing).
  static result<record_secret> from_file(const std::string& path);
  using mac_bytes = std::array<std::byte, 32>;
  // HMAC-SHA256 of the store key's 16 bytes followed by `data`.
  mac_bytes mac(const store_key& key, std::span<const std::byte> data) const;

 private:
  std::string key_;
};

// Encodes a record; compress = false stores the payload as is. With a
// secret: version 2, MACed; without: version 1.
std::vector<std::byte> encode_block_record(const block_record& r, bool compress = true,
                                           const record_secret* secret = nullptr);
// Decodes and verifies (magic, version, sizes, checksum, the MAC under
// `secret` (see the top of this file), and that it is the entry `expected`
// names; a payload over k_block_record_max_bytes, or a zstd frame that does
// not declare the record's size, is damage). Errors: errc::corrupt (damaged),
// errc::unauthenticated (forged: no MAC, a MAC that fails, or a MAC and no
// secret to check it), errc::unsupported (another format version),
// errc::not_found (another key's entry).
result<block_record> decode_block_record(std::span<const std::byte> data, const store_key& expected,
                                         const record_secret* secret = nullptr);
// The same checks without keeping the payload (for verify walks).
status check_block_record(std::span<const std::byte> data, const store_key& expected,
                          const record_secret* secret = nullptr);

}  // namespace pagoda
